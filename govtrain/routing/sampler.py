"""Poisson sampling (docs/design.md §5): every eligible unit (an example, or under privacy_unit = "contribution"
a whole contribution) joins a step's batch independently with probability q, so batches vary in size and may be empty
(the step then releases noise alone). A sampled contribution then uses at most a public number of its
examples, drawn uniformly without replacement (`take`).

Eligibility is decided by the caller from the ledger (admitted, not withdrawn, not retired) and
passed in per step: an example of a contribution withdrawn or retired before the step cannot be
drawn. The generator is seeded from the operating system's entropy; `insecure_seed` makes it
repeatable for tests and nothing else.

**A step's draw is a function of the run's secret key and the step** (`key`, `at_step`): each unit of the
corpus gets its own uniform per step, from a generator seeded with HMAC-SHA-256(key, step), and joins if it
is below q. A step that is run again (after a kill, after leaving the run's `with` block mid-step, from a
copy of the run state) draws exactly the same batch, so no process can re-draw a step until it likes the
draw: rejection sampling the sampler would void the amplification the accountant charges for. The key is as
secret as the draws it decides (knowing which units a step drew voids amplification too): it lives only in
the run state (0600), never in a log, and goes with the state when the run ends.
"""

from __future__ import annotations

import hashlib
import hmac
from fractions import Fraction
from typing import Sequence

import numpy as np


class PoissonSampler:
    def __init__(self, sampling_rate: float, *, insecure_seed: int | None = None) -> None:
        if not 0 < sampling_rate <= 1:
            raise ValueError("the sampling rate must be in (0, 1]")
        self.sampling_rate = sampling_rate
        # SeedSequence() with no entropy argument draws 128 bits from the OS (secrets/urandom).
        seed = np.random.SeedSequence() if insecure_seed is None else np.random.SeedSequence(insecure_seed)
        self._rng = np.random.Generator(np.random.PCG64(seed))
        self.key: bytes | None = None  # the run's secret: with it, each step's draw is fixed by the step
        self._step_seed: int | None = None

    def at_step(self, step: int) -> None:
        """Draw step `step`'s batch next: with a `key`, the same step draws the same batch in any process."""
        if self.key is None:
            return
        digest = hmac.new(self.key, b"govtrain-poisson-step\0" + step.to_bytes(8, "big"), hashlib.sha256).digest()
        self._step_seed = int.from_bytes(digest, "big")
        self._rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(self._step_seed)))

    def sample(self, eligible: Sequence[int] | np.ndarray, *, units: int | None = None) -> np.ndarray:
        """The indices (a subset of `eligible`, in its order) drawn for one step. With `units` (how many units
        the corpus has; `eligible` indexes them), each unit gets its own uniform, so whether it joins does not
        depend on which others are eligible (a withdrawal between a step and its re-run moves no one else)."""
        eligible = np.asarray(eligible, dtype=np.int64)
        if units is None:
            return eligible[self._rng.random(eligible.shape[0]) < self.sampling_rate]
        return eligible[self._rng.random(units)[eligible] < self.sampling_rate]

    def take(self, members: Sequence[int] | np.ndarray, most: int, *, unit: int | None = None) -> np.ndarray:
        """`most` of `members` (all of them if fewer), uniformly without replacement, in their order. With a
        key and `unit` (the contribution's index), the choice is fixed by the step and the unit alone."""
        members = np.asarray(members, dtype=np.int64)
        if members.shape[0] <= most:
            return members
        rng = self._rng
        if self._step_seed is not None and unit is not None:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self._step_seed, unit])))
        return np.sort(members[rng.choice(members.shape[0], size=most, replace=False)])


_MIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def cyclic_parts(units: np.ndarray, cycle: int, partition_key: bytes) -> np.ndarray:
    """Each unit's part, in [0, cycle): a public keyed hash of the unit's own index alone (SplitMix64's finaliser on
    the index plus a seed from SHA-256 of `partition_key`), so it is fixed for the run and the same in every process.
    Only the Poisson draw inside a part is secret; which part a unit is in may be public, as the partition is
    independent of the data."""
    seed = np.uint64(int.from_bytes(hashlib.sha256(b"govtrain-cyclic-part\0" + partition_key).digest()[:8], "big"))
    with np.errstate(over="ignore"):
        x = np.asarray(units, dtype=np.uint64) * _MIX[0] + seed
        x = (x ^ (x >> np.uint64(30))) * _MIX[1]
        x = (x ^ (x >> np.uint64(27))) * _MIX[2]
        x = x ^ (x >> np.uint64(31))
    return (x % np.uint64(cycle)).astype(np.int64)


class CyclicPoissonSampler(PoissonSampler):
    """Cyclic Poisson sampling (b-min-separation), the participation banded MF's amplified accounting and BLT's
    multi-participation bound assume (`Participation(scheme="cyclic", cycle=b)`).

    Units are split into `cycle` parts by `cyclic_parts`, a public rule fixed for the run: a keyed hash of the unit's
    stable index (its position in the corpus of `units` units) and the run's public `partition_key` (e.g. its run
    id). Step t draws only from part t mod cycle, each eligible unit of it independently at rate min(1, cycle·q),
    so the expected batch is unchanged and a unit takes part at most once in any `cycle` consecutive steps.

    The part must not depend on who else is eligible. If it did (say, a unit's rank among the eligible, mod cycle),
    a withdrawal or retirement between two steps would move other units to other parts, and a unit moved from
    part j to part j+1 could be drawn at steps j and j+1: two participations one step apart, which the accounting
    (disjoint bands, or separation ≥ b) does not cover. It would also make one person's presence change everyone
    else's participation pattern, so neighbouring datasets would no longer differ in one unit's rows alone.

    The step must be set (`at_step`) before each `sample`: the step decides the part, and, with the run's secret
    `key`, the draw (as for `PoissonSampler`, a re-run of a step draws the same batch).

    cycle·q > 1 is refused unless `allow_rate_cap=True`: the part rate is then capped at 1, so the expected batch
    falls to N/cycle, below q·N. Privacy is not at stake (the banded charge composes at min(1, cycle·q), the rate
    drawn), but the run would train on smaller batches than its configuration says."""

    def __init__(self, sampling_rate: float, *, cycle: int, partition_key: bytes | None,
                 insecure_seed: int | None = None, allow_rate_cap: bool = False) -> None:
        """`partition_key` None: set it (`partition_key = ...`) before the first `sample`, as a run does once its
        run id is known (a resumed run sets the same id, so its units stay in their parts)."""
        super().__init__(sampling_rate, insecure_seed=insecure_seed)
        if type(cycle) is not int or cycle < 1:
            raise ValueError("the cycle must be a positive int")
        if cycle * Fraction(sampling_rate) > 1 and not allow_rate_cap:
            raise ValueError(f"cycle·q = {cycle}·{sampling_rate} > 1: each part would be drawn whole and the expected "
                             f"batch would drop from q·N to N/{cycle}; lower q or the cycle (bands), or pass "
                             "allow_rate_cap=True")
        self.cycle = cycle
        self.partition_key = None if partition_key is None else bytes(partition_key)
        self._step: int | None = None

    @property
    def part_rate(self) -> float:
        """Each part member's rate, min(1, cycle·q), at the rate the sampler draws at now (a run sets q per epoch)."""
        return min(1.0, self.cycle * self.sampling_rate)

    def at_step(self, step: int) -> None:
        self._step = step
        super().at_step(step)

    def sample(self, eligible: Sequence[int] | np.ndarray, *, units: int | None = None) -> np.ndarray:
        """The eligible units of part (step mod cycle) drawn at rate min(1, cycle·q), in `eligible`'s order. With
        `units`, each unit of the corpus gets its own uniform, as in `PoissonSampler.sample`."""
        if self._step is None:
            raise RuntimeError("call at_step(step) before sample: the step decides which part is drawn")
        if self.partition_key is None:
            raise RuntimeError("set the partition key (the run's id) before sample: it decides each unit's part")
        eligible = np.asarray(eligible, dtype=np.int64)
        uniforms = self._rng.random(eligible.shape[0]) if units is None else self._rng.random(units)[eligible]
        in_part = cyclic_parts(eligible, self.cycle, self.partition_key) == self._step % self.cycle
        return eligible[in_part & (uniforms < self.part_rate)]
