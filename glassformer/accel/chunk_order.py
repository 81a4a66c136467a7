"""The order in which the AVX-512 VNNI kernels read a quantized weight row's bytes.

Block order (GGUF's, weight_formats.py) keeps each block of 32 weights together. The AVX-512
kernels (csrc/quantized.cpp) take blocks in chunks of CHUNK, one block per 32-bit lane, so in
chunk order the t-th 64 bytes of a chunk hold bytes 4t..4t+3 of each of its 16 blocks: one
plain load then gives every lane its block's next 4 bytes, with no regrouping per call. A
shorter last chunk holds 4·len bytes per t; a tail that one 64-byte load holds (up to 4 int4
or 2 int8 blocks) stays in block order. Only bytes within a row move: rows, scales and mins
keep their meaning, and a row in chunk order takes the same memory.

A layer whose kernels read chunk order (`kernels.chunk_order()`) holds its `qweight` so, in
place of the block-order bytes (made once, when the layer is built or loaded), and writes
block order to its state dict (`ChunkOrdered`): checkpoints are the same on every CPU.
"""

from __future__ import annotations

import torch
from torch import nn

CHUNK = 16  # blocks per chunk: one per 32-bit lane of a 512-bit register


def _index(n_blocks: int, block_bytes: int) -> torch.Tensor:
    """(row bytes,) int64: the block-order byte that each chunk-order byte holds."""
    tail = n_blocks % CHUNK
    tail = tail if tail * block_bytes <= 64 else 0
    body, parts = n_blocks - tail, []
    for b0 in range(0, body, CHUNK):
        length = min(CHUNK, body - b0)
        block = torch.arange(b0 * block_bytes, (b0 + length) * block_bytes)
        parts.append(block.reshape(length, block_bytes // 4, 4).transpose(0, 1).reshape(-1))
    parts.append(torch.arange(body * block_bytes, n_blocks * block_bytes))
    return torch.cat(parts)


def to_chunk_order(qweight: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """(N, row bytes) int8 / int4 blocks in block order -> a new tensor in chunk order."""
    index = _index(n_blocks, qweight.shape[1] // n_blocks)
    return qweight[:, index.to(qweight.device)]


def from_chunk_order(qweight: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """The inverse of `to_chunk_order`: a new tensor in block order."""
    index = _index(n_blocks, qweight.shape[1] // n_blocks)
    return qweight[:, torch.argsort(index).to(qweight.device)]


def in_block_order(qweight: torch.Tensor, n_blocks: int, chunked: bool) -> torch.Tensor:
    """qweight's rows in block order: `from_chunk_order` where they are held `chunked`, else
    qweight itself."""
    return from_chunk_order(qweight, n_blocks) if chunked else qweight


class ChunkOrdered(nn.Module):
    """A module with int8 / int4 `qweight` and `scales` buffers that holds `qweight` in chunk
    order where `chunked` is set, and reads and writes its state dict in block order."""

    chunked = False

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.chunked and prefix + "qweight" in destination:
            destination[prefix + "qweight"] = from_chunk_order(self.qweight, self.scales.shape[1])

    def _load_from_state_dict(self, state_dict, prefix, *args):
        errors = args[-1]
        before = len(errors)
        super()._load_from_state_dict(state_dict, prefix, *args)
        if self.chunked and prefix + "qweight" in state_dict and len(errors) == before:
            self.qweight = to_chunk_order(self.qweight, self.scales.shape[1])
