"""DistributedDataParallel on CPU (gloo), 2 processes, set up the way torchrun sets them up
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): the result equals one process over the same
global batch."""

import json
import os
import socket

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from glassformer import ModelConfig, Transformer
from glassformer.formats.checkpoint import load_model
from glassformer.model.presets import get_preset
from glassformer.training.config import TrainConfig
from glassformer.training.loop import train
from glassformer.training.optim import make_optimizer
from glassformer.training.step import train_step

CONFIG = ModelConfig(vocab_size=17, context_length=8, d_model=16, n_layers=2, n_heads=2)
STEP = TrainConfig(lr=1e-2, weight_decay=0.1, grad_clip=0.5)
NO_AMP = torch.autocast("cpu", enabled=False)
RUN = TrainConfig(batch_size=2, max_iters=3, warmup_iters=1, eval_interval=3, eval_iters=2,
                  log_interval=1, sample_tokens=4, device="cpu")
TEXT = "a rose by any other name would smell as sweet. " * 30


def _global_batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 17, (8, 8), generator=g)  # (global batch, T)
    y = torch.randint(0, 17, (8, 8), generator=g)
    return x, y


def _fresh():
    torch.manual_seed(0)
    model = Transformer(CONFIG)
    return model, make_optimizer(model, STEP)


def _join(rank, world, port):
    """This process as rank `rank` of `world`, set up as torchrun sets it up."""
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo")


def _worker(rank, world, port, tmp):
    _join(rank, world, port)
    try:
        model, opt = _fresh()
        x, y = _global_batch()
        share = slice(rank * 4, (rank + 1) * 4)  # each rank its half of the global batch
        train_step(DistributedDataParallel(model), opt, x[share], y[share], 2, STEP.grad_clip,
                   NO_AMP)
        if rank == 0:
            safetensors.torch.save_model(model, f"{tmp}/step.safetensors")
        summary = train(f"{tmp}/corpus.txt", f"{tmp}/ddp", CONFIG, RUN, progress=False,
                        echo=lambda s: None)
        if rank == 0:
            with open(f"{tmp}/summary.json", "w") as f:
                json.dump(summary, f)
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_equals_one_process_on_the_same_global_batch(tmp_path):
    (tmp_path / "corpus.txt").write_text(TEXT)
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)

    # One optimizer step: 2 ranks × 2 micro-batches of 2 == 1 process × 4 micro-batches of 2.
    model, opt = _fresh()
    x, y = _global_batch()
    train_step(model, opt, x, y, 4, STEP.grad_clip, NO_AMP)
    ddp_model = Transformer(CONFIG)
    safetensors.torch.load_model(ddp_model, tmp_path / "step.safetensors")
    before, _ = _fresh()
    assert not torch.equal(before.embed.tokens.weight, model.embed.tokens.weight)  # a real step
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(ddp_model.state_dict()[name], tensor, msg=name)

    # The whole loop: 2 ranks drawing their own slices == 1 process accumulating both slices.
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["tokens_seen"] == 3 * 2 * 2 * 8
    single = train(tmp_path / "corpus.txt", tmp_path / "one", CONFIG, RUN.replace(grad_accum=2),
                   progress=False, echo=lambda s: None)
    assert single["tokens_seen"] == summary["tokens_seen"]
    assert abs(single["val_loss"] - summary["val_loss"]) < 1e-5
    a, _, _ = load_model(tmp_path / "ddp")
    b, _, _ = load_model(tmp_path / "one")
    for name, tensor in a.state_dict().items():
        torch.testing.assert_close(tensor, b.state_dict()[name], msg=name)
    assert not (tmp_path / "ddp" / ".step-0000003.tmp").exists()  # only rank 0 wrote


ENCODER = CONFIG.replace(causal=False)
SEQ2SEQ = get_preset("tiny-t5").replace(context_length=16, d_model=16, n_heads=2, d_ff=32)
# objective -> (model, run): the masks or noise spans of the whole global batch are drawn on
# every process, so each rank corrupts its own share of the same draws.
OBJECTIVES = {"mlm": (ENCODER, RUN.replace(objective="mlm", batch_size=4)),
              "span": (SEQ2SEQ, RUN.replace(objective="span"))}


def _objective_worker(rank, world, port, tmp, objective):
    _join(rank, world, port)
    try:
        summary = train(f"{tmp}/corpus.txt", f"{tmp}/ddp", *OBJECTIVES[objective], progress=False,
                        echo=lambda s: None)
        assert os.path.exists(summary["checkpoint"])  # every rank returns after rank 0 saved
        if rank == 0:
            with open(f"{tmp}/summary.json", "w") as f:
                json.dump(summary, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_ddp_objective_equals_one_process(tmp_path, objective):
    """2 ranks equal 1 process accumulating both slices: weights and validation loss."""
    (tmp_path / "corpus.txt").write_text(TEXT)
    mp.spawn(_objective_worker, args=(2, _free_port(), str(tmp_path), objective), nprocs=2,
             join=True)
    summary = json.loads((tmp_path / "summary.json").read_text())
    model_config, run = OBJECTIVES[objective]
    single = train(tmp_path / "corpus.txt", tmp_path / "one", model_config,
                   run.replace(grad_accum=2), progress=False, echo=lambda s: None)
    assert summary["world_size"] == 2 and single["tokens_seen"] == summary["tokens_seen"]
    assert abs(single["val_loss"] - summary["val_loss"]) < 1e-5
    a, tokenizer, _ = load_model(tmp_path / "ddp")
    b, _, _ = load_model(tmp_path / "one")
    assert objective != "mlm" or tokenizer.mask_id is not None
    for name, tensor in a.state_dict().items():
        torch.testing.assert_close(tensor, b.state_dict()[name], msg=name)
