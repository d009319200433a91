"""Poisson sampling (DESIGN §5): every eligible unit (an example, or under privacy_unit = "contribution" a whole
contribution) joins a step's batch independently with probability q, so batches vary in size and may be empty
(the step then releases noise alone). A sampled contribution then uses at most a public number of its
examples, drawn uniformly without replacement (`take`).

Eligibility is decided by the caller from the ledger (admitted, not withdrawn, not retired) and
passed in per step: an example of a contribution withdrawn or retired before the step cannot be
drawn. The generator is seeded from the operating system's entropy; `insecure_seed` makes it
repeatable for tests and nothing else.
"""

from __future__ import annotations

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

    def sample(self, eligible: Sequence[int] | np.ndarray) -> np.ndarray:
        """The indices (a subset of `eligible`, in its order) drawn for one step."""
        eligible = np.asarray(eligible, dtype=np.int64)
        return eligible[self._rng.random(eligible.shape[0]) < self.sampling_rate]

    def take(self, members: Sequence[int] | np.ndarray, most: int) -> np.ndarray:
        """`most` of `members` (all of them if fewer), uniformly without replacement, in their order."""
        members = np.asarray(members, dtype=np.int64)
        if members.shape[0] <= most:
            return members
        return np.sort(members[self._rng.choice(members.shape[0], size=most, replace=False)])
