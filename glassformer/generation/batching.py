"""Sequences of different lengths in one batch: left padding, and picking rows of a KV cache.

Left padding keeps every row's newest token in the last column, so one decode step serves
all rows; the pad mask hides the padding from attention and positions count real tokens only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..model.kv_cache import KVCache


def left_pad(rows: Sequence[Sequence[int]], device: torch.device) -> tuple[Tensor, ...]:
    """ids (B, L) padded on the left, their positions (B, L) and pad_mask (B, L);
    positions and pad_mask are None when every row has the same length."""
    L = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), L, dtype=torch.long, device=device)  # (B, L)
    mask = torch.zeros(len(rows), L, dtype=torch.bool, device=device)  # (B, L)
    for b, row in enumerate(rows):
        ids[b, L - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[b, L - len(row) :] = True
    if mask.all():
        return ids, None, None
    positions = (mask.long().cumsum(dim=1) - 1).clamp(min=0)  # (B, L): 0 at the first real token
    return ids, positions, mask


def select_rows(cache: KVCache, rows: Tensor) -> None:
    """Keep (or repeat) the cache's batch rows `rows` (B',) in that order, in place."""
    for i, (k, v) in enumerate(zip(cache.keys, cache.values, strict=True)):
        if k is not None:
            cache.keys[i], cache.values[i] = k.index_select(0, rows), v.index_select(0, rows)
    for scales in (cache.key_scales, cache.value_scales):
        scales[:] = [s.index_select(0, rows) for s in scales]
    cache.cross = [(k.index_select(0, rows), v.index_select(0, rows)) for k, v in cache.cross]
    cache.positions = cache.positions.index_select(0, rows.to(cache.positions.device))
    cache.valid = cache.valid.index_select(0, rows.to(cache.valid.device))
    cache.batch_size = len(rows)
    cache.shape = (len(rows), *cache.shape[1:])
