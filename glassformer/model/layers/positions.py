"""Relative position schemes: rotary embeddings (RoPE, with context extension), ALiBi and T5's
bucketed bias.

RoPE (Su et al., 2021) rotates each (x_i, x_{i+d/2}) pair of a query or key at position m by the
angle m·θ_i with θ_i = base^(-2i/d), so that q_m·k_n depends only on m - n; partial rotary
(GPT-NeoX, Phi) turns only each head's first d = rotary_dim dimensions and passes the rest.
ALiBi (Press et al., 2022) adds -slope_h·(m - n) to the attention score of head h instead.
T5 (Raffel et al., 2020) adds a learned scalar per head and bucket of n - m, one table per
stack shared by its layers.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from ..config import ModelConfig


def rope_inverse_frequencies(config: ModelConfig, local: bool = False,
                             long: bool = False) -> tuple[torch.Tensor, float]:
    """θ_i for i < d/2 (d: the rotated dimensions, d_head unless partial), and the attention
    factor that scales cos and sin (1 except YaRN and LongRoPE). `local`: the sliding layers'
    own angles where rope_local_theta sets their base (Gemma 3), which no scaling stretches;
    `long`: LongRoPE's set for a text past the original context (`uses_long_factors`).

    - linear (position interpolation, Chen et al. 2023): θ_i / s, i.e. positions m/s.
    - ntk (NTK-aware scaling, bloc97 2023): base' = base · s^(d/(d-2)), low frequencies stretch
      most, the highest is kept.
    - yarn (Peng et al. 2023): with the original context C, dimension 2i is kept (θ_i) at or
      below the one where a pair turns β_fast times over C, interpolated (θ_i / s) at or above
      the one where it turns β_slow times, and mixed linearly between (the edges rounded out to
      whole dimensions unless rope_truncate is off); cos and sin times the attention factor
      (rope_attention_factor, or 0.1·ln s + 1).
    - llama3 (Meta's Llama 3.1): a wavelength λ_i = 2π/θ_i longer than C / rope_low_freq_factor
      is interpolated (θ_i / s), one shorter than C / rope_high_freq_factor kept, and between
      them θ_i is mixed as (1 - t)·θ_i/s + t·θ_i with t = (C/λ_i - low) / (high - low).
    - longrope (Microsoft's LongRoPE, Phi-3): θ_i / f_i with per-pair factors f, the short ones
      for a text within C and the long ones past it; cos and sin times the attention factor
      (rope_attention_factor, or √(1 + ln s / ln C)).
    with s = rope_factor.
    """
    d, base, s = config.rotated_dim, config.rope_theta, config.rope_factor
    exponents = torch.arange(0, d, 2, dtype=torch.int64).float() / d  # (d/2,)
    if local:
        return 1.0 / (config.rope_local_theta**exponents), 1.0  # (d/2,)
    if config.rope_scaling == "ntk":
        base = base * s ** (d / (d - 2))
    inv_freq = 1.0 / (base**exponents)  # (d/2,)
    if config.rope_scaling == "linear":
        return inv_freq / s, 1.0
    if config.rope_scaling == "yarn":
        return _yarn(config, base**exponents), _attention_factor(config, 0.1 * math.log(s) + 1.0)
    if config.rope_scaling == "llama3":
        return _llama3(inv_freq, s, config.original_context, config.rope_low_freq_factor,
                       config.rope_high_freq_factor), 1.0
    if config.rope_scaling == "longrope":
        factors = torch.tensor(config.rope_long_factors if long else config.rope_short_factors)  # (d/2,)
        derived = math.sqrt(1 + math.log(s) / math.log(config.original_context))
        return 1.0 / (factors * base**exponents), _attention_factor(config, derived)
    return inv_freq, 1.0


def _attention_factor(config: ModelConfig, derived: float) -> float:
    """The stated attention factor, else `derived` (1 without an extension: s = 1)."""
    if config.rope_attention_factor is not None:
        return config.rope_attention_factor
    return derived if config.rope_factor > 1 else 1.0


def _yarn(config: ModelConfig, wavelength_scale: torch.Tensor) -> torch.Tensor:
    """YaRN's θ_i (rope_inverse_frequencies) from base^(2i/d) (d/2,) -> (d/2,)."""
    d, s, context = config.rotated_dim, config.rope_factor, config.original_context

    def dim_for(turns: float) -> float:  # the dimension whose pair turns `turns` times over C
        return d * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(config.rope_theta))

    low, high = dim_for(config.rope_beta_fast), dim_for(config.rope_beta_slow)
    if config.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    ramp = (torch.arange(d // 2, dtype=torch.float32) - low) / (high - low if high != low else 1e-3)
    keep = 1.0 - ramp.clamp(0.0, 1.0)  # 1: extrapolate (keep θ_i), 0: interpolate (θ_i / s)
    return 1.0 / (s * wavelength_scale) * (1.0 - keep) + 1.0 / wavelength_scale * keep


def _llama3(inv_freq: torch.Tensor, s: float, context: int, low: float, high: float) -> torch.Tensor:
    """Llama 3.1's bands (rope_inverse_frequencies): (d/2,) -> (d/2,)."""
    turns = context * inv_freq / (2 * math.pi)  # C / λ_i: how often pair i turns over the context
    mix = ((turns - low) / (high - low)).clamp(0.0, 1.0)  # 0: interpolate, 1: keep
    return inv_freq / s * (1.0 - mix) + inv_freq * mix


def uses_long_factors(config: ModelConfig, highest: torch.Tensor | int) -> torch.Tensor | bool:
    """LongRoPE's switch: whether a pass whose highest position is `highest` (any shape) turns
    by the long factors, i.e. reaches past the original context (highest + 1 > C), as
    transformers decides on each forward pass. A cache keeps the keys of earlier passes as
    they were turned, so a text that crosses C while decoding holds keys of both sets."""
    return highest + 1 > config.original_context


def switches_to_long(config: ModelConfig, cached: int, length: int) -> bool:
    """Whether a text of `length` tokens, the first `cached` of them with keys in a cache, is
    computed again from its first token: under LongRoPE a text's keys are turned by the short
    set while it fits the original context and all by the long set once it grows past, as
    transformers' Phi-3 generation does (it drops its cache there)."""
    return (config.rope_scaling == "longrope" and not uses_long_factors(config, cached - 1)
            and bool(uses_long_factors(config, length - 1)))


def rope_frequencies(config: ModelConfig, positions: torch.Tensor, inv_freq: torch.Tensor,
                     long_inv_freq: torch.Tensor | None) -> torch.Tensor:
    """The θ_i each row of `positions` (B, T) turns by: inv_freq (d/2,) for every row, except
    under LongRoPE, where each row picks its set by its own highest position (B, d/2); a
    batch of texts of one length is turned as transformers turns it."""
    if config.rope_scaling != "longrope":
        return inv_freq
    long = uses_long_factors(config, positions.amax(dim=-1, keepdim=True))  # (B, 1)
    return torch.where(long, long_inv_freq, inv_freq)  # (B, d/2)


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, attention_factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of m·θ_i for positions m (B, T), each (B, 1, T, d) ready to broadcast;
    inv_freq (d/2,) for every row, or (B, d/2) a set per row (`rope_frequencies`)."""
    angles = positions.float()[..., None] * inv_freq.to(positions.device)[..., None, :]  # (B, T, d/2)
    angles = torch.cat((angles, angles), dim=-1)[:, None]  # (B, 1, T, d)
    return angles.cos() * attention_factor, angles.sin() * attention_factor


# RoPE's cos and sin per kind of layer, each (B, 1, T, d): [0] every layer's, [1] the sliding
# layers' where rope_local_theta gives them their own base (an Attention picks its kind).
RopeAngles = tuple[tuple[torch.Tensor, torch.Tensor], ...]


class RopeSets(NamedTuple):
    """The θ a model's layers turn by (the Transformer's buffers, (d/2,) each): every layer's
    and the attention factor scaling its cos and sin, LongRoPE's long set (None without), and
    the sliding layers' own base (rope_local_theta; None without)."""

    inv_freq: torch.Tensor
    attention_factor: float
    long_inv_freq: torch.Tensor | None
    local_inv_freq: torch.Tensor | None

    def angles(self, config: ModelConfig, positions: torch.Tensor, long: bool | None = None) -> RopeAngles:
        """RoPE's cos and sin at positions (B, T) for each kind of layer, (B, 1, T, rotated)
        each in float32: every layer's, then the sliding layers' own where rope_local_theta is
        set (each attention layer takes its kind's: `ModelConfig.local_rope`). Under LongRoPE
        each row picks its set by its reach (`rope_frequencies`), or `long` says which."""
        if long is None:
            inv_freq = rope_frequencies(config, positions, self.inv_freq, self.long_inv_freq)
        else:
            inv_freq = self.long_inv_freq if long else self.inv_freq
        kinds = [(inv_freq, self.attention_factor)]  # (d/2,) or, under LongRoPE, (B, d/2)
        if self.local_inv_freq is not None:
            kinds.append((self.local_inv_freq, 1.0))
        return tuple(rope_cos_sin(frequencies, positions, factor) for frequencies, factor in kinds)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x_1, x_2) -> (-x_2, x_1) on the two halves of the last dimension."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate queries or keys x (B, heads, T, d_head) by their positions' angles; with angles
    for d < d_head dimensions (partial rotary) the first d turn and the rest pass as they are."""
    d = cos.shape[-1]
    if d < x.shape[-1]:
        turned, passed = x[..., :d], x[..., d:]  # (B, heads, T, d), (B, heads, T, d_head - d)
        return torch.cat((apply_rope(turned, cos, sin), passed), dim=-1)
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


class Rotary(nn.Module):
    """`apply_rope` as a module, so that a conversion (glassformer.accel) can swap it."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(x, cos, sin)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """Head slopes 2^(-8k/n) for k = 1..n when n is a power of two; otherwise the slopes of the
    nearest lower power of two p, then every other slope of 2p (Press et al., 2022)."""

    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * k / n) for k in range(1, n + 1)]

    p = 2 ** math.floor(math.log2(n_heads))
    slopes = geometric(p) + geometric(2 * p)[0::2][: n_heads - p]
    return torch.tensor(slopes)  # (H,)


def alibi_bias(slopes: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """-slope_h · (m - n) for queries at m (B, Tq) and keys at n (B, Tk): (B, H, Tq, Tk)."""
    distance = (q_pos[:, :, None] - k_pos[:, None, :]).float()  # (B, Tq, Tk)
    return -slopes.to(q_pos.device)[None, :, None, None] * distance[:, None]


def relative_bucket(distance: torch.Tensor, bidirectional: bool, n_buckets: int,
                    max_distance: int) -> torch.Tensor:
    """T5's bucket of each key-minus-query distance n - m: one bucket per distance below half
    the buckets (per direction when bidirectional, else keys after the query all count as 0),
    then logarithmically wider buckets up to max_distance, beyond which all share the last."""
    bucket = torch.zeros_like(distance)
    if bidirectional:
        n_buckets //= 2
        bucket = (distance > 0).long() * n_buckets  # keys after the query: the upper half
        distance = distance.abs()
    else:
        distance = (-distance).clamp(min=0)  # how far back the key lies
    exact = n_buckets // 2
    log_ratio = torch.log(distance.float().clamp(min=1) / exact) / math.log(max_distance / exact)
    far = (exact + (log_ratio * (n_buckets - exact)).long()).clamp(max=n_buckets - 1)
    return bucket + torch.where(distance < exact, distance, far)


class RelativeBias(nn.Module):
    """The learned bias table (buckets, H) of one stack; `forward` gives it per query and key."""

    def __init__(self, config: ModelConfig, bidirectional: bool) -> None:
        super().__init__()
        self.bidirectional = bidirectional
        self.n_buckets, self.max_distance = config.relative_buckets, config.relative_max_distance
        self.table = nn.Embedding(self.n_buckets, config.n_heads)  # (buckets, H)

    def forward(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Queries at m (B, Tq), keys at n (B, Tk) -> bias (B, H, Tq, Tk)."""
        distance = k_pos[:, None, :] - q_pos[:, :, None]  # (B, Tq, Tk)
        buckets = relative_bucket(distance, self.bidirectional, self.n_buckets, self.max_distance)
        return self.table(buckets).permute(0, 3, 1, 2)  # (B, H, Tq, Tk)
