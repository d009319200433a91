"""The noise families' samplers and their rounding (govtrain/privatizers/families): the moments and a
goodness-of-fit test of each sampler on 10⁶ draws against the exact pmf (or cdf), and conditional randomised
rounding's bound (every output) and unbiasedness.

Each generator has a fixed seed, so the statistics below are reproducible; the thresholds (p > 1e-3, moments
within 5 standard errors) are what a correct sampler passes and a wrong one (a shifted, rescaled or rounded
distribution) fails at this many draws."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from govtrain.accounting.families import l1_bound, l2_bound
from govtrain.privatizers.families import samplers

DRAWS = 1_000_000


def _rng(seed: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(seed))


def _moments(pmf: dict[int, float]) -> tuple[float, float, float]:
    """Mean, variance and excess kurtosis of an integer pmf."""
    xs = np.array(list(pmf), dtype=np.float64)
    ps = np.array(list(pmf.values()))
    mean = float((xs * ps).sum())
    var = float(((xs - mean) ** 2 * ps).sum())
    kurt = float(((xs - mean) ** 4 * ps).sum()) / var ** 2 - 3
    return mean, var, kurt


def _pmf(logweight, support: range) -> dict[int, float]:
    logs = np.array([logweight(x) for x in support])
    logs -= logs.max()
    weights = np.exp(logs)
    return dict(zip(support, weights / weights.sum()))


def _chi_square(draws: np.ndarray, pmf: dict[int, float], *, bins: int | None = None) -> tuple[float, float]:
    """Chi-square of the draws' counts against the pmf: single integers where at least 20 draws are expected, the
    tails pooled (and, with `bins`, consecutive integers pooled into about that many equal-probability bins)."""
    xs = np.array(sorted(pmf))
    ps = np.array([pmf[x] for x in xs])
    cdf = np.cumsum(ps)
    minimum = 20 / len(draws)
    edges = [xs[0]]  # bin k is [edges[k], edges[k+1])
    target = 1 / bins if bins else 0
    acc = 0.0
    for x, p in zip(xs, ps):
        acc += p
        if acc >= max(minimum, target) and 1 - cdf[x - xs[0]] >= max(minimum, target):
            edges.append(x + 1)
            acc = 0.0
    edges = np.array(edges[1:])  # interior edges
    index = np.searchsorted(edges, xs, side="right")
    expected = np.bincount(index, weights=ps) * len(draws)
    observed = np.bincount(np.searchsorted(edges, draws, side="right"), minlength=len(expected))
    assert observed.sum() == len(draws) and len(observed) == len(expected), "a draw outside the pmf's support"
    statistic, p_value = stats.chisquare(observed, expected * len(draws) / expected.sum())
    return float(statistic), float(p_value)


def _assert_moments(draws: np.ndarray, pmf: dict[int, float]) -> None:
    mean, var, kurt = _moments(pmf)
    n = len(draws)
    x = draws.astype(np.float64)
    m, v = x.mean(), x.var()
    k = ((x - m) ** 4).mean() / v ** 2 - 3
    assert abs(m - mean) < 5 * math.sqrt(var / n)
    fourth = (kurt + 3) * var ** 2
    assert abs(v - var) < 5 * math.sqrt((fourth - var ** 2) / n)
    assert abs(k - kurt) < 0.05 + 0.1 * abs(kurt), (k, kurt)


@pytest.mark.parametrize("sigma2, bins", [(4, None), (2.5, None), (1 << 20, 200)])
def test_discrete_gaussian_fits_its_pmf(sigma2, bins):
    draws = samplers.discrete_gaussian(_rng(1), DRAWS, sigma2)
    sigma = math.sqrt(sigma2)
    pmf = _pmf(lambda x: -x * x / (2 * sigma2), range(-int(12 * sigma) - 2, int(12 * sigma) + 3))
    _assert_moments(draws, pmf)
    assert abs(_moments(pmf)[1] / sigma2 - 1) < 1e-3  # N_Z's variance is σ²'s (to e^-2π²σ²)
    statistic, p_value = _chi_square(draws, pmf, bins=bins)
    assert p_value > 1e-3, (statistic, p_value)


def test_discrete_gaussian_tiny_and_rational_sigma():
    """σ² = 1/4 (t = 1, mostly rejected) and an exact Fraction; both against their pmfs."""
    from fractions import Fraction

    for sigma2 in (0.25, Fraction(9, 7)):
        draws = samplers.discrete_gaussian(_rng(2), 200_000, sigma2)
        pmf = _pmf(lambda x: -x * x / (2 * float(sigma2)), range(-12, 13))
        assert _chi_square(draws, pmf)[1] > 1e-3


def test_discrete_laplace_fits_its_pmf():
    t = 3
    draws = samplers.discrete_laplace(_rng(3), DRAWS, t)
    pmf = _pmf(lambda x: -abs(x) / t, range(-80, 81))
    _assert_moments(draws, pmf)
    statistic, p_value = _chi_square(draws, pmf)
    assert p_value > 1e-3, (statistic, p_value)


def test_skellam_fits_its_pmf():
    mu = 5
    draws = samplers.skellam(_rng(4), DRAWS, mu)
    support = range(-60, 61)
    pmf = dict(zip(support, stats.skellam.pmf(np.array(support), mu, mu)))
    assert abs(_moments(pmf)[1] - 2 * mu) < 1e-9
    _assert_moments(draws, pmf)
    statistic, p_value = _chi_square(draws, pmf)
    assert p_value > 1e-3, (statistic, p_value)


def test_continuous_laplace_fits_its_cdf():
    b = 1.7
    draws = samplers.laplace(_rng(5), DRAWS, b)
    statistic, p_value = stats.kstest(draws, stats.laplace(scale=b).cdf)
    assert p_value > 1e-3, (statistic, p_value)
    assert abs(draws.var() / (2 * b * b) - 1) < 5 * math.sqrt(5 / DRAWS)  # Var = 2b², kurtosis 3 (excess)


def test_a_wrong_distribution_fails_the_same_test():
    """The chi-square above can fail: the continuous Gaussian rounded to the integers is not N_Z (σ² = 1)."""
    draws = np.rint(_rng(6).normal(0, 1, DRAWS)).astype(np.int64)
    pmf = _pmf(lambda x: -x * x / 2, range(-12, 13))
    assert _chi_square(draws, pmf)[1] < 1e-6


def test_bernoulli_exp_is_exact_in_expectation():
    """Bern(exp(-γ)) for γ across [0, 5], including whole numbers and the fraction boundary."""
    rng = _rng(7)
    for num, den in ((0, 1), (1, 3), (1, 1), (5, 2), (5, 1), (7, 3)):
        n = 400_000
        hits = samplers.bernoulli_exp(rng, np.full(n, num), den).mean()
        p = math.exp(-num / den)
        assert abs(hits - p) < 5 * math.sqrt(p * (1 - p) / n) + 1e-12, (num, den, hits, p)


def test_generators_are_seeded_from_the_os_or_an_insecure_seed_never_a_torch_generator():
    import torch

    a, b = samplers.generator(), samplers.generator()
    assert a.integers(0, 1 << 62) != b.integers(0, 1 << 62)
    assert samplers.generator(5).integers(0, 1 << 62) == samplers.generator(5).integers(0, 1 << 62)
    assert samplers.generator((5, 0)).integers(0, 1 << 62) != samplers.generator((5, 1)).integers(0, 1 << 62)
    with pytest.raises(TypeError):  # the router's torch generator keeps 32 bits of its seed
        samplers.generator(torch.Generator().manual_seed(5))


def test_samplers_refuse_bad_parameters():
    rng = _rng(8)
    for call in (lambda: samplers.discrete_gaussian(rng, 3, 0), lambda: samplers.discrete_laplace(rng, 3, 0),
                 lambda: samplers.discrete_laplace(rng, 3, 1.5), lambda: samplers.skellam(rng, 3, 0),
                 lambda: samplers.skellam(rng, 3, samplers.SKELLAM_MAX_MU + 1),
                 lambda: samplers.laplace(rng, 3, 0.0), lambda: samplers.bernoulli_exp(rng, np.array([-1]), 1)):
        with pytest.raises(ValueError):
            call()


# -- conditional randomised rounding ---------------------------------------------------------------------------

def _sphere(rows: int, d: int, radius: float, seed: int, norm: str = "l2"):
    import torch

    g = torch.Generator().manual_seed(seed)
    y = torch.randn(rows, d, generator=g, dtype=torch.float64)
    scale = y.norm(dim=1) if norm == "l2" else y.abs().sum(1)
    return y / scale[:, None] * radius


@pytest.mark.parametrize("norm", ["l2", "l1"])
def test_conditional_rounding_keeps_its_bound_on_every_output(norm):
    """Half-way coordinates (each rounds to 0 or 1 at even odds) and β = 1/2: many first roundings exceed the
    bound (about 1% in L2, 12% in L1), and every kept one is within it."""
    import torch

    from govtrain.privatizers.families.rounding import conditional_round, randomized_round

    d, rows = 64, 4000
    y = torch.full((rows, d), 0.5, dtype=torch.float64)
    y[::2] *= -1
    c = 0.5 * math.sqrt(d) if norm == "l2" else 0.5 * d
    span = torch.full((rows,), c, dtype=torch.float64)
    bound = (l2_bound if norm == "l2" else l1_bound)(c, d, 1)
    first = randomized_round(y, torch.Generator().manual_seed(1))
    size = first.norm(dim=1) if norm == "l2" else first.abs().sum(1)
    assert int((size > bound).sum()) > 10  # the conditioning is exercised
    q = conditional_round(y, span, norm=norm, dimension=d, beta_exp=1, generator=torch.Generator().manual_seed(2))
    assert torch.equal(q, torch.round(q))
    size = q.norm(dim=1) if norm == "l2" else q.abs().sum(1)
    assert bool((size <= bound * (1 + 1e-12)).all())
    assert bool(((q - y).abs() < 1).all())  # each coordinate is one of its two neighbours


def test_rounding_of_sphere_points_stays_within_its_span():
    """Rows of norm exactly c in L2 and L1 at the default β: the bound holds, and never needs more than c + √d."""
    import torch

    from govtrain.privatizers.families.rounding import conditional_round

    for norm in ("l2", "l1"):
        d, c = 50, 7.5
        y = _sphere(2000, d, c, 5, norm)
        q = conditional_round(y, torch.full((2000,), c, dtype=torch.float64), norm=norm, dimension=d, beta_exp=40,
                              generator=torch.Generator().manual_seed(6))
        size = q.norm(dim=1) if norm == "l2" else q.abs().sum(1)
        assert bool((size <= (l2_bound if norm == "l2" else l1_bound)(c, d, 40)).all())


def test_rounding_is_unbiased():
    import torch

    from govtrain.privatizers.families.rounding import conditional_round

    d, n = 16, 40_000
    y = _sphere(1, d, 3.3, 3).expand(n, d).contiguous()
    q = conditional_round(y, torch.full((n,), 3.3, dtype=torch.float64), norm="l2", dimension=d, beta_exp=40,
                          generator=torch.Generator().manual_seed(4))
    frac = y[0] - torch.floor(y[0])
    se = torch.sqrt(frac * (1 - frac) / n).clamp(min=1e-9)
    assert bool(((q.mean(0) - y[0]).abs() < 5 * se + 1e-12).all())


def test_rounding_refuses_rows_longer_than_the_charged_dimension():
    import torch

    from govtrain.privatizers.families.rounding import conditional_round

    with pytest.raises(ValueError, match="more than"):
        conditional_round(torch.zeros(2, 9, dtype=torch.float64), torch.ones(2, dtype=torch.float64), norm="l2",
                          dimension=8, beta_exp=40, generator=torch.Generator())


@pytest.mark.parametrize("row, span", [(math.inf, 80.0), (-math.inf, 80.0), (1.0, math.inf), (1.0, -0.5)])
def test_conditional_rounding_refuses_infinite_rows_and_bad_spans(row, span):
    import torch

    from govtrain.privatizers.families.rounding import conditional_round

    y = torch.tensor([[row, 2.0], [3.0, 4.0]], dtype=torch.float64)
    spans = torch.tensor([span, 5.0], dtype=torch.float64)
    generator = torch.Generator().manual_seed(0)
    before = generator.get_state()
    with pytest.raises(ValueError):
        conditional_round(y, spans, norm="l1", dimension=2, beta_exp=40, generator=generator)
    assert torch.equal(generator.get_state(), before)  # refused before anything was drawn
