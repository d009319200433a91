"""Noise generators seeded with all the entropy their state holds (docs/privatizers.md, "The noise generator's
entropy").

Noise that can be guessed can be subtracted. `torch.Generator.manual_seed(s)` on the CPU keeps only the low 32 bits
of `s` (the Mersenne Twister's `init_with_uint32`): a generator so seeded from 64 bits of OS entropy still has 2^32
possible streams, and anyone holding one released step can try them all. So an OS-seeded noise generator is built
here, its whole state drawn from `os.urandom`:

- **CPU** (mt19937): the 624 32-bit words of the twister's state, 2,496 bytes of OS entropy (the generator uses
  19,937 bits of them), with the position a fresh seeding leaves (`left` 1, `next` 0: the state is twisted before
  the first output). Written with `set_state` into the byte layout of torch's `CPUGeneratorImplState`, which is
  checked first against a generator seeded the ordinary way: a torch whose layout differs is refused, never seeded
  with less.
- **CUDA** (Philox-4x32-10): a 64-bit key (`manual_seed` keeps all 64 bits there) and a random starting offset, a
  multiple of 4 below 2^62 (the offset must be a multiple of 4; below 2^62 it cannot wrap in any run): 124 bits.

`insecure_seed` never comes here: a fixed seed seeds with `manual_seed`, exactly as before, for tests.
"""

from __future__ import annotations

import os
import struct
from typing import Callable

import torch

__all__ = ["os_generator", "MT_WORDS", "MT_BYTES", "PHILOX_BYTES"]

MT_WORDS = 624  # the Mersenne Twister's state: 624 words of 32 bits
MT_BYTES = 4 * MT_WORDS  # OS entropy a CPU generator takes
PHILOX_BYTES = 16  # a CUDA generator's: 8 for the key, 8 for the offset (of which 60 bits are kept)

# torch's CPUGeneratorImplState (aten/src/ATen/CPUGeneratorImpl.cpp), as `get_state()` returns it, little-endian:
# uint64 the_initial_seed; int32 left; int32 seeded; uint64 next; uint64 state[624] (each word's low 32 bits are the
# twister's); double normal_x, normal_y, normal_rho; int32 normal_is_valid (padded to 8); float next_float_normal;
# bool its validity (padded to 8).
_HEAD = struct.Struct("<QiiQ")
_STATE = 24  # offset of state[0]
_SIZE = 5056
_PROBE_SEED = 0x1234567890ABCDEF  # a 64-bit seed whose high half manual_seed drops: what the layout check seeds


def os_generator(device: torch.device | str, *, urandom: Callable[[int], bytes] | None = None) -> torch.Generator:
    """A generator on `device` whose whole state is drawn from the OS (`urandom`: `os.urandom`, read when called)."""
    urandom = os.urandom if urandom is None else urandom
    device = torch.device(device)
    generator = torch.Generator(device=device)
    if device.type == "cpu":
        _fill_mt19937(generator, urandom)
    elif device.type == "cuda":
        key = _draw(urandom, 8)
        offset = _draw(urandom, 8)
        generator.manual_seed(int.from_bytes(key, "little"))
        generator.set_offset(4 * (int.from_bytes(offset, "little") >> 4))
    else:
        raise RuntimeError(f"no noise generator for device type {device.type!r}: govtrain seeds cpu and cuda "
                           "generators from the OS with their whole state")
    return generator


def _draw(urandom: Callable[[int], bytes], size: int) -> bytes:
    drawn = urandom(size)
    if type(drawn) is not bytes or len(drawn) != size:
        raise RuntimeError(f"the OS entropy source returned {len(drawn) if isinstance(drawn, bytes) else drawn!r} "
                           f"bytes, not {size}")
    return drawn


def _fill_mt19937(generator: torch.Generator, urandom: Callable[[int], bytes]) -> None:
    _check_layout()
    state = bytearray(generator.get_state().numpy().tobytes())
    while True:
        words = struct.unpack(f"<{MT_WORDS}I", _draw(urandom, MT_BYTES))
        if words[0] >> 31 or any(words[1:]):  # the twister uses state[0]'s top bit and the other words: never all 0
            break
    # the_initial_seed 0 (`initial_seed()` means nothing for such a generator), left 1, seeded, next 0: a fresh
    # seeding's position
    _HEAD.pack_into(state, 0, 0, 1, 1, 0)
    struct.pack_into(f"<{MT_WORDS}Q", state, _STATE, *words)
    state[_STATE + 8 * MT_WORDS:] = bytes(len(state) - _STATE - 8 * MT_WORDS)  # no cached normal sample
    generator.set_state(torch.frombuffer(state, dtype=torch.uint8).clone())
    if generator.get_state().numpy().tobytes() != bytes(state):
        raise RuntimeError("torch did not take the generator state govtrain drew: refusing to draw noise from it")


def _check_layout() -> None:
    """Refuse a torch whose CPU generator state is not the layout `_fill_mt19937` writes: seed one the ordinary way
    and find the seed's low word, the position and the next word of the twister's initialisation where they belong."""
    probe = torch.Generator().manual_seed(_PROBE_SEED)
    raw = probe.get_state().numpy().tobytes()
    low = _PROBE_SEED & 0xFFFFFFFF
    second = (1812433253 * (low ^ (low >> 30)) + 1) & 0xFFFFFFFF
    if len(raw) != _SIZE or _HEAD.unpack_from(raw, 0)[1:] != (1, 1, 0) \
            or struct.unpack_from("<2Q", raw, _STATE) != (low, second):
        raise RuntimeError(f"torch {torch.__version__}'s CPU generator state is not the layout govtrain fills from the "
                           "OS (aten CPUGeneratorImplState): refusing to seed noise with manual_seed's 32 bits")
