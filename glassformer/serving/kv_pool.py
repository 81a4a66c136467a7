"""The paged KV cache's storage: one preallocated pool of token slots per layer.

Slot s = block · block_size + offset. Keys and values are stored per slot as (KV, d_head):
  fp32 / bf16: the values themselves;
  int8: q = round(x / scale) in [-127, 127] with one float32 scale = amax / 127 per slot and
        head, i.e. 1 + 4/d_head bytes per value instead of 4 (fp32) or 2 (bf16).
Reads always return float32; everything attends to what the pool holds, so a request sees the
same keys whether they were written by a decode step, a prefill chunk or another request.

The pool is sized by what the requests use, up to its `n_blocks`: memory is taken for the
first blocks only, and grows (doubling) when a step needs a block beyond them (`reserve`).
The block manager hands out never-used blocks in order before it reuses freed ones (which may
hold a cached prefix), so memory follows the work the engine has seen, up to the pool's size:
two short prompts never take the whole `--kv-memory-mb`.
"""

from __future__ import annotations

import torch

from ..model.config import ModelConfig

KV_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}


def bytes_per_block(config: ModelConfig, block_size: int, kv_dtype: str) -> int:
    """Memory of one block across every layer, keys and values."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype: choose one of {tuple(KV_DTYPES)}, got {kv_dtype!r}")
    per_head = config.head_dim * KV_DTYPES[kv_dtype].itemsize + (4 if kv_dtype == "int8" else 0)
    return 2 * config.n_layers * block_size * config.kv_heads * per_head


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., d) float -> int8 values (..., d) and float32 scales (...,), per vector."""
    scale = x.float().abs().amax(-1) / 127  # (...,)
    q = torch.where(scale[..., None] > 0, x.float() / scale[..., None], 0.0).round()
    return q.clamp(-127, 127).to(torch.int8), scale


class KVPool:
    def __init__(self, config: ModelConfig, n_blocks: int, block_size: int, kv_dtype: str = "fp32",
                 device: torch.device | str = "cpu") -> None:
        bytes_per_block(config, block_size, kv_dtype)  # validates kv_dtype
        self.n_blocks, self.block_size, self.kv_dtype = n_blocks, block_size, kv_dtype
        self.slot_shape = (config.kv_heads, config.head_dim)  # (KV, d_head) per slot
        self.device, self.allocated = device, 0  # blocks held in memory so far
        empty = [torch.zeros(0, *self.slot_shape, dtype=KV_DTYPES[kv_dtype], device=device)
                 for _ in range(2 * config.n_layers)]  # (slots, KV, d_head) each
        self.keys, self.values = empty[: config.n_layers], empty[config.n_layers :]
        self.key_scales: list[torch.Tensor] = []
        self.value_scales: list[torch.Tensor] = []
        if kv_dtype == "int8":  # (slots, KV) one scale per slot and head
            scales = [torch.zeros(0, config.kv_heads, device=device) for _ in range(2 * config.n_layers)]
            self.key_scales, self.value_scales = scales[: config.n_layers], scales[config.n_layers :]

    def reserve(self, n_blocks: int) -> None:
        """Hold at least the first `n_blocks` blocks in memory (grown by doubling, up to the
        pool's size); what they hold is kept."""
        if n_blocks <= self.allocated:
            return
        if n_blocks > self.n_blocks:
            raise ValueError(f"blocks: {n_blocks} needed, the pool has {self.n_blocks}")
        grown = min(self.n_blocks, max(n_blocks, 2 * self.allocated))
        extra = (grown - self.allocated) * self.block_size  # new slots
        for store in (self.keys, self.values, self.key_scales, self.value_scales):
            for layer, t in enumerate(store):
                store[layer] = torch.cat([t, t.new_zeros(extra, *t.shape[1:])])
        self.allocated = grown

    def nbytes(self) -> int:
        tensors = self.keys + self.values + self.key_scales + self.value_scales
        return sum(t.numel() * t.element_size() for t in tensors)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (N, KV, d_head) at slots (N,)."""
        if self.kv_dtype == "int8":
            for store, scales, x in ((self.keys, self.key_scales, k), (self.values, self.value_scales, v)):
                q, scale = quantize_kv(x)
                store[layer].index_copy_(0, slots, q)
                scales[layer].index_copy_(0, slots, scale)
            return
        self.keys[layer].index_copy_(0, slots, k.to(self.keys[layer].dtype))
        self.values[layer].index_copy_(0, slots, v.to(self.values[layer].dtype))

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at slots (...,): each (..., KV, d_head) float32."""
        k, v = self.keys[layer][slots], self.values[layer][slots]
        if self.kv_dtype == "int8":
            k = k.float() * self.key_scales[layer][slots][..., None]
            v = v.float() * self.value_scales[layer][slots][..., None]
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
                t.index_copy_(0, dst.to(t.device), t[src.to(t.device)])
