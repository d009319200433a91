"""The Skellam privatizer: as the discrete Gaussian (L2 clipping, the lattice, Δ₂), with Skellam noise of the
same variance, Poisson(4^b / 2) − Poisson(4^b / 2) per coordinate: variance 4^b, a standard deviation of 2^b
lattice steps (`lattice.py`; accounting: Agarwal, Kairouz & Liu 2021, in `accounting.families`). Sums of Skellam
noise are Skellam, which is what makes it the distributed family; here it is drawn once, centrally.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from govtrain.privatizers.families.lattice import LatticePrivatizer

if TYPE_CHECKING:
    import numpy as np

__all__ = ["Skellam"]


class Skellam(LatticePrivatizer):
    name = "skellam"
    family = "skellam"

    def _draw(self, rng: "np.random.Generator", count: int) -> "np.ndarray":
        from govtrain.privatizers.families.samplers import skellam

        return skellam(rng, count, 1 << (2 * self.granularity_bits - 1))
