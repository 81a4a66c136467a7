"""Training a recipe's model for a fixed time (or a fixed number of steps), as experiments do.

A run that stops on the clock cannot end a cosine schedule on time, so the rate is constant
after a short warmup; one step on random tokens first keeps first-call costs off every clock.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch

from ..model.config import ModelConfig
from ..model.transformer import Transformer
from ..training.config import TrainConfig, get_recipe

RECIPE = "shakespeare-char"
NEVER = 10**9  # an iteration count no timed run reaches


def base_model() -> ModelConfig:
    return get_recipe(RECIPE).model


def train_config(seconds: float | None, seed: int, iters: int = NEVER) -> TrainConfig:
    """The recipe's settings with a constant rate after 10 warmup steps, one final evaluation
    and no samples, stopping after `seconds` of training (or `iters` steps)."""
    recipe = get_recipe(RECIPE).train
    return recipe.replace(max_time=seconds, max_iters=iters, lr_decay_iters=NEVER,
                          warmup_iters=10, min_lr=recipe.lr, eval_interval=NEVER, eval_iters=10,
                          log_interval=5, sample_tokens=0, seed=1337 + seed, device="cpu")


def train_timed(data: str | Path, folder: Path, config: ModelConfig, train: TrainConfig) -> dict:
    """training.loop.train into `folder`, quietly, after a warm-up step; its summary."""
    from ..training.loop import train as run_training
    from ..training.optim import make_optimizer
    from ..training.step import train_step

    model = Transformer(config.replace(vocab_size=65))
    x = torch.randint(0, 65, (train.batch_size, config.context_length))  # (B, T)
    train_step(model, make_optimizer(model, train), x, x, 1, train.grad_clip, nullcontext())
    return run_training(data, folder, config, train, progress=False, echo=lambda line: None)
