"""The Skellam privatizer: as the discrete Gaussian (L2 clipping, the lattice, Δ₂), with Skellam noise of the
same variance, Poisson(4^b / 2) − Poisson(4^b / 2) per coordinate: variance 4^b, a standard deviation of 2^b
lattice steps (`lattice.py`; accounting: Agarwal, Kairouz & Liu 2021, in `accounting.families`). Sums of Skellam
noise are Skellam, which is what makes it the distributed family; here it is drawn once, centrally.

Its granularity is at most `SKELLAM_MAX_BITS` (8; also its default): above it numpy's Poisson sampler, computed
in double, is not the exact pmf the accountant assumes (`accounting.families`), so a larger b is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from govtrain.accounting.families import SKELLAM_MAX_BITS, check_skellam_bits
from govtrain.privatizers.families.lattice import DEFAULT_BETA_EXP, LatticePrivatizer

if TYPE_CHECKING:
    import numpy as np

__all__ = ["Skellam"]


class Skellam(LatticePrivatizer):
    name = "skellam"
    family = "skellam"

    def __init__(self, *, granularity_bits: int = SKELLAM_MAX_BITS, beta_exp: int = DEFAULT_BETA_EXP,
                 dimension: int | None = None, insecure_seed: int | None = None) -> None:
        super().__init__(granularity_bits=granularity_bits, beta_exp=beta_exp, dimension=dimension,
                         insecure_seed=insecure_seed)
        check_skellam_bits(granularity_bits)

    def _draw(self, rng: "np.random.Generator", count: int) -> "np.ndarray":
        from govtrain.privatizers.families.samplers import skellam

        return skellam(rng, count, 1 << (2 * self.granularity_bits - 1))
