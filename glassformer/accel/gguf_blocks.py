"""GGUF blocks -> a QuantizedLinear's tensors, without requantizing: Q8_0 / Q4_0 / Q4_1 as the
int8 / int4 kernel tensors, and the K-quants and Q5_x (Q3_K ... Q6_K, Q5_0, Q5_1) as the
file's own bytes (kquants.py). `KEPT_TYPES` names every type so kept.

GGUF stores a quantized (N, K) matrix as N rows of K / 32 blocks (what `gguf` returns as
`tensor.data`: a uint8 array of N rows of bytes). Block layouts:
  Q8_0  fp16 d, 32 × int8 q                 w = d · q
  Q4_0  fp16 d, 16 bytes of nibbles         w = d · (q - 8)   ->  int4 with m = -8 d
  Q4_1  fp16 d, fp16 m, 16 bytes            w = d · q + m
The nibble order is already block order's (element j low, element j + 16 high; a
QuantizedLinear moves the bytes into chunk order where its kernels read that). The scales
are copied bit for bit, so the dequantized weights equal `gguf.quants.dequantize` exactly.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import InputError
from . import kquants
from .weight_formats import WeightFormat

BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}  # the types moved into int8 / int4 blocks of 32
KEPT_TYPES = (*BLOCK_BYTES, *kquants.BY_TYPE)


def from_gguf_blocks(
    data: np.ndarray, qtype, shape: tuple[int, int]
) -> tuple[WeightFormat, dict[str, torch.Tensor]]:
    """(mode, tensors) for QuantizedLinear from raw blocks of an (N, K) = `shape` matrix.

    `qtype` is a `gguf.GGMLQuantizationType` or its name (one of KEPT_TYPES).
    """
    name = getattr(qtype, "name", qtype)
    if name not in KEPT_TYPES:
        raise InputError(None, f"GGUF type {name} has no direct kernel; supported: {list(KEPT_TYPES)}")
    n, k = shape
    if name in kquants.BY_TYPE:
        fmt = kquants.BY_TYPE[name]
        try:
            size = kquants.row_bytes(fmt, k)
        except ValueError as error:
            raise InputError(None, str(error)) from None
        raw = np.asarray(data, dtype=np.uint8)
        if raw.size != n * size:
            raise InputError(None, f"{name} data of {raw.size} bytes does not fit a ({n}, {k}) matrix")
        return fmt, {"qweight": torch.from_numpy(raw.reshape(n, size).copy())}  # (N, row bytes), copied once
    if k % 32:
        raise InputError(None, f"GGUF {name} rows must hold whole blocks of 32, got {k} columns")
    nb, size = k // 32, BLOCK_BYTES[name]
    raw = np.asarray(data, dtype=np.uint8)  # a view where it can be
    if raw.size != n * nb * size:
        raise InputError(None, f"{name} data of {raw.size} bytes does not fit a ({n}, {k}) matrix")
    blocks = raw.reshape(n, nb, size)

    def field(start: int, stop: int) -> torch.Tensor:  # (N, nb, stop - start) bytes, copied once
        return torch.from_numpy(np.ascontiguousarray(blocks[:, :, start:stop]))

    d = field(0, 2).view(torch.float16).squeeze(-1)  # (N, nb)
    if name == "Q8_0":
        q = field(2, size).view(torch.int8).reshape(n, -1)  # (N, K)
        return WeightFormat.INT8, {"qweight": q, "scales": d}
    if name == "Q4_0":
        m = d * -8  # exact in fp16: a power of two
        nibbles = field(2, size)
    else:
        m = field(2, 4).view(torch.float16).squeeze(-1)  # (N, nb)
        nibbles = field(4, size)
    return WeightFormat.INT4, {"qweight": nibbles.reshape(n, -1), "scales": d, "mins": m}
