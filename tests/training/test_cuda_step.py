"""Training on the GPU (marked cuda, skipped without one): a float32 step there against the same
step on the CPU, the oracle, with AdamW and with Muon; and the fast GPU recipe's own settings
(bfloat16, compiled, Muon) through the loop, its loss falling."""

from __future__ import annotations

import math
from contextlib import nullcontext

import pytest
import torch

from glassformer.model.config import ModelConfig
from glassformer.model.transformer import Transformer
from glassformer.training.config import TrainConfig, get_recipe
from glassformer.training.loop import train
from glassformer.training.metrics import read_metrics
from glassformer.training.optim import make_optimizer
from glassformer.training.step import train_step

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

CONFIG = ModelConfig(vocab_size=41, context_length=32, d_model=64, n_layers=2, n_heads=4,
                     position="rope", norm="rmsnorm", activation="silu", gated=True)


def _three_steps(device: str, optimizer: str) -> tuple[list[float], dict]:
    torch.manual_seed(0)
    model = Transformer(CONFIG).to(device)
    config = TrainConfig(optimizer=optimizer, lr=3e-3, muon_lr=0.02)
    opt = make_optimizer(model, config)
    ids = torch.randint(0, CONFIG.vocab_size, (8, CONFIG.context_length + 1),
                        generator=torch.Generator().manual_seed(1)).to(device)  # (8, T + 1)
    losses = [train_step(model, opt, ids[:, :-1], ids[:, 1:], 2, 1.0, nullcontext()).item()
              for _ in range(3)]
    return losses, {k: v.cpu() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(("optimizer", "tolerance"), [("adamw", 1e-4), ("muon", 2e-3)])
def test_a_float32_step_on_the_gpu_is_the_cpus(optimizer, tolerance):
    """Muon's iterations run in bfloat16 on the GPU, in float32 on a CPU where bfloat16 does
    not pay: hence its wider tolerance on the weights."""
    cpu_losses, cpu_weights = _three_steps("cpu", optimizer)
    gpu_losses, gpu_weights = _three_steps("cuda", optimizer)
    assert gpu_losses == pytest.approx(cpu_losses, abs=tolerance)
    for name, weight in cpu_weights.items():
        torch.testing.assert_close(gpu_weights[name], weight, atol=tolerance, rtol=0, msg=name)


def test_the_fast_gpu_recipe_trains_compiled_in_bfloat16(tmp_path):
    words = "the king and queen of a far land spoke to their people at dawn".split()
    ids = torch.randint(0, len(words), (4000,), generator=torch.Generator().manual_seed(0))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(words[i] for i in ids.tolist()), encoding="utf-8")
    recipe = get_recipe("shakespeare-char-gpu-fast")
    model = recipe.model.replace(n_layers=2, d_model=128, n_heads=2, d_ff=256, context_length=64)
    config = recipe.train.replace(max_iters=60, eval_interval=30, eval_iters=4, batch_size=16,
                                  warmup_iters=5, log_interval=1, device="cuda")
    summary = train(corpus, tmp_path / "run", model, config, progress=False, echo=lambda s: None)
    assert summary["dtype"] == "bfloat16" and summary["iters"] == 60
    losses = [r["train_loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "lr" in r]
    assert len(losses) == 60 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 0.5 and summary["val_loss"] < losses[0] - 0.5
