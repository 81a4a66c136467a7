"""Many tokens past the sink cache's window in one call (model/sink.py).

Once the cache is full, streaming takes one token a step: token t sees the S sinks and the W
latest tokens t-W+1..t, the window's at their text distance and sink s at distance S+W-1-s
(the query sits at the cache's last position, L-1 = S+W-1). A chunk of T tokens n0..n0+T-1
(T ≤ W) sees exactly that in one call per layer, with two blocks of scores under one softmax:

- the window block: the chunk's queries are numbered S+W-T .. S+W-1 (the last one where a
  streamed query sits) and the keys they may see, tokens n0-W+1 .. n0+T-1 (the W-1 latest
  before the chunk, then the chunk's own), S+1-T .. S+W-1: a query and a key are as far apart
  as in the text, and the band (distance < W) leaves each query its own W latest;
- the sink block: query i is turned forward by T-1-i positions to the cache's last position
  (RoPE's rotations add up: R(a) R(b) = R(a + b)), and its distance bias (ALiBi, T5's) is that
  of the last query's row, so every query sees sink s at distance S+W-1-s.

    scores = [ turn(Q) K_sinkᵀ · scale + M_sink | Q K_windowᵀ · scale + M_window ]
    out    = softmax(scores) [ V_sink ; V_window ]

That is what the T streamed steps compute, up to rounding, with nothing recomputed: every key
is stored (unrotated) where streaming stores it. PyTorch's fused attention computes it over
the keys [zeros | K_window], the sink block written into its additive mask (the mask built
once per chunk, its sink columns once per layer). It is not the model's attention kernel, so
the reference kernel's own sites (scores, pattern) do not fire for such a chunk; a policy with
chunk=1 streams instead. The dense sink cache and the engine's pool both call it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .layers.masking import AttentionMask
from .layers.positions import apply_rope, rope_cos_sin, rope_inverse_frequencies


def window_positions(sink_tokens: int, window: int, n_new: int) -> torch.Tensor:
    """Where a chunk of n_new tokens past the window places the keys it may see: the sinks at
    0..S-1, then the W-1 latest tokens and the chunk's at S+1-n_new .. S+W-1, (S+W-1+n_new,)."""
    S, W = sink_tokens, window
    return torch.cat([torch.arange(S), torch.arange(S + 1 - n_new, S + W)])


def query_turn(config: ModelConfig, n_new: int, device: torch.device,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """RoPE's pure rotation (no attention factor) by n_new-1-i positions for query i,
    cos and sin (n_new, d_head); None for a model without RoPE."""
    if config.position != "rope":
        return None
    inv_freq, _ = rope_inverse_frequencies(config)
    ahead = torch.arange(n_new - 1, -1, -1, device=device)[None]  # (1, n_new)
    cos, sin = rope_cos_sin(inv_freq, ahead)
    return cos[0, 0].to(dtype), sin[0, 0].to(dtype)  # (n_new, d_head) each


@dataclass
class ChunkMask:
    """What a chunk's queries may see, built once for every layer: the additive mask over
    [sinks | window] (B, H, T, S+W-1+T), whose window columns hold the band and the distance
    bias and whose sink columns each layer fills with its sink scores; the sinks' distance
    bias, the last query's row (B, 1 or H, 1, S); RoPE's cos and sin at window_positions
    (S+W-1+T, d_head) each, and query_turn's; None without RoPE."""

    bias: torch.Tensor
    sink_bias: torch.Tensor
    rotation: tuple[torch.Tensor, torch.Tensor] | None
    turn: tuple[torch.Tensor, torch.Tensor] | None


def chunk_mask(mask: AttentionMask, window: int, n_sinks: int, n_heads: int,
               rotation: tuple[torch.Tensor, torch.Tensor] | None,
               turn: tuple[torch.Tensor, torch.Tensor] | None) -> ChunkMask:
    """ChunkMask from the model's mask over the keys at window_positions, and the rotations."""
    S, T = n_sinks, mask.q_pos.shape[1]
    banded = dataclasses.replace(mask, window=window if mask.window is None else min(mask.window, window))
    band = banded.bias(torch.float32, cols=slice(S, None))  # (B, 1 or H, T, W-1+T)
    B, Tk = band.shape[0], band.shape[-1] + S
    bias = torch.empty(B, n_heads, T, Tk, device=band.device)  # (B, H, T, S+W-1+T)
    bias[..., S:] = band
    return ChunkMask(bias, mask.bias(torch.float32, rows=slice(T - 1, T), cols=slice(0, S)), rotation, turn)


def chunk_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, n_sinks: int,
                    mask: ChunkMask, scale: float) -> torch.Tensor:
    """The context (B, H, T, d_head) of queries q (B, H, T, d_head), rotated at S+W-T..S+W-1,
    over keys and values (B, KV, S+W-1+T, d_head), the sinks' then the window's, the keys
    rotated at window_positions. The sinks' scores (the queries turned by mask.turn, times
    their keys) enter as the mask's sink columns against keys of zeros, so one fused kernel
    computes the single softmax."""
    B, H, T, d_head = q.shape
    S, kv_heads = n_sinks, keys.shape[1]
    if S:
        turned = q if mask.turn is None else apply_rope(q, *mask.turn)
        grouped = turned.reshape(B, kv_heads, -1, d_head)  # each key head's H/KV query heads
        sink_scores = (grouped @ keys[:, :, :S].transpose(-2, -1) * scale).reshape(B, H, T, S)
        mask.bias[..., :S] = sink_scores + mask.sink_bias  # (B, H, T, S)
        keys = torch.cat([torch.zeros_like(keys[:, :, :S]), keys[:, :, S:]], dim=2)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask.bias.to(q.dtype), scale=scale,
                                          enable_gqa=H != kv_heads)  # (B, H, T, d_head)
