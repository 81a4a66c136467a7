import collections

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from glassformer.generation.sampling import (
    SamplingConfig,
    apply_presence_frequency_penalty,
    apply_repetition_penalty,
    greedy,
    min_p_filter,
    next_token,
    process_logits,
    sample,
    token_counts,
    top_k_filter,
    top_p_filter,
)


def _logits(seed: int, rows: int = 4, vocab: int = 17) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _kept(logits: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(torch.isfinite(row)).flatten().tolist()) for row in logits]


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(X >= statistic) for X ~ chi-square with (#cells - 1) degrees of freedom."""
    expected = probs * counts.sum()
    statistic = ((counts - expected) ** 2 / expected).sum()
    dof = torch.tensor((len(probs) - 1) / 2, dtype=torch.float64)
    return torch.special.gammaincc(dof, statistic.double() / 2).item()


@pytest.mark.parametrize(
    "field, value",
    [("temperature", -1.0), ("top_k", 0), ("top_p", 0.0), ("top_p", 1.5), ("min_p", -0.1),
     ("repetition_penalty", 0.0), ("temperature", float("nan")), ("top_p", float("nan")),
     ("presence_penalty", float("inf")), ("frequency_penalty", float("-inf")),
     ("temperature", "0.7"), ("min_p", None)],
)
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingConfig(**{field: value})


def test_token_counts_match_counter():
    ids = torch.tensor([[3, 1, 3, 0], [2, 2, 2, 1]])
    mask = torch.tensor([[True, True, True, True], [False, True, True, True]])
    counts = token_counts(ids, 5, mask)
    for b in range(2):
        expected = collections.Counter(ids[b][mask[b]].tolist())
        assert counts[b].tolist() == [float(expected[v]) for v in range(5)]


def test_top_k_keeps_exactly_the_k_largest():
    logits = _logits(0)
    for k in (1, 3, 17, 50):
        expected = [set(torch.argsort(row, descending=True)[:k].tolist()) for row in logits]
        assert _kept(top_k_filter(logits, k)) == expected


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 10_000), p=st.floats(0.01, 0.999))
def test_top_p_keeps_the_smallest_set_reaching_p(seed, p):
    logits = _logits(seed)
    probs = logits.softmax(-1)
    for row_probs, kept in zip(probs, _kept(top_p_filter(logits, p)), strict=True):
        order = torch.argsort(row_probs, descending=True).tolist()
        total, expected = 0.0, set()
        for v in order:  # oracle: add tokens by decreasing probability until the mass reaches p
            expected.add(v)
            total += row_probs[v].item()
            if total >= p:
                break
        assert kept == expected


def test_min_p_keeps_tokens_above_a_fraction_of_the_top_probability():
    logits = _logits(1)
    probs = logits.softmax(-1)
    for min_p in (0.0, 0.05, 0.3, 1.0):
        expected = [
            set(torch.nonzero(row >= min_p * row.max() * (1 - 1e-6)).flatten().tolist())
            for row in probs
        ]
        assert _kept(min_p_filter(logits, min_p)) == expected


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0]])
    counts = torch.tensor([[1.0, 2.0, 0.0, 0.0]])
    out = apply_repetition_penalty(logits, counts, 2.0)
    torch.testing.assert_close(out, torch.tensor([[1.0, -2.0, 0.5, -3.0]]))


def test_presence_and_frequency_penalties_follow_the_formula():
    logits = _logits(2)
    counts = torch.randint(0, 3, logits.shape, generator=torch.Generator().manual_seed(0)).float()
    out = apply_presence_frequency_penalty(logits, counts, 0.5, 0.25)
    expected = logits.clone()
    for b, v in torch.nonzero(counts).tolist():
        expected[b, v] -= 0.5 + 0.25 * counts[b, v]
    torch.testing.assert_close(out, expected)


def test_penalties_without_counts_are_an_error():
    with pytest.raises(ValueError, match="counts"):
        process_logits(_logits(0), SamplingConfig(repetition_penalty=1.3))


@pytest.mark.parametrize(
    "config",
    [SamplingConfig(top_k=1), SamplingConfig(top_p=1e-6), SamplingConfig(temperature=1e-4),
     SamplingConfig(temperature=0.0), SamplingConfig(min_p=1.0)],
)
def test_degenerate_settings_equal_greedy(config):
    logits = _logits(3, rows=64)
    generator = torch.Generator().manual_seed(0)
    assert torch.equal(next_token(logits, config, generator), greedy(logits))


def test_a_seed_reproduces_a_sample_and_another_seed_differs():
    logits = torch.zeros(256, 50)  # uniform: every draw is pure chance
    config = SamplingConfig(temperature=1.0)
    draws = [next_token(logits, config, torch.Generator().manual_seed(s)) for s in (7, 7, 8)]
    assert torch.equal(draws[0], draws[1])
    assert not torch.equal(draws[0], draws[2])


@pytest.mark.parametrize(
    "config",
    [SamplingConfig(temperature=0.7), SamplingConfig(temperature=1.3, top_k=4),
     SamplingConfig(top_p=0.8), SamplingConfig(temperature=0.9, top_k=6, top_p=0.9, min_p=0.05)],
)
def test_sample_frequencies_match_the_filtered_distribution(config):
    base = torch.tensor([2.0, 1.5, 1.0, 0.6, 0.3, 0.0, -0.5, -1.0])
    n = 40_000
    draws = next_token(base.expand(n, -1), config, torch.Generator().manual_seed(1234))
    counts = torch.bincount(draws, minlength=len(base)).double()

    # oracle: the filtered distribution written out directly from the definitions
    probs = (base / config.temperature).softmax(-1).double()
    order = torch.argsort(probs, descending=True)
    keep = torch.zeros(len(base), dtype=torch.bool)
    mass = 0.0
    for rank, v in enumerate(order.tolist()):
        if config.top_k is not None and rank >= config.top_k:
            break
        keep[v] = True
        mass += probs[v].item()
        if mass >= config.top_p:
            break
    top_k_p = torch.where(keep, probs, 0.0)
    keep &= top_k_p >= config.min_p * top_k_p.max()
    target = torch.where(keep, probs, 0.0)
    target = target / target.sum()

    assert counts[~keep].sum() == 0
    assert _chi_square_p_value(counts[keep], target[keep]) > 1e-3
    # the test has power: the same filter at a 10% higher temperature is rejected
    wrong = torch.where(keep, (base / (1.1 * config.temperature)).softmax(-1).double(), 0.0)
    assert _chi_square_p_value(counts[keep], (wrong / wrong.sum())[keep]) < 1e-3


def test_sample_never_draws_a_masked_token():
    logits = torch.full((1000, 5), float("-inf"))
    logits[:, 2] = 0.0
    logits[:, 4] = 1.0
    draws = sample(logits, torch.Generator().manual_seed(0))
    assert set(draws.tolist()) <= {2, 4}
