"""Banded matrix factorization ("banded-mf"): correlated noise from a b-banded Toeplitz strategy, amplified by
cyclic Poisson sampling (Choquette-Choo et al., arXiv 2306.08153; jax_privacy's `amplified_bandmf_event`).

Strategy: C[i, j] = c_{i-j} for 0 ≤ i-j < b, else 0, with c optimised for the run's horizon T to minimise the mean
squared error of the T prefix sums at unit sensitivity (`optimize.banded_column`), and scaled so that ‖c‖ ≤ 1
exactly in the recorded integers (Σ c_p² ≤ 10²⁴): every column of C, hence the sensitivity of one participation,
has norm ≤ 1. The noise w = C⁻¹z̃ is streamed by forward substitution, w_t = (z̃_t - Σ_{k=1}^{b-1} c_k w_{t-k}) / c_0,
with the last b-1 values per slot in a float64 ring buffer (`stream.py` for the keys, the scale s_t and resume). The
recurrence multiplies by float64 coefficients rounded toward zero from the recorded integers, so the strategy it
applies keeps Σ c² ≤ 1 exactly too, whatever the slot's dtype (only the released noise is cast to it). A record
whose c(x) = Σ c_k x^k has a root with |x| ≤ 1 is refused: C⁻¹'s column is the power series of 1/c(x), which then
grows without bound (decided in exact integers, `toeplitz.no_root_in_closed_unit_disc`).

Participation and charge. The sampler is cyclic with cycle b (`CyclicPoissonSampler`): units are split into b parts
by a public rule, step t draws from part t mod b only, each unit at rate min(1, b·q). A unit's participations are
then ≥ b steps apart, so they touch disjoint row blocks of C (column t of a b-banded C lives on rows t..t+b-1), and
the release is, for that unit, a composition of independent Poisson-subsampled Gaussians, one per step its part is
drawn, each at rate min(1, b·q) and that step's σ_eff: DP-SGD over ⌈T/b⌉ rounds.

`charge(q, σ, steps)` charges a ledger epoch of `steps` steps as ⌈steps/b⌉ such rounds. Over-count, never under:
the sampler's step index is the run's global step, so in any window of n consecutive steps a given part is drawn at
⌊n/b⌋ or ⌈n/b⌉ of them (never more), whatever the window's offset; a unit's rounds in the whole run are the sum over
its epochs of its part's draws in each, ≤ Σ_epochs ⌈n_e/b⌉. When epochs are not multiples of b the sum can exceed the
true count (e.g. two epochs of 3 steps at b = 4: 2 charged, at most 2 real), and composing an extra Poisson-subsampled
Gaussian only ever adds privacy loss, so the ledger over-counts, as a crash does.

The horizon only tunes the coefficients: a run longer than T keeps every column's norm ≤ 1 and the same charge.
"""

from __future__ import annotations

import functools
import math
import os
from fractions import Fraction
from typing import Any, Callable, ClassVar, Mapping, Sequence

import torch
from torch import Tensor

from govtrain import units
from govtrain.accounting.records import Charge
from govtrain.privatizers.base import Participation
from govtrain.privatizers.mf.charge import banded_charge, check_banded
from govtrain.privatizers.mf.optimize import banded_column
from govtrain.privatizers.mf.stream import StreamingPrivatizer
from govtrain.privatizers.mf.toeplitz import no_root_in_closed_unit_disc


def round_coefficients(column: Sequence[float]) -> tuple[int, ...]:
    """The column in pico-units, rounded toward zero and then trimmed until Σ c_p² ≤ 10²⁴ holds in integers, so the
    recorded strategy's column norm is ≤ 1 exactly (rounding favours privacy)."""
    ints = [int(math.copysign(math.floor(abs(v) * units.PICO), v)) for v in column]
    while sum(v * v for v in ints) > units.PICO ** 2:
        i = max(range(len(ints)), key=lambda j: abs(ints[j]))
        ints[i] -= 1 if ints[i] > 0 else -1
    return tuple(ints)


def toward_zero(value_p: int) -> float:
    """value_p / 10¹² as the float64 nearest to it on the side of zero (so that |float| ≤ |exact|)."""
    out = value_p / units.PICO  # correctly rounded
    if abs(Fraction(out)) > abs(Fraction(value_p, units.PICO)):
        out = math.nextafter(out, 0.0)
    return out


@functools.lru_cache(maxsize=64)
def _stable(coefficients_p: tuple[int, ...]) -> bool:
    return no_root_in_closed_unit_disc(coefficients_p)


class BandedMF(StreamingPrivatizer):
    name: ClassVar[str] = "banded-mf"

    def __init__(self, *, bands: int, horizon: int, coefficients_p: Sequence[int] | None = None,
                 insecure_seed: int | None = None, entropy: Callable[[int], bytes] = os.urandom) -> None:
        """`bands` b and the run's `horizon` T (its total steps); `coefficients_p` the column in pico-units (as
        recorded), or None to optimise it for (b, T). `insecure_seed`: a fixed noise key, for tests only."""
        super().__init__(insecure_seed=insecure_seed, entropy=entropy)
        if coefficients_p is None:
            check_banded({"name": self.name, "bands": bands, "horizon": horizon, "coefficients_p": [1] * bands})
            coefficients_p = round_coefficients(banded_column(bands, horizon))
        self.bands, self.horizon, self.coefficients_p = check_banded(
            {"name": self.name, "bands": bands, "horizon": horizon, "coefficients_p": list(coefficients_p)})
        if not _stable(self.coefficients_p):
            raise ValueError("this banded strategy's inverse is unstable (c(x) has a root with |x| ≤ 1): its noise "
                             "would grow without bound; use optimised coefficients")
        self.column = torch.tensor([toward_zero(v) for v in self.coefficients_p], dtype=torch.float64)

    @property
    def depth(self) -> int:
        return self.bands - 1

    def record(self) -> dict[str, Any]:
        return {"name": self.name, "bands": self.bands, "horizon": self.horizon,
                "coefficients_p": list(self.coefficients_p)}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> "BandedMF":
        bands, horizon, coefficients = check_banded(record)
        return cls(bands=bands, horizon=horizon, coefficients_p=coefficients)

    def participation(self) -> Participation:
        return Participation(scheme="cyclic", cycle=self.bands)

    def charge(self, *, sampling_rate_u: int, noise_multiplier_u: int, steps: int) -> Charge:
        """DP-SGD at rate min(1, b·q) over ⌈steps/b⌉ rounds, at the epoch's σ_eff (the module docstring says
        why per-epoch ceilings over-count)."""
        rate_u, multiplier_u, rounds = banded_charge(self.record(), sampling_rate_u=sampling_rate_u,
                                                     noise_multiplier_u=noise_multiplier_u, steps=steps)
        return Charge(family=self.family, sampling_rate_u=rate_u, noise_multiplier_u=multiplier_u, rounds=rounds)

    def _advance(self, buffer: Tensor, z: Tensor, step: int) -> tuple[Tensor, Tensor]:
        c = self.column
        lead = c[0].to(z.device)
        if self.bands == 1:
            return z / lead, buffer
        ring = self.bands - 1
        # ring position (step-k) mod ring holds w_{step-k}, whose weight is c_k (k = 1..b-1); built on the CPU, one copy
        order = torch.tensor([(step - k) % ring for k in range(1, self.bands)])
        weights = torch.empty(ring, dtype=torch.float64).index_copy_(0, order, c[1:]).to(z.device)
        w = (z - torch.tensordot(weights, buffer, dims=1)) / lead
        advanced = buffer.clone()
        advanced[step % ring] = w
        return w, advanced
