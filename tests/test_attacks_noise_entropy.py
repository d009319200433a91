"""Attack class: brute-forcing the noise's seed. Adversary: anyone holding one released step (a model consumer
with two checkpoints). torch's CPU generator keeps only the low 32 bits of `manual_seed`'s seed, so a router
seeded that way from 8 OS bytes drew one of 2³² noise streams: enumerable, after which the noise is subtracted.
The router's generator now takes its whole state from the OS (`privatizers.entropy`)."""

from __future__ import annotations

import os

import pytest
import torch

from govtrain.privatizers import entropy


class _Counting:
    def __init__(self, fill=None) -> None:
        self.asked = 0
        self.fill = fill

    def __call__(self, n: int) -> bytes:
        self.asked += n
        return os.urandom(n) if self.fill is None else self.fill(n)


def test_the_cpu_generator_takes_its_whole_state_from_the_os():
    source = _Counting()
    made = entropy.generator("cpu", entropy=source)
    assert source.asked == 4 * 624  # every mt19937 word: 19,968 bits, not 32
    words = torch.frombuffer(bytearray(bytes(made.get_state().numpy())[24:24 + 8 * 624]), dtype=torch.int64)
    assert len(set(words.tolist())) > 600  # the words themselves, not one seed expanded


def test_two_states_equal_in_any_first_8_bytes_draw_different_noise():
    """What `manual_seed(int.from_bytes(os.urandom(8)))` could not tell apart is now 2^19936 states apart."""
    prefix = os.urandom(8)
    first = entropy.generator("cpu", entropy=lambda n: prefix + os.urandom(n - 8))
    second = entropy.generator("cpu", entropy=lambda n: prefix + os.urandom(n - 8))
    a = torch.normal(0.0, 1.0, size=(256,), generator=first, dtype=torch.float64)
    b = torch.normal(0.0, 1.0, size=(256,), generator=second, dtype=torch.float64)
    assert not torch.equal(a, b)
    for seed in (int.from_bytes(prefix, "big"), int.from_bytes(prefix, "big") & 0xFFFF_FFFF, 0):  # no seed replays it
        replay = torch.normal(0.0, 1.0, size=(256,), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        assert not torch.equal(a, replay)


def test_a_routers_noise_is_not_any_32_bit_seeds():
    pytest.importorskip("peft")
    from govtrain.resolver.model import describe
    from govtrain.resolver.profile import resolve
    from govtrain.routing.router import Router
    from tests.test_routing import CLASSES, model

    net = model()
    router = Router(net, resolve(CLASSES, describe(net)))  # as a run builds it: no insecure seed
    try:
        drawn = torch.normal(0.0, 1.0, size=(64,), generator=router.generator, dtype=torch.float64)
        assert router.generator.initial_seed() == 0  # it reports no seed: there was none
        for seed in range(0, 2048):  # a brute force's first candidates find nothing
            trial = torch.normal(0.0, 1.0, size=(64,), generator=torch.Generator().manual_seed(seed),
                                 dtype=torch.float64)
            assert not torch.equal(drawn, trial)
    finally:
        router.close()


def test_insecure_seed_draws_exactly_what_manual_seed_drew():
    """Seeded tests and goldens are unchanged: only the OS path changed."""
    a = torch.rand(32, generator=entropy.generator("cpu", 1234), dtype=torch.float64)
    b = torch.rand(32, generator=torch.Generator().manual_seed(1234), dtype=torch.float64)
    assert torch.equal(a, b)


def test_a_broken_entropy_source_is_refused():
    with pytest.raises(RuntimeError, match="zeros"):
        entropy.generator("cpu", entropy=lambda n: bytes(n))
    with pytest.raises(RuntimeError, match="too little"):
        entropy.generator("cpu", entropy=lambda n: os.urandom(n // 2))
