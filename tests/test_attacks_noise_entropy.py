"""Attack: guess the noise generator's seed and subtract the noise (docs/privatizers.md, "The noise generator's
entropy"). torch's CPU `manual_seed` keeps the low 32 bits of its seed, so a router seeded with
`manual_seed(64 bits of os.urandom)` had 2^32 possible noise streams: with one released step, an attacker tries
them all and subtracts the noise. The router (and an i.i.d. Gaussian that seeds its own generator) now draws the
generator's whole state from the OS (`govtrain.privatizers.entropy`)."""

from __future__ import annotations

import os
import struct

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from govtrain.privatizers import entropy  # noqa: E402
from govtrain.privatizers.base import Slot  # noqa: E402
from govtrain.privatizers.gaussian import IIDGaussian  # noqa: E402
from govtrain.resolver.model import describe  # noqa: E402
from govtrain.resolver.profile import resolve  # noqa: E402
from govtrain.routing.router import Router  # noqa: E402
from tests.test_routing import CLASSES, model  # noqa: E402

LOW = b"\x5e\xed\x00\x01"  # the low 32 bits (big-endian bytes 4-8) two OS draws share


class Entropy:
    """A stand-in for os.urandom: a fixed stream of bytes whose first 8 are `high` + LOW (so `int.from_bytes(first 8,
    "big")` has the low 32 bits LOW), the rest a function of `tag`; counts what it handed out."""

    def __init__(self, high: bytes, tag: bytes) -> None:
        import hashlib

        tail = b"".join(hashlib.sha256(tag + i.to_bytes(4, "big")).digest() for i in range(200))
        self.stream, self.taken = high + LOW + tail, 0

    def __call__(self, size: int) -> bytes:
        out = self.stream[self.taken:self.taken + size]
        self.taken += size
        return out


def _noise(router: Router) -> dict[str, torch.Tensor]:
    groups = [group for group in router.resolution.groups if group.classes]
    router.noise_only({group.classes: 1.0 for group in groups}, expected_batch_size=1.0)
    return {name: p.grad.clone() for name, p in router.params.items() if p.grad is not None}


def _router(net, monkeypatch, source: Entropy) -> Router:
    monkeypatch.setattr(os, "urandom", source)
    try:
        return Router(net, resolve(CLASSES, describe(net)))
    finally:
        monkeypatch.undo()


def test_manual_seed_keeps_32_bits_on_the_cpu_which_is_the_attack():
    """The premise: two 64-bit seeds equal in their low 32 bits give one stream under manual_seed."""
    first = int.from_bytes(b"\xaa" * 4 + LOW, "big")
    second = int.from_bytes(b"\xbb" * 4 + LOW, "big")
    draws = [torch.randn(64, generator=torch.Generator().manual_seed(seed)) for seed in (first, second)]
    assert first != second and torch.equal(*draws)


def test_routers_whose_first_os_bytes_share_their_low_32_bits_draw_different_noise(monkeypatch):
    """Two routers built without a seed, where the 8 bytes the old code took from os.urandom agree in the low 32 bits
    (so the old routers drew one noise stream) and the rest of the OS's bytes differ: their noise differs, and each
    took its generator's whole state, 624 words of 32 bits, from the OS."""
    net = model(torch.float64)
    first_source, second_source = Entropy(b"\xaa" * 4, b"first"), Entropy(b"\xbb" * 4, b"second")
    first, second = _router(net, monkeypatch, first_source), _router(net, monkeypatch, second_source)
    seeded = [router.generator.get_state().numpy().tobytes() for router in (first, second)]  # before any draw
    first_noise = _noise(first)
    second_noise = _noise(second)
    assert first_noise.keys() == second_noise.keys() and first_noise
    assert all(not torch.equal(first_noise[name], second_noise[name]) for name in first_noise)
    for state, source in zip(seeded, (first_source, second_source)):
        assert source.taken == entropy.MT_BYTES and 8 * source.taken >= 19_000
        words = struct.unpack_from(f"<{entropy.MT_WORDS}Q", state, 24)
        assert words == struct.unpack(f"<{entropy.MT_WORDS}I", source.stream[:entropy.MT_BYTES])  # every bit kept
    first.close()
    second.close()

    # one byte of the 2,496 changed, deep in the state: another stream (the state is the OS's bytes, not a digest)
    changed = Entropy(b"\xaa" * 4, b"first")
    changed.stream = changed.stream[:2000] + bytes([changed.stream[2000] ^ 1]) + changed.stream[2001:]
    third = _router(net, monkeypatch, changed)
    assert not torch.equal(next(iter(_noise(third).values())), next(iter(first_noise.values())))
    third.close()


def test_an_iid_gaussian_that_seeds_its_own_generator_takes_the_whole_state_from_the_os(monkeypatch):
    source = Entropy(b"\xaa" * 4, b"own")
    monkeypatch.setattr(os, "urandom", source)
    total = torch.zeros(8, dtype=torch.float64)
    privatizer = IIDGaussian()
    state = privatizer.init([Slot(key="w", shape=total.shape, dtype=total.dtype, device=total.device)])
    privatizer.update({"w": total}, state, std={"w": 1.0})
    monkeypatch.undo()
    assert source.taken == entropy.MT_BYTES
    expected = torch.normal(0.0, 1.0, size=(8,), dtype=torch.float64,
                            generator=entropy.os_generator("cpu", urandom=Entropy(b"\xaa" * 4, b"own")))
    assert torch.equal(total, expected)
    old = torch.Generator().manual_seed(int.from_bytes(source.stream[:8], "big"))  # what the old code drew
    assert not torch.equal(total, torch.normal(0.0, 1.0, size=(8,), dtype=torch.float64, generator=old))


def test_the_insecure_seed_path_is_manual_seed_as_before():
    net = model(torch.float64)
    router = Router(net, resolve(CLASSES, describe(net)), insecure_seed=7)
    assert torch.equal(router.generator.get_state(), torch.Generator().manual_seed(7).get_state())
    router.close()


def test_a_short_os_read_or_a_torch_with_another_state_layout_is_refused(monkeypatch):
    """Never a weaker seed: a short read from the entropy source, or a generator state laid out otherwise than the
    layout check finds it (as a torch whose CPUGeneratorImplState changed would), raises before any noise."""
    with pytest.raises(RuntimeError, match="bytes"):
        entropy.os_generator("cpu", urandom=lambda size: bytes(size - 1))
    monkeypatch.setattr(entropy, "_STATE", 32)
    with pytest.raises(RuntimeError, match="layout"):
        entropy.os_generator("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the Philox generator is seeded with key + offset")
def test_a_cuda_generator_takes_a_64_bit_key_and_a_random_offset():
    first, second = Entropy(b"\xaa" * 4, b"cuda"), Entropy(b"\xbb" * 4, b"cuda")
    generators = [entropy.os_generator("cuda", urandom=source) for source in (first, second)]
    for generator, source in zip(generators, (first, second)):
        assert source.taken == entropy.PHILOX_BYTES
        assert generator.initial_seed() == int.from_bytes(source.stream[:8], "little")  # all 64 bits kept
        assert generator.get_offset() == 4 * (int.from_bytes(source.stream[8:16], "little") >> 4)
    draws = [torch.randn(64, device="cuda", generator=g) for g in generators]
    assert not torch.equal(*draws)
