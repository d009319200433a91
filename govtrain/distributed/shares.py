"""Each rank's share of a step's draw (docs/distributed.md, sampling).

The lead draws the step once (`Run._draw`: one Poisson draw from the run's secret sampling key, which only the
lead holds) and broadcasts the drawn units: example indices, or a contribution's taken examples, in the order of
their identities (contribution id, then row index: never their place in the corpus, which a withdrawal or a resume
changes). Rank r takes the r-th of `size` contiguous, disjoint slices of each microbatch's units, so the ranks'
shares partition the draw exactly: no unit is clipped twice or dropped, and each unit's inclusion is the single draw's, independent
across units as Poisson sampling makes it (tests/test_distributed_sampling.py measures pairwise inclusion).
"""

from __future__ import annotations

from typing import Sequence, TypeVar

T = TypeVar("T")

__all__ = ["bounds", "share"]


def bounds(count: int, size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of rank `rank`'s slice of `count` units over `size` ranks: the first count % size ranks take
    one more, so no two slices differ by more than one unit."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in [0, {size})")
    base, extra = divmod(count, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def share(units: Sequence[T], size: int, rank: int) -> list[T]:
    """Rank `rank`'s slice of `units` (`bounds`)."""
    start, stop = bounds(len(units), size, rank)
    return list(units[start:stop])
