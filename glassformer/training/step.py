"""One optimizer step and one evaluation: what the training loop repeats.

`train_step` runs the micro-batches of one step (forward under autocast, backward, the
gradients of every micro-batch but the last kept local under DDP), clips and steps;
`evaluate` is the mean validation loss per counted target over the run's fixed validation set.
Both take the model the run steps (plain, compiled or wrapped by DDP) and the objective's
batches, so they know nothing of recipes, files or checkpoints.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from ..accel.decisions import bf16_products_pay
from ..accel.fast_training import clip_grad_norm_
from . import distributed
from .batches import ChatBatches, TokenBatches
from .masking import IGNORE
from .objectives import OBJECTIVES, Batch


def autocast(device: torch.device, dtype: str):
    """bf16 autocast where bf16 products pay (CUDA support; measured on a CPU); else float32."""
    if dtype == "bfloat16" and bf16_supported(device):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def bf16_supported(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and bf16_products_pay()  # measured once per CPU


def lm_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, reduction="mean"):
    return OBJECTIVES["clm"].loss(model, (x, y), reduction)


def train_step(model, optimizer, x, y, grad_accum: int, grad_clip: float, amp,
               objective=OBJECTIVES["clm"], batch: Batch | None = None) -> torch.Tensor:
    """One optimizer step over `grad_accum` micro-batches of (x, y) (n, T), or of the
    objective's `batch` made from them. Returns the loss."""
    batch = (x, y) if batch is None else batch
    total = torch.zeros((), device=x.device)
    for i, micro in enumerate(zip(*(t.chunk(grad_accum) for t in batch), strict=True)):
        last = i == grad_accum - 1
        sync = nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            with amp:
                loss = objective.loss(model, micro) / grad_accum
            loss.backward()
        total += loss.detach()
    if grad_clip:
        clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


@torch.no_grad()
def evaluate(model, batches: TokenBatches | ChatBatches, batch_size: int, process, amp) -> float:
    """Mean validation loss per counted target over the run's validation set (this process's
    share of it, summed over every process)."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=process.device)  # (loss sum, targets)
    for batch in batches.validation(batch_size, process.device):
        with amp:
            totals[0] += batches.objective.loss(model, batch, reduction="sum").double()
        totals[1] += (batch[-1] != IGNORE).sum()  # the targets that count
    distributed.all_reduce_sum(process, totals)
    model.train()
    return (totals[0] / totals[1]).item()
