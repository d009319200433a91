"""Adversarial review of the noise families (issue 24, item 3): proof scripts.

Part 1, FINDINGS: each test below fails on the reviewed code (branch rev-fam at 9a6cad7) and passes once the
finding is fixed. Each docstring names the attack, the adversary, and what should happen instead.

Part 2, HELD: attacks that were tried and held; these pass, and guard against a regression.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
from scipy import stats
from scipy.special import logsumexp

torch = pytest.importorskip("torch")

from govtrain import units  # noqa: E402
from govtrain.accounting import families  # noqa: E402
from govtrain.accounting.families import Lattice, epsilon_u  # noqa: E402
from govtrain.errors import Code, ConfigError  # noqa: E402
from govtrain.privatizers.base import Charge, Slot  # noqa: E402
from govtrain.privatizers.families import samplers  # noqa: E402
from govtrain.privatizers.families.discrete_gaussian import DiscreteGaussian  # noqa: E402
from govtrain.privatizers.families.floors import check_family_floor  # noqa: E402
from govtrain.privatizers.families.laplace import Laplace  # noqa: E402
from govtrain.privatizers.families.rounding import conditional_round  # noqa: E402
from govtrain.privatizers.families.skellam import Skellam  # noqa: E402


def _tiny_router(privatizer, insecure_seed: int | None = 0):  # type: ignore[no-untyped-def]
    """The tiny BERT of tests/test_routing.py through the router, materialized for `privatizer`."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from govtrain.resolver.model import describe
    from govtrain.resolver.profile import resolve
    from govtrain.routing.router import Router
    from tests.test_routing import CLASSES, model

    net = model()
    resolution = resolve(CLASSES, describe(net))
    router = Router(net, resolution, insecure_seed=insecure_seed)
    if privatizer is not None:
        privatizer.bind(sum(p.numel() for p in net.parameters() if p.requires_grad))
        router.materialize(privatizer)
    return net, resolution, router


def _product_error(a: np.ndarray, b: float) -> np.ndarray:
    """a·b − fl(a·b), exactly (Dekker's two-product, no FMA needed)."""
    p = a * b
    split = 134217729.0  # 2^27 + 1
    c = split * a
    a_hi = c - (c - a)
    a_lo = a - a_hi
    c = split * b
    b_hi = c - (c - b)
    b_lo = b - b_hi
    return ((a_hi * b_hi - p) + a_hi * b_lo + a_lo * b_hi) + a_lo * b_lo


def _rounding_bias(k: np.ndarray, lam: float) -> float:
    """How much more often the draws k fall on integers whose k·ln λ rounds up (in double) than down: the ratio
    of the counts with residue below −1/4 ulp and above +1/4 ulp. Any law that is smooth at the scale of one
    integer (a Poisson, a Skellam) gives 1 up to sampling noise: the residue is equidistributed in k."""
    k = k.astype(np.float64)
    residue = _product_error(k, math.log(lam)) / np.spacing(k * math.log(lam))
    return float((residue < -0.25).sum()) / float((residue > 0.25).sum())


# ======================================================================================================
# Part 1: FINDINGS (fail today)
# ======================================================================================================


def test_finding_skellam_noise_at_high_granularity_is_not_skellam():
    """ATTACK: sampler distinguishability. ADVERSARY: anyone who sees released Skellam-noised sums and knows
    numpy's Poisson algorithm (Hörmann's PTRS, public). At granularity_bits = 24 (an accepted setting) the
    privatizer draws Poisson(2^47) twice per coordinate; PTRS accepts through log-pmf terms of size ~4.6e15,
    computed in double (ulp 1), so its acceptance test is off by up to ~1 in log at every integer, in a pattern
    fixed by k·ln λ's rounding. The noise's pmf is distorted by several percent per integer (here: integers
    where k·ln λ rounds up are drawn ~7% more often than those where it rounds down; a law smooth at the
    integer scale, like the true Poisson, shows no such bias). The Agarwal–Kairouz–Liu RDP the accountant
    charges assumes the exact Skellam pmf; with a distorted pmf the per-coordinate divergence is no longer
    ~q²/V but carries a d-fold sum of O(1e-3) terms. SHOULD: draw Skellam noise with an exact integer sampler
    (or refuse the granularities at which numpy's Poisson is not exact to the accountant's precision).

    FIXED BY REFUSAL (the test's second option; no exact Poisson sampler at λ ~ 2^47 was written): Skellam, its
    record and its charge refuse granularity_bits above SKELLAM_MAX_BITS = 8, where PTRS's log-pmf error is
    below 4.7e-10 (accounting/families.py). The attack itself is then run at the largest accepted b, through the
    privatizer's own `_draw`, and must find no bias."""

    class Recording:
        def __init__(self, rng: np.random.Generator) -> None:
            self.rng, self.draws = rng, []

        def poisson(self, lam, size):  # type: ignore[no-untyped-def]
            out = self.rng.poisson(lam, size=size)
            self.draws.append((lam, out))
            return out

    for bits in (24, families.SKELLAM_MAX_BITS + 1):
        with pytest.raises(ValueError, match="granularity_bits"):
            Skellam(granularity_bits=bits)
        with pytest.raises(ValueError, match="granularity_bits"):
            Skellam.from_record({"name": "skellam", "granularity_bits": bits, "beta_exp": 40, "dimension": 10})
        charge = Charge(family="skellam", sampling_rate_u=10_000, noise_multiplier_u=1_000_000, rounds=1,
                        params=(bits, 40, 10))
        with pytest.raises(ValueError, match="granularity_bits"):
            epsilon_u("rdp", 10 ** 7, [charge])
    rng = np.random.Generator(np.random.PCG64(2024))
    recording = Recording(rng)
    Skellam(granularity_bits=families.SKELLAM_MAX_BITS)._draw(recording, 1_000_000)  # type: ignore[arg-type]
    lam = float(recording.draws[0][0])
    assert lam == 2.0 ** (2 * families.SKELLAM_MAX_BITS - 1)
    # the control: a law smooth at the integer scale, with the same mean and spread, shows no bias
    smooth = np.round(lam + math.sqrt(lam) * rng.standard_normal(2_000_000))
    assert abs(_rounding_bias(smooth, lam) - 1) < 0.015
    poisson = np.concatenate([draws for _, draws in recording.draws])
    assert abs(_rounding_bias(poisson, lam) - 1) < 0.015, "the Skellam noise's pmf is distorted at the integer level"
    low, high = int(lam - 3 * math.sqrt(lam)), int(lam + 3 * math.sqrt(lam))  # ≥ 10 expected per integer
    inside = poisson[(poisson >= low) & (poisson < high)] - low
    counts = np.bincount(inside, minlength=high - low)
    expected = stats.poisson.pmf(np.arange(low, high), lam)
    assert stats.chisquare(counts, expected * inside.size / expected.sum()).pvalue > 1e-4


@pytest.mark.parametrize("sigma2", [0.1, 2 ** 60], ids=["tiny-float", "huge"])
def test_finding_discrete_gaussian_slow_path_recurses_forever(sigma2):
    """ATTACK: the exact sampler's slow path (Python integers). ADVERSARY: a config or caller choosing σ² whose
    fractions do not fit the int64 path (a float σ² like 0.1, whose exact value has denominator 2^55, or a huge
    σ² like 2^60). `_bernoulli_exp_scalar(γ)` draws Bern(exp(−1)) for γ's whole part by calling itself with
    Fraction(1), whose whole part is 1 again: infinite recursion, RecursionError on the first γ ≥ 1. The
    docstring promises any rational σ² "exactly". SHOULD: the whole part drawn by the K loop at γ = 1 (as
    `_bernoulli_exp_one` does), and the draws follow N_Z(0, σ²)."""
    rng = np.random.Generator(np.random.PCG64(7))
    n = 4000
    x = samplers.discrete_gaussian(rng, n, sigma2)
    if sigma2 < 1:
        support = np.arange(-10, 11)
        p0 = 1 / float(np.exp(-support.astype(float) ** 2 / (2 * sigma2)).sum())
        assert abs(float((x == 0).mean()) - p0) < 5 * math.sqrt(p0 * (1 - p0) / n)
    else:
        assert float(np.var(x.astype(np.float64))) == pytest.approx(float(sigma2), rel=0.12)


def test_finding_router_finish_adds_float_gaussian_noise_to_the_lattice_sum():
    """ATTACK: the router hook as committed. ADVERSARY: whoever reads the released gradient of a step run through
    `router.privatize` (begin(group_std) → accumulate → finish) with a quantising privatizer materialized.
    `finish` never calls the privatizer's `update`: it adds the Gaussian path's float noise N(0, s_g²) to sums
    that are in lattice units (each unit spans 2^b/σ steps). The noise is s_g = 0.2 lattice steps instead of
    2^b = 256, and floating-point (Mironov): rounding the released gradient recovers the exact quantised
    clipped sum in ~99% of coordinates. SHOULD: `finish` releases through `privatizer.update` (integer noise of
    2^b steps, times the spacing) or refuses while a quantising privatizer is materialized and not wired."""
    from tests.test_routing import batch, losses_of

    privatizer = Laplace(granularity_bits=8)
    net, resolution, router = _tiny_router(privatizer)
    ids, attention, labels, classes, clip = batch()
    group_std = {group.classes: 0.2 for group in resolution.groups if group.classes}
    router.begin(group_std)
    with router.capture():
        losses = losses_of(net, ids, attention, labels)
    router.accumulate(losses, classes, clip)
    sums = {name: total.clone() for name, total in router._totals.items()}
    try:
        router.finish(group_std, 1.0)
    except (RuntimeError, ConfigError):
        assert all(p.grad is None for p in router.params.values())  # refused: nothing released
        return
    finally:
        router.close()
    released = torch.cat([p.grad.double().flatten() for name, p in router.params.items() if p.grad is not None])
    exact = torch.cat([sums[name].flatten() for name, p in router.params.items() if p.grad is not None])
    spacing = privatizer.spacing(0.2)
    assert float((torch.round(released) == exact).double().mean()) < 0.5, "the exact lattice sum is recoverable"
    on_lattice = released / spacing
    assert torch.allclose(on_lattice, torch.round(on_lattice), atol=1e-6)
    assert float((on_lattice - exact).std()) > 0.5 * 2 ** 8


def test_finding_run_noise_generator_has_32_bits_of_entropy():
    """ATTACK: brute-forcing the noise seed. ADVERSARY: anyone holding a released gradient (a model consumer).
    The router seeds its torch CPU generator with 64 bits from os.urandom, but torch's CPU generator
    (mt19937) keeps only the seed's low 32 bits; the families' numpy PCG64 "256-bit" seed is drawn from that
    generator. So every run's noise is one of 2^32 streams: enumerable in hours, after which the noise is
    subtracted exactly. SHOULD: noise seeded with ≥ 128 bits of OS entropy (samplers.generator() from
    os.urandom, or the mt19937 state filled from os.urandom), so two distinct OS seeds never share noise."""
    _, _, router = _tiny_router(None, insecure_seed=None)  # as a run builds it (a seeded router is a test's)
    try:
        seed = router.generator.initial_seed()
        twin = torch.Generator().manual_seed(seed ^ (0x5EED << 40))  # another 64-bit seed, same low 32 bits
        mine = torch.rand(64, generator=router.generator, dtype=torch.float64)
        theirs = torch.rand(64, generator=twin, dtype=torch.float64)
        assert not torch.equal(mine, theirs), "the router's noise generator is determined by 32 bits"
    finally:
        router.close()
    slot = [Slot(key="w", shape=torch.Size([8]), dtype=torch.float64, device=torch.device("cpu"))]
    noises = []
    for run_seed in (0x1234_5678_9ABC, 0x1234_5678_9ABC ^ (0x77 << 40)):
        privatizer = DiscreteGaussian(granularity_bits=4)
        privatizer.generator = torch.Generator().manual_seed(run_seed)
        state = privatizer.init(slot)
        noises.append(privatizer.update({"w": torch.zeros(8, dtype=torch.float64)}, state, std={"w": 1.0})[0]["w"])
    assert not torch.equal(noises[0], noises[1]), "two runs with different seeds drew the same family noise"


@pytest.mark.parametrize("sampling_rate_u, noise_multiplier_u, bits", [
    (1_000_000, 1_000, 16), (10_000, 1_000, 16), (10_000, 500, 24)])
def test_finding_laplace_pure_epsilon_overflows_at_large_epsilon(sampling_rate_u, noise_multiplier_u, bits):
    """ATTACK: huge ε where the conversion misbehaves. ADVERSARY: a spend entry (or a verifier replaying one)
    with a small Laplace multiplier (σ ≲ 1.4e-3: ε₀ = Δ₁/2^b > 709). The pure-ε bound computes
    log1p(q·expm1(ε₀)), and math.expm1 raises OverflowError, so `epsilon_u` dies with an uncoded OverflowError
    instead of charging. SHOULD: ε₀ + log(q + (1−q)e^−ε₀) for large ε₀ (or the RDP value alone): a finite,
    rounded-up charge, at least ε₀ + ln q − 1 (one step, sampled with probability q ≫ δ, leaks about ε₀ + ln q
    with probability ≥ q/2)."""
    charge = Charge(family="laplace", sampling_rate_u=sampling_rate_u, noise_multiplier_u=noise_multiplier_u,
                    rounds=1, params=(bits, 40, 1000))
    eps_u = epsilon_u("rdp", 10 ** 7, [charge])
    eps0 = families.laplace_pure_epsilon(charge.params, noise_multiplier_u)
    assert eps0 > 709
    assert eps_u >= (eps0 + math.log(sampling_rate_u / units.MICRO) - 1) * units.MICRO


@pytest.mark.parametrize("case", ["nan-row", "nan-span", "negative-span"])
def test_finding_conditional_round_accepts_what_voids_its_bound(case):
    """ATTACK: the rounding's contract ("every output within Δ(c)"). ADVERSARY: a poisoned example whose loss is
    inf/NaN (its clipped row is NaN: norm NaN > bound is False), or a caller's span that is NaN or negative.
    A NaN comparison never re-draws: `conditional_round` returns a NaN row, or with a NaN span any row at all
    (here an integer vector of norm 70 under "span" NaN), and a negative span is read through min(c + √d, …) as
    a positive bound. SHOULD: refuse non-finite rows and non-finite or negative spans with a ValueError, so that
    nothing outside Δ(c) is handed on as "within the bound"."""
    y = torch.tensor([[50.0, 50.0]], dtype=torch.float64)
    span = torch.tensor([80.0], dtype=torch.float64)
    if case == "nan-row":
        y[0, 1] = float("nan")
    elif case == "nan-span":
        span[0] = float("nan")
    else:
        y = torch.tensor([[3.0, 4.0]], dtype=torch.float64)
        span[0] = -1.0
    with pytest.raises(ValueError):
        out = conditional_round(y, span, norm="l2", dimension=100, beta_exp=40,
                                generator=torch.Generator().manual_seed(0))
        pytest.fail(f"conditional_round returned {out.tolist()} for a {case}")


@pytest.mark.parametrize("family", ["Laplace", "float-laplace", "gaussian "])
def test_finding_floor_check_without_table_accepts_unknown_families(tmp_path, family):
    """ATTACK: a family named differently. ADVERSARY: a privatizer (or a record) whose `family` is not one of the
    four the policy knows. Without a [floor.families] table, `check_family_floor` lets *any* string train at the
    corpus floor: the floor check passes, and only the accountant refuses later. SHOULD: refuse a family not
    in NOISE_FAMILIES (`family_not_allowed`) whatever the table says: the floor is the gate, and it fails
    open."""
    from tests.conftest import TEST_POLICY
    from tests.test_family_floors import _policy

    policy = _policy(tmp_path, TEST_POLICY)
    with pytest.raises(ConfigError) as refused:
        check_family_floor(policy, family, [("c1", 50_000_000)])
    assert refused.value.code is Code.FAMILY_NOT_ALLOWED


# ======================================================================================================
# Part 2: HELD (pass today)
# ======================================================================================================


@pytest.mark.parametrize("norm", ["l2", "l1"])
@pytest.mark.parametrize("bits, beta_exp, d, sigma_u", [
    (1, 1, 1, 333_333), (24, 256, 1, 1_000_000), (16, 40, 7, 1_234_567), (8, 2, 1000, 700_001),
    (3, 40, 300, 10_000_000), (24, 40, 50, 123_457)])
def test_held_every_rounding_stays_within_the_charged_delta(norm, bits, beta_exp, d, sigma_u):
    """ATTACK: a quantised vector beyond the accountant's Δ. Rows of norm exactly the span c = 2^b/σ_u (the
    largest the router can form with σ rounded down), half-way coordinates, a zero row, float32 input, d = 1,
    β at 1/2 and 2^-256, b at 1 and 24, c non-integer: every output is within Lattice(...).l2/l1(σ_u)."""
    c = (1 << bits) * units.MICRO / sigma_u
    g = torch.Generator().manual_seed(bits * 1000 + d)
    y = torch.randn(300, d, generator=g, dtype=torch.float64)
    y[::3] = torch.sign(y[::3]) * 0.5  # half-way coordinates: the most rounding error
    size = y.norm(dim=1) if norm == "l2" else y.abs().sum(1)
    y = y / size[:, None] * c
    y[0] = 0
    rows = [y, y.to(torch.float32).to(torch.float64).clamp(-c, c)]
    lattice = Lattice((bits, beta_exp, d))
    delta = lattice.l2(sigma_u) if norm == "l2" else lattice.l1(sigma_u)
    for y in rows:
        q = conditional_round(y, torch.full((y.shape[0],), c, dtype=torch.float64), norm=norm, dimension=d,
                              beta_exp=beta_exp, generator=g)
        size = q.norm(dim=1) if norm == "l2" else q.abs().sum(1)
        assert torch.equal(q, torch.round(q)) and bool((size <= delta).all())


def _renyi(lp: np.ndarray, lq: np.ndarray, alpha: float) -> float:
    keep = np.isfinite(lp) & np.isfinite(lq)
    return float(logsumexp(alpha * lp[keep] + (1 - alpha) * lq[keep])) / (alpha - 1)


def _log_pmfs(family: str, shift: int, scale: float) -> tuple[np.ndarray, np.ndarray]:
    x = np.arange(-800, 801)
    if family == "discrete-gaussian":
        f = lambda z: -z.astype(float) ** 2 / (2 * scale * scale)  # noqa: E731
    elif family == "laplace":
        f = lambda z: -np.abs(z).astype(float) / scale  # noqa: E731
    else:
        f = lambda z: stats.skellam.logpmf(z, scale * scale / 2, scale * scale / 2)  # noqa: E731
    lp, lq = f(x), f(x - shift)
    return lp - logsumexp(lp), lq - logsumexp(lq)


@pytest.mark.parametrize("family, shift, scale", [
    ("discrete-gaussian", 1, 0.6), ("discrete-gaussian", 3, 2.0), ("laplace", 1, 1.0), ("laplace", 4, 3.0),
    ("skellam", 1, 1.0), ("skellam", 2, 3.0)])
def test_held_subsampled_curves_bound_the_exact_mixture_both_ways(family, shift, scale):
    """ATTACK: under-charging by the Zhu–Wang bound. The exact Poisson-subsampled 1-D mechanism's Rényi
    divergence, D_α((1−q)P + qQ ‖ P) and D_α(P ‖ (1−q)P + qQ), from exact pmfs at integer orders 2..40, never
    exceeds the family's subsampled curve (q tiny to q = 0.99; σ below 1)."""
    lp, lq = _log_pmfs(family, shift, scale)
    orders = np.arange(2, 41).astype(np.float64)
    if family == "discrete-gaussian":
        base = functools.partial(families.discrete_gaussian_rdp, l2=shift, sigma=scale)
    elif family == "laplace":
        base = functools.partial(families.pure_rdp, epsilon0=shift / scale)
    else:
        base = functools.partial(families.skellam_rdp, l1=shift, l2=shift, variance=scale * scale)
    for q in (1e-4, 0.01, 0.2, 0.99):
        bound = families.poisson_subsampled_rdp(orders, q, base)
        mixed = np.logaddexp(math.log1p(-q) + lp, math.log(q) + lq)
        for alpha, b in zip(orders, bound):
            exact = max(_renyi(mixed, lp, alpha), _renyi(lp, mixed, alpha))
            assert exact <= b * (1 + 1e-9) + 1e-12, (q, alpha)


def test_held_exact_samplers_match_their_tails():
    """ATTACK: inexact tails (the exactness claim beyond χ² in the bulk). P(|X| ≥ k) far out, on 2·10^6 draws,
    against the exact pmf (two-sided binomial, p > 1e-6): discrete Laplace t = 1 (k = 9), t = 2^10 (k = 9t),
    discrete Gaussian σ² = 1 (k = 4) and σ² = 4^5 (k = 4σ)."""
    rng = np.random.Generator(np.random.PCG64(99))
    n = 2_000_000
    cases = [("laplace", 1, 9), ("laplace", 1 << 10, 9 << 10), ("gauss", 1, 4), ("gauss", 4 ** 5, 4 << 5)]
    for kind, scale, k in cases:
        if kind == "laplace":
            x = samplers.discrete_laplace(rng, n, scale)
            r = math.exp(-1 / scale)
            tail = 2 * r ** k / (1 + r)  # P(|X| ≥ k) = 2 r^k (1 − r) / ((1 + r)(1 − r))
        else:
            x = samplers.discrete_gaussian(rng, n, scale)
            z = np.arange(0, 60 * int(math.sqrt(scale)) + 60)
            w = np.exp(-z.astype(float) ** 2 / (2 * scale))
            tail = 2 * float(w[k:].sum()) / (2 * float(w.sum()) - 1)
        count = int((np.abs(x) >= k).sum())
        assert stats.binomtest(count, n, tail).pvalue > 1e-6, (kind, scale, count, tail * n)


def test_held_floor_table_refuses_misnamed_families(tmp_path):
    """ATTACK: evading a [floor.families] table by case or spelling. With the table, 'Laplace', 'discrete_gaussian'
    and 'laplace ' are not named, so they are refused (family_not_allowed): fail-closed."""
    from tests.test_family_floors import FAMILY_POLICY, _policy

    policy = _policy(tmp_path, FAMILY_POLICY)
    for family in ("Laplace", "discrete_gaussian", "laplace "):
        with pytest.raises(ConfigError) as refused:
            check_family_floor(policy, family, [("c1", 50_000_000)])
        assert refused.value.code is Code.FAMILY_NOT_ALLOWED


def test_held_removing_a_unit_of_a_mixed_clip_group_moves_the_sum_within_its_delta():
    """ATTACK: units of one group with different C_i on one lattice (spacing from the group's std): removing a
    unit whose C_i is the group's largest, and one whose C_i is its smallest, moves the quantised sum by an
    integer vector of L2 norm ≤ that unit's own Δ₂ (from its own σ_u = min_g s_g / C_i, rounded down)."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from govtrain.resolver.model import describe
    from govtrain.resolver.profile import resolve
    from tests.test_materialized import _quantised_sum
    from tests.test_routing import CLASSES, batch, model

    net = model()
    resolution = resolve(CLASSES, describe(net))
    _, _, _, classes, _ = batch()
    clip = torch.tensor([0.05, 0.01, 0.08, 0.02, 0.03, 0.005], dtype=torch.float64)  # every example clipped
    privatizer = DiscreteGaussian(granularity_bits=5, beta_exp=40)
    privatizer.bind(sum(p.numel() for p in net.parameters() if p.requires_grad))
    group_std = {g.classes: 0.08 * (1.0 + 0.5 * k) for k, g in enumerate(resolution.groups) if g.classes}
    seeds = lambda i: 500 + i  # noqa: E731
    whole = _quantised_sum(net, resolution, privatizer, range(len(classes)), group_std, clip, seeds)
    for removed in (2, 5):
        rest = _quantised_sum(net, resolution, privatizer, [i for i in range(len(classes)) if i != removed],
                              group_std, clip, seeds)
        diff = torch.cat([(whole[n] - rest[n]).flatten() for n in whole])
        reached = [g for g in resolution.groups if classes[removed] in g.classes and g.classes in group_std]
        sigma_u = math.floor(min(group_std[g.classes] for g in reached) / float(clip[removed]) * units.MICRO)
        assert torch.equal(diff, torch.round(diff))
        assert 0 < float(diff.norm()) <= Lattice((5, 40, privatizer.dimension)).l2(sigma_u)
