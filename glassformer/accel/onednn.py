"""Training's float32 matrix products through oneDNN, for CPUs where it beats MKL.

PyTorch multiplies float32 matrices on the CPU with MKL, which runs its AVX-512 kernels only
on Intel processors: on other AVX-512 CPUs (AMD Zen 4 and 5) it takes its AVX2 path, about
half their speed. oneDNN, also inside PyTorch, chooses its kernels from the instruction set.
`linear` sends a training step's three products (output, input gradient, weight gradient)
through oneDNN: the same float32 arithmetic, summed in another order. Under torch.compile,
autocast, or for a product that needs no gradient, it returns None and the caller keeps
`F.linear` (tests/accel/test_onednn.py compares both, values and gradients). `OneDNNLinear`
is nn.Linear with its products taken so, installed by `fast_training.use_fast_training`
where oneDNN measured faster (`onednn_pays`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import decisions, kernels


def _transposed(t: torch.Tensor) -> torch.Tensor:
    """t (M, K) as a contiguous (K, M) tensor: in 8 × 8 register tiles where the C++ kernels
    are built (about 5× PyTorch's strided copy at these sizes)."""
    if not t.is_contiguous() or not kernels.available():
        return t.t().contiguous()
    return kernels.transpose(t)


def _product(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a (M, K) @ b (N, K)^T (+ bias) -> (M, N); strided operands are read in place."""
    return torch.ops.mkldnn._linear_pointwise(a, b, bias, "none", [], "")


def available() -> bool:
    """Whether this PyTorch has oneDNN's linear."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        rows = x.reshape(-1, x.shape[-1])  # (M, K)
        ctx.save_for_backward(rows, weight)
        ctx.has_bias = bias is not None
        return _product(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])  # (..., N)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, weight = ctx.saved_tensors  # (M, K), (N, K)
        grad_rows = grad.reshape(-1, grad.shape[-1])  # (M, N)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = _product(grad_rows, weight.t()).view(*grad.shape[:-1], weight.shape[1])
        if ctx.needs_input_grad[1]:
            # dW = g^T x (N, K), a sum over the M rows; oneDNN wants its left operand
            # contiguous, and is quicker producing the taller of dW and dW^T.
            if weight.shape[0] > weight.shape[1]:
                dw = _transposed(_product(_transposed(rows), grad_rows.t()))
            else:
                dw = _product(_transposed(grad_rows), rows.t())
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = grad_rows.sum(0)  # (N,)
        return dx, dw, db


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """x (..., K) @ weight (N, K)^T + bias through oneDNN for a training product (float32 CPU
    tensors needing a gradient, no autocast), else None."""
    tensors = (x, weight) if bias is None else (x, weight, bias)
    if (
        torch.compiler.is_compiling()
        or torch.is_autocast_enabled("cpu")
        or not torch.is_grad_enabled()
        or not any(t.requires_grad for t in tensors)
        or not all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
        or not available()
    ):
        return None
    return _Linear.apply(x, weight, bias)


class OneDNNLinear(nn.Linear):
    """nn.Linear whose training products go through `linear` where it applies."""

    @classmethod
    def sharing(cls, layer: nn.Linear) -> OneDNNLinear:
        """A layer holding `layer`'s own parameters (so tied weights stay tied)."""
        with torch.device("meta"):  # nothing allocated: the parameters are replaced below
            new = cls(layer.in_features, layer.out_features, bias=layer.bias is not None)
        new.weight, new.bias = layer.weight, layer.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias) if y is None else y


# ------------------------------------------------------------- the measured decision

def onednn_products() -> decisions.Decision:
    if os.environ.get("GLASSFORMER_KERNELS", "").lower() == "torch":
        return decisions.Decision("onednn_products", "mkl", "environment", note="GLASSFORMER_KERNELS=torch")
    setting = decisions.env_setting("GLASSFORMER_ONEDNN", ("0", "1"))
    if setting is not None:
        return decisions.Decision("onednn_products", "onednn" if setting == "1" else "mkl", "environment",
                        note=f"GLASSFORMER_ONEDNN={setting}")
    return _onednn_products()


def onednn_pays() -> bool:
    """Whether training's float32 linear products go through oneDNN (measured once per CPU)."""
    return onednn_products().choice == "onednn"


@functools.cache
def _onednn_products() -> decisions.Decision:
    if not available():
        return decisions.Decision("onednn_products", "mkl", "ruled out",
                                  note="this PyTorch has no oneDNN linear")
    return decisions.measured("onednn_products", "mkl", "onednn", _onednn_options,
                              repr(decisions.TRAINING_SHAPES))


def _onednn_options() -> dict[str, Callable[[], object]]:
    generator = torch.Generator().manual_seed(0)
    cases = [(torch.randn(rows, d, generator=generator),
              torch.randn(d_ff, d, generator=generator, requires_grad=True))
             for rows, d, d_ff in decisions.TRAINING_SHAPES]

    def run(product: Callable) -> None:
        with torch.enable_grad(), torch.autocast("cpu", enabled=False):
            for x, weight in cases:
                product(x, weight, None).sum().backward()  # (rows, d_ff): all three products

    return {"mkl": lambda: run(F.linear), "onednn": lambda: run(linear)}
