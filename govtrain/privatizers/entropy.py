"""Noise generators seeded with the operating system's entropy, in full.

`torch.Generator.manual_seed` takes a 64-bit seed, but the CPU generator (mt19937) keeps only its low 32 bits:
seeded that way, every run's noise would be one of 2³² streams, and anyone holding one released step could try
them all and subtract the noise. So a generator that draws noise is never seeded through `manual_seed` outside
tests: its whole internal state is drawn from `os.urandom`.

- CPU (mt19937): the 624 32-bit words of its state (19,968 bits, of which mt19937 uses 19,937), with the
  position set so that the next draw regenerates from them.
- CUDA (Philox 4x32-10): its 64-bit key and its 64-bit counter offset (a multiple of 4, as torch advances it):
  126 bits.

`insecure_seed` (tests only) keeps `manual_seed`, so seeded runs draw exactly what they always drew.
"""

from __future__ import annotations

import os
import struct

import torch

_MT_WORDS = 624
_MT_STATE = 24  # byte offset of the 624 state words (uint64 each, 32 bits used) in the CPU generator's state
_CPU_STATE_BYTES = 5056


def generator(device: torch.device | str, insecure_seed: int | None = None,
              entropy=os.urandom) -> torch.Generator:  # type: ignore[no-untyped-def]
    """A generator on `device`: its whole state from `entropy` (the OS), or `manual_seed(insecure_seed)`."""
    made = torch.Generator(device=device)
    if insecure_seed is not None:
        made.manual_seed(insecure_seed)
        return made
    if made.device.type == "cpu":
        made.manual_seed(0)  # a valid state to fill: position 1 (regenerate at the next draw), seeded
        state = bytearray(bytes(made.get_state().numpy()))
        if len(state) != _CPU_STATE_BYTES:
            raise RuntimeError(f"unexpected CPU generator state of {len(state)} bytes: cannot seed it in full")
        words = entropy(4 * _MT_WORDS)
        if len(words) != 4 * _MT_WORDS or not any(words):  # an all-zero mt19937 state never leaves zero
            raise RuntimeError("the operating system's entropy source returned too little or nothing but zeros")
        for i in range(_MT_WORDS):
            struct.pack_into("<Q", state, _MT_STATE + 8 * i, int.from_bytes(words[4 * i:4 * i + 4], "little"))
        struct.pack_into("<Q", state, 0, 0)  # the "initial seed" it reports: none
        made.set_state(torch.frombuffer(state, dtype=torch.uint8).clone())
        return made
    key, offset = struct.unpack("<QQ", entropy(16))
    made.manual_seed(key)
    state = made.get_state().clone()
    if state.numel() == 16:  # Philox: (seed, offset)
        state.view(torch.int64)[1] = (offset & ((1 << 60) - 1)) * 4
        made.set_state(state)
    return made
