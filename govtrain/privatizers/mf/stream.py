"""Streaming correlated noise: what BandedMF and BLT share (keyed draws, per-slot recurrence state, resume).

Step t releases, for each slot, `sums[k] + s_t · w_t` with w = C⁻¹z̃, z̃_t ~ N(0, I) and s_t the step's std for the
slot (the router's s_g). With a constant s this is C⁻¹z for z ~ N(0, s² I), the brief's form. Scaling the
standardised stream at the output (not z at the input) is what lets s change between ledger epochs: C·S⁻¹·(release)
= C·S⁻¹·x + z̃, so a participation at step t enters the Gaussian query C·S⁻¹·x scaled by C_i / s_t alone, and is
charged at its own step's σ_eff = s_t / C_i, exactly as DP-SGD charges it.

**z̃_t is a keyed function of the step.** Each slot's z̃_t is drawn from numpy's Philox generator (a counter-based
generator with a 128-bit key) keyed through `SeedSequence` by the whole digest HMAC-SHA-256(key, "govtrain-mf-noise"
‖ slot key ‖ t), as float64 standard normals: no 32- or 64-bit seed fixes a draw (torch's CPU generator keeps only
32 bits of its seed), and distinct (slot, step) pairs never share one. The draws are made on the CPU and moved to
the slot's device. The 32-byte key is drawn from the OS (`os.urandom`) at `init`, or derived from `insecure_seed` in
tests. So the state that a resumed run needs is small and exact: the key, the step, and per slot the recurrence's
last few values (`depth` float64 tensors of the slot's shape: b-1 for banded, d for BLT), never a T×T matrix.

**The recurrence runs in float64 whatever the slot's dtype**: its buffers are float64 and only the released noise
s_t·w_t is cast to the slot's dtype, so the strategy applied is the recorded one (in float32 the coefficients would
be rounded to nearest, above the norm the record was trimmed to, and BLT's 1/(1-θ) amplifies that rounding).

**An update is atomic**: every slot's sums, std and keep mask are checked first, every slot's noise and next buffers
are computed out of place, and only then are the sums noised (in place, in slot order) and a new state returned. A
call that raises leaves the state it was given (and the sums) as they were, so a retried step continues the
uninterrupted stream. `update(..., step=t)` refuses a state that is not at step t, so the stream cannot drift from the
run's global step (the sampler's).

**A state resumes only under the record that saved it**: `state_dict` carries the record, and `load_state` refuses a
state saved by another strategy (other coefficients, another horizon's optimum, another privatizer): resuming under
one would realise a hybrid encoder whose columns straddling the switch are not bounded by either record.

The key and the buffers are secret (whoever has them can rebuild and subtract the noise): `state_dict` is for the run
state only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
from abc import abstractmethod
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from govtrain.privatizers.base import Privatizer, Slot

KEY_BYTES = 32
_LABEL = b"govtrain-mf-noise\0"


@dataclass(frozen=True, kw_only=True)
class StreamState:
    """`buffers[k]`: the slot's recurrence state, float64 [depth, *shape]. `update` never changes a state: it returns
    a new one (`state_dict` copies)."""

    key: bytes
    step: int
    slots: tuple[Slot, ...]
    buffers: dict[str, Tensor]

    def __repr__(self) -> str:  # the key and buffers are the noise: never in a log or a traceback
        return f"StreamState(step={self.step}, slots={len(self.slots)}, <secret>)"


def standard_normal(key: bytes, slot: Slot, step: int) -> Tensor:
    """z̃_t for one slot: N(0, 1) float64 entries of the slot's shape on its device, fixed by (key, slot key, step):
    Philox keyed by the whole 256-bit HMAC digest (module docstring)."""
    name = slot.key.encode()
    message = _LABEL + len(name).to_bytes(4, "big") + name + step.to_bytes(8, "big")
    digest = hmac.new(key, message, hashlib.sha256).digest()
    generator = np.random.Generator(np.random.Philox(np.random.SeedSequence(int.from_bytes(digest, "big"))))
    draws = generator.standard_normal(math.prod(slot.shape), dtype=np.float64)
    return torch.from_numpy(draws).reshape(slot.shape).to(slot.device)


def _record_text(record: Mapping[str, Any]) -> str:
    return json.dumps(record, sort_keys=True, separators=(",", ":"))


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
    def _advance(self, buffer: Tensor, z: Tensor, step: int) -> tuple[Tensor, Tensor]:
        """(w_t, the slot's next buffer) from z̃_t and its buffer, in float64 and out of place: w_t is the
        standardised noise (at s_t = 1); `buffer` is left as it was."""

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
        buffers = {s.key: torch.zeros((self.depth, *s.shape), dtype=torch.float64, device=s.device) for s in slots}
        return StreamState(key=self._new_key(), step=0, slots=slots, buffers=buffers)

    def update(self, sums: Mapping[str, Tensor], state: StreamState, *, std: Mapping[str, float],
               keep: Mapping[str, Tensor | None] | None = None,
               step: int | None = None) -> tuple[dict[str, Tensor], StreamState]:
        """`step`: the run's global step, if the caller knows it; ValueError if the state is at another one."""
        # 1. Check everything before anything moves.
        if step is not None and (type(step) is not int or step != state.step):
            raise ValueError(f"the noise state is at step {state.step}, the run at step {step!r}: resume the run "
                             "state that was saved with the run's step")
        held = {s.key: s for s in state.slots}
        unknown = set(sums) - set(held)
        if unknown:
            raise ValueError(f"sums for slots the state does not hold: {sorted(unknown)}")
        for key, value in std.items():
            if not math.isfinite(float(value)) or float(value) < 0:
                raise ValueError(f"the noise std of {key} must be finite and ≥ 0, got {float(value)!r}")
        masks = {}
        for key, total in sums.items():
            slot = held[key]
            if tuple(total.shape) != tuple(slot.shape) or total.dtype != slot.dtype:
                raise ValueError(f"the sum for {key} is {total.dtype} {tuple(total.shape)}, the slot is "
                                 f"{slot.dtype} {tuple(slot.shape)}")
            mask = keep.get(key) if keep is not None else None
            if mask is not None and torch.broadcast_shapes(mask.shape, slot.shape) != slot.shape:
                raise RuntimeError(f"the keep mask of {key} has shape {tuple(mask.shape)}, which does not fit the "
                                   f"slot's {tuple(slot.shape)}")
            masks[key] = mask
        # 2. Every slot's recurrence advances every step (noised or not), so the stream stays a function of the step;
        # computed out of place, so that an exception here leaves the state as it was.
        buffers, noises = {}, []
        for slot in state.slots:
            w, buffers[slot.key] = self._advance(state.buffers[slot.key], standard_normal(state.key, slot, state.step),
                                                 state.step)
            scale = float(std.get(slot.key, 0.0))
            if slot.key not in sums or scale == 0:
                continue
            noise = (w * scale).to(slot.dtype)
            if masks[slot.key] is not None:
                noise = noise * masks[slot.key]
            noises.append((slot.key, noise.to(sums[slot.key].device)))
        # 3. Commit: noise the sums in slot order (two slots may name one tensor), then the new state.
        for key, noise in noises:
            sums[key] += noise
        return {k: sums[k] for k in sums}, replace(state, step=state.step + 1, buffers=buffers)

    def state_dict(self, state: StreamState) -> dict[str, Any]:
        return {"record": self.record(), "key": torch.tensor(list(state.key), dtype=torch.uint8), "step": state.step,
                "dtypes": {s.key: str(s.dtype) for s in state.slots},
                "buffers": {k: v.detach().clone() for k, v in state.buffers.items()}}

    def load_state(self, slots: Sequence[Slot], saved: Mapping[str, Any]) -> StreamState:
        slots = tuple(slots)
        if set(saved) != {"record", "key", "step", "dtypes", "buffers"}:
            raise ValueError("not a correlated-noise state: expected record, key, step, dtypes and buffers")
        record, key, step, dtypes, buffers = (saved[k] for k in ("record", "key", "step", "dtypes", "buffers"))
        if not isinstance(record, Mapping) or _record_text(record) != _record_text(self.record()):
            raise ValueError(f"the noise state was saved under another record, not {self.name} "
                             f"{_record_text(self.record())}: resume under the record that saved it")
        if not (isinstance(key, Tensor) and key.dtype == torch.uint8 and key.shape == (KEY_BYTES,)):
            raise ValueError(f"the noise key must be {KEY_BYTES} bytes")
        if type(step) is not int or step < 0:
            raise ValueError("the step must be a non-negative int")
        names = {s.key for s in slots}
        if not isinstance(buffers, Mapping) or not isinstance(dtypes, Mapping) or set(buffers) != names \
                or set(dtypes) != names or len(buffers) != len(slots):
            raise ValueError("the saved noise state is for other slots")
        restored = {}
        for s in slots:
            buffer = buffers[s.key]
            if dtypes[s.key] != str(s.dtype):
                raise ValueError(f"the saved state of {s.key} is for {dtypes[s.key]}, the slot is {s.dtype}")
            if not isinstance(buffer, Tensor) or tuple(buffer.shape) != (self.depth, *s.shape):
                raise ValueError(f"the saved buffer of {s.key} has shape {tuple(getattr(buffer, 'shape', ()))}, "
                                 f"expected {(self.depth, *s.shape)}")
            if buffer.dtype != torch.float64:
                raise ValueError(f"the saved buffer of {s.key} is {buffer.dtype}, not torch.float64")
            restored[s.key] = buffer.detach().to(device=s.device).clone()
        return StreamState(key=bytes(key.tolist()), step=step, slots=slots, buffers=restored)
