"""The i.i.d. Gaussian (DP-SGD's noise) as a privatizer: each slot's clipped sum gets N(0, s²) per coordinate,
s its group's standard deviation, masked to the slot's part of the tensor, drawn slot after slot from one
generator. In the router's slot order, with the router's generator, these are the very draws the router made
before privatizers existed: a run's `.grad` bytes and adapter are unchanged (tests/test_privatizers_core.py
holds them to hashes recorded before).

Its noise depends on nothing earlier, so it keeps no secret state: a resumed run draws fresh noise from a
generator the OS seeds, as it always has.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

from govtrain.privatizers.base import Privatizer, Slot

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["IIDGaussian", "check_gaussian"]


def check_gaussian(record: Mapping[str, Any]) -> int:
    """The microbatches k of an i.i.d. Gaussian record, or ValueError: the record holds its name and, only when k
    is 2 or more, "microbatches" (torch-free: `govtrain.privatizers.rules`, the verifier's path)."""
    other = sorted(set(record) - {"name", "microbatches"})
    if other or record.get("name") != IIDGaussian.name:
        raise ValueError(f"the i.i.d. Gaussian records its name and microbatches (k > 1) alone, not {sorted(record)}")
    microbatches = record.get("microbatches", 1)
    if "microbatches" in record and (type(microbatches) is not int or microbatches < 2):
        raise ValueError(f"microbatches is recorded only when it is 2 or more: got {microbatches!r}")
    return microbatches


class IIDGaussian(Privatizer):
    """`microbatches`: RUN.toml [noise] microbatches, the router's per-microbatch noise (docs/privatizers.md). The
    noise of each draw is the same; k > 1 is recorded ("microbatches": k) so that the ledger says how the step was
    noised, and k = 1, the ordinary step, is not: its record stays {"name": "gaussian"}, byte for byte. The charge
    is the same for every k (parallel composition over the microbatches)."""

    name = "gaussian"
    family = "gaussian"
    per_microbatch = True

    def __init__(self, *, microbatches: int = 1) -> None:
        if type(microbatches) is not int or microbatches < 1:
            raise ValueError(f"microbatches is a positive integer: got {microbatches!r}")
        self.microbatches = microbatches

    def record(self) -> dict[str, Any]:
        return {"name": self.name, **({"microbatches": self.microbatches} if self.microbatches > 1 else {})}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> "IIDGaussian":
        return cls(microbatches=check_gaussian(record))

    def init(self, slots: Sequence[Slot]) -> tuple[str, ...]:
        """The state: the slots' keys in order (public: what the noise is drawn in the order of)."""
        keys = tuple(slot.key for slot in slots)
        if len(set(keys)) != len(keys):
            raise ValueError("two slots with one key")
        return keys

    def update(self, sums: Mapping[str, "Tensor"], state: tuple[str, ...], *, std: Mapping[str, float],
               keep: Mapping[str, "Tensor | None"] | None = None) -> tuple[dict[str, "Tensor"], tuple[str, ...]]:
        import torch

        unknown = sorted(set(sums) - set(state))
        if unknown:
            raise ValueError(f"slot {unknown[0]!r} was not among the slots the privatizer was initialised with")
        if self.generator is None:  # the OS's entropy, on the sums' device, once: its whole state (privatizers.entropy)
            from govtrain.privatizers import entropy

            device = next(iter(sums.values())).device if sums else torch.device("cpu")
            self.generator = entropy.generator(device)
        for key in state:
            if key not in sums:
                continue
            total, scale = sums[key], float(std.get(key, 0.0))
            if scale <= 0:
                continue
            noise = torch.normal(0.0, scale, size=total.shape, generator=self.generator, device=total.device,
                                 dtype=total.dtype)
            mask = keep.get(key) if keep is not None else None
            if mask is not None:
                noise = noise * mask
            total += noise
        return dict(sums), state
