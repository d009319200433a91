"""CyclicPoissonSampler (govtrain/routing/sampler.py): b-min-separation, the per-step inclusion rate, re-runs draw
the same batch, and the partition depends on nothing but the unit and the public partition key."""

from __future__ import annotations

import math

import numpy as np
import pytest

from govtrain.routing.sampler import CyclicPoissonSampler, PoissonSampler, cyclic_parts, unit_identities

KEY = bytes(range(32))
RUN_ID = b"run-0001"


def _ids(units: int) -> np.ndarray:
    """The identities of units named "0", "1", ...: a fixed corpus, nothing withdrawn or admitted."""
    return unit_identities(str(i) for i in range(units))


def _sampler(q=0.01, cycle=8) -> CyclicPoissonSampler:
    sampler = CyclicPoissonSampler(q, cycle=cycle, partition_key=RUN_ID)
    sampler.key = KEY
    return sampler


def _draws(sampler, steps, units, eligible=None):
    eligible = np.arange(units) if eligible is None else eligible
    identities = _ids(units)
    out = []
    for t in range(steps):
        sampler.at_step(t)
        out.append(sampler.sample(eligible, identities=identities))
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
    parts = cyclic_parts(_ids(units), cycle, RUN_ID)
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
    parts = cyclic_parts(_ids(units), cycle, RUN_ID)
    counts = np.bincount(parts, minlength=cycle)
    expected = units / cycle
    chi2 = float(np.sum((counts - expected) ** 2 / expected))
    assert chi2 < 44.3  # χ²(15) upper 0.0001 quantile
    subset = np.arange(0, units, 7)
    assert np.array_equal(cyclic_parts(_ids(units)[subset], cycle, RUN_ID), parts[subset])
    assert not np.array_equal(cyclic_parts(_ids(units), cycle, b"another-run"), parts)


def test_a_step_run_again_draws_the_same_batch():
    units = 5000
    first = _draws(_sampler(), 40, units)
    again = _sampler()
    for t in reversed(range(40)):  # any order, any process with the key
        again.at_step(t)
        assert np.array_equal(again.sample(np.arange(units), identities=_ids(units)), first[t])
    # a withdrawal between a step and its re-run moves no one else
    withdrawn = np.setdiff1d(np.arange(units), first[3][:5])
    rerun = _sampler()
    rerun.at_step(3)
    assert np.array_equal(rerun.sample(withdrawn, identities=_ids(units)), first[3][5:])


def test_cycle_one_is_plain_poisson_sampling():
    plain = PoissonSampler(0.05)
    plain.key = KEY
    cyclic = CyclicPoissonSampler(0.05, cycle=1, partition_key=RUN_ID)
    cyclic.key = KEY
    for t in range(5):
        plain.at_step(t)
        cyclic.at_step(t)
        assert np.array_equal(plain.sample(np.arange(3000), identities=_ids(3000)),
                              cyclic.sample(np.arange(3000), identities=_ids(3000)))


def test_misuse_is_refused():
    with pytest.raises(ValueError):
        CyclicPoissonSampler(0.01, cycle=0, partition_key=RUN_ID)
    with pytest.raises(RuntimeError):
        CyclicPoissonSampler(0.01, cycle=4, partition_key=RUN_ID).sample(np.arange(10), identities=_ids(10))
    with pytest.raises(ValueError, match="expected batch would drop"):  # cycle·q > 1: a smaller batch than asked
        CyclicPoissonSampler(0.5, cycle=4, partition_key=RUN_ID)
    assert CyclicPoissonSampler(0.25, cycle=4, partition_key=RUN_ID).part_rate == 1.0  # cycle·q = 1 exactly
    sampler = CyclicPoissonSampler(0.5, cycle=4, partition_key=RUN_ID, allow_rate_cap=True)
    assert sampler.part_rate == 1.0  # min(1, cycle·q), when allowed


# -- issue 34 item 1: every per-unit decision is keyed by the unit's identity, never its position -------------------

NAMES = [f"contribution-{i:03d}/{row}" for i in range(300) for row in range(4)]


def _by_name(names, step, sampler, cycle=None):  # type: ignore[no-untyped-def]
    """{name: (its uniform, its part)} at `step`, the corpus being `names` in that order."""
    identities = unit_identities(names)
    sampler.at_step(step)
    uniforms = sampler.uniforms(identities)
    parts = cyclic_parts(identities, cycle, RUN_ID) if cycle else [None] * len(names)
    return {n: (float(u), None if p is None else int(p)) for n, u, p in zip(names, uniforms, parts)}


def test_a_units_part_and_uniform_do_not_change_when_others_come_go_or_move():
    """The corpus a resume rebuilds: the first unit withdrawn, new ones admitted before and after the others, and the
    order changed (another order of the data files): every remaining unit keeps its part and its uniform at every
    step, so it is drawn exactly when it would have been."""
    generator = np.random.default_rng(7)
    rebuilt = [f"admitted-{i}/0" for i in range(40)] + NAMES[4:] + [f"zz-{i}/1" for i in range(40)]
    rebuilt = [rebuilt[i] for i in generator.permutation(len(rebuilt))]
    for step in (0, 3, 17):
        before, after = _by_name(NAMES, step, _sampler(cycle=4), 4), _by_name(rebuilt, step, _sampler(cycle=4), 4)
        assert all(after[n] == before[n] for n in NAMES[4:])
    # and so the draw, by name: a unit is drawn in the rebuilt corpus exactly when it was in the first one
    sampler = _sampler(q=0.2, cycle=4)
    for step in range(8):
        sampler.at_step(step)
        first = {NAMES[i] for i in sampler.sample(np.arange(len(NAMES)), identities=unit_identities(NAMES))}
        again = {rebuilt[i] for i in sampler.sample(np.arange(len(rebuilt)), identities=unit_identities(rebuilt))}
        assert first - set(NAMES[:4]) == again - {n for n in rebuilt if n not in NAMES}
        assert first  # a part at rate 0.8 of ~300 units is never empty


def test_the_uniforms_are_keyed_uniform_and_independent_of_the_units_name_order():
    identities = _ids(20_000)
    sampler = _sampler()
    sampler.at_step(5)
    u = sampler.uniforms(identities)
    assert u.min() >= 0 and u.max() < 1 and abs(u.mean() - 0.5) < 5 * math.sqrt(1 / 12 / u.size)
    # a 10-bin χ² (9 dof, upper 0.0001 quantile 33.7) and no correlation between neighbours
    counts = np.bincount((u * 10).astype(int), minlength=10)
    assert float(np.sum((counts - 2000) ** 2 / 2000)) < 33.7
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 5 / math.sqrt(u.size)
    sampler.at_step(6)
    assert not np.array_equal(sampler.uniforms(identities), u)  # another step, other uniforms
    other = PoissonSampler(0.01)
    other.key = bytes(32)
    other.at_step(5)
    assert not np.array_equal(other.uniforms(identities), u)  # another key, other uniforms
    assert np.array_equal(sampler.uniforms(identities[::-1])[::-1], sampler.uniforms(identities))


def test_take_is_keyed_by_the_contributions_identity():
    """The examples a drawn contribution brings depend on the key, the step and its identity: not on its position
    among the contributions (which a withdrawal before it changes)."""
    sampler = PoissonSampler(0.5)
    sampler.key = KEY
    identities = unit_identities(["alpha", "beta", "gamma"])
    sampler.at_step(2)
    chosen = sampler.take(np.arange(100, 140), 4, identity=identities[2])
    again = PoissonSampler(0.5)
    again.key = KEY
    again.at_step(2)
    assert np.array_equal(again.take(np.arange(100, 140), 4, identity=unit_identities(["gamma"])[0]), chosen)
    assert not np.array_equal(again.take(np.arange(100, 140), 4, identity=identities[1]), chosen)
    with pytest.raises(ValueError, match="identity"):  # a keyed take never falls back to anything positional
        again.take(np.arange(100, 140), 4)


def test_a_keyed_draw_refuses_positions():
    sampler = _sampler()
    sampler.at_step(0)
    with pytest.raises(ValueError, match="identity"):
        sampler.sample(np.arange(10))
    plain = PoissonSampler(0.5)
    plain.key = KEY
    plain.at_step(0)
    with pytest.raises(ValueError, match="identity"):
        plain.sample(np.arange(10))
    with pytest.raises(ValueError, match="positions"):
        cyclic_parts(np.arange(10), 4, RUN_ID)
