"""The Laplace privatizer: each clipping unit clipped in L1 to its C_i, the clipped gradient quantised to the
noise group's lattice, and the discrete Laplace of scale 2^b lattice steps (= s_g) added per coordinate: pure ε
per step, Δ₁ / 2^b ≈ 1/σ (σ = s_g / C_i) plus the rounding's share (`accounting.families`).

A continuous Laplace in floating point would leak the exact sum through the low bits of its output (Mironov
2012); on the lattice every output is an integer multiple of the public spacing γ_g (`lattice.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from govtrain.privatizers.families.lattice import LatticePrivatizer

if TYPE_CHECKING:
    import numpy as np

__all__ = ["Laplace"]


class Laplace(LatticePrivatizer):
    name = "laplace"
    family = "laplace"
    norm: ClassVar[str] = "l1"

    def _draw(self, rng: "np.random.Generator", count: int) -> "np.ndarray":
        from govtrain.privatizers.families.samplers import discrete_laplace

        return discrete_laplace(rng, count, 1 << self.granularity_bits)
