"""Correlated noise by matrix factorization (docs/privatizers.md, "Matrix factorization"): banded Toeplitz
(`BandedMF`, "banded-mf") and buffered linear Toeplitz (`BLT`, "blt") strategies optimised for the run's horizon,
their streamed noise (O(bands) secret state per slot), participation and charge.

    toeplitz   the strategies' algebra from their first column: C⁻¹, prefix-sum error, min-separated sensitivity
    optimize   the horizon's strategy: banded coefficients, BLT decays and weights
    stream     keyed draws, per-slot recurrence state, resume
    banded     BandedMF: amplified, DP-SGD over ⌈T/b⌉ rounds
    blt        BLT: unamplified, multi-participation bound
    charge     what a record charges, without torch (the verifier's path)

The classes are imported on first use, so that `govtrain.privatizers.mf.charge` stays free of torch.
"""

from typing import Any

__all__ = ["BLT", "BandedMF"]


def __getattr__(name: str) -> Any:
    if name == "BandedMF":
        from govtrain.privatizers.mf.banded import BandedMF

        return BandedMF
    if name == "BLT":
        from govtrain.privatizers.mf.blt import BLT

        return BLT
    raise AttributeError(name)
