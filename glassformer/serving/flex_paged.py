"""Paged attention through PyTorch's FlexAttention, for decoding rows in fixed shapes.

B decoding rows, one query each, attend over the whole pool of one layer, seen as one sequence
of keys (1, KV, S_pool, d_head). A `BlockMask` says which pool blocks each row visits: its own
request's, listed in its block table (`kv_blocks` (B, 1, 1) how many, `kv_indices` (B, 1, 1,
n) which); FlexAttention skips every other block. Within those blocks the mask is the model's
rule written on positions: a key's position is its block's place in the table times the block
size plus its offset (`block_position`, (blocks,), the same for every request sharing a cached
prefix, whose blocks sit at the same places), seen while it is at most the query's (causal)
and, with a sliding window, less than `window` behind it.

Every tensor here has a shape fixed by the batch bucket and the pool, so the step compiles
once per bucket (graph_path.py) and on CUDA is recorded as a graph. The reference it must
match is the paged view (paged_attention.py) over the same pool; the attention module's own
function is not called, so the model must be one whose attention is plain scaled dot-product
under those masks (graph_path.py: its table and `refuses`).
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from ..model.kv_cache import AttentionFn
from ..model.layers.masking import AttentionMask

# FlexAttention's own block (its default size), which every tile its CUDA kernels choose
# divides: a row's one query sits in a block of this many, and on CUDA the pool's KV blocks
# are a multiple of it (its kernels take a tile of 32 to 128 keys, or, where a KV head's query
# heads are a power of two, no more keys than a block holds).
FLEX_BLOCK = 128


def paged_block_mask(kv_blocks: torch.Tensor, kv_indices: torch.Tensor, block_position: torch.Tensor,
                     q_position: torch.Tensor, block_size: int, pool_slots: int,
                     window: int | None) -> BlockMask:
    """Which pool slots each of B rows sees: kv_blocks (B, 1, 1) and kv_indices (B, 1, 1, n)
    int32, its block table; block_position (blocks,) each block's place in its table;
    q_position (B,) each row's position."""

    def sees(b, h, q_idx, kv_idx):
        key = block_position[kv_idx // block_size] * block_size + kv_idx % block_size
        seen = key <= q_position[b]
        if window is not None:
            seen = seen & (q_position[b] - key < window)
        return seen

    return BlockMask.from_kv_blocks(kv_blocks, kv_indices, BLOCK_SIZE=(FLEX_BLOCK, block_size),
                                    mask_mod=sees, seq_lengths=(1, pool_slots))


class FlexPagedCache:
    """The AttentionCache (model/kv_cache.py) of a graph step: each layer's new keys and values
    (B, KV, 1, d_head) written at `slots` (B,) of the pool, then FlexAttention of the queries
    over the pool under `block_mask`, at each layer's score scale (None: 1/√d_head)."""

    rotates_keys = False

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], slots: torch.Tensor,
                 block_mask: BlockMask, scales: list[float | None]) -> None:
        self.keys, self.values, self.slots = keys, values, slots  # (S_pool, KV, d_head) each layer
        self.block_mask, self.scales = block_mask, scales

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: AttentionMask | None, attention: AttentionFn) -> torch.Tensor:
        keys, values = self.keys[layer], self.values[layer]
        keys.index_copy_(0, self.slots, k[:, :, 0].to(keys.dtype))
        values.index_copy_(0, self.slots, v[:, :, 0].to(values.dtype))
        pooled_k = keys.transpose(0, 1)[None].to(q.dtype)  # (1, KV, S_pool, d_head)
        pooled_v = values.transpose(0, 1)[None].to(q.dtype)  # (1, KV, S_pool, d_head)
        grouped = q.shape[1] != k.shape[1]  # grouped-query attention
        return flex_attention(q, pooled_k, pooled_v, block_mask=self.block_mask, scale=self.scales[layer],
                              enable_gqa=grouped)  # (B, H, 1, d_head)
