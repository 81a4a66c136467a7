import numpy as np
import pytest

from glassformer.experiments.stats import (
    growth_exponent,
    lower_is_better,
    mean_spread,
    ranks,
    spearman,
    top_overlap,
)


def test_mean_spread_is_half_the_range():
    assert mean_spread([2.0, 3.0]) == (2.5, 0.5)
    assert mean_spread([1.0, 1.0, 4.0]) == (2.0, 1.5)


def test_lower_is_better_needs_separated_seeds():
    assert lower_is_better([1.0, 1.1], [1.2, 1.3]) is True
    assert lower_is_better([1.2, 1.3], [1.0, 1.1]) is False
    assert lower_is_better([1.0, 1.25], [1.2, 1.3]) is None


def test_ranks_share_ties():
    np.testing.assert_array_equal(ranks([10.0, 30.0, 20.0, 30.0]), [0.0, 2.5, 1.0, 2.5])


def test_spearman_against_pearson_of_ranks():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=50), rng.normal(size=50)
    oracle = np.corrcoef(np.argsort(np.argsort(a)), np.argsort(np.argsort(b)))[0, 1]
    assert spearman(a, b) == pytest.approx(oracle)
    assert spearman(a, np.exp(a)) == pytest.approx(1.0)
    assert spearman(a, -a**3) == pytest.approx(-1.0)


def test_top_overlap():
    assert top_overlap([5, 4, 3, 2, 1], [1, 4, 5, 2, 3], 2) == 0.5
    assert top_overlap([5, 4, 3], [5, 4, 3], 3) == 1.0


@pytest.mark.parametrize("power", [0.0, 1.0, 2.0])
def test_growth_exponent_recovers_a_power_law(power):
    lengths = [16, 32, 64, 128, 256, 512]
    seconds = [3e-6 * n**power for n in lengths]
    assert growth_exponent(lengths, seconds) == pytest.approx(power, abs=1e-9)


def test_growth_exponent_uses_the_longer_half():
    lengths = [1, 2, 4, 8, 16, 32]
    seconds = [4.0, 4.0, 4.0, 8.0, 16.0, 32.0]  # a fixed cost first, then linear
    assert growth_exponent(lengths, seconds) == pytest.approx(1.0)
    assert np.polyfit(np.log(lengths), np.log(seconds), 1)[0] < 0.8  # all points: too low
