"""The noise-family privatizers (govtrain/privatizers/families): their public record, rebuilt as the verifier
rebuilds it, the charge it implies, and what `update` refuses to release."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from govtrain.accounting.families import epsilon_u  # noqa: E402
from govtrain.privatizers.base import Slot  # noqa: E402
from govtrain.privatizers.families.discrete_gaussian import DiscreteGaussian  # noqa: E402
from govtrain.privatizers.families.laplace import Laplace  # noqa: E402
from govtrain.privatizers.families.lattice import dimension_of  # noqa: E402
from govtrain.privatizers.families.skellam import Skellam  # noqa: E402

FAMILIES = (Laplace, DiscreteGaussian, Skellam)


def _slots() -> list[Slot]:
    cpu = torch.device("cpu")
    return [Slot(key="a.weight", shape=torch.Size([4, 3]), dtype=torch.float32, device=cpu),
            Slot(key="b.weight@public", shape=torch.Size([5]), dtype=torch.float32, device=cpu),
            Slot(key="b.weight@public+sensitive", shape=torch.Size([5]), dtype=torch.float32, device=cpu)]


@pytest.mark.parametrize("cls", FAMILIES)
def test_the_record_rebuilds_the_privatizer_and_its_charge(cls):
    privatizer = cls(granularity_bits=8, beta_exp=30)  # 8: Skellam's largest (SKELLAM_MAX_BITS)
    with pytest.raises(RuntimeError, match="dimension"):
        privatizer.record()  # nothing to record before the slots fix the dimension
    state = privatizer.init(_slots())
    assert state == ("a.weight", "b.weight@public", "b.weight@public+sensitive")
    assert dimension_of(_slots()) == 17 and privatizer.dimension == 17  # b.weight counted once
    record = privatizer.record()
    assert record == {"name": cls.name, "granularity_bits": 8, "beta_exp": 30, "dimension": 17}
    rebuilt = cls.from_record(record)
    charge = rebuilt.charge(sampling_rate_u=10_000, noise_multiplier_u=1_500_000, steps=20)
    assert charge == privatizer.charge(sampling_rate_u=10_000, noise_multiplier_u=1_500_000, steps=20)
    assert (charge.family, charge.params, charge.rounds) == (cls.family, (8, 30, 17), 20)
    assert epsilon_u("prv", 10**7, [charge]) > 0


@pytest.mark.parametrize("record", [
    {"name": "skellam", "granularity_bits": 12, "beta_exp": 30, "dimension": 17, "extra": 1},
    {"name": "skellam", "granularity_bits": "12"},
    {"name": "skellam", "granularity_bits": 12.0},
    {"name": "skellam", "granularity_bits": 0},
    {"name": "skellam", "granularity_bits": 25},
    {"name": "skellam", "beta_exp": 0},
    {"name": "skellam", "dimension": 0},
    {"name": "laplace", "granularity_bits": 12},
])
def test_a_record_it_did_not_write_is_refused(record):
    with pytest.raises(ValueError):
        Skellam.from_record(record)


def test_a_recorded_dimension_smaller_than_the_slots_is_refused():
    with pytest.raises(ValueError, match="recorded for"):
        DiscreteGaussian(dimension=10).init(_slots())


def test_update_refuses_a_sum_off_the_lattice_and_data_where_there_is_no_noise():
    privatizer = DiscreteGaussian(granularity_bits=4, insecure_seed=0)
    state = privatizer.init(_slots()[:1])
    off = {"a.weight": torch.full((4, 3), 0.5, dtype=torch.float64)}
    with pytest.raises(RuntimeError, match="lattice"):
        privatizer.update(off, state, std={"a.weight": 1.0})
    assert bool((off["a.weight"] == 0.5).all())  # nothing released
    data = {"a.weight": torch.ones(4, 3, dtype=torch.float64)}
    with pytest.raises(RuntimeError, match="no noise"):
        privatizer.update(data, state, std={"a.weight": 0.0})
    assert bool((data["a.weight"] == 1).all())


def test_a_split_parameter_is_released_slot_by_slot_in_place():
    """Two groups share b.weight (rows 0-1 and 2-4): each releases its own coordinates at its own spacing."""
    privatizer = Skellam(granularity_bits=3, insecure_seed=1)
    slots = _slots()[1:]
    state = privatizer.init(slots)
    total = torch.tensor([1.0, -2.0, 3.0, 0.0, 5.0], dtype=torch.float64)
    first, second = torch.tensor([1.0, 1, 0, 0, 0]), torch.tensor([0.0, 0, 1, 1, 1])
    sums = {"b.weight@public": total, "b.weight@public+sensitive": total}
    noisy, _ = privatizer.update(sums, state, std={"b.weight@public": 0.8, "b.weight@public+sensitive": 1.6},
                                 keep={"b.weight@public": first, "b.weight@public+sensitive": second})
    assert noisy["b.weight@public"] is total and noisy["b.weight@public+sensitive"] is total
    spacing = torch.where(first > 0, privatizer.spacing(0.8), privatizer.spacing(1.6))
    on_lattice = total / spacing
    assert torch.allclose(on_lattice, torch.round(on_lattice), atol=1e-9)


def _noise(privatizer, steps: int = 1) -> list[torch.Tensor]:
    state = privatizer.init(_slots()[:1])
    out = []
    for _ in range(steps):
        sums = {"a.weight": torch.zeros(4, 3, dtype=torch.float64)}
        out.append(privatizer.update(sums, state, std={"a.weight": 1.0})[0]["a.weight"].clone())
    return out


def test_the_noise_is_seeded_from_the_os_and_never_from_a_torch_generator():
    """Runs seed every step's noise from os.urandom: two privatizers given the same torch generator seed (the
    router's, which keeps 32 bits) still draw different noise, and a generator attribute is not read."""
    first, second = DiscreteGaussian(granularity_bits=5), DiscreteGaussian(granularity_bits=5)
    first.generator = torch.Generator().manual_seed(9)  # type: ignore[attr-defined]
    second.generator = torch.Generator().manual_seed(9)  # type: ignore[attr-defined]
    assert not torch.equal(_noise(first)[0], _noise(second)[0])


def test_an_insecure_seed_reproduces_the_noise_step_by_step():
    """Tests only: the same insecure seed gives the same noise stream, each step different from the last."""
    a = _noise(DiscreteGaussian(granularity_bits=5, insecure_seed=9), steps=2)
    b = _noise(DiscreteGaussian(granularity_bits=5, insecure_seed=9), steps=2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and bool(a[0].any())
    assert not torch.equal(a[0], a[1])
    assert "insecure_seed" not in DiscreteGaussian(dimension=3, insecure_seed=9).record()
    for seed in (-1, 1.5, "9"):
        with pytest.raises(ValueError):
            DiscreteGaussian(insecure_seed=seed)  # type: ignore[arg-type]
