"""Span corruption under DistributedDataParallel (CPU, gloo, 2 processes): the noise masks of
the whole global batch are drawn on every process, so 2 ranks equal 1 process accumulating
both slices, encoder-decoder weights and validation loss alike."""

import json
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from glassformer.formats.checkpoint import load_model
from glassformer.model.presets import get_preset
from glassformer.training.config import TrainConfig
from glassformer.training.loop import train

CONFIG = get_preset("tiny-t5").replace(context_length=16, d_model=16, n_heads=2, d_ff=32)
RUN = TrainConfig(objective="span", batch_size=2, max_iters=3, warmup_iters=1, eval_interval=3,
                  eval_iters=2, log_interval=1, sample_tokens=4, device="cpu")
TEXT = "a rose by any other name would smell as sweet. " * 30


def _worker(rank, world, port, tmp):
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo")
    try:
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


def test_two_ranks_equal_one_process(tmp_path):
    (tmp_path / "corpus.txt").write_text(TEXT)
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    summary = json.loads((tmp_path / "summary.json").read_text())
    single = train(tmp_path / "corpus.txt", tmp_path / "one", CONFIG, RUN.replace(grad_accum=2),
                   progress=False, echo=lambda s: None)
    assert summary["world_size"] == 2 and single["tokens_seen"] == summary["tokens_seen"]
    assert abs(single["val_loss"] - summary["val_loss"]) < 1e-5
    a, _, _ = load_model(tmp_path / "ddp")
    b, _, _ = load_model(tmp_path / "one")
    for name, tensor in a.state_dict().items():
        torch.testing.assert_close(tensor, b.state_dict()[name], msg=name)
