"""Streaming correlated noise: what BandedMF and BLT share (keyed draws, per-slot recurrence state, resume).

Step t releases, for each slot, `sums[k] + s_t · w_t` with w = C⁻¹z̃, z̃_t ~ N(0, I) and s_t the step's std for the
slot (the router's s_g). With a constant s this is C⁻¹z for z ~ N(0, s² I), the brief's form. Scaling the
standardised stream at the output (not z at the input) is what lets s change between ledger epochs: C·S⁻¹·(release)
= C·S⁻¹·x + z̃, so a participation at step t enters the Gaussian query C·S⁻¹·x scaled by C_i / s_t alone, and is
charged at its own step's σ_eff = s_t / C_i, exactly as DP-SGD charges it.

**z̃_t is a keyed function of the step.** Each slot's z̃_t comes from a generator seeded by
HMAC-SHA-256(key, "govtrain-mf-noise" ‖ slot key ‖ t) (its first 64 bits: torch generators take a 64-bit seed);
the 32-byte key is drawn from the OS (`os.urandom`) at `init`, or derived from `insecure_seed` in tests. So the
state that a resumed run needs is small and exact: the key, the step, and per slot the recurrence's last few
values (`depth` tensors of the slot's shape: b-1 for banded, d for BLT), never a T×T matrix. The key and the
buffers are secret (whoever has them can rebuild and subtract the noise): `state_dict` is for the run state only.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from abc import abstractmethod
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor

from govtrain.privatizers.base import Privatizer, Slot

KEY_BYTES = 32
_LABEL = b"govtrain-mf-noise\0"


@dataclass(frozen=True, kw_only=True)
class StreamState:
    """`buffers[k]`: the slot's recurrence state, [depth, *shape], updated in place by `update` (so an
    update consumes the state it is given; `state_dict` copies)."""

    key: bytes
    step: int
    slots: tuple[Slot, ...]
    buffers: dict[str, Tensor]

    def __repr__(self) -> str:  # the key and buffers are the noise: never in a log or a traceback
        return f"StreamState(step={self.step}, slots={len(self.slots)}, <secret>)"


def standard_normal(key: bytes, slot: Slot, step: int) -> Tensor:
    """z̃_t for one slot: N(0, 1) entries of the slot's shape, dtype and device, fixed by (key, slot key, step)."""
    name = slot.key.encode()
    message = _LABEL + len(name).to_bytes(4, "big") + name + step.to_bytes(8, "big")
    seed = int.from_bytes(hmac.new(key, message, hashlib.sha256).digest()[:8], "big")
    generator = torch.Generator(device=slot.device)
    generator.manual_seed(seed)
    return torch.randn(slot.shape, generator=generator, dtype=slot.dtype, device=slot.device)


class StreamingPrivatizer(Privatizer):
    correlated = True

    def __init__(self, *, insecure_seed: int | None = None, entropy: Callable[[int], bytes] = os.urandom) -> None:
        self._insecure_seed = insecure_seed
        self._entropy = entropy

    @property
    @abstractmethod
    def depth(self) -> int:
        """How many past values per slot the recurrence keeps."""

    @abstractmethod
    def _advance(self, buffer: Tensor, z: Tensor, step: int) -> Tensor:
        """w_t (standardised: the noise at s_t = 1) from z̃_t and the slot's buffer, updating the buffer in place."""

    def _new_key(self) -> bytes:
        if self._insecure_seed is not None:
            return hashlib.sha256(b"govtrain-insecure-mf-key\0" + str(self._insecure_seed).encode()).digest()
        key = self._entropy(KEY_BYTES)
        if len(key) != KEY_BYTES:
            raise RuntimeError(f"the entropy source returned {len(key)} bytes, not {KEY_BYTES}")
        return key

    def init(self, slots: Sequence[Slot]) -> StreamState:
        slots = tuple(slots)
        if len({s.key for s in slots}) != len(slots):
            raise ValueError("slot keys must be distinct")
        buffers = {s.key: torch.zeros((self.depth, *s.shape), dtype=s.dtype, device=s.device) for s in slots}
        return StreamState(key=self._new_key(), step=0, slots=slots, buffers=buffers)

    def update(self, sums: Mapping[str, Tensor], state: StreamState, *, std: Mapping[str, float],
               keep: Mapping[str, Tensor | None] | None = None) -> tuple[dict[str, Tensor], StreamState]:
        unknown = set(sums) - {s.key for s in state.slots}
        if unknown:
            raise ValueError(f"sums for slots the state does not hold: {sorted(unknown)}")
        # Every slot's recurrence advances every step (noised or not), so the stream stays a function of the step.
        for slot in state.slots:
            w = self._advance(state.buffers[slot.key], standard_normal(state.key, slot, state.step), state.step)
            scale = float(std.get(slot.key, 0.0))
            if slot.key not in sums or scale <= 0:
                continue
            noise = w * scale
            mask = keep.get(slot.key) if keep is not None else None
            if mask is not None:
                noise = noise * mask
            sums[slot.key] += noise
        return {k: sums[k] for k in sums}, replace(state, step=state.step + 1)

    def state_dict(self, state: StreamState) -> dict[str, Any]:
        return {"key": torch.tensor(list(state.key), dtype=torch.uint8), "step": state.step,
                "buffers": {k: v.detach().clone() for k, v in state.buffers.items()}}

    def load_state(self, slots: Sequence[Slot], saved: Mapping[str, Any]) -> StreamState:
        slots = tuple(slots)
        if set(saved) != {"key", "step", "buffers"}:
            raise ValueError("not a correlated-noise state: expected key, step and buffers")
        key, step, buffers = saved["key"], saved["step"], saved["buffers"]
        if not (isinstance(key, Tensor) and key.dtype == torch.uint8 and key.shape == (KEY_BYTES,)):
            raise ValueError(f"the noise key must be {KEY_BYTES} bytes")
        if type(step) is not int or step < 0:
            raise ValueError("the step must be a non-negative int")
        if set(buffers) != {s.key for s in slots} or len(buffers) != len(slots):
            raise ValueError("the saved noise state is for other slots")
        restored = {}
        for s in slots:
            buffer = buffers[s.key]
            if tuple(buffer.shape) != (self.depth, *s.shape):
                raise ValueError(f"the saved buffer of {s.key} has shape {tuple(buffer.shape)}, "
                                 f"expected {(self.depth, *s.shape)}")
            if buffer.dtype != s.dtype:
                raise ValueError(f"the saved buffer of {s.key} is {buffer.dtype}, the slot is {s.dtype}")
            restored[s.key] = buffer.detach().to(device=s.device).clone()
        return StreamState(key=bytes(key.tolist()), step=step, slots=slots, buffers=restored)
