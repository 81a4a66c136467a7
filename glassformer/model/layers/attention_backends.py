"""Attention kernels: three ways to compute softmax(QKᵀ/√d_head + M) V, all the same function.
`scale` replaces 1/√d_head where a model says so (T5 uses 1).

- reference: the math written plainly; returns the attention weights. The oracle.
- sdpa: PyTorch's fused scaled_dot_product_attention.
- flash: exact tiled attention with the online softmax (Milakov & Gimelshein 2018; Dao et al.
  2022): a running max m, a running denominator l and a rescaled accumulator per query, so no
  Tq×Tk matrix is ever materialised, only one tile at a time.

Shapes: q (B, H, Tq, d_head); k, v (B, KV, Tk, d_head) with H a multiple of KV (GQA/MQA).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ...errors import InputError
from .masking import AttentionMask

Hook = Callable[[str, torch.Tensor], torch.Tensor]


def _no_hook(site: str, x: torch.Tensor) -> torch.Tensor:
    return x


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Share each key/value head with n_rep query heads: (B, KV, T, d) -> (B, KV·n_rep, T, d)."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask,
    dropout: float = 0.0,
    hook: Hook = _no_hook,
    scale: float | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns the context αV (B, H, Tq, d_head) and the weights α (B, H, Tq, Tk).
    `softcap` c: the scaled scores become c · tanh(scores / c) (Gemma 2) before the mask."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)  # (B, H, Tk, d_head)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale  # (B, H, Tq, Tk)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = hook("scores", scores)
    masked = hook("masked_scores", scores + mask.bias(scores.dtype))  # A + M
    pattern = hook("pattern", torch.softmax(masked.float(), dim=-1).to(q.dtype))  # α
    if mask.k_valid is not None:
        pattern = pattern.masked_fill(mask.empty_rows(), 0.0)
    context = F.dropout(pattern, dropout) @ v if dropout else pattern @ v  # (B, H, Tq, d_head)
    return context, pattern


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask,
    dropout: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    n_rep = q.shape[1] // k.shape[1]
    if mask.is_plain and (q.shape[2] == 1 or not mask.causal):
        bias, is_causal = None, False  # one query sees every cached key; or no mask at all
    elif mask.is_plain and q.shape[2] == k.shape[2]:
        bias, is_causal = None, True
    else:
        bias, is_causal = mask.bias(q.dtype), False
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=bias, dropout_p=dropout, is_causal=is_causal, scale=scale,
        enable_gqa=n_rep > 1,
    )  # (B, H, Tq, d_head)
    if mask.k_valid is not None:
        out = out.masked_fill(mask.empty_rows(), 0.0)
    return out


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask,
    dropout: float = 0.0,
    scale: float | None = None,
    block_q: int = 64,
    block_k: int = 64,
) -> torch.Tensor:
    if dropout:
        raise InputError("attention_kernel", "'flash' is exact attention and takes no dropout")
    B, H, Tq, d_head = q.shape
    Tk, n_rep = k.shape[2], H // k.shape[1]
    scale = 1.0 / math.sqrt(d_head) if scale is None else scale
    out = torch.empty_like(q)  # (B, H, Tq, d_head)
    for r0 in range(0, Tq, block_q):
        rows = slice(r0, min(r0 + block_q, Tq))
        q_tile = q[:, :, rows].float() * scale  # (B, H, bq, d_head)
        running_max = q_tile.new_full((*q_tile.shape[:3], 1), float("-inf"))  # m (B, H, bq, 1)
        denominator = q_tile.new_zeros(running_max.shape)  # l
        accumulator = q_tile.new_zeros(q_tile.shape)  # (B, H, bq, d_head)
        for c0 in range(0, Tk, block_k):
            cols = slice(c0, min(c0 + block_k, Tk))
            bias = mask.bias(torch.float32, rows, cols)  # (B, 1 or H, bq, bk)
            if not torch.isfinite(bias).any():
                continue  # the whole tile is masked (e.g. above the causal diagonal)
            k_tile = repeat_kv(k[:, :, cols], n_rep).float()  # (B, H, bk, d_head)
            v_tile = repeat_kv(v[:, :, cols], n_rep).float()
            scores = q_tile @ k_tile.transpose(-2, -1) + bias  # (B, H, bq, bk)
            new_max = torch.maximum(running_max, scores.amax(dim=-1, keepdim=True))
            safe_max = new_max.masked_fill(new_max == float("-inf"), 0.0)
            probs = torch.exp(scores - safe_max)  # (B, H, bq, bk)
            rescale = torch.exp(running_max - safe_max)  # shrinks what was summed so far
            denominator = denominator * rescale + probs.sum(dim=-1, keepdim=True)
            accumulator = accumulator * rescale + probs @ v_tile
            running_max = new_max
        tile_out = accumulator / denominator.clamp_min(torch.finfo(torch.float32).tiny)
        if mask.k_valid is not None:
            tile_out = tile_out.masked_fill(mask.empty_rows(rows), 0.0)
        out[:, :, rows] = tile_out.to(q.dtype)
    return out


def _reference_context(q, k, v, mask, dropout=0.0, scale=None):
    return reference_attention(q, k, v, mask, dropout, scale=scale)[0]


KERNELS = {"reference": _reference_context, "sdpa": sdpa_attention, "flash": flash_attention}
