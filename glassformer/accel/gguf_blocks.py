"""GGUF Q8_0 / Q4_0 / Q4_1 blocks -> the int8 / int4 kernel tensors, without requantizing.

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
from .weight_formats import WeightFormat

BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def from_gguf_blocks(
    data: np.ndarray, qtype, shape: tuple[int, int]
) -> tuple[WeightFormat, dict[str, torch.Tensor]]:
    """(mode, tensors) for QuantizedLinear from raw blocks of an (N, K) = `shape` matrix.

    `qtype` is a `gguf.GGMLQuantizationType` or its name ("Q8_0", "Q4_0", "Q4_1").
    """
    name = getattr(qtype, "name", qtype)
    if name not in BLOCK_BYTES:
        raise InputError(None, f"GGUF type {name} has no direct kernel; supported: {list(BLOCK_BYTES)}")
    n, k = shape
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
