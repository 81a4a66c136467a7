"""How a KV cache stores keys and values: the one table of KV dtypes, and the scaled formats.

  fp32 / bf16: the values themselves;
  int8 / fp8:  each vector (one token's key or value in one head, d_head numbers) as
               q = x / scale with one float32 scale = amax / top per vector, clamped to ±top:
               int8 rounds q to an integer (top 127); fp8 casts it to e4m3
               (torch.float8_e4m3fn: 4 exponent bits, 3 mantissa bits, rounding to nearest
               even; top 448, its largest finite value). Reading gives q · scale in float32.
So a scaled format costs 1 + 4/d_head bytes per value instead of 4 (fp32) or 2 (bf16). The
dense cache (kv_cache.py) and the engine's pool (serving/kv_pool.py) both store through here.
"""

from __future__ import annotations

from types import MappingProxyType

import torch

from ..errors import InputError

KV_DTYPES = MappingProxyType({
    "fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn,
})
SCALE_TOP = MappingProxyType({"int8": 127.0, "fp8": torch.finfo(torch.float8_e4m3fn).max})


def check_kv_dtype(kv_dtype: str) -> None:
    if kv_dtype not in KV_DTYPES:
        raise InputError("kv_dtype", f"choose one of {tuple(KV_DTYPES)}, got {kv_dtype!r}")


def is_scaled(kv_dtype: str | None) -> bool:
    """Whether the format keeps a float32 scale per vector beside its values."""
    return kv_dtype in SCALE_TOP


def bytes_per_vector(kv_dtype: str, d_head: int) -> int:
    """Memory of one stored vector of d_head values, its scale included."""
    check_kv_dtype(kv_dtype)
    return d_head * KV_DTYPES[kv_dtype].itemsize + (4 if is_scaled(kv_dtype) else 0)


def quantize_kv(x: torch.Tensor, kv_dtype: str = "int8") -> tuple[torch.Tensor, torch.Tensor]:
    """(..., d) float -> values (..., d) in the scaled format and float32 scales (...,)."""
    top = SCALE_TOP[kv_dtype]
    scale = x.float().abs().amax(-1) / top  # (...,)
    q = torch.where(scale[..., None] > 0, x.float() / scale[..., None], 0.0)  # (..., d)
    if kv_dtype == "int8":
        q = q.round()
    return q.clamp(-top, top).to(KV_DTYPES[kv_dtype]), scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Values (..., d) and scales (...,) -> float32 (..., d)."""
    return q.float() * scale[..., None]


def index_copy_(store: torch.Tensor, index: torch.Tensor, source: torch.Tensor) -> None:
    """store[index] = source along dim 0; fp8 tensors are copied as their bytes (the CPU has
    no index_copy for them)."""
    if store.dtype == torch.float8_e4m3fn:
        store, source = store.view(torch.uint8), source.view(torch.uint8)
    store.index_copy_(0, index, source)
