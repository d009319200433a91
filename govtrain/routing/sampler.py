"""Poisson sampling (DESIGN §5): every eligible example joins a step's batch independently with
probability q, so batches vary in size and may be empty (the step then releases noise alone).

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
