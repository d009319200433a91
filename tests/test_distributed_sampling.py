"""Each rank's share of a step's draw (govtrain/distributed/shares.py, docs/distributed.md#sampling-one-draw-disjoint-shares).

The lead draws each step once (Poisson, from the run's key) and rank r takes the r-th contiguous slice of the drawn
units. Measured over many steps of the sampler the run uses: the shares are disjoint and their union is the draw;
each unit's inclusion rate is q; and each pair's joint inclusion rate is q² (independence). Which rank a drawn unit
lands on depends on the rest of the draw (its position in it), but it is internal: the ranks' sums are summed before
anything is released. Oracles: the binomial's normal
approximation with a Bonferroni correction over the tests made.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from govtrain.distributed.shares import bounds, share
from govtrain.routing.sampler import PoissonSampler, unit_identities

UNITS, STEPS, Q = 24, 10_000, 0.3


@pytest.mark.parametrize("count", [0, 1, 5, 7, 8])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_the_slices_partition_the_units_in_order_and_differ_by_at_most_one(count, size):
    units = list(range(100, 100 + count))
    slices = [share(units, size, r) for r in range(size)]
    assert [u for part in slices for u in part] == units  # disjoint, nothing dropped, in the draw's order
    assert max(map(len, slices)) - min(map(len, slices)) <= 1
    assert [bounds(count, size, r) for r in range(size)] == [
        (sum(map(len, slices[:r])), sum(map(len, slices[:r + 1]))) for r in range(size)]


@pytest.mark.parametrize("size", [1, 2])
def test_a_rank_outside_the_world_has_no_share(size):
    with pytest.raises(ValueError):
        bounds(5, size, size)
    with pytest.raises(ValueError):
        bounds(5, size, -1)


def _shares(size: int) -> np.ndarray:
    """[STEPS, UNITS] of the rank each unit trained on at each step (-1: not drawn), through the run's sampler."""
    sampler = PoissonSampler(Q)
    sampler.key = bytes(range(32))
    ranks = np.full((STEPS, UNITS), -1, dtype=np.int64)
    identities = unit_identities(str(unit) for unit in range(UNITS))
    for step in range(STEPS):
        sampler.at_step(step)
        drawn = sampler.sample(np.arange(UNITS), identities=identities).tolist()
        seen: list[int] = []
        for rank in range(size):
            mine = share(drawn, size, rank)
            assert not set(mine) & set(seen)  # no unit on two ranks
            seen += mine
            ranks[step, mine] = rank
        assert seen == drawn  # the union is the lead's draw
    return ranks


def _z(observed: float, p: float, n: int) -> float:
    return abs(observed - p) / math.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("size", [2, 3])
def test_inclusion_is_q_and_pairwise_inclusion_is_q_squared_across_ranks(size):
    ranks = _shares(size)
    included = ranks >= 0
    pairs = list(itertools.combinations(range(UNITS), 2))
    tests = UNITS + len(pairs)
    bound = 3.0 + math.sqrt(2 * math.log(tests))  # Bonferroni over every test here, at well under 1e-3 overall
    for unit in range(UNITS):
        assert _z(included[:, unit].mean(), Q, STEPS) < bound, unit
    for i, j in pairs:  # independence: P(i and j drawn) = q²
        assert _z((included[:, i] & included[:, j]).mean(), Q * Q, STEPS) < bound, (i, j)


def test_the_draw_is_the_same_for_any_number_of_ranks():
    """A run resumed with another number of processes draws the same units: the draw is the lead's."""
    union = [(_shares(size)[:200] >= 0) for size in (1, 2, 3)]
    assert all(np.array_equal(union[0], other) for other in union[1:])
