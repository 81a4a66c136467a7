"""Logits -> next token. Every rule is a small pure function on the last row of logits.

Order (as Hugging Face and llama.cpp apply them): penalties on the raw logits, then
temperature, then the filters top-k, top-p, min-p (each sets dropped tokens to -inf), then
greedy argmax or one draw from softmax with an explicit `torch.Generator`.
Shapes: logits (B, V); counts (B, V) how often each token occurred in the context so far.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import InputError


@dataclass(frozen=True)
class SamplingConfig:
    """How to pick the next token. `temperature=0` (or `top_k=1`) is greedy decoding."""

    temperature: float = 1.0
    top_k: int | None = None  # None: no top-k filter
    top_p: float = 1.0  # 1: no nucleus filter
    min_p: float = 0.0  # 0: no min-p filter
    repetition_penalty: float = 1.0  # 1: none (CTRL-style, > 1 discourages repeats)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise InputError(name, f"must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise InputError("temperature", f"must be >= 0, got {self.temperature}")
        top_k = self.top_k
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise InputError("top_k", f"must be a positive integer or None, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise InputError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InputError("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise InputError("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def uses_counts(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def token_counts(ids: Tensor, vocab_size: int, mask: Tensor | None = None) -> Tensor:
    """counts[b, v] = #{t : ids[b, t] = v and mask[b, t]}; ids (B, T) -> (B, V) float."""
    counts = torch.zeros(ids.shape[0], vocab_size, device=ids.device)  # (B, V)
    weights = torch.ones_like(ids, dtype=counts.dtype) if mask is None else mask.to(counts.dtype)
    return counts.scatter_add_(1, ids, weights)


def apply_repetition_penalty(logits: Tensor, counts: Tensor, penalty: float) -> Tensor:
    """z_v <- z_v / r if z_v > 0 else z_v * r, for every seen token v (Keskar et al. 2019)."""
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(counts > 0, penalized, logits)


def apply_presence_frequency_penalty(
    logits: Tensor, counts: Tensor, presence: float, frequency: float
) -> Tensor:
    """z_v <- z_v - presence * 1[c_v > 0] - frequency * c_v (OpenAI's definition)."""
    return logits - presence * (counts > 0).to(logits.dtype) - frequency * counts.to(logits.dtype)


def apply_temperature(logits: Tensor, temperature: float) -> Tensor:
    """z <- z / T: T < 1 sharpens softmax(z), T > 1 flattens it (T > 0)."""
    return logits / temperature


def top_k_filter(logits: Tensor, k: int) -> Tensor:
    """Keep z_v if z_v >= the k-th largest logit, else -inf."""
    k = min(k, logits.shape[-1])
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # (B, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: Tensor, p: float) -> Tensor:
    """Keep the smallest most-likely set S with sum_{v in S} softmax(z)_v >= p (Holtzman et al.)."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, V)
    probs = sorted_logits.softmax(dim=-1)
    # a token is dropped when the tokens ranked before it already reach p; the top one stays
    drop_sorted = (probs.cumsum(dim=-1) - probs) >= p
    drop_sorted[..., 0] = False
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def min_p_filter(logits: Tensor, min_p: float) -> Tensor:
    """Keep z_v if softmax(z)_v >= min_p * max_u softmax(z)_u, i.e. z_v >= max z + ln(min_p)."""
    if min_p <= 0.0:
        return logits
    threshold = logits.max(dim=-1, keepdim=True).values + torch.log(
        torch.tensor(min_p, dtype=logits.dtype, device=logits.device)
    )
    return logits.masked_fill(logits < threshold, float("-inf"))


def greedy(logits: Tensor) -> Tensor:
    """next = argmax_v z_v; (B, V) -> (B,)."""
    return logits.argmax(dim=-1)


def sample(logits: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """next ~ Categorical(softmax(z)); (B, V) -> (B,). Drawn as the exponential race:
    argmax_v p_v / E_v with E_v ~ Exp(1) independent (the argmax is distributed as p), on the
    logits' device with `generator` (one on that device), so nothing waits for the host. Tokens
    at -inf (p = 0) are never drawn: exponential_ never draws 0."""
    probs = logits.float().softmax(dim=-1)  # (B, V)
    race = torch.empty_like(probs).exponential_(generator=generator)  # (B, V)
    return (probs / race).argmax(dim=-1)


def sample_rows(logits: Tensor, generators: list[torch.Generator]) -> Tensor:
    """Row b drawn with generators[b], as `sample` draws it alone: (B, V) -> (B,), the race's
    division and argmax once for the batch."""
    probs = logits.float().softmax(dim=-1)  # (B, V)
    race = torch.stack([torch.empty_like(row).exponential_(generator=g)
                        for row, g in zip(probs, generators, strict=True)])  # (B, V)
    return (probs / race).argmax(dim=-1)


def process_logits(
    logits: Tensor, config: SamplingConfig, counts: Tensor | None = None
) -> Tensor:
    """All rules of `config` except the final draw, in the standard order; (B, V) -> (B, V)."""
    logits = logits.float()
    if config.uses_counts:
        if counts is None:
            raise InputError("counts", "penalties need the token counts of the context")
        if config.repetition_penalty != 1.0:
            logits = apply_repetition_penalty(logits, counts, config.repetition_penalty)
        if config.presence_penalty or config.frequency_penalty:
            logits = apply_presence_frequency_penalty(
                logits, counts, config.presence_penalty, config.frequency_penalty
            )
    if config.greedy:
        return logits
    logits = apply_temperature(logits, config.temperature)
    if config.top_k is not None:
        logits = top_k_filter(logits, config.top_k)
    if config.top_p < 1.0:
        logits = top_p_filter(logits, config.top_p)
    if config.min_p > 0.0:
        logits = min_p_filter(logits, config.min_p)
    return logits


def next_token(
    logits: Tensor,
    config: SamplingConfig,
    generator: torch.Generator | None = None,
    counts: Tensor | None = None,
) -> Tensor:
    """Pick one token per row: (B, V) -> (B,)."""
    logits = process_logits(logits, config, counts)
    return greedy(logits) if config.greedy else sample(logits, generator)
