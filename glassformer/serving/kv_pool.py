"""The paged KV cache's storage: one pool of token slots per layer (slot = block · block_size +
offset), keys and values (KV, d_head) per slot in a format of model/kv_formats.py; reads are
always float32, so a request sees the same keys whoever wrote them.

Memory follows use up to `n_blocks`: the pool grows when a step needs a block beyond those
held, by a quarter at least (growing by doubling held up to twice what the requests used, 32
blocks for 17; by a quarter each slot is copied fewer than five times in all). On an
accelerator it is taken whole at once (`preallocate`: its addresses never move, so a step's
index tensors and a captured graph stay valid), as for the graph executor, which also gets one
scratch block past the last for its padding rows (`scratch`).
"""

from __future__ import annotations

import math

import torch

from ..errors import InputError
from ..model.config import ModelConfig
from ..model.kv_formats import (
    KV_DTYPES,
    bytes_per_vector,
    dequantize_kv,
    index_copy_,
    is_scaled,
    quantize_kv,
)
from ..model.sizes import MIB, check_fits


def bytes_per_block(config: ModelConfig, block_size: int, kv_dtype: str) -> int:
    """Memory of one block across every layer, keys and values."""
    return 2 * config.n_layers * block_size * config.kv_heads * bytes_per_vector(kv_dtype, config.head_dim)


def pool_blocks(config: ModelConfig, kv_memory_mb: float, block_size: int, kv_dtype: str,
                device: torch.device | str) -> int:
    """How many blocks a pool of kv_memory_mb MiB holds, checked before anything is built:
    a pool no larger than the device's memory (sizes.check_fits) and one block at least."""
    block = bytes_per_block(config, block_size, kv_dtype)
    check_fits(block, device, "block_size", f"one KV block of {block_size} tokens")
    check_fits(kv_memory_mb * MIB, device, "kv_memory_mb", f"a KV pool of {kv_memory_mb:g} MiB")
    n_blocks = int(kv_memory_mb * MIB) // block
    if n_blocks < 1:
        smallest = math.ceil(block / MIB * 1000) / 1000
        raise InputError("kv_memory_mb", f"{kv_memory_mb:g} MiB holds no KV block of {block_size} tokens "
                         f"(block_size), which takes {block / MIB:.3g} MiB for this model: the "
                         f"smallest pool that works is {smallest:g} MiB, or smaller blocks")
    return n_blocks


class KVPool:
    def __init__(self, config: ModelConfig, n_blocks: int, block_size: int, kv_dtype: str = "fp32",
                 device: torch.device | str = "cpu", preallocate: bool | None = None,
                 scratch: bool = False) -> None:
        """`preallocate`: take all n_blocks now (default: on any device but the CPU);
        `scratch`: all of them now and one block more, `scratch_block`, no request's."""
        bytes_per_block(config, block_size, kv_dtype)  # validates kv_dtype
        self.n_blocks, self.block_size, self.kv_dtype = n_blocks, block_size, kv_dtype
        self.device, self.allocated = device, 0  # blocks held in memory so far
        self.scratch_block = n_blocks if scratch else None
        layers, empty = range(config.n_layers), (0, config.kv_heads, config.head_dim)  # (slots, KV, d_head)
        self.keys = [torch.zeros(empty, dtype=KV_DTYPES[kv_dtype], device=device) for _ in layers]
        self.values = [torch.zeros_like(t) for t in self.keys]
        scaled = layers if is_scaled(kv_dtype) else ()  # (slots, KV): one scale per slot and head
        self.key_scales = [torch.zeros(0, config.kv_heads, device=device) for _ in scaled]
        self.value_scales = [torch.zeros_like(t) for t in self.key_scales]
        if scratch or (preallocate if preallocate is not None else torch.device(device).type != "cpu"):
            self.reserve(n_blocks)

    def reserve(self, n_blocks: int) -> None:
        """Hold at least the first `n_blocks` blocks in memory (grown by a quarter at least, up
        to the pool's size); what they hold is kept."""
        if n_blocks <= self.allocated:
            return
        if n_blocks > self.n_blocks:
            raise InputError("blocks", f"{n_blocks} needed, the pool has {self.n_blocks}")
        grown = min(self.n_blocks, max(n_blocks, self.allocated + self.allocated // 4))
        scratch = self.scratch_block is not None and grown == self.n_blocks  # taken whole: one more
        extra = (grown - self.allocated + scratch) * self.block_size  # new slots
        for store in (self.keys, self.values, self.key_scales, self.value_scales):
            for layer, t in enumerate(store):
                store[layer] = torch.cat([t, t.new_zeros(extra, *t.shape[1:])])
        self.allocated = grown

    def nbytes(self) -> int:
        tensors = self.keys + self.values + self.key_scales + self.value_scales
        return sum(t.numel() * t.element_size() for t in tensors)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (N, KV, d_head) at slots (N,)."""
        for store, scales, x in ((self.keys, self.key_scales, k), (self.values, self.value_scales, v)):
            if scales:  # a scaled format: its values, and one scale per slot and head
                x, scale = quantize_kv(x, self.kv_dtype)
                scales[layer].index_copy_(0, slots, scale)
            index_copy_(store[layer], slots, x.to(store[layer].dtype))

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at slots (...,): each (..., KV, d_head) float32."""
        k, v = self.keys[layer][slots], self.values[layer][slots]
        if is_scaled(self.kv_dtype):
            k_scale, v_scale = self.key_scales[layer][slots], self.value_scales[layer][slots]
            return dequantize_kv(k, k_scale), dequantize_kv(v, v_scale)
        return k.float(), v.float()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks (source, destination) in every layer (copy-on-write)."""
        if not pairs:
            return
        self.reserve(1 + max(max(pair) for pair in pairs))
        bs = self.block_size
        src = torch.cat([torch.arange(s * bs, (s + 1) * bs) for s, _ in pairs])
        dst = torch.cat([torch.arange(d * bs, (d + 1) * bs) for _, d in pairs])
        for store in (self.keys, self.values, self.key_scales, self.value_scales):
            for t in store:
                index_copy_(t, dst.to(t.device), t[src.to(t.device)])
