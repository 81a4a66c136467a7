"""The little statistics the experiments need: spreads, rank agreement and growth fits."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..errors import InputError


def mean_spread(values: Sequence[float]) -> tuple[float, float]:
    """Mean and spread (half the range: with 2 seeds, how far each lies from the mean)."""
    values = [float(v) for v in values]
    return sum(values) / len(values), (max(values) - min(values)) / 2


def lower_is_better(a: Sequence[float], b: Sequence[float]) -> bool | None:
    """True when every value of `a` is below every value of `b`, False when every value of
    `b` is below every value of `a`, None when the seeds overlap (no clear difference)."""
    if max(a) < min(b):
        return True
    if max(b) < min(a):
        return False
    return None


def ranks(values: Sequence[float]) -> np.ndarray:
    """Ranks 0..n-1 (ties share their mean rank)."""
    values = np.asarray(values, dtype=np.float64)
    order = np.argsort(values, kind="stable")
    result = np.empty(len(values))
    result[order] = np.arange(len(values))
    for value in np.unique(values):
        tied = values == value
        result[tied] = result[tied].mean()
    return result


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks."""
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = math.sqrt(float((ra * ra).sum() * (rb * rb).sum()))
    return float((ra * rb).sum() / denominator) if denominator else 0.0


def top_overlap(a: Sequence[float], b: Sequence[float], k: int) -> float:
    """The share of the k largest entries of `a` that are also among the k largest of `b`."""
    top_a = set(np.argsort(-np.asarray(a), kind="stable")[:k].tolist())
    top_b = set(np.argsort(-np.asarray(b), kind="stable")[:k].tolist())
    return len(top_a & top_b) / k


def growth_exponent(lengths: Sequence[float], seconds: Sequence[float]) -> float:
    """p in seconds ≈ c · length^p, fitted by least squares on log-log over the longer half
    of the lengths (where fixed per-call costs matter least)."""
    pairs = sorted(zip(lengths, seconds, strict=True))
    pairs = pairs[(len(pairs) - 1) // 2:]
    if len(pairs) < 2:
        raise InputError("growth_exponent", "need at least two lengths")
    x = np.log([p[0] for p in pairs])
    y = np.log([p[1] for p in pairs])
    return float(np.polyfit(x, y, 1)[0])
