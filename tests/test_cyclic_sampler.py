"""CyclicPoissonSampler (govtrain/routing/sampler.py): b-min-separation, the per-step inclusion rate, re-runs draw
the same batch, and the partition depends on nothing but the unit and the public partition key."""

from __future__ import annotations

import math

import numpy as np
import pytest

from govtrain.routing.sampler import CyclicPoissonSampler, PoissonSampler, cyclic_parts

KEY = bytes(range(32))
RUN_ID = b"run-0001"


def _sampler(q=0.01, cycle=8) -> CyclicPoissonSampler:
    sampler = CyclicPoissonSampler(q, cycle=cycle, partition_key=RUN_ID)
    sampler.key = KEY
    return sampler


def _draws(sampler, steps, units, eligible=None):
    eligible = np.arange(units) if eligible is None else eligible
    out = []
    for t in range(steps):
        sampler.at_step(t)
        out.append(sampler.sample(eligible, units=units))
    return out


def test_a_unit_never_takes_part_twice_within_a_cycle():
    cycle, units = 8, 4000
    last = {}
    for t, batch in enumerate(_draws(_sampler(q=0.1, cycle=cycle), 200, units)):  # rate 0.8 in the part
        for unit in batch.tolist():
            assert t - last.get(unit, -cycle) >= cycle
            last[unit] = t
    assert len(last) > 0.9 * units


def test_inclusion_rate_is_cycle_times_q_in_the_units_part_and_zero_elsewhere():
    q, cycle, units, steps = 0.01, 8, 20_000, 160
    sampler = _sampler(q=q, cycle=cycle)
    parts = cyclic_parts(np.arange(units), cycle, RUN_ID)
    drawn = trials = 0
    for t, batch in enumerate(_draws(sampler, steps, units)):
        assert np.all(parts[batch] == t % cycle)  # only part t mod cycle is ever drawn
        drawn += batch.shape[0]
        trials += int(np.sum(parts == t % cycle))
    rate = cycle * q
    # drawn ~ Binomial(trials, cycle·q): within 5 standard errors (a false alarm has p < 1e-6)
    assert abs(drawn / trials - rate) <= 5 * math.sqrt(rate * (1 - rate) / trials)
    # the expected batch equals plain Poisson's q · units
    assert drawn / steps == pytest.approx(q * units, rel=0.05)


def test_parts_are_balanced_and_independent_of_eligibility():
    cycle, units = 16, 32_000
    parts = cyclic_parts(np.arange(units), cycle, RUN_ID)
    counts = np.bincount(parts, minlength=cycle)
    expected = units / cycle
    chi2 = float(np.sum((counts - expected) ** 2 / expected))
    assert chi2 < 44.3  # χ²(15) upper 0.0001 quantile
    subset = np.arange(0, units, 7)
    assert np.array_equal(cyclic_parts(subset, cycle, RUN_ID), parts[subset])
    assert not np.array_equal(cyclic_parts(np.arange(units), cycle, b"another-run"), parts)


def test_a_step_run_again_draws_the_same_batch():
    units = 5000
    first = _draws(_sampler(), 40, units)
    again = _sampler()
    for t in reversed(range(40)):  # any order, any process with the key
        again.at_step(t)
        assert np.array_equal(again.sample(np.arange(units), units=units), first[t])
    # a withdrawal between a step and its re-run moves no one else
    withdrawn = np.setdiff1d(np.arange(units), first[3][:5])
    rerun = _sampler()
    rerun.at_step(3)
    assert np.array_equal(rerun.sample(withdrawn, units=units), first[3][5:])


def test_cycle_one_is_plain_poisson_sampling():
    plain = PoissonSampler(0.05)
    plain.key = KEY
    cyclic = CyclicPoissonSampler(0.05, cycle=1, partition_key=RUN_ID)
    cyclic.key = KEY
    for t in range(5):
        plain.at_step(t)
        cyclic.at_step(t)
        assert np.array_equal(plain.sample(np.arange(3000), units=3000), cyclic.sample(np.arange(3000), units=3000))


def test_misuse_is_refused():
    with pytest.raises(ValueError):
        CyclicPoissonSampler(0.01, cycle=0, partition_key=RUN_ID)
    with pytest.raises(RuntimeError):
        CyclicPoissonSampler(0.01, cycle=4, partition_key=RUN_ID).sample(np.arange(10), units=10)
    with pytest.raises(ValueError, match="expected batch would drop"):  # cycle·q > 1: a smaller batch than asked
        CyclicPoissonSampler(0.5, cycle=4, partition_key=RUN_ID)
    assert CyclicPoissonSampler(0.25, cycle=4, partition_key=RUN_ID).part_rate == 1.0  # cycle·q = 1 exactly
    sampler = CyclicPoissonSampler(0.5, cycle=4, partition_key=RUN_ID, allow_rate_cap=True)
    assert sampler.part_rate == 1.0  # min(1, cycle·q), when allowed
