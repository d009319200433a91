"""The discrete Gaussian privatizer: each clipping unit clipped in L2 to its C_i, quantised to the noise group's
lattice (conditional randomised rounding, L2 bound Δ₂), and N_Z(0, 4^b) added per coordinate by the exact
Canonne–Kamath–Steinke sampler: a standard deviation of 2^b lattice steps, s_g in the gradient's units
(`lattice.py`; accounting: `accounting.families`, α Δ₂² / (2 · 4^b) per step before subsampling).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from govtrain.privatizers.families.lattice import LatticePrivatizer

if TYPE_CHECKING:
    import numpy as np

__all__ = ["DiscreteGaussian"]


class DiscreteGaussian(LatticePrivatizer):
    name = "discrete-gaussian"
    family = "discrete-gaussian"

    def _draw(self, rng: "np.random.Generator", count: int) -> "np.ndarray":
        from govtrain.privatizers.families.samplers import discrete_gaussian

        return discrete_gaussian(rng, count, 1 << (2 * self.granularity_bits))
