"""y = x @ W^T (+ bias) for each weight format: the C++ kernels and their PyTorch twins.

Every function takes x as a (M, K) float32 tensor and returns (M, N) float32. Up to
`SMALL_BATCH` rows on the CPU go to the C++ kernels (decode); the PyTorch path computes the
same thing: for int8/int4 it quantizes the activations per block exactly as the kernels do
and sums the integer block products, so both give the same result up to float summation
order. Larger batches (prefill), and inputs that require a gradient, use `torch.matmul` on
the dequantized weight, with unquantized activations: in bfloat16 where the CPU multiplies
it several times faster than float32 (AMX or AVX-512 BF16) and no gradient is needed,
else in float32. `backend` is "auto" (C++ when built, else PyTorch), "cpp" or "torch".

Row invariance: the C++ kernels compute each row on its own, with the same arithmetic
whatever the number of rows and whatever the other rows hold, so a row's result is the
same bits in any batch up to `SMALL_BATCH` rows. With `invariant=True`, larger batches go
to the C++ kernels too where they run (all rows in one call, which gives the bits of tiles of
`SMALL_BATCH` rows), so a row's result never depends on what shares its call; the dense
product is faster for large float32/bfloat16 batches, so that is not the default.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import weight_formats as quant
from .build import extension
from .cpu import bf16_products_pay

SMALL_BATCH = 8
BACKENDS = ("auto", "cpp", "torch")


def _kernels(x: torch.Tensor, backend: str, invariant: bool = False):
    """The compiled module to use for this call, or None for the PyTorch path."""
    if backend == "torch":
        return None
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if x.shape[0] > SMALL_BATCH and not invariant:
        return None
    usable = x.device.type == "cpu" and not x.requires_grad
    ext = extension() if usable else None
    if ext is None and backend == "cpp":
        raise RuntimeError("the C++ kernels are not available for this call")
    return ext


def _block_products(qx: torch.Tensor, dx: torch.Tensor, qw: torch.Tensor, dw: torch.Tensor):
    """sum_b dw[n, b] dx[m, b] (qw[n, b] · qx[m, b]): the integer dot of the kernels."""
    dots = torch.einsum("mbk,nbk->mnb", qx, qw)  # (M, N, nb), exact integers in float32
    return (dots * (dx.unsqueeze(1) * dw.unsqueeze(0))).sum(-1)  # (M, N)


def _dense_linear(x, weight, bias, backend):
    """x @ weight^T + bias for many rows, weight float32 or bfloat16: bfloat16 operands
    (float32 accumulation) where that pays and no gradient is needed."""
    if backend != "torch" and not x.requires_grad and bf16_products_pay():
        y = F.linear(x.to(torch.bfloat16), weight.to(torch.bfloat16)).float()  # (M, N)
        return y if bias is None else y + bias
    return F.linear(x, weight.float(), bias)


def _dense(x: torch.Tensor) -> bool:
    """Large batches, and inputs that need a gradient (rounding has none), use the dense
    product with unquantized activations."""
    return x.shape[0] > SMALL_BATCH or (x.requires_grad and torch.is_grad_enabled())


def dequantize(qweight, scales, mins, in_features, backend="auto"):
    """The (N, K) float32 weight of int8 (mins None) or int4 blocks, in C++ where it runs."""
    ext = None if backend == "torch" or qweight.device.type != "cpu" else extension()
    if ext is not None:
        return ext.dequantize(qweight, scales, mins, in_features)
    if mins is None:
        return quant.dequantize_int8(qweight, scales, in_features)
    return quant.dequantize_int4(qweight, scales, mins, in_features)


def linear_fp32(x, weight, bias=None, backend="auto", invariant=False):
    """weight (N, K) float32."""
    ext = _kernels(x, backend, invariant)
    if ext is not None:
        return ext.linear_f32(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_bf16(x, weight, bias=None, backend="auto", invariant=False):
    """weight (N, K) bfloat16, products in float32. Many rows (prefill) multiply in bfloat16
    (activations rounded too) where that pays (see bf16_products_pay)."""
    ext = _kernels(x, backend, invariant)
    if ext is not None:
        return ext.linear_bf16(x, weight, bias)
    if x.shape[0] > SMALL_BATCH:
        return _dense_linear(x, weight, bias, backend)
    return F.linear(x, weight.float(), bias)


def linear_int8(x, qweight, scales, bias=None, backend="auto", invariant=False):
    """qweight (N, nb·32) int8, scales (N, nb) fp16 (see quant.quantize_int8)."""
    ext = _kernels(x, backend, invariant)
    if ext is not None:
        return ext.linear_q8(x, qweight, scales, bias)
    if _dense(x):
        return _dense_linear(x, dequantize(qweight, scales, None, x.shape[1], backend), bias, backend)
    qx, dx = quant.quantize_activations(x)  # (M, nb, 32), (M, nb)
    qw = qweight.reshape(qweight.shape[0], -1, quant.BLOCK).float()  # (N, nb, 32)
    y = _block_products(qx, dx, qw, scales.float())
    return y if bias is None else y + bias


def linear_int4(x, qweight, scales, mins, bias=None, backend="auto", invariant=False):
    """qweight (N, nb·16) uint8 nibbles, scales and mins (N, nb) fp16 (quant.quantize_int4)."""
    ext = _kernels(x, backend, invariant)
    if ext is not None:
        return ext.linear_q4(x, qweight, scales, mins, bias)
    if _dense(x):
        return _dense_linear(x, dequantize(qweight, scales, mins, x.shape[1], backend), bias, backend)
    qx, dx = quant.quantize_activations(x)  # (M, nb, 32), (M, nb)
    qw = quant.unpack_nibbles(qweight).float()  # (N, nb, 32)
    y = _block_products(qx, dx, qw, scales.float())
    y = y + (dx * qx.sum(-1)) @ mins.float().T  # the minimum term: sum_b m[n, b] dx sum(qx)
    return y if bias is None else y + bias
