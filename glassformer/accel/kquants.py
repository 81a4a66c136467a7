"""GGUF's K-quants (Q3_K, Q4_K, Q5_K, Q6_K) and 5-bit blocks (Q5_0, Q5_1), held as the file stores
them, and their float32 weights written as plain PyTorch (the oracle beside gguf's own).

A layer in one of these formats holds one tensor, `qweight` (N, row bytes) uint8: each row its
blocks exactly as in the file, so it costs what the file does, byte for byte (bits a weight):
  Q4_K  4.5     super-block of 256 (144 bytes): fp16 d, fp16 dmin, 12 bytes packing 8 six-bit
                scales sc and minimums m, 128 bytes of nibbles; w = d sc_j q - dmin m_j for
                sub-block j of 32 (byte l of the 32 at 32 i: element l of sub-block 2 i low,
                of 2 i + 1 high)
  Q5_K  5.5     (176 bytes) Q4_K's header, 32 bytes of high bits (bit j of byte l: element l
                of sub-block j), Q4_K's nibbles; q = nibble + 16 h
  Q6_K  6.5625  (210 bytes) 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales
                (one per 16 weights), fp16 d; w = d sc (q - 32)
  Q3_K  3.4375  (110 bytes) 32 bytes of high bits (bit j of byte l: element l of block j), 64
                bytes of 2-bit quants (byte l of the 32 at 32 h: bits 2 k of element l of block
                4 h + k), 12 bytes packing 16 six-bit scales (one per 16 weights, stored plus
                32), fp16 d; w = d sc (q - 4), q = the 2 bits + 4 h
  Q5_0  5.5     block of 32 (22 bytes): fp16 d, 32 high bits, 16 bytes of nibbles (byte l:
                element l low, l + 16 high); w = d (q - 16)
  Q5_1  6.0     (24 bytes) fp16 d, fp16 m, the same; w = d q + m
No scale is widened and nothing is requantized. The C++ kernels (csrc/kquants.cpp) decode
these bytes as they multiply; `dequantize` computes the weights with the same exact products
as gguf.quants.dequantize, so both give its values bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .weight_formats import WeightFormat, quantize_activations

# format -> (GGUF type name, weights a block, bytes a block)
LAYOUTS = {
    WeightFormat.Q4_K: ("Q4_K", 256, 144),
    WeightFormat.Q5_K: ("Q5_K", 256, 176),
    WeightFormat.Q6_K: ("Q6_K", 256, 210),
    WeightFormat.Q3_K: ("Q3_K", 256, 110),
    WeightFormat.Q5_0: ("Q5_0", 32, 22),
    WeightFormat.Q5_1: ("Q5_1", 32, 24),
}
BY_TYPE = {name: fmt for fmt, (name, _, _) in LAYOUTS.items()}


def bits_per_weight(fmt: WeightFormat) -> float:
    _, weights, size = LAYOUTS[fmt]
    return 8 * size / weights


def row_bytes(fmt: WeightFormat, in_features: int) -> int:
    """The bytes a row of `in_features` weights takes; they must be whole blocks."""
    _, weights, size = LAYOUTS[fmt]
    if in_features % weights:
        raise ValueError(f"{LAYOUTS[fmt][0]} rows hold whole blocks of {weights}, "
                         f"got {in_features} columns")
    return in_features // weights * size


def _half(b: torch.Tensor) -> torch.Tensor:
    """(..., 2) little-endian fp16 bytes -> (..., 1) float32."""
    return b.contiguous().view(torch.float16).float()


def _bits(b: torch.Tensor, width: int) -> torch.Tensor:
    """(..., B) bytes -> (..., B · 8 / width) fields of `width` bits, low bits first per byte,
    fields of a byte side by side: (..., 8 / width, B) flattened."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=b.device)[:, None]  # (8 / width, 1)
    return (b.unsqueeze(-2) >> shifts) & ((1 << width) - 1)  # (..., 8 / width, B)


def _scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., 12) packed bytes (Q4_K, Q5_K) -> the 8 six-bit scales and minimums (..., 8) float32."""
    low, mid, high = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = torch.cat([low & 63, (high & 15) | ((low >> 6) << 4)], -1)
    mins = torch.cat([mid & 63, (high >> 4) | ((mid >> 6) << 4)], -1)
    return scales.float(), mins.float()


def dequantize(qweight: torch.Tensor, fmt: WeightFormat, in_features: int) -> torch.Tensor:
    """(M, row bytes) uint8 rows of `fmt` blocks -> the (M, in_features) float32 weight."""
    _, weights, size = LAYOUTS[fmt]
    m = qweight.shape[0]
    blocks = qweight.reshape(m, row_bytes(fmt, in_features) // size, size)  # (M, G, size)
    g = blocks.shape[1]
    if fmt in (WeightFormat.Q5_0, WeightFormat.Q5_1):
        d = _half(blocks[..., 0:2])  # (M, G, 1)
        rest = blocks[..., 2:] if fmt == WeightFormat.Q5_0 else blocks[..., 4:]
        high = _bits(rest[..., 0:4], 1).transpose(-1, -2).reshape(m, g, 32)  # bit i: element i
        nibbles = torch.cat([rest[..., 4:] & 15, rest[..., 4:] >> 4], -1)  # (M, G, 32)
        q = nibbles | (high << 4)
        if fmt == WeightFormat.Q5_0:
            w = d * (q.to(torch.int16) - 16).float()
        else:
            w = d * q.float() + _half(blocks[..., 2:4])
        return w.reshape(m, in_features)
    if fmt == WeightFormat.Q6_K:
        low = _bits(blocks[..., 0:128].reshape(m, g, 2, 64), 4)  # (M, G, 2, 2, 64)
        pairs = _bits(blocks[..., 128:192].reshape(m, g, 2, 32), 2)  # (M, G, 2, 4, 32)
        q = low.reshape(m, g, 8, 32) | (pairs.reshape(m, g, 8, 32) << 4)
        scales = blocks[..., 192:208].contiguous().view(torch.int8).float()  # (M, G, 16)
        d = _half(blocks[..., 208:210]) * scales  # (M, G, 16)
        w = d[..., None] * (q.to(torch.int16) - 32).float().reshape(m, g, 16, 16)
        return w.reshape(m, in_features)
    if fmt == WeightFormat.Q3_K:
        packed = blocks[..., 96:108]  # (M, G, 12): low 4 bits in bytes 0-7, top 2 in 8-11
        low = _bits(packed[..., 0:8], 4).reshape(m, g, 16)
        top = _bits(packed[..., 8:12], 2).reshape(m, g, 16)
        scales = ((low | (top << 4)).to(torch.int16) - 32).float()  # (M, G, 16)
        d = _half(blocks[..., 108:110]) * scales  # (M, G, 16)
        two = _bits(blocks[..., 32:96].reshape(m, g, 2, 32), 2).reshape(m, g, 8, 32)
        q = two | (_bits(blocks[..., 0:32], 1) << 2)  # (M, G, 8, 32)
        w = d[..., None] * (q.to(torch.int16) - 4).float().reshape(m, g, 16, 16)
        return w.reshape(m, in_features)
    d, dmin = _half(blocks[..., 0:2]), _half(blocks[..., 2:4])  # (M, G, 1) each
    scales, mins = _scales_and_mins(blocks[..., 4:16])  # (M, G, 8) each
    nibbles = _bits(blocks[..., -128:].reshape(m, g, 4, 32), 4).reshape(m, g, 8, 32)
    q = nibbles
    if fmt == WeightFormat.Q5_K:
        q = nibbles | (_bits(blocks[..., 16:48], 1) << 4)  # (M, G, 8, 32)
    w = (d * scales)[..., None] * q.float() - (dmin * mins)[..., None]  # (M, G, 8, 32)
    return w.reshape(m, in_features)


def linear(x: torch.Tensor, qweight: torch.Tensor, fmt: WeightFormat,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """The product the kernels compute, as plain math: x (M, K) quantized per block of 32 as
    they quantize it, times the dequantized weight: (M, N). An input that needs a gradient
    (rounding has none) multiplies the weight unquantized."""
    k = x.shape[1]
    w = dequantize(qweight, fmt, k)  # (N, K)
    if not (x.requires_grad and torch.is_grad_enabled()):
        q, d = quantize_activations(x)  # (M, nb, 32), (M, nb)
        x = (q * d.unsqueeze(-1)).reshape(x.shape[0], -1)[:, :k]  # (M, K)
    return F.linear(x, w, bias)
