"""What the router hands its privatizer each step (`govtrain.privatizers`): one slot per tensor the step noises,
keyed stably across steps, in the order the noise is drawn.

- Under prism, first each stack of LoRA pairs' two standard Gaussians, Ω_A [P, m, r] and Ω_B [P, n, r] in
  float64 (slots "prism:<stack>:A" and "prism:<stack>:B", std 1, a zero sum): `prism.tangent_noise` turns them
  into the isotropic tangent noise of each pair's group (`TangentStacks.release`).
- Then each noise group's parts, group after group (`Resolution.groups`), with the group's s_g: a parameter's
  clipped sum, keyed by the parameter's name, or by "name@classes" when the parameter is split between groups
  (a heads profile); then the slot's `keep` masks the noise to the group's rows or columns, and the slots of
  one parameter add their noise to one tensor in turn.

A correlated privatizer cannot serve prism: the tangent basis moves with the factors every step, so noise
correlated across steps in it is no matrix mechanism on any fixed space (`check_privatizer`).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import Tensor

from govtrain.errors import Code, ConfigError
from govtrain.privatizers.base import Privatizer, Slot
from govtrain.resolver.profile import Group, Resolution

__all__ = ["NoiseSlots", "check_privatizer"]


def check_privatizer(mechanism: str, privatizer: Privatizer) -> None:
    """Refuse (`privatizer_unsupported`) a privatizer the mechanism or this router cannot release with."""
    if mechanism == "prism" and (privatizer.correlated or privatizer.quantized or privatizer.norm != "l2"):
        what = ("correlates its noise across steps" if privatizer.correlated else
                "adds integer noise to quantised gradients" if privatizer.quantized else
                f"clips in the {privatizer.norm} norm")
        raise ConfigError(Code.PRIVATIZER_UNSUPPORTED,
                          f"privatizer {privatizer.name!r} {what}, and prism noises each LoRA pair isotropically in "
                          "its tangent space, whose basis changes every step: correlated noise in it is not a "
                          "matrix mechanism, and the tangent Gaussian is an L2 Gaussian. Use the gaussian "
                          "privatizer with prism, or dpsgd or dp-muon with this one")


class NoiseSlots:
    def __init__(self, params: Mapping[str, Tensor], resolution: Resolution, paired: set[str], tangent) -> None:
        """`params`: the trainable parameters; `paired`: the LoRA pairs' names under prism (noised as stacks);
        `tangent`: their `TangentStacks`, or None."""
        slots: list[Slot] = []
        self._stacks: list[tuple[str, str]] = []  # per stack: its Ω_A and Ω_B keys
        self._stack_pairs: list[tuple[str, ...]] = []  # per stack: its pairs, by their lora_B names
        for i, stack in enumerate(tangent.stacks if tangent is not None else ()):
            lora_B, lora_A = params[stack.lora_B[0]], params[stack.lora_A[0]]
            keys = (f"prism:{i}:A", f"prism:{i}:B")
            (m, r), n = lora_B.shape, lora_A.shape[1]
            for key, shape in zip(keys, ((len(stack.lora_B), m, r), (len(stack.lora_B), n, r))):
                slots.append(Slot(key=key, shape=torch.Size(shape), dtype=torch.float64, device=lora_B.device))
            self._stacks.append(keys)
            self._stack_pairs.append(stack.lora_B)
        noised = [(group, part) for group in resolution.groups if group.classes for part in group.parts
                  if part.name not in paired]
        holders: dict[str, int] = {}
        for _, part in noised:
            holders[part.name] = holders.get(part.name, 0) + 1
        self._parts: list[tuple[str, Group, object]] = []  # (key, group, part) in draw order
        for group, part in noised:
            key = part.name if holders[part.name] == 1 else f"{part.name}@{'+'.join(sorted(group.classes))}"
            param = params[part.name]
            slots.append(Slot(key=key, shape=param.shape, dtype=torch.promote_types(param.dtype, torch.float32),
                              device=param.device))
            self._parts.append((key, group, part))
        self.split = {name for name, count in holders.items() if count > 1}
        self.slots: tuple[Slot, ...] = tuple(slots)
        self._masks: dict[tuple[str, torch.dtype], Tensor] = {}

    def step(self, totals: Mapping[str, Tensor], groups: Sequence[tuple[Group, float]], pair_std: Mapping[str, float]
             ) -> tuple[dict[str, Tensor], dict[str, float], dict[str, Tensor | None]]:
        """This step's (sums, std, keep) for `Privatizer.update`, in slot order: the clipped sums are `totals`'
        own tensors (noised in place), the tangent slots fresh zeros with std 1 where some pair of the stack
        has noise (else std 0: nothing is drawn for it)."""
        sums: dict[str, Tensor] = {}
        std: dict[str, float] = {}
        keep: dict[str, Tensor | None] = {}
        for i, (keys, pairs) in enumerate(zip(self._stacks, self._stack_pairs)):
            noised = any(float(pair_std.get(b, 0.0)) > 0 for b in pairs)
            for key, slot in zip(keys, self.slots[2 * i:2 * i + 2]):
                sums[key] = torch.zeros(slot.shape, dtype=slot.dtype, device=slot.device)
                std[key], keep[key] = (1.0 if noised else 0.0), None
        group_std = {group.classes: s for group, s in groups}
        for key, group, part in self._parts:
            total = totals[part.name]
            sums[key] = total
            std[key] = float(group_std.get(group.classes, 0.0))
            keep[key] = None if part.dim is None else self._mask(key, total, part.dim, part.index)
        return sums, std, keep

    def released(self, totals: dict[str, Tensor], noisy: Mapping[str, Tensor]) -> None:
        """Put the privatizer's noised sums back in `totals`. A parameter split between groups must come back
        as the one tensor each of its slots noised in turn (in place)."""
        for key, _, part in self._parts:
            if noisy[key] is totals[part.name]:
                continue
            if part.name in self.split:
                raise RuntimeError(f"the privatizer did not noise {part.name}'s slots in place: a parameter split "
                                   "between groups is one tensor that each slot adds its noise to in turn")
            totals[part.name] = noisy[key]

    def omega(self, noisy: Mapping[str, Tensor]) -> list[tuple[Tensor, Tensor]]:
        """Each stack's (Ω_A, Ω_B) as the privatizer drew them."""
        return [(noisy[key_A], noisy[key_B]) for key_A, key_B in self._stacks]

    def _mask(self, key: str, like: Tensor, dim: int, index) -> Tensor:
        """A 0/1 tensor in `like`'s dtype that broadcasts against it: 1 at `index` along `dim`, 0 elsewhere."""
        mask = self._masks.get((key, like.dtype))
        if mask is None or mask.device != like.device:
            mask = torch.zeros(like.shape[dim], dtype=like.dtype, device=like.device)
            mask[list(index)] = 1
            mask = mask.reshape([-1 if d == dim else 1 for d in range(like.dim())])
            self._masks[(key, like.dtype)] = mask
        return mask
