"""RMSNorm, LayerNorm, rotary embeddings, SwiGLU and GELU as single C++ passes
(csrc/train_ops.cpp) for training.

The plain expressions in `glassformer.model.layers` take several elementwise ops each,
forward and backward, and at the sizes of a small model on a CPU those ops' fixed costs add
up to a large share of a training step. These compute the same values in one pass each
way, as autograd nodes written in C++ (csrc/train_autograd.cpp), whose backward pass never
enters Python (a Python autograd function costs tens of microseconds a call each way). They
apply to float32 CPU tensors that need a gradient, with the kernels built; every other call
(inference, other dtypes or devices) keeps the plain expressions, which remain the reference
(tests/accel/test_fused.py compares both, values and gradients). The modules at the end are
the layers' drop-in replacements, installed by `fast_training.use_fast_training`.
"""

from __future__ import annotations

import torch

from ..model.layers.feedforward import Activation
from ..model.layers.norm import LayerNorm, RMSNorm
from ..model.layers.positions import Rotary
from . import kernels


def _applies(*tensors: torch.Tensor) -> bool:
    return (
        not torch.compiler.is_compiling()  # torch.compile fuses the plain expressions itself
        and torch.is_grad_enabled()
        and any(t.requires_grad for t in tensors)
        and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
        and kernels.available()
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x / sqrt(mean(x²) + eps) * weight over the last dimension, or None where the fused
    kernel does not apply (the caller then computes the plain expression)."""
    if not _applies(x, weight):
        return None
    return kernels.rms_norm(x, weight, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               eps: float) -> torch.Tensor | None:
    """(x - mean(x)) / sqrt(var(x) + eps) * weight (+ bias) over the last dimension, or None
    where the fused kernel does not apply."""
    if not _applies(x, weight, *([] if bias is None else [bias])):
        return None
    return kernels.layer_norm(x, weight, bias, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """x cos + rotate_half(x) sin for x (B, H, T, D) and cos, sin (B or 1, 1, T, D), or None
    where the fused kernel does not apply."""
    if not _applies(x) or cos.requires_grad or sin.requires_grad or x.stride(-1) != 1:
        return None
    if cos.dtype != torch.float32 or cos.shape[0] not in (1, x.shape[0]) or cos.shape[1] != 1:
        return None
    if cos.shape[-1] != x.shape[-1]:  # partial rotary: the plain expression
        return None
    angles = (cos[:, 0].contiguous(), sin[:, 0].contiguous())  # (B or 1, T, D) each
    return kernels.rotary(x, *angles)


def swiglu(h: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for h = [gate | up] on its last dimension (..., 2F) -> (..., F), with
    one gradient tensor for both halves; or None where the fused kernel does not apply."""
    if not _applies(h) or h.shape[-1] % 2:
        return None
    return kernels.swiglu(h)


def gelu(x: torch.Tensor) -> torch.Tensor | None:
    """x Φ(x) (F.gelu, exact), its erf within 1.5e-7, or None where the fused kernel does not
    apply. ATen's erf is several times slower on AVX2 than this one pass."""
    if not _applies(x):
        return None
    return kernels.gelu(x)


class FusedRMSNorm(RMSNorm):
    """RMSNorm, same parameter, through `rms_norm` where it applies."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = rms_norm(x, self.weight, self.eps)
        return super().forward(x) if y is None else y


class FusedLayerNorm(LayerNorm):
    """LayerNorm, same parameters, through `layer_norm` where it applies."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = layer_norm(x, self.weight, self.bias, self.eps)
        return super().forward(x) if y is None else y


class FusedRotary(Rotary):
    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        y = rope(x, cos, sin)
        return super().forward(x, cos, sin) if y is None else y


class FusedSwiGLU(Activation):
    """The gated silu Activation through `swiglu` where it applies."""

    def __init__(self) -> None:
        super().__init__("silu", gated=True)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        y = swiglu(u)
        return super().forward(u) if y is None else y


class FusedGELU(Activation):
    """The exact GELU Activation through `gelu` where it applies."""

    def __init__(self) -> None:
        super().__init__("gelu", gated=False)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        y = gelu(u)
        return super().forward(u) if y is None else y
