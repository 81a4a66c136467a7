"""The language-model head and its cross-entropy together, a chunk of rows at a time: training
never holds the (N, V) logits, their softmax or their gradient, only one chunk's (n, V).

For rows h_i (d,) of the final hidden state, the head W (V, d) and b (V,), and targets y_i:

    z_i = W h_i + b                       the row's logits (V,)
    ℓ_i = logsumexp(z_i) − z_i[y_i]       its loss; a row whose target is IGNORE counts for nothing
    L   = Σ_i ℓ_i                         (the mean divides by the number of counted rows)

and, with p_i = softmax(z_i) and e_y the one-hot row of y (both zero for an ignored row),

    ∂L/∂z_i = p_i − e_{y_i}
    ∂L/∂h_i = Wᵀ ∂L/∂z_i,    ∂L/∂W = Σ_i ∂L/∂z_i h_iᵀ,    ∂L/∂b = Σ_i ∂L/∂z_i

The gradients are computed in the forward pass, chunk by chunk, while each chunk's logits are
at hand (nothing is computed twice), and the backward pass scales them by the incoming
gradient. A tied head's ∂L/∂W is added to the token table's by autograd as for any tied weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn.parallel import DistributedDataParallel

from ..errors import InputError
from ..model.transformer import Transformer
from .masking import IGNORE

CHUNK_ROWS = 512  # at a 49,152-token vocabulary, 100 MB of float32 logits at a time


class LinearCrossEntropy(torch.autograd.Function):
    """L (a scalar) for h (N, d), weight (V, d), bias (V,) or None, targets (N,); `grads` says
    which of h, weight and bias get a gradient."""

    @staticmethod
    def forward(ctx, h, weight, bias, targets, grads: tuple[bool, bool, bool], chunk_rows: int):
        need_h, need_w, need_b = grads
        dh = torch.empty_like(h) if need_h else None  # (N, d)
        dw = torch.zeros_like(weight) if need_w else None  # (V, d)
        db = torch.zeros_like(bias) if need_b else None  # (V,)
        total = h.new_zeros(())
        for start in range(0, h.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            x, y = h[rows], targets[rows]  # (n, d), (n,)
            counted = y != IGNORE  # (n,)
            y = y.masked_fill(~counted, 0)  # any class: the row is zeroed below
            z = F.linear(x, weight, bias)  # (n, V)
            lse = torch.logsumexp(z, dim=-1)  # (n,)
            total += ((lse - z.gather(1, y[:, None]).squeeze(1)) * counted).sum()
            if not any(grads):
                continue
            dz = z.sub_(lse[:, None]).exp_()  # softmax, in place of the logits (n, V)
            dz[torch.arange(len(y)), y] -= 1
            if not counted.all():
                dz[~counted] = 0
            if need_h:
                torch.mm(dz, weight, out=dh[rows])
            if need_w:
                dw.addmm_(dz.t(), x)
            if need_b:
                db += dz.sum(0)
        ctx.save_for_backward(dh, dw, db)
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        # Scaled in place: a second backward through a retained graph finds them changed and
        # refuses (autograd's version check) rather than scaling twice.
        dh, dw, db = (None if g is None else g.mul_(grad) for g in ctx.saved_tensors)
        return dh, dw, db, None, None, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         targets: torch.Tensor, reduction: str = "mean",
                         chunk_rows: int = CHUNK_ROWS) -> torch.Tensor:
    """F.cross_entropy(F.linear(h, weight, bias), targets, ignore_index=IGNORE) for h (..., d)
    and targets (...), `reduction` "mean" (over the counted targets; 0 where none counts) or
    "sum", without the logits; gradients for whichever of h, weight, bias need one."""
    if reduction not in ("mean", "sum"):
        raise InputError("reduction", f"'mean' or 'sum', got {reduction!r}")
    rows, y = h.reshape(-1, h.shape[-1]), targets.reshape(-1)  # (N, d), (N,)
    tracked = torch.is_grad_enabled()
    grads = tuple(tracked and t is not None and t.requires_grad for t in (rows, weight, bias))
    return reduced(LinearCrossEntropy.apply(rows, weight, bias, y, grads, chunk_rows), y, reduction)


def reduced(total: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
    """A summed loss as `reduction` asks: the sum, or its mean over the counted targets."""
    if reduction == "sum":
        return total
    return total / (targets != IGNORE).sum().clamp(min=1)


def unwrapped(model: nn.Module) -> nn.Module:
    """The model inside DistributedDataParallel (`module`) and torch.compile's wrapper, which
    keeps it as `_orig_mod` (its class is not imported here: that would load the compiler)."""
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            return model


def fused_head_applies(model: nn.Module) -> bool:
    """Whether the model's head can be fused with its loss: a Transformer (wrapped by
    DistributedDataParallel or torch.compile or not), its head a float32 linear layer taking
    the final hidden state as it is and giving the logits as they are (no soft-cap), no hooks
    to show the logits to, no autocast."""
    model = unwrapped(model)
    return (
        isinstance(model, Transformer)
        and model.head_transform is None
        and not model.config.scale_head_input
        and model.config.final_softcap is None
        and isinstance(model.lm_head, nn.Linear)
        and model.lm_head.weight.dtype == torch.float32
        and not model.hooks
        and not torch.is_autocast_enabled(model.lm_head.weight.device.type)
    )


def language_model_loss(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor,
                        reduction: str = "mean", **inputs) -> torch.Tensor:
    """The cross-entropy of model(ids, **inputs)'s logits (B, T, V) against targets (B, T),
    IGNORE counting for nothing: through `linear_cross_entropy` where `fused_head_applies`,
    else on the logits."""
    if fused_head_applies(model):
        h = model(ids, head=False, **inputs)  # (B, T, d), through the wrapper's own forward
        head = unwrapped(model).lm_head
        return linear_cross_entropy(h, head.weight, head.bias, targets, reduction)
    logits = model(ids, **inputs).flatten(0, 1).float()  # (B·T, V)
    return reduced(F.cross_entropy(logits, targets.flatten(), ignore_index=IGNORE, reduction="sum"),
                   targets, reduction)
