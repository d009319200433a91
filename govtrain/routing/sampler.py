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
