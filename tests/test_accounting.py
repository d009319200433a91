"""Accountants: golden epsilons pinned from dp-accounting's PLD accountant and cross-checked."""

from __future__ import annotations

import math

import pytest

from govtrain import units
from govtrain.accounting import Bucket, PLDAccountant, PRVAccountant, RDPAccountant, spend_epsilon_u

DELTA = 1e-5
# dp-accounting 0.6.0 PLD accountant (value_discretization_interval 1e-4), delta 1e-5, printed this session.
GOLDEN = {
    (0.001, 0.6, 100): 0.779594072, (0.001, 0.6, 1000): 1.425263733, (0.001, 0.6, 10000): 2.456182619,
    (0.001, 1.0, 100): 0.055174691, (0.001, 1.0, 1000): 0.148955844, (0.001, 1.0, 10000): 0.475987014,
    (0.001, 2.0, 100): 0.014668462, (0.001, 2.0, 1000): 0.050137038, (0.001, 2.0, 10000): 0.173846977,
    (0.01, 0.6, 100): 3.815599215, (0.01, 0.6, 1000): 7.433616103, (0.01, 0.6, 10000): 23.017587249,
    (0.01, 1.0, 100): 0.718036710, (0.01, 1.0, 1000): 1.828243646, (0.01, 1.0, 10000): 6.187744997,
    (0.01, 2.0, 100): 0.189799062, (0.01, 2.0, 1000): 0.622048525, (0.01, 2.0, 10000): 2.162773645,
    (0.1, 0.6, 100): 20.573804349, (0.1, 0.6, 1000): 78.648523320, (0.1, 0.6, 10000): 461.266372016,
    (0.1, 1.0, 100): 7.046602877, (0.1, 1.0, 1000): 25.204555193, (0.1, 1.0, 10000): 127.878977678,
    (0.1, 2.0, 100): 2.337400192, (0.1, 2.0, 1000): 8.279293380, (0.1, 2.0, 10000): 36.003697929,
}
# prv-accountant 0.2.0 raises ("discrete mean differs from continuous mean") for q = 0.1, sigma = 0.6.
PRV_RAISES = {(0.1, 0.6, 100), (0.1, 0.6, 1000), (0.1, 0.6, 10000)}


# The long tier holds the three points of 10,000 steps at the largest epsilons (each 15-30 s of PLD convolutions on
# 2 cores); the default tier keeps the other 24, which hold every q, sigma and step count of the grid.
LONG_POINTS = {(0.1, 1.0, 10000), (0.1, 2.0, 10000), (0.01, 0.6, 10000)}


@pytest.mark.parametrize("point", [point if point not in LONG_POINTS else pytest.param(point, marks=pytest.mark.long)
                                   for point in sorted(GOLDEN)], ids=str)
def test_golden_grid(point):
    q, sigma, steps = point
    buckets = [Bucket(q, sigma, steps)]
    pld = PLDAccountant().epsilon(buckets, DELTA)
    assert pld.epsilon_u == math.ceil(GOLDEN[point] * 1e6) or abs(pld.epsilon_u - GOLDEN[point] * 1e6) <= 2
    assert RDPAccountant().epsilon(buckets, DELTA).epsilon >= pld.epsilon  # RDP is never tighter than PLD
    if point in PRV_RAISES:
        return
    prv = PRVAccountant().epsilon(buckets, DELTA)
    assert prv.fallback is None and prv.lower <= prv.estimate <= prv.epsilon
    assert abs(prv.estimate - GOLDEN[point]) <= 0.01 * GOLDEN[point]


@pytest.mark.parametrize("steps", [100, 1000])
def test_prv_falls_back_to_pld_where_it_raises(steps):
    result = PRVAccountant().epsilon([Bucket(0.1, 0.6, steps)], DELTA)
    assert result.fallback is not None and result.fallback.startswith("pld")
    assert result.epsilon_u == PLDAccountant().epsilon([Bucket(0.1, 0.6, steps)], DELTA).epsilon_u


def test_prv_with_its_rdp_remembered_is_bitwise_the_library():
    """`PRVAccountant` remembers the mechanism's RDP at each order per (q, sigma) (the domain bound prv-accountant
    recomputes on every call); its bounds and estimate are bitwise the library's own, called afresh, for one bucket
    and heterogeneous compositions, steps searched at a fixed (q, sigma) as a run's planner does, asked twice."""
    from prv_accountant import PoissonSubsampledGaussianMechanism
    from prv_accountant import PRVAccountant as Library

    def library(key):
        accountant = Library(prvs=[PoissonSubsampledGaussianMechanism(noise_multiplier=s, sampling_probability=q)
                                   for q, s, _ in key], max_self_compositions=[t for *_, t in key],
                             eps_error=0.01, delta_error=1e-10)
        return accountant.compute_epsilon(delta=DELTA, num_self_compositions=[t for *_, t in key])

    keys = [((0.25, 1.0, k),) for k in (1, 3, 8)] + [
        ((0.01, 1.0, 100),), ((0.5, 0.8, 10),),
        ((0.01, 1.0, 50), (0.01, 2.0, 30)), ((0.05, 0.9, 7), (0.25, 1.0, 3), (0.5, 1.5, 2))]
    for key in keys + keys[:2]:
        lower, estimate, upper = library(key)
        ours = PRVAccountant().epsilon([Bucket(*b) for b in key], DELTA)
        assert ours.fallback is None, key
        assert (ours.lower, ours.estimate, ours.epsilon_u) == (lower, estimate, units.spent_eps_u(float(upper))), key


def test_heterogeneous_composition_matches_the_library():
    from dp_accounting import dp_event, pld, rdp

    history = [Bucket(0.01, 1.0, 500), Bucket(0.01, 2.0, 300)]
    event = dp_event.ComposedDpEvent([
        dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(0.01, dp_event.GaussianDpEvent(1.0)), 500),
        dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(0.01, dp_event.GaussianDpEvent(2.0)), 300),
    ])
    for interval in (1e-3, 1e-4):  # the default, and a coarser one: the same float operations as the library
        library = pld.PLDAccountant(value_discretization_interval=interval)
        library.compose(event)
        expected = library.get_epsilon(DELTA)
        ours = PLDAccountant(value_discretization_interval=interval).epsilon(history, DELTA)
        assert ours.epsilon_u == math.ceil(expected * 1e6)
    fine = expected
    rdp_library = rdp.RdpAccountant()
    rdp_library.compose(event)
    assert RDPAccountant().epsilon(history, DELTA).epsilon_u == math.ceil(rdp_library.get_epsilon(DELTA) * 1e6)
    prv = PRVAccountant().epsilon(history, DELTA)
    assert abs(prv.estimate - fine) <= 0.01 * fine
    # Order and splitting change PLD's float rounding only; prv and rdp merge buckets, so not at all.
    split = [Bucket(0.01, 2.0, 100), Bucket(0.01, 1.0, 500), Bucket(0.01, 2.0, 200)]
    assert abs(PLDAccountant().epsilon(split, DELTA).epsilon - ours.epsilon) <= 1e-4 * ours.epsilon
    assert RDPAccountant().epsilon(split, DELTA) == RDPAccountant().epsilon(history, DELTA)


def test_q_zero_buckets_cost_nothing():
    history = [Bucket(0.01, 1.0, 1000)]
    with_free = history + [Bucket(0.0, 1.0, 5000), Bucket(0.5, 1.0, 0)]
    for accountant in (PLDAccountant(), RDPAccountant(), PRVAccountant()):
        assert accountant.epsilon(with_free, DELTA).epsilon_u == accountant.epsilon(history, DELTA).epsilon_u
        assert accountant.epsilon([Bucket(0.0, 1.0, 10)], DELTA).epsilon_u == 0


def test_spend_seam_rounds_up_in_micro_units():
    value = spend_epsilon_u("pld", 10_000_000, [(10_000, 1_000_000, 1000)])
    assert value == math.ceil(PLDAccountant().epsilon([Bucket(0.01, 1.0, 1000)], DELTA).epsilon * 1e6)
    exact = PLDAccountant()._bucket((0.01, 1.0, 1000)).get_epsilon_for_delta(DELTA)
    assert value == math.ceil(exact * 1e6) and value - 1 < exact * 1e6 <= value
    with pytest.raises(ValueError):
        spend_epsilon_u("moments", 10_000_000, [(10_000, 1_000_000, 1000)])


def test_verifier_recomputes_spend_with_a_real_accountant(corpus):
    from govtrain.errors import IntegrityError
    from govtrain.verify.verifier import verify_ledger
    from tests.test_signed_ledger import _admit, _spend

    _admit(corpus, "acct")
    implied = spend_epsilon_u("prv", 10_000_000, [(10_000, 1_000_000, 10)])
    _spend(corpus, "acct", eps_u=implied, steps=10)
    assert verify_ledger(corpus.url, accountant=spend_epsilon_u).spend_recomputed
    with corpus.open() as ledger:
        ledger.close_epoch(now=corpus.now)
    _spend(corpus, "acct", eps_u=implied, steps=10)  # a second epoch of steps recorded as free
    with pytest.raises(IntegrityError) as info:
        verify_ledger(corpus.url, accountant=spend_epsilon_u)
    assert info.value.code.value == "bad_spend"


def test_the_verifier_recomputes_spend_by_default_without_importing_torch(corpus):
    import subprocess
    import sys

    from tests.test_signed_ledger import _admit, _spend

    _admit(corpus, "acct")
    _spend(corpus, "acct", eps_u=spend_epsilon_u("prv", 10_000_000, [(10_000, 1_000_000, 10)]), steps=10)
    code = ("import sys\nfrom govtrain.verify.verifier import verify_ledger\n"
            f"report = verify_ledger({corpus.url!r})\n"
            "assert report.spend_recomputed, report\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'the verifier imported torch'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
