"""The learning-rate schedule: linear warmup, then cosine decay to a floor. A pure function."""

from __future__ import annotations

import math


def learning_rate(step: int, lr: float, min_lr: float, warmup_iters: int, decay_iters: int) -> float:
    """The rate for optimizer step `step` (0-based).

    warmup: lr · (step + 1) / warmup_iters for step < warmup_iters
    cosine: min_lr + ½ (1 + cos(π · progress)) (lr - min_lr), progress from 0 to 1 over
            [warmup_iters, decay_iters]; min_lr after that.
    """
    if step < warmup_iters:
        return lr * (step + 1) / warmup_iters
    if step >= decay_iters:
        return min_lr
    progress = (step - warmup_iters) / max(1, decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)
