"""y = x @ W^T (+ bias) for each weight format: the C++ kernels and their PyTorch twins.

Every function takes x as a (M, K) float32 tensor and returns (M, N) float32. Up to
`ROW_TILE` rows on the CPU go to the C++ kernels (decode); the PyTorch path computes the
same thing: for int8/int4 it quantizes the activations per block exactly as the kernels do
and sums the integer block products, so both give the same result up to float summation
order. Larger batches (prefill), and inputs that require a gradient, use `torch.matmul` on
the dequantized weight, with unquantized activations: in bfloat16 where the CPU multiplies
it several times faster than float32 (AMX or AVX-512 BF16) and no gradient is needed,
else in float32. `backend` is "auto" (C++ when built, else PyTorch), "cpp" or "torch".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import kernels
from . import weight_formats as quant
from .cpu import bf16_products_pay
from .kernels import ROW_TILE

BACKENDS = ("auto", "cpp", "torch")


def _kernels(x: torch.Tensor, backend: str) -> bool:
    """Whether this call goes to the C++ kernels (else the PyTorch path)."""
    if backend == "torch":
        return False
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if x.shape[0] > ROW_TILE:
        return False
    usable = x.device.type == "cpu" and not x.requires_grad and kernels.available()
    if not usable and backend == "cpp":
        raise RuntimeError("the C++ kernels are not available for this call")
    return usable


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
    return x.shape[0] > ROW_TILE or (x.requires_grad and torch.is_grad_enabled())


def dequantize(qweight, scales, mins, in_features, backend="auto"):
    """The (N, K) float32 weight of int8 (mins None) or int4 blocks, in C++ where it runs."""
    if backend != "torch" and qweight.device.type == "cpu" and kernels.available():
        return kernels.dequantize(qweight, scales, mins, in_features)
    if mins is None:
        return quant.dequantize_int8(qweight, scales, in_features)
    return quant.dequantize_int4(qweight, scales, mins, in_features)


def linear_fp32(x, weight, bias=None, backend="auto"):
    """weight (N, K) float32."""
    if _kernels(x, backend):
        return kernels.linear_f32(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_bf16(x, weight, bias=None, backend="auto"):
    """weight (N, K) bfloat16, products in float32. Many rows (prefill) multiply in bfloat16
    (activations rounded too) where that pays (see bf16_products_pay)."""
    if _kernels(x, backend):
        return kernels.linear_bf16(x, weight, bias)
    if x.shape[0] > ROW_TILE:
        return _dense_linear(x, weight, bias, backend)
    return F.linear(x, weight.float(), bias)


def linear_int8(x, qweight, scales, bias=None, backend="auto"):
    """qweight (N, nb·32) int8, scales (N, nb) fp16 (see quant.quantize_int8)."""
    if _kernels(x, backend):
        return kernels.linear_q8(x, qweight, scales, bias)
    if _dense(x):
        return _dense_linear(x, dequantize(qweight, scales, None, x.shape[1], backend), bias, backend)
    qx, dx = quant.quantize_activations(x)  # (M, nb, 32), (M, nb)
    qw = qweight.reshape(qweight.shape[0], -1, quant.BLOCK).float()  # (N, nb, 32)
    y = _block_products(qx, dx, qw, scales.float())
    return y if bias is None else y + bias


def linear_int4(x, qweight, scales, mins, bias=None, backend="auto"):
    """qweight (N, nb·16) uint8 nibbles, scales and mins (N, nb) fp16 (quant.quantize_int4)."""
    if _kernels(x, backend):
        return kernels.linear_q4(x, qweight, scales, mins, bias)
    if _dense(x):
        return _dense_linear(x, dequantize(qweight, scales, mins, x.shape[1], backend), bias, backend)
    qx, dx = quant.quantize_activations(x)  # (M, nb, 32), (M, nb)
    qw = quant.unpack_nibbles(qweight).float()  # (N, nb, 32)
    y = _block_products(qx, dx, qw, scales.float())
    y = y + (dx * qx.sum(-1)) @ mins.float().T  # the minimum term: sum_b m[n, b] dx sum(qx)
    return y if bias is None else y + bias
