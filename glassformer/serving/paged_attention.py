"""The engine's paged KV cache as an attention cache (model/kv_cache.py `AttentionCache`).

The model's blocks run over a step's N new rows as one sequence (B = 1, T = N); each attention
layer hands the view its q, k, v and its attention function; the view writes k and v at their
pool slots, then calls that function over each request's own keys, in position order, under the
model's mask. Reference: each query alone. Fast: a chunk's queries in groups at fixed positions
(EngineConfig.query_group), the step's single queries together, each padded to whole blocks: a
call's shape depends on the request's own positions alone. Under a sink policy positions are
the cache's, and the view rotates the stored, unrotated keys (model/sink.py).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

from ..model.kv_cache import AttentionFn
from ..model.layers.masking import AttentionMask
from ..model.sink import SinkPolicy, past_window_context, past_window_mask, rotate_keys
from ..model.sink_chunk import ChunkMask, window_positions
from ..model.transformer import Transformer
from .kv_pool import KVPool

if TYPE_CHECKING:
    from .step import RequestRows


class PagedView:
    """One step's view of the pool: where each request's keys are and what each query sees.
    Built once per step; every layer reuses its gather indices and masks."""

    def __init__(self, pool: KVPool, parts: tuple[RequestRows, ...], fast: bool, model: Transformer,
                 sink: SinkPolicy | None = None, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                 group: int = 1, deterministic: bool = False) -> None:
        """`rope`: the model's cos and sin (P, d_head) at positions 0..P-1, to rotate the keys a
        sink policy stores unrotated. `deterministic`: each single query in a call of its own
        (a GPU kernel may split a row's keys by how many rows share its call)."""
        self.pool, self.sink, self.model, self.deterministic = pool, sink, model, deterministic
        self.rotation = rope if sink is not None else None
        self.rotates_keys = sink is not None
        device = pool.device
        self.new_slots = torch.cat([p.slots[p.context - p.n :] for p in parts]).to(device)  # (N,)
        self.past_window = [p for p in parts if p.past_window]
        single: list[tuple[int, torch.Tensor]] = []  # fast: (flat row, slots seen) of each single-query call
        self.chunks: list[tuple[RequestRows, list[tuple[int, int, int, AttentionMask]]]] = []  # other calls
        for part in parts:
            if part.past_window:
                continue
            calls = self._calls(part, group if fast else 1)
            if fast:
                single += [(row, part.slots[:end]) for row, end, m in calls if m == 1]
                calls = [call for call in calls if call[2] > 1]
            masks = [model.attention_mask(torch.arange(end - m, end, device=device)[None],
                                          torch.arange(end, device=device)[None], contiguous=True)
                     for _, end, m in calls]
            if calls:
                self.chunks.append((part, [(*call, mask) for call, mask in zip(calls, masks, strict=True)]))
        self.single = self._single_calls(single)
        self.past_window_masks: list[ChunkMask] = []  # made at the first layer, for every layer

    def _single_calls(self, single: list[tuple[int, torch.Tensor]]):
        """The single-query calls side by side, one call per padded length L (each row's keys
        padded to whole blocks; deterministic: one call per row): (rows (B,), slots (B, L), mask) each."""
        device, block = self.pool.device, self.pool.block_size
        by_length: dict[tuple[int, int], list[tuple[int, torch.Tensor]]] = {}  # (L, row if alone, else 0)
        for row, slots in single:
            length = -(-slots.shape[0] // block) * block
            by_length.setdefault((length, row if self.deterministic else 0), []).append((row, slots))
        calls = []
        for (length, _), rows in by_length.items():
            seen = torch.tensor([slots.shape[0] for _, slots in rows], device=device)  # (B,) keys seen
            k_pos = torch.arange(length, device=device).expand(len(rows), length)  # (B, L)
            valid = k_pos < seen[:, None]  # (B, L)
            slot_matrix = torch.zeros(valid.shape, dtype=torch.long, device=device)  # (B, L)
            slot_matrix[valid] = torch.cat([slots for _, slots in rows]).to(device)
            calls.append((torch.tensor([row for row, _ in rows], device=device), slot_matrix,
                          self.model.attention_mask(seen[:, None] - 1, k_pos, valid)))  # queries at (B, 1)
        return calls

    def _past_window_mask(self, n: int, q: torch.Tensor) -> ChunkMask:
        """What a chunk of n tokens past the window sees (model/sink.py past_window_mask)."""
        S, W = self.sink.sink_tokens, self.sink.window
        q_pos = torch.arange(S + W - n, S + W, device=q.device)[None]  # (1, n)
        mask = self.model.attention_mask(q_pos, window_positions(S, W, n).to(q.device)[None])
        return past_window_mask(self.model.config, self.sink, mask, q.shape[1], q.dtype)

    def _calls(self, part: RequestRows, size: int) -> list[tuple[int, int, int]]:
        """(first flat row, keys seen, queries) of each attention call over a part's queries,
        in order, in groups at multiples of `size` positions (the reference: 1, one by one)."""
        first = part.context - part.n
        edges = [first, *range((first // size + 1) * size, part.context, size), part.context]
        return [(part.first + a - first, b, b - a) for a, b in itertools.pairwise(edges)]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: AttentionMask | None, attention: AttentionFn) -> torch.Tensor:
        """q (1, H, N, d_head), k and v (1, KV, N, d_head): the step's new rows."""
        before = [self._read(layer, p.slots[: p.context - p.n], q.dtype, rotate=False)
                  for p in self.past_window]  # (1, KV, S + W - 1, d_head) each: before the write
        if layer == 0:
            self.past_window_masks = [self._past_window_mask(p.n, q) for p in self.past_window]
        self.pool.write(layer, self.new_slots, k[0].transpose(0, 1), v[0].transpose(0, 1))
        out = torch.empty_like(q)  # (1, H, N, d_head)
        for part, seen, mask in zip(self.past_window, before, self.past_window_masks, strict=True):
            rows = part.rows
            out[:, :, rows] = past_window_context(self.model.config, self.sink, q[:, :, rows], seen,
                                                  (k[:, :, rows], v[:, :, rows]), mask)
        for rows, slots, mask in self.single:  # every query sees itself: no row of the mask is empty
            keys, values = self._read(layer, slots, q.dtype)  # (B, KV, L, d_head)
            queries = q[0, :, rows].transpose(0, 1)[:, :, None]  # (B, H, 1, d_head)
            context = attention(queries, keys, values, mask)  # (B, H, 1, d_head)
            out[0, :, rows] = context[:, :, 0].transpose(0, 1)
        for part, calls in self.chunks:
            keys, values = self._read(layer, part.slots, q.dtype)  # (1, KV, S, d_head)
            for row, end, m, call_mask in calls:
                out[:, :, row : row + m] = attention(q[:, :, row : row + m], keys[:, :, :end],
                                                     values[:, :, :end], call_mask)
        return out

    def _read(self, layer: int, slots: torch.Tensor, dtype: torch.dtype, rotate: bool = True):
        """Keys and values at slots (S,) or (B, S): each (1 or B, KV, S, d_head) in `dtype`,
        the keys rotated at 0..S-1 where they are stored unrotated and `rotate` asks."""
        k, v = self.pool.read(layer, slots)  # (..., S, KV, d_head)
        if slots.dim() == 1:
            k, v = k[None], v[None]
        k, v = k.transpose(1, 2).to(dtype), v.transpose(1, 2).to(dtype)
        return (rotate_keys(k, self.rotation) if rotate else k), v
