"""y = x @ W^T (+ bias) for each weight format: the C++ kernels and their PyTorch twins.

Every function takes x as a (M, K) float32 tensor and returns (M, N) float32, and computes
the layer's own function whatever M is:
- int8 / int4 and GGUF's blocks (q4_k ... q5_1): activations quantized per block of 32 as the
  kernels do, integer block products, scales applied per block (weight_formats.py and
  kquants.py are the references). The C++ kernels
  take any number of rows on the CPU; the PyTorch path computes the same thing. Only an
  input that needs a gradient (rounding has none) multiplies the dequantized weight with
  unquantized activations.
- fp32 / bf16: the float32 product with the stored weight (bf16 widened, activations never
  rounded). Up to `ROW_TILE` rows go to the C++ kernels (decode), more to `torch.matmul`
  (prefill), which sums in another order, unless `any_rows` asks for the C++ kernels at any
  number of rows (the serving engine's batch invariance).
Row invariance: the C++ kernels compute each row on its own, with the same arithmetic
whatever the number of rows and whatever the other rows hold (csrc/quantized.cpp, kquants.cpp:
register tiles of rows, each row's sums in one fixed order). So an int8 / int4 / GGUF-block
row's result never
depends on what shares its call; a float row's does not up to `ROW_TILE` rows, or at any
number with `any_rows`.
`backend` is "auto" (C++ when built, else PyTorch), "cpp" or "torch".
int8 / int4 `qweight`, `scales` and `mins` are in block order, or in tile order with `tiled`
(tile_order.py); each path puts them in the order it reads, which costs a copy where they
differ.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import InputError
from . import kernels, kquants
from . import weight_formats as quant
from .kernels import ROW_TILE
from .tile_order import in_order

BACKENDS = ("auto", "cpp", "torch")


def _kernels(x: torch.Tensor, backend: str, any_rows: bool = False) -> bool:
    """Whether this call goes to the C++ kernels (else the PyTorch path)."""
    if backend == "torch":
        return False
    if backend not in BACKENDS:
        raise InputError(None, f"backend must be one of {BACKENDS}, got {backend!r}")
    if x.shape[0] > ROW_TILE and not any_rows:
        return False
    usable = x.device.type == "cpu" and not x.requires_grad and kernels.available()
    if not usable and backend == "cpp":
        raise RuntimeError("the C++ kernels are not available for this call")
    return usable


def _block_products(qx: torch.Tensor, dx: torch.Tensor, qw: torch.Tensor, dw: torch.Tensor):
    """sum_b dw[n, b] dx[m, b] (qw[n, b] · qx[m, b]): the integer dot of the kernels."""
    dots = torch.einsum("mbk,nbk->mnb", qx, qw)  # (M, N, nb), exact integers in float32
    return (dots * (dx.unsqueeze(1) * dw.unsqueeze(0))).sum(-1)  # (M, N)


def _straight_through(x: torch.Tensor) -> bool:
    """Inputs that need a gradient (rounding has none) multiply the dequantized weight with
    unquantized activations."""
    return x.requires_grad and torch.is_grad_enabled()


def dequantize(qweight, scales, mins, in_features, backend="auto", tiled=False):
    """The (N, K) float32 weight of int8 (mins None) or int4 blocks, in C++ where it runs."""
    if mins is None:
        qweight, scales = in_order(False, tiled, qweight=qweight, scales=scales)
    else:
        qweight, scales, mins = in_order(False, tiled, qweight=qweight, scales=scales, mins=mins)
    if backend != "torch" and qweight.device.type == "cpu" and kernels.available():
        return kernels.dequantize(qweight, scales, mins, in_features)
    if mins is None:
        return quant.dequantize_int8(qweight, scales, in_features)
    return quant.dequantize_int4(qweight, scales, mins, in_features)


def dequantize_gguf(qweight, fmt, in_features, backend="auto"):
    """The (N, K) float32 weight of rows of GGUF blocks (kquants.py), in C++ where it runs:
    both equal gguf's dequantization bit for bit."""
    if backend != "torch" and qweight.device.type == "cpu" and kernels.available():
        return kernels.dequantize_gguf(qweight, fmt, in_features)
    return kquants.dequantize(qweight, fmt, in_features)


def linear_gguf(x, qweight, fmt, bias=None, backend="auto"):
    """qweight (N, row bytes) uint8: rows of GGUF K-quant / Q5_x blocks as stored (kquants.py)."""
    if _kernels(x, backend, any_rows=True):
        return kernels.linear_gguf(x, qweight, fmt, bias)
    return kquants.linear(x, qweight, fmt, bias)


def linear_fp32(x, weight, bias=None, backend="auto", any_rows=False):
    """weight (N, K) float32."""
    if _kernels(x, backend, any_rows):
        return kernels.linear_f32(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_bf16(x, weight, bias=None, backend="auto", any_rows=False):
    """weight (N, K) bfloat16, products in float32 (activations are never rounded)."""
    if _kernels(x, backend, any_rows):
        return kernels.linear_bf16(x, weight, bias)
    return F.linear(x, weight.float(), bias)


def linear_int8(x, qweight, scales, bias=None, backend="auto", tiled=False):
    """qweight (N, nb·32) int8, scales (N, nb) fp16 (see quant.quantize_int8)."""
    if _kernels(x, backend, any_rows=True):
        return kernels.linear_q8(x, *in_order(True, tiled, qweight=qweight, scales=scales),
                                 bias)
    qweight, scales = in_order(False, tiled, qweight=qweight, scales=scales)
    if _straight_through(x):
        return F.linear(x, dequantize(qweight, scales, None, x.shape[1], backend), bias)
    qx, dx = quant.quantize_activations(x)  # (M, nb, 32), (M, nb)
    qw = qweight.reshape(qweight.shape[0], -1, quant.BLOCK).float()  # (N, nb, 32)
    y = _block_products(qx, dx, qw, scales.float())
    return y if bias is None else y + bias


def linear_int4(x, qweight, scales, mins, bias=None, backend="auto", tiled=False):
    """qweight (N, nb·16) uint8 nibbles, scales and mins (N, nb) fp16 (quant.quantize_int4)."""
    if _kernels(x, backend, any_rows=True):
        tensors = in_order(True, tiled, qweight=qweight, scales=scales, mins=mins)
        return kernels.linear_q4(x, *tensors, bias)
    qweight, scales, mins = in_order(False, tiled, qweight=qweight, scales=scales, mins=mins)
    if _straight_through(x):
        return F.linear(x, dequantize(qweight, scales, mins, x.shape[1], backend), bias)
    qx, dx = quant.quantize_activations(x)  # (M, nb, 32), (M, nb)
    qw = quant.unpack_nibbles(qweight).float()  # (N, nb, 32)
    y = _block_products(qx, dx, qw, scales.float())
    y = y + (dx * qx.sum(-1)) @ mins.float().T  # the minimum term: sum_b m[n, b] dx sum(qx)
    return y if bias is None else y + bias
