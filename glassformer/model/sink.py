"""Attention sinks (StreamingLLM, Xiao et al. 2023): a cache that keeps the first S tokens and
the last W, so a text of any length streams through a fixed window without recomputation.

Which keys a query sees. After n tokens (the query, token n-1, included) the cache holds

    kept(n) = [0, min(S, n))  ∪  [max(S, n - W), n)            at most S + W tokens

so the first S tokens (the sinks, which soak up attention mass the softmax must put
somewhere) stay forever and token t leaves when token t + W arrives (t ≥ S): the oldest
non-sink token is the one evicted.

Where a key is stored. Token t lives in slot

    slot(t) = t                          t < S + W   (before the first eviction)
    slot(t) = S + (t - S) mod W          otherwise   (a ring over the window's W slots)

so token t overwrites exactly token t - W, the one that left; nothing is ever moved.

Positions inside the cache. Keys are stored before any rotation. When a step attends, the
kept keys, ordered by age (sinks, then the window oldest first), are at cache positions
0..L-1 with L = |kept(n)|, and the newest query at L - 1:

    k_j = R(j) k̃_j           j = 0..L-1     (R(p): RoPE's rotation at position p)
    q   = R(L - 1) q̃
    score_j = q·k_j / √d  + bias(L - 1 - j)       (ALiBi's or T5's distance bias, by cache positions)

which is what the model computes, uncached, over the kept tokens alone at positions
0..L-1 (for a one-layer model exactly; deeper layers' stored keys keep the context they
were computed in, which is the point: nothing is recomputed). Absolute positions (learned,
sinusoidal) are added to the embedding before a key exists, so a kept key cannot move: those
models are refused.

Several tokens enter in one call while none is evicted (n + T ≤ S + W: a prompt's start);
after that up to the policy's `chunk` at a time (`room`; 1 streams, a token a call as each
moves the window): sink_chunk.py gives a chunk the same keys and distances as streaming in
one call, so a long prompt costs a prefill, not a step a token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError
from .config import ModelConfig
from .kv_cache import AttentionFn, KVCache
from .layers.masking import AttentionMask
from .layers.positions import apply_rope, rope_cos_sin, rope_inverse_frequencies
from .sink_chunk import ChunkMask, chunk_attention, chunk_mask, query_turn, window_positions

MOVABLE_POSITIONS = ("rope", "alibi", "relative", "none")
PAST_WINDOW_CHUNK = 256  # tokens a sink cache takes in one call once full (sink_chunk.py)


@dataclass(frozen=True)
class SinkPolicy:
    """Keep `sink_tokens` (S) first tokens and the `window` (W) latest ones."""

    sink_tokens: int = 4
    window: int = 1020
    chunk: int = PAST_WINDOW_CHUNK  # tokens entering together once the cache is full (1: streaming)

    def __post_init__(self) -> None:
        for name, low in (("sink_tokens", 0), ("window", 1), ("chunk", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InputError(name, f"must be an integer >= {low}, got {value!r}")

    @property
    def capacity(self) -> int:
        return self.sink_tokens + self.window

    def check(self, config: ModelConfig) -> None:
        """Refuse a model the policy cannot serve, naming the field."""
        if self.capacity > config.context_length:
            raise InputError("window", f"sink_tokens + window = {self.capacity} exceeds the model's "
                             f"context_length={config.context_length}")
        if config.sliding_window is not None and self.capacity > config.sliding_window:
            raise InputError("window", f"sink_tokens + window = {self.capacity} exceeds the model's "
                             f"sliding_window={config.sliding_window}")
        for name in ("attn_softcap", "attn_scale", "layer_windows"):
            if getattr(config, name) is not None:  # a chunk past the window scores in sink_chunk.py
                raise InputError(name, f"the sink policy's chunks past the window score keys "
                                 f"with d_head^-1/2 over one window; {name} is not computed there")
        if config.rope_local_theta is not None:  # key_rotation turns every layer's keys alike
            raise InputError("rope_local_theta", "the sink policy rotates every layer's kept keys "
                             "by one RoPE base; a base of the sliding layers' own is not computed")
        if config.position not in MOVABLE_POSITIONS:
            raise InputError("position", f"the sink policy places keys at positions within the cache; "
                             f"{config.position!r} positions are fixed in the embedding "
                             f"(use a {'/'.join(MOVABLE_POSITIONS)} model)")
        if not config.causal or config.n_encoder_layers:
            raise InputError("causal", "the sink policy streams a decoder-only model's text")
        if config.rope_scaling == "longrope":
            raise InputError("rope_scaling", "longrope chooses its factors by the text's length, "
                             "which the sink policy's cache positions do not show")

    def slot(self, t: int) -> int:
        S, W = self.sink_tokens, self.window
        return t if t < S + W else S + (t - S) % W

    def kept(self, n: int) -> list[int]:
        """The tokens a query sees after n tokens (itself included), in cache order."""
        S, W = self.sink_tokens, self.window
        return [*range(min(S, n)), *range(max(S, n - W), n)]

    def kept_slots(self, n: int) -> list[int]:
        """The slots of kept(n), in cache order: the newest token's slot is last."""
        return [self.slot(t) for t in self.kept(n)]

    def full(self, n: int) -> bool:
        """Whether the cache is full after n tokens: what enters next is past the window."""
        return n >= self.capacity

    def room(self, n: int) -> int:
        """How many tokens may enter together after n: all up to S + W, then `chunk` (at most W)."""
        return min(self.chunk, self.window) if self.full(n) else self.capacity - n

    def chunk_slots(self, n: int) -> list[int]:
        """After n ≥ S + W tokens, the slots a chunk past the window reads before its own
        overwrite the oldest: the sinks', then the W - 1 latest tokens' (sink_chunk.py)."""
        slots = self.kept_slots(n)
        return slots[: self.sink_tokens] + slots[self.sink_tokens + 1 :]

    def position(self, n: int, n_new: int = 1) -> int:
        """The cache position of the first of n_new tokens entering after n: n until the cache
        is full, then S + W - n_new (the last one sits at S + W - 1, where a streamed query sits)."""
        return self.capacity - n_new if self.full(n) else n


def key_rotation(config: ModelConfig, positions: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """RoPE's cos and sin at cache positions (P,), each (P, d_head), or None for a model
    without RoPE. The model's own angles (rope_inverse_frequencies of its config)."""
    if config.position != "rope":
        return None
    inv_freq, factor = rope_inverse_frequencies(config)
    cos, sin = rope_cos_sin(inv_freq, positions[None], factor)
    return cos[0, 0].to(dtype), sin[0, 0].to(dtype)  # (P, rotated) each


def rotate_keys(keys: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """Kept keys (B, KV, L, d_head), stored unrotated, rotated at cache positions 0..L-1."""
    if rotation is None:
        return keys
    L = keys.shape[2]
    return apply_rope(keys, rotation[0][:L], rotation[1][:L])


def past_window_mask(config: ModelConfig, policy: SinkPolicy, mask: AttentionMask, n_heads: int,
                     dtype: torch.dtype) -> ChunkMask:
    """What a chunk of T tokens past the window sees at every layer (sink_chunk.py): the
    model's `mask` over window_positions made a ChunkMask, with the rotation of the keys at
    those positions and the turn of the queries to the sinks, in `dtype`."""
    S, W, T = policy.sink_tokens, policy.window, mask.q_pos.shape[1]
    at = window_positions(S, W, T).to(mask.q_pos.device)  # (S+W-1+T,): sinks, then the window
    return chunk_mask(mask, W, S, n_heads, key_rotation(config, at, dtype),
                      query_turn(config, T, at.device, dtype))


def past_window_context(config: ModelConfig, policy: SinkPolicy, q: torch.Tensor,
                        before: tuple[torch.Tensor, torch.Tensor], new: tuple[torch.Tensor, torch.Tensor],
                        mask: ChunkMask) -> torch.Tensor:
    """The context (B, H, T, d_head) of T > 1 tokens past the window (sink_chunk.py): queries q
    (B, H, T, d_head); `before`, the keys and values (B, KV, S+W-1, d_head) of chunk_slots,
    stored unrotated and read before the chunk's overwrite them; `new`, the chunk's (B, KV,
    T, d_head); `mask`, the chunk's (past_window_mask)."""
    keys = torch.cat([before[0], new[0].to(before[0].dtype)], dim=2)  # (B, KV, S+W-1+T, d_head)
    values = torch.cat([before[1], new[1].to(before[1].dtype)], dim=2)
    keys = rotate_keys(keys, mask.rotation)
    scale = config.head_dim ** -0.5 if config.scale_scores else 1.0
    return chunk_attention(q, keys.to(q.dtype), values.to(q.dtype), policy.sink_tokens, mask, scale)


class SinkKVCache(KVCache):
    """The dense cache under a SinkPolicy: (B, KV, S + W, d_head) per layer, slots as above.
    `length` is the next query's cache position, so the model numbers its queries and builds
    its masks over cache positions; `seen` counts every token that entered. Once full it takes
    up to the policy's `chunk` tokens a call (sink_chunk.py)."""

    rotates_keys = True

    def __init__(self, config: ModelConfig, batch_size: int, policy: SinkPolicy,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        policy.check(config)
        super().__init__(config, batch_size, policy.capacity, device, dtype)
        self.policy, self.config = policy, config
        self.seen = 0
        self.rotation: tuple[torch.Tensor, torch.Tensor] | None = None  # made with the tensors
        self.chunk_mask: ChunkMask | None = None  # the current chunk's past the window (sink_chunk.py)

    @property
    def length(self) -> int:
        return self.policy.position(self.seen)

    @length.setter
    def length(self, value: int) -> None:  # KVCache.__init__ and crop set it
        self.seen = value

    @property
    def full(self) -> bool:
        return self.policy.full(self.seen)

    def room(self) -> int:
        """How many tokens may enter in the next call (SinkPolicy.room)."""
        return self.policy.room(self.seen)

    def query_start(self, n_new: int) -> int:
        return self.policy.position(self.seen, n_new)

    def reserve(self, positions: torch.Tensor, pad_mask: torch.Tensor | None) -> None:
        T = positions.shape[1]
        if pad_mask is not None:
            raise InputError("context", "the sink policy streams one text per row (no padding)")
        if T > self.room():
            raise InputError("context", f"the sink cache takes {self.room()} new tokens now, got {T}")

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: AttentionMask | None, attention: AttentionFn) -> torch.Tensor:
        if k.shape[2] == 1 or not self.full:
            return super().attend(layer, q, k, v, mask, attention)
        return self._attend_chunk(layer, q, k, v, mask)

    def _attend_chunk(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: AttentionMask) -> torch.Tensor:
        """T > 1 new tokens past the window: the keys they see are read before theirs
        overwrite the oldest."""
        policy, T = self.policy, k.shape[2]
        keys, values = self.keys[layer], self.values[layer]
        kept = torch.tensor(policy.chunk_slots(self.seen), device=k.device)  # (S + W - 1,)
        before = keys[:, :, kept], values[:, :, kept]  # (B, KV, S + W - 1, d_head) each, copies
        new = torch.tensor([policy.slot(self.seen + i) for i in range(T)], device=k.device)  # (T,)
        keys.index_copy_(2, new, k.to(keys.dtype))
        values.index_copy_(2, new, v.to(values.dtype))
        if layer == 0:  # every layer's queries see the same keys: one mask for the chunk
            self.chunk_mask = past_window_mask(self.config, policy, mask, q.shape[1], q.dtype)
        return past_window_context(self.config, policy, q, before, (k, v), self.chunk_mask)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new rows (B, KV, T, d_head) at their slots; the kept keys (rotated at
        their cache positions) and values in cache order, (B, KV, L, d_head) each."""
        if self.keys[layer] is None:
            self.allocate(k.device, k.dtype)
        T, policy = k.shape[2], self.policy
        new = torch.tensor([policy.slot(self.seen + i) for i in range(T)], device=k.device)  # (T,)
        kept = torch.tensor(policy.kept_slots(self.seen + T), device=k.device)  # (L,)
        keys, values = self.keys[layer], self.values[layer]
        keys.index_copy_(2, new, k.to(keys.dtype))
        values.index_copy_(2, new, v.to(values.dtype))
        return rotate_keys(keys[:, :, kept], self.rotation), values[:, :, kept]

    def allocate(self, device: torch.device, dtype: torch.dtype) -> None:
        super().allocate(device, dtype)
        positions = torch.arange(self.max_length, device=self.keys[0].device)  # (S + W,)
        self.rotation = key_rotation(self.config, positions, self.keys[0].dtype)

    def advance(self, n_tokens: int) -> None:
        self.seen += n_tokens

    def key_positions(self, n_new: int) -> torch.Tensor:
        """The cache positions of the keys n_new queries see: 0..L-1, or once full
        sink_chunk.window_positions, (B, L)."""
        if self.full:
            at = window_positions(self.policy.sink_tokens, self.policy.window, n_new)
        else:
            at = torch.arange(self.length + n_new)
        return at.to(self.positions.device).expand(self.batch_size, len(at))  # (B, L)

    def key_valid(self, n_new: int) -> None:
        return None

    def crop(self, length: int) -> None:
        """Forget every token from `length` on; only possible before the first eviction."""
        if not 0 <= length <= self.seen or (length < self.seen and self.seen > self.max_length):
            raise InputError("length", f"a sink cache that saw {self.seen} tokens can be cut back "
                             "only before its first eviction")
        self.seen = length
