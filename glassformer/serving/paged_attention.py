"""The engine's paged KV cache as an attention cache (model/kv_cache.py `AttentionCache`).

The engine runs the model's own blocks over the flat batch of a step: the N new tokens of
every request as one sequence of N rows (B = 1, T = N). Each attention layer hands the view
its queries, keys and values and its own attention function (`Attention.context`: the
model's kernel, its score scale, hook sites). The view writes the keys and values at their
pool slots, then calls that function over each request's own keys, read back from the pool
in position order, under the mask the model itself builds (`Transformer.attention_mask`:
causality, the window, ALiBi, T5's relative bias):

- reference: each query alone over its own prefix. Every call has a shape set by the token's
  position alone, so its numbers are the same bit for bit whatever shares the step, the
  chunk, the block size or the cache hits; a decoding query is the very call `generate`
  makes on the module path.
- fast: the single-query requests of a step (decoding) in one call, their keys gathered
  into (B, KV, S_max, d_head) with the padding masked; each multi-token chunk (prefill) in
  one call with the causal mask offset by its cached prefix.
Queries, keys and values of request r are at positions 0..S_r-1 of its own sequence; under a
sink policy those are cache positions (`Part.slots` lists the kept slots in cache order), and
the view rotates the keys, stored unrotated, at them (model/sink.py). A chunk past the sink
policy's window reads the keys it sees before its own overwrite the oldest, and attends as
the dense sink cache does (model/sink_chunk.py), whichever attention the engine runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.kv_cache import AttentionFn
from ..model.layers.masking import AttentionMask
from ..model.sink import SinkPolicy, past_window_context, past_window_mask, rotate_keys
from ..model.sink_chunk import ChunkMask, window_positions
from ..model.transformer import Transformer
from .kv_pool import KVPool

ATTENTION = ("reference", "fast")


def slots_of(block_table: list[int], length: int, block_size: int) -> torch.Tensor:
    """The pool slots of a sequence's first `length` tokens: (length,)."""
    table = torch.tensor(block_table, dtype=torch.long)
    return (table[:, None] * block_size + torch.arange(block_size)).flatten()[:length]


@dataclass
class Part:
    """One request's share of a step: rows start..start+n of the flat batch."""

    start: int
    n: int
    slots: torch.Tensor  # (S,) every slot the request's queries see, in position order, new ones last
    past_window: bool = False  # a chunk past the sink policy's window (model/sink_chunk.py)

    @property
    def context(self) -> int:
        return self.slots.shape[0]

    @property
    def rows(self) -> slice:
        return slice(self.start, self.start + self.n)


class PagedView:
    """One step's view of the pool: where each request's keys are and what each query sees.
    Built once per step; every layer reuses its gather indices and masks."""

    def __init__(self, pool: KVPool, parts: list[Part], fast: bool, model: Transformer,
                 sink: SinkPolicy | None = None,
                 rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """`sink`: the engine's sink policy, whose keys are stored unrotated, with `rope`, the
        model's cos and sin (P, d_head) at positions 0..P-1 to rotate them; None: the layers
        rotated them."""
        self.pool, self.fast, self.sink, self.model = pool, fast, sink, model
        self.rotation = rope if sink is not None else None
        self.rotates_keys = sink is not None
        device = pool.device
        self.new_slots = torch.cat([p.slots[p.context - p.n :] for p in parts]).to(device)  # (N,)
        self.single = [p for p in parts if p.n == 1] if fast else []
        self.past_window = [p for p in parts if p.past_window]
        self.chunks = [p for p in parts if not (fast and p.n == 1) and not p.past_window]
        if self.single:
            B, s_max = len(self.single), max(p.context for p in self.single)
            self.rows = torch.tensor([p.start for p in self.single], device=device)  # (B,)
            self.slot_matrix = torch.zeros(B, s_max, dtype=torch.long, device=device)  # (B, S_max)
            valid = torch.zeros(B, s_max, dtype=torch.bool, device=device)  # (B, S_max)
            for b, p in enumerate(self.single):
                self.slot_matrix[b, : p.context] = p.slots
                valid[b, : p.context] = True
            k_pos = torch.arange(s_max, device=device).expand(B, s_max)  # (B, S_max)
            q_pos = torch.tensor([[p.context - 1] for p in self.single], device=device)  # (B, 1)
            self.single_mask = model.attention_mask(q_pos, k_pos, valid)
        # fast: one call per chunk; reference: one per query, over its own prefix
        self.chunk_calls = [self._calls(p) for p in self.chunks]
        self.chunk_masks = [
            [model.attention_mask(torch.arange(end - m, end, device=device)[None],
                                  torch.arange(end, device=device)[None], contiguous=True)
             for end, m in calls]
            for calls in self.chunk_calls
        ]
        self.past_window_masks: list[ChunkMask] = []  # made at the first layer, for every layer

    def _past_window_mask(self, n: int, q: torch.Tensor) -> ChunkMask:
        """What a chunk of n tokens past the window sees (model/sink.py past_window_mask)."""
        S, W = self.sink.sink_tokens, self.sink.window
        q_pos = torch.arange(S + W - n, S + W, device=q.device)[None]  # (1, n)
        mask = self.model.attention_mask(q_pos, window_positions(S, W, n).to(q.device)[None])
        return past_window_mask(self.model.config, self.sink, mask, q.shape[1], q.dtype)

    def _calls(self, part: Part) -> list[tuple[int, int]]:
        """(keys seen, queries) of each attention call for a chunk's queries, in order."""
        if self.fast:
            return [(part.context, part.n)]
        first = part.context - part.n
        return [(first + i + 1, 1) for i in range(part.n)]

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
        if self.single:  # every query sees itself, so no row of the mask is empty
            keys, values = self._read(layer, self.slot_matrix, q.dtype)  # (B, KV, S_max, d_head)
            queries = q[0, :, self.rows].transpose(0, 1)[:, :, None]  # (B, H, 1, d_head)
            context = attention(queries, keys, values, self.single_mask)  # (B, H, 1, d_head)
            out[0, :, self.rows] = context[:, :, 0].transpose(0, 1)
        for part, calls, masks in zip(self.chunks, self.chunk_calls, self.chunk_masks, strict=True):
            keys, values = self._read(layer, part.slots, q.dtype)  # (1, KV, S, d_head)
            row = part.start
            for (end, m), call_mask in zip(calls, masks, strict=True):
                out[:, :, row : row + m] = attention(q[:, :, row : row + m], keys[:, :, :end],
                                                     values[:, :, :end], call_mask)
                row += m
        return out

    def _read(self, layer: int, slots: torch.Tensor, dtype: torch.dtype, rotate: bool = True):
        """Keys and values at slots (S,) or (B, S): each (1 or B, KV, S, d_head) in `dtype`,
        the keys rotated at 0..S-1 where they are stored unrotated and `rotate` asks."""
        k, v = self.pool.read(layer, slots)  # (..., S, KV, d_head)
        if slots.dim() == 1:
            k, v = k[None], v[None]
        k, v = k.transpose(1, 2).to(dtype), v.transpose(1, 2).to(dtype)
        return (rotate_keys(k, self.rotation) if rotate else k), v
