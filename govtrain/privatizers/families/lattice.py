"""What the three noise-family privatizers share: the lattice, the record, the charge and the integer noise step
(docs/privatizers.md, "Noise families"; the accounting is `govtrain.accounting.families`).

The router's materialized path (`routing/materialized.py`) divides each clipping unit's clipped gradient by its
noise group's lattice spacing γ_g = s_g · 2^-b (`spacing`), and `quantize` rounds the result to an integer vector
of norm at most Δ(c), c = the unit's span in lattice steps. Summed, the clipped sums are integer vectors (float64,
exact). `update` adds integer noise of scale 2^b to each slot's coordinates and multiplies by the slot's γ in
place: every released coordinate is an integer multiple of a public spacing, so its low bits carry nothing about
the data (Mironov 2012), and a neighbouring dataset moves the integer sum by one unit's vector.

Why the spacing follows the noise and not C: the units of one noise group must share one lattice (a discrete
noise shifted off its lattice has a different support: infinite privacy loss), and their clip norms C_i differ
(each contribution signs its own). With γ_g ∝ s_g, a unit's span c = C_i / min_g γ_g = 2^b / σ_eff,i depends only on
the effective multiplier its spend records, so the accountant charges each unit its own sensitivity.

The noise is drawn from a numpy PCG64 seeded afresh every step with 256 bits from `os.urandom`
(`samplers.generator`), never from the router's torch generator (whose CPU seed keeps 32 bits: 2^32 streams, which
can be enumerated). Tests may give an `insecure_seed`; each `update` then seeds from (seed, its call count). The
noise depends on nothing earlier, so there is no state to keep (`state_dict` is empty), as for the i.i.d. Gaussian.

This module imports neither torch nor numpy at import time: the verifier rebuilds privatizers from records.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Sequence

from govtrain.accounting.records import Charge
from govtrain.privatizers.base import Privatizer, Slot

if TYPE_CHECKING:
    import numpy as np
    import torch
    from torch import Tensor

__all__ = ["LatticePrivatizer", "dimension_of", "check_lattice", "lattice_charge"]

DEFAULT_BITS = 16
DEFAULT_BETA_EXP = 40
_FIELDS = ("granularity_bits", "beta_exp")
RECORD_FIELDS = ("name", *_FIELDS, "dimension")


def check_lattice(name: str, record: Mapping[str, Any]) -> tuple[int, int, int]:
    """(granularity_bits, beta_exp, dimension) of a `name` record, or ValueError: a record has every field, ints in
    the lattice's range (and Skellam's granularity at most SKELLAM_MAX_BITS), since its charge depends on all three
    (`govtrain.privatizers.rules`, the verifier's path)."""
    from govtrain.accounting.families import Lattice, check_skellam_bits

    if set(record) != set(RECORD_FIELDS) or record["name"] != name:
        raise ValueError(f"a {name} record has exactly {', '.join(RECORD_FIELDS)}: got {sorted(record)}")
    params = tuple(record[k] for k in RECORD_FIELDS[1:])
    if any(type(v) is not int for v in params):
        raise ValueError(f"{name}: granularity_bits, beta_exp and dimension are integers")
    Lattice(params)  # raises out of range
    if name == "skellam":
        check_skellam_bits(params[0])
    return params  # type: ignore[return-value]


def lattice_charge(family: str, params: tuple[int, int, int], *, sampling_rate_u: int, noise_multiplier_u: int,
                   steps: int) -> Charge:
    """`steps` rounds of the family's mechanism at (q, σ), with the lattice's parameters for its accountant."""
    return Charge(family=family, sampling_rate_u=sampling_rate_u, noise_multiplier_u=noise_multiplier_u,
                  rounds=steps, params=params)


def dimension_of(slots: Sequence[Slot]) -> int:
    """The coordinates the slots' parameters hold, each parameter once (the router keys a parameter split
    between noise groups "name@classes", one slot per group)."""
    sizes: dict[str, int] = {}
    for slot in slots:
        count = 1
        for n in slot.shape:
            count *= int(n)
        sizes[slot.key.partition("@")[0]] = count
    return sum(sizes.values())


class LatticePrivatizer(Privatizer):
    """Base of Laplace, DiscreteGaussian and Skellam: `granularity_bits` b (the noise is 2^b lattice steps
    wide), `beta_exp` (β = 2^-beta_exp, the rounding's failure probability before re-drawing), and `dimension`
    (the coordinates a unit may reach: bound at `init` from the slots, or given). `insecure_seed`: tests only
    (not recorded); without it the noise is seeded from the operating system."""

    quantized: ClassVar[bool] = True
    parameters: ClassVar[tuple[str, ...]] = _FIELDS  # RUN.toml [noise] fields

    def __init__(self, *, granularity_bits: int = DEFAULT_BITS, beta_exp: int = DEFAULT_BETA_EXP,
                 dimension: int | None = None, insecure_seed: int | None = None) -> None:
        from govtrain.accounting.families import Lattice

        Lattice((granularity_bits, beta_exp, dimension if dimension is not None else 1))  # raises out of range
        if insecure_seed is not None and (type(insecure_seed) is not int or insecure_seed < 0):
            raise ValueError(f"an insecure seed is a non-negative integer: got {insecure_seed!r}")
        self.granularity_bits, self.beta_exp, self.dimension = granularity_bits, beta_exp, dimension
        self.insecure_seed, self._updates = insecure_seed, 0

    # -- the public record and the charge -------------------------------------------------------------------

    def record(self) -> dict[str, Any]:
        if self.dimension is None:
            raise RuntimeError(f"{self.name}: its dimension is set at init (or bind): nothing to record before")
        return {"name": self.name, "granularity_bits": self.granularity_bits, "beta_exp": self.beta_exp,
                "dimension": self.dimension}

    @classmethod
    def from_parameters(cls, params: Mapping[str, Any], *, horizon: int | None = None,
                        insecure_seed: int | None = None) -> "LatticePrivatizer":
        """RUN.toml [noise]'s granularity_bits and beta_exp (defaults otherwise): its dimension is not a setting
        (`init` binds it from the slots)."""
        given = cls.check_parameters(params)
        if any(type(v) is not int for v in given.values()):
            raise ValueError(f"{cls.name}: granularity_bits and beta_exp are integers")
        return cls(**given, insecure_seed=insecure_seed)

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> "LatticePrivatizer":
        """Every field is required (the charge depends on each): ValueError otherwise."""
        bits, beta_exp, dimension = check_lattice(cls.name, record)
        return cls(granularity_bits=bits, beta_exp=beta_exp, dimension=dimension)

    def bind(self, dimension: int) -> None:
        """Set the dimension the accountant charges for (once; a record already carrying one must agree)."""
        if type(dimension) is not int or dimension < 1:
            raise ValueError(f"a dimension is a positive integer: got {dimension!r}")
        if self.dimension is not None and self.dimension < dimension:
            raise ValueError(f"{self.name} was recorded for {self.dimension} coordinates, and these slots hold "
                             f"{dimension}")
        if self.dimension is None:
            self.dimension = dimension

    def charge(self, *, sampling_rate_u: int, noise_multiplier_u: int, steps: int) -> Charge:
        return lattice_charge(self.family, check_lattice(self.name, self.record()), sampling_rate_u=sampling_rate_u,
                              noise_multiplier_u=noise_multiplier_u, steps=steps)

    # -- the per-sample side --------------------------------------------------------------------------------

    def spacing(self, std: float) -> float:
        """γ_g: the lattice spacing of a noise group whose noise scale is `std` (exact: a power-of-two scaling)."""
        return float(std) * 2.0 ** -self.granularity_bits

    def quantize(self, clipped: "Tensor", clip: "Tensor", generator: "torch.Generator") -> "Tensor":
        """Each row of `clipped` (a unit's clipped gradient divided by its spacing, norm ≤ `clip` = its span c)
        as an integer vector (float64) of norm ≤ Δ(c), in the privatizer's norm."""
        from govtrain.privatizers.families.rounding import conditional_round

        if self.dimension is None:
            raise RuntimeError(f"{self.name}: init (or bind) before quantising")
        return conditional_round(clipped, clip, norm=self.norm, dimension=self.dimension, beta_exp=self.beta_exp,
                                 generator=generator)

    # -- the noise ------------------------------------------------------------------------------------------

    def _draw(self, rng: "np.random.Generator", count: int) -> "np.ndarray":
        """`count` integer noise draws of scale 2^b (the family's)."""
        raise NotImplementedError

    def init(self, slots: Sequence[Slot]) -> tuple[str, ...]:
        keys = tuple(slot.key for slot in slots)
        if len(set(keys)) != len(keys):
            raise ValueError("two slots with one key")
        self.bind(dimension_of(slots))
        return keys

    def update(self, sums: Mapping[str, "Tensor"], state: tuple[str, ...], *, std: Mapping[str, float],
               keep: Mapping[str, "Tensor | None"] | None = None) -> tuple[dict[str, "Tensor"], tuple[str, ...]]:
        """Each slot in turn: its integer sum plus integer noise, times its spacing, in place (a parameter split
        between groups is one tensor each slot releases its own coordinates of)."""
        import torch

        from govtrain.privatizers.families import samplers

        unknown = sorted(set(sums) - set(state))
        if unknown:
            raise ValueError(f"slot {unknown[0]!r} was not among the slots the privatizer was initialised with")
        rng = samplers.generator(None if self.insecure_seed is None else (self.insecure_seed, self._updates))
        self._updates += 1
        for key in state:
            if key not in sums:
                continue
            total = sums[key]
            mask = keep.get(key) if keep is not None else None
            where = torch.ones(total.shape, dtype=torch.bool, device=total.device) if mask is None else \
                mask.expand(total.shape).to(torch.bool)
            integer = total.to(torch.float64)[where]
            if not bool(torch.equal(integer, torch.round(integer))):
                raise RuntimeError(f"{key}: the clipped sum is not on the lattice (quantise before the sum)")
            scale = float(std.get(key, 0.0))
            if scale <= 0:  # no noise: nothing of the data may be released here
                if bool(integer.any()):
                    raise RuntimeError(f"{key}: a quantised sum where the group has no noise")
                continue
            noise = torch.from_numpy(self._draw(rng, int(integer.numel()))).to(device=total.device,
                                                                                dtype=torch.float64)
            released = (integer + noise) * self.spacing(scale)
            total[where] = released.to(total.dtype)
        return dict(sums), state
