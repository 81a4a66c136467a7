"""Attention over block tables: each request's queries against the keys its blocks hold.

- reference: per query token, the keys and values of its own prefix gathered from the pool
  in position order, then the model's reference kernel (the oracle). Every product then has
  a shape set by the token's position alone, so its numbers are the same bit for bit
  whatever shares the step, the chunk, the block size or the cache hits (matrix products
  sum in an order that may change with their shapes).
- fast: the single-query requests of a step (decoding) in one batched SDPA call, their keys
  gathered into (B, KV, S_max, d_head) with the padding masked; each multi-token chunk
  (prefill) in its own SDPA call with the causal mask offset by its cached prefix.
Queries, keys and values of request r are at positions 0..S_r-1 of its own sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..model.layers.attention_backends import reference_attention
from ..model.layers.masking import AttentionMask
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
    slots: torch.Tensor  # (S,) every cached slot of the request, new ones last

    @property
    def context(self) -> int:
        return self.slots.shape[0]


class AttentionPlan:
    """Per step, the gather indices and masks (as additive biases) that every layer reuses."""

    def __init__(self, parts: list[Part], fast: bool, window: int | None,
                 alibi_slopes: torch.Tensor | None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        self.window, self.alibi_slopes = window, alibi_slopes
        self.single = [p for p in parts if p.n == 1] if fast else []
        self.chunks = [p for p in parts if not (fast and p.n == 1)]
        self.fast = fast
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
            self.single_bias = self._mask(q_pos, k_pos, valid).bias(dtype)  # (B, 1 or H, 1, S_max)
        self.chunk_masks = [
            self._mask(torch.arange(p.context - p.n, p.context, device=device)[None],
                       torch.arange(p.context, device=device)[None])
            for p in self.chunks
        ]
        # fast chunks: no bias when a causal mask over a fresh prompt says it all
        self.chunk_biases = [
            None if mask.is_plain and p.n == p.context else mask.bias(dtype)
            for p, mask in zip(self.chunks, self.chunk_masks, strict=True)
        ] if fast else []

    def _mask(self, q_pos, k_pos, valid=None) -> AttentionMask:
        return AttentionMask(q_pos=q_pos, k_pos=k_pos, causal=True, window=self.window,
                             k_valid=valid, alibi_slopes=self.alibi_slopes, contiguous=valid is None)


def _sdpa(q, k, v, bias) -> torch.Tensor:
    """q (B, H, n, d), k and v (B, KV, S, d); bias None means causal over n = S."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=bias is None,
                                          enable_gqa=q.shape[1] != k.shape[1])


def paged_attention(q: torch.Tensor, pool: KVPool, layer: int, plan: AttentionPlan) -> torch.Tensor:
    """Context vectors (N, H, d_head) for the flat queries q (N, H, d_head) of a step."""
    out = torch.empty_like(q)  # (N, H, d_head)
    if plan.single:  # every query sees itself, so no row of the bias is all -inf
        k, v = pool.read(layer, plan.slot_matrix)  # (B, S_max, KV, d_head)
        qb = q[plan.rows][:, :, None]  # (B, H, 1, d_head)
        context = _sdpa(qb, k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype),
                        plan.single_bias)  # (B, H, 1, d_head)
        out[plan.rows] = context[:, :, 0]
    for i, (part, mask) in enumerate(zip(plan.chunks, plan.chunk_masks, strict=True)):
        k, v = pool.read(layer, part.slots)  # (S, KV, d_head)
        k, v = k.transpose(0, 1)[None].to(q.dtype), v.transpose(0, 1)[None].to(q.dtype)  # (1, KV, S, d)
        qc = q[part.start : part.start + part.n].transpose(0, 1)[None]  # (1, H, n, d_head)
        if plan.fast:
            context = _sdpa(qc, k, v, plan.chunk_biases[i])[0].transpose(0, 1)  # (n, H, d_head)
        else:
            context = _per_query(qc, k, v, mask)
        out[part.start : part.start + part.n] = context
    return out


def _per_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
    """The reference kernel for each query alone over its own prefix: (n, H, d_head)."""
    n, S = q.shape[2], k.shape[2]
    rows = []
    for i in range(n):
        end = S - n + i + 1  # keys 0..end-1 precede or are the query
        sub = AttentionMask(q_pos=mask.q_pos[:, i : i + 1], k_pos=mask.k_pos[:, :end], causal=True,
                            window=mask.window, alibi_slopes=mask.alibi_slopes, contiguous=True)
        k_i, v_i = k[:, :, :end].contiguous(), v[:, :, :end].contiguous()  # (1, KV, end, d_head)
        rows.append(reference_attention(q[:, :, i : i + 1].contiguous(), k_i, v_i, sub)[0][0, :, 0])
    return torch.stack(rows)  # (n, H, d_head)
