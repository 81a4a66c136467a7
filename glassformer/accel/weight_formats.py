"""The formats a linear layer's weight is stored in, and the block quantization of weights
and activations behind int8 / int4, written as plain PyTorch (the oracle).

`WeightFormat` is the one name for a format from the command line (`--quantize`) through
`quantize_model` and `QuantizedLinear` to the C++ kernels, whose enum has the same names.
Weights are quantized along the input dimension in blocks of 32, each block with its own
fp16 scale (and, for int4, an fp16 minimum), and padded with zeros to a multiple of 32:
  int8: w ≈ d · q,      q ∈ [-127, 127]                      (like GGUF Q8_0)
  int4: w ≈ d · q + m,  q ∈ [0, 15], two per byte            (like GGUF Q4_1; Q4_0 is m = -8d)
Nibble order follows GGUF: byte j of a block holds element j in its low nibble and
element j + 16 in its high nibble. Activations are quantized per block of 32 to int8 with
scale amax / 127, as llama.cpp's Q8 dot product does.
"""

from __future__ import annotations

from enum import StrEnum

import torch
import torch.nn.functional as F

from ..errors import InputError

BLOCK = 32


class WeightFormat(StrEnum):
    """fp32 (N, K) float32; bf16 (N, K) bfloat16; int8 / int4 blocks of 32 (below); q4_k ...
    q5_1 rows of GGUF blocks as a file stores them (GGUF_FORMATS, kquants.py)."""

    FP32 = "fp32"
    BF16 = "bf16"
    INT8 = "int8"
    INT4 = "int4"
    # GGUF's blocks in the file's own layout (kquants.py): kept from a file, never made here
    Q4_K = "q4_k"
    Q5_K = "q5_k"
    Q6_K = "q6_k"
    Q3_K = "q3_k"
    Q5_0 = "q5_0"
    Q5_1 = "q5_1"

    @classmethod
    def parse(cls, value: str, field: str = "mode") -> WeightFormat:
        """A format from its name; "none" is float32 (no quantization), as `--quantize` says."""
        if value == "none":
            return cls.FP32
        try:
            return cls(value)
        except ValueError:
            raise InputError(field, f"unknown weight format {value!r}; choose one of "
                             f"{', '.join(['none', *cls])}") from None


# The formats only a GGUF file's blocks are kept in (there is no quantizer for them here)
GGUF_FORMATS = (WeightFormat.Q4_K, WeightFormat.Q5_K, WeightFormat.Q6_K, WeightFormat.Q3_K,
                WeightFormat.Q5_0, WeightFormat.Q5_1)


def n_blocks(in_features: int) -> int:
    return -(-in_features // BLOCK)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """(..., K) -> (..., nb, 32) float32, zero-padded to whole blocks."""
    k = x.shape[-1]
    x = F.pad(x.float(), (0, n_blocks(k) * BLOCK - k))
    return x.reshape(*x.shape[:-1], -1, BLOCK)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> qweight (N, nb·32) int8 and scales (N, nb) fp16."""
    blocks = _blocks(weight)  # (N, nb, 32)
    scales = (blocks.abs().amax(-1) / 127).half()  # (N, nb)
    d = scales.float().unsqueeze(-1)
    q = torch.where(d > 0, blocks / d, 0.0).round().clamp(-127, 127)
    return q.to(torch.int8).reshape(weight.shape[0], -1), scales


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor, in_features: int) -> torch.Tensor:
    """The (N, K) float32 weight that int8 blocks stand for."""
    n, nb = scales.shape
    w = qweight.reshape(n, nb, BLOCK).float() * scales.float().unsqueeze(-1)  # (N, nb, 32)
    return w.reshape(n, -1)[:, :in_features]


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(N, nb, 32) values in 0..15 -> (N, nb·16) uint8, GGUF nibble order."""
    q = q.to(torch.uint8)
    return (q[..., :16] | (q[..., 16:] << 4)).reshape(q.shape[0], -1)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """(N, nb·16) uint8 -> (N, nb, 32) uint8 values in 0..15."""
    p = packed.reshape(packed.shape[0], -1, 16)
    return torch.cat([p & 0x0F, p >> 4], dim=-1)


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, K) float -> qweight (N, nb·16) uint8, scales (N, nb) fp16, mins (N, nb) fp16."""
    blocks = _blocks(weight)  # (N, nb, 32)
    low, high = blocks.amin(-1), blocks.amax(-1)
    mins = low.half()
    scales = ((high - mins.float()) / 15).half()
    d, m = scales.float().unsqueeze(-1), mins.float().unsqueeze(-1)
    q = torch.where(d > 0, (blocks - m) / d, 0.0).round().clamp(0, 15)
    return pack_nibbles(q), scales, mins


def dequantize_int4(
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, in_features: int
) -> torch.Tensor:
    """The (N, K) float32 weight that 4-bit blocks stand for."""
    q = unpack_nibbles(qweight).float()  # (N, nb, 32)
    w = q * scales.float().unsqueeze(-1) + mins.float().unsqueeze(-1)
    return w.reshape(q.shape[0], -1)[:, :in_features]


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) float -> q (M, nb, 32) int8 values held as float32, scales d (M, nb) float32."""
    blocks = _blocks(x)  # (M, nb, 32)
    amax = blocks.abs().amax(-1)  # (M, nb)
    inv = torch.where(amax > 0, 127 / amax, 0.0).unsqueeze(-1)
    return (blocks * inv).round(), amax / 127
