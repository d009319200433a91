"""The router's materialized path (govtrain/routing/materialized.py) for the noise families: its L2 clipped sum
equals the router's own ghost/weighted-sum path, its L1 clipping matches a dense per-sample reference
(torch.func.grad, one example at a time: vmap cannot run through transformers' data-dependent attention
masking), and its quantised sum moves by one unit's integer vector, of L2 norm at most the accountant's Δ₂, when
that unit is removed."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

import torch.nn.functional as F  # noqa: E402
from torch.func import functional_call, grad  # noqa: E402

from govtrain import units  # noqa: E402
from govtrain.accounting.families import Lattice  # noqa: E402
from govtrain.errors import Code, ConfigError  # noqa: E402
from govtrain.privatizers.families.discrete_gaussian import DiscreteGaussian  # noqa: E402
from govtrain.privatizers.families.laplace import Laplace  # noqa: E402
from govtrain.resolver.model import describe  # noqa: E402
from govtrain.resolver.profile import resolve  # noqa: E402
from govtrain.routing.router import Router  # noqa: E402
from tests.test_routing import CLASSES, batch, losses_of, model  # noqa: E402


class _PlainL2:
    """The Gaussian's clipping, asked of the materialized path."""

    name, norm, quantized = "l2-reference", "l2", False


def _grads(net) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in net.named_parameters() if p.requires_grad}


def _dense_per_sample(net, resolution, ids, attention, labels, classes):
    """Each example's gradient by torch.func.grad, restricted to its class's reach: {name: [n, *shape]} per
    example, as a list."""
    params = {n: p.detach() for n, p in net.named_parameters() if p.requires_grad}
    reach = {c: {part.name: part for part in parts} for c, parts in resolution.reach.items()}

    def loss(p, i):
        logits = functional_call(net, p, (), {"input_ids": ids[i:i + 1], "attention_mask": attention[i:i + 1]}).logits
        return F.cross_entropy(logits, labels[i:i + 1])

    out = []
    for i, data_class in enumerate(classes):
        g = grad(loss)(params, i)
        kept = {}
        for name, part in reach[data_class].items():
            value = g[name]
            if part.dim is not None:
                keep = torch.zeros(value.shape[part.dim], dtype=value.dtype)
                keep[list(part.index)] = 1
                value = value * keep.reshape([-1 if d == part.dim else 1 for d in range(value.dim())])
            kept[name] = value
        out.append(kept)
    return out


def test_its_l2_clipped_sum_equals_the_routers_own_path():
    net = model()
    resolution = resolve(CLASSES, describe(net))
    ids, attention, labels, classes, clip = batch()
    own = Router(net, resolution, insecure_seed=0)
    with own.capture():
        losses = losses_of(net, ids, attention, labels)
    expected_report = own.privatize(losses, classes, clip, {}, expected_batch_size=1.0)
    expected = _grads(net)
    own.close()
    router = Router(net, resolution, insecure_seed=0)
    router.materialize(_PlainL2())
    with router.capture():
        losses = losses_of(net, ids, attention, labels)
    report = router.privatize(losses, classes, clip, {}, expected_batch_size=1.0)
    got = _grads(net)
    assert report.clipped == expected_report.clipped and 0 < report.clipped < len(classes)
    assert report.max_norm == pytest.approx(expected_report.max_norm, rel=1e-12)
    compared = 0
    for name, value in expected.items():
        if value is None:
            assert got[name] is None
            continue
        assert torch.allclose(got[name], value, rtol=1e-12, atol=1e-14), name
        compared += 1
    assert compared > 10


def test_l1_clipping_matches_a_dense_per_sample_reference():
    net = model()
    resolution = resolve(CLASSES, describe(net))
    ids, attention, labels, classes, clip = batch()
    dense = _dense_per_sample(net, resolution, ids, attention, labels, classes)
    l1 = [sum(float(g.abs().sum()) for g in grads.values()) for grads in dense]
    hair = clip * (1 - 8 * torch.finfo(torch.float64).eps)  # the router clips a hair under C_i
    expected: dict[str, torch.Tensor] = {}
    for i, grads in enumerate(dense):
        factor = min(1.0, float(hair[i]) / l1[i])
        for name, value in grads.items():
            expected[name] = expected.get(name, torch.zeros_like(value)) + factor * value
    router = Router(net, resolution, insecure_seed=0)

    class _L1:
        name, norm, quantized = "l1-reference", "l1", False

    router.materialize(_L1())
    with router.capture():
        losses = losses_of(net, ids, attention, labels)
    report = router.privatize(losses, classes, clip, {}, expected_batch_size=1.0)
    assert report.max_norm == pytest.approx(max(l1), rel=1e-10)
    assert report.clipped == sum(n > float(c) * (1 - 8 * 2.3e-16) for n, c in zip(l1, clip))
    got = _grads(net)
    for name, value in expected.items():
        assert torch.allclose(got[name], value, rtol=1e-9, atol=1e-12), name


def _quantised_sum(net, resolution, privatizer, members, group_std, clip_all, seed_of) -> dict[str, torch.Tensor]:
    """The step's quantised clipped sum (lattice units) of the examples `members`, one per chunk, the router's
    generator re-seeded per example: an example's rounding draws are the same whoever else is in the step."""
    ids, attention, labels, classes, _ = batch()
    router = Router(net, resolution, insecure_seed=0)
    router.materialize(privatizer)
    router.begin(group_std)
    for i in members:
        router.generator.manual_seed(seed_of(i))
        with router.capture():
            losses = losses_of(net, ids[i:i + 1], attention[i:i + 1], labels[i:i + 1])
        router.accumulate(losses, [classes[i]], clip_all[i:i + 1])
    totals = {n: t.clone() for n, t in router._totals.items()}
    router.close()
    return totals


def test_removing_one_unit_moves_the_quantised_sum_by_one_integer_vector_within_delta_2():
    net = model()
    resolution = resolve(CLASSES, describe(net))
    _, _, _, classes, _ = batch()
    clip = torch.full((len(classes),), 0.05, dtype=torch.float64)  # every example clipped: norm C_i
    privatizer = DiscreteGaussian(granularity_bits=6, beta_exp=40)
    privatizer.bind(sum(p.numel() for p in net.parameters() if p.requires_grad))
    group_std = {group.classes: 0.05 * (1.0 + 0.25 * k) for k, group in enumerate(resolution.groups)
                 if group.classes}  # s_g ≥ σ·C with σ ≥ 1, different per group
    seeds = lambda i: 1000 + i  # noqa: E731
    whole = _quantised_sum(net, resolution, privatizer, range(len(classes)), group_std, clip, seeds)
    for removed in range(len(classes)):
        rest = _quantised_sum(net, resolution, privatizer, [i for i in range(len(classes)) if i != removed],
                              group_std, clip, seeds)
        diff = torch.cat([(whole[n] - rest[n]).flatten() for n in whole])
        assert torch.equal(diff, torch.round(diff))
        # the unit's charged multiplier: min over its groups of s_g / C, rounded down as the scheduler does
        reached = [g for g in resolution.groups if classes[removed] in g.classes and g.classes in group_std]
        sigma_u = math.floor(min(group_std[g.classes] for g in reached) / 0.05 * units.MICRO)
        delta_2 = Lattice((6, 40, privatizer.dimension)).l2(sigma_u)
        norm = float(diff.norm())
        assert 0 < norm <= delta_2
        assert norm >= 0.5 * Lattice((6, 40, privatizer.dimension)).span(sigma_u)  # it is the unit's whole vector


def test_a_quantised_step_releases_integer_multiples_of_the_spacing():
    """The sum (lattice integers) through the privatizer's update: every released coordinate is (integer sum +
    integer noise) times its group's spacing, and the noise is s_g wide."""
    net = model()
    resolution = resolve(CLASSES, describe(net))
    ids, attention, labels, classes, clip = batch()
    for privatizer in (DiscreteGaussian(granularity_bits=8, insecure_seed=3), Laplace(granularity_bits=8,
                                                                                        insecure_seed=3)):
        privatizer.bind(sum(p.numel() for p in net.parameters() if p.requires_grad))
        group_std = {group.classes: 0.2 for group in resolution.groups if group.classes}
        router = Router(net, resolution, insecure_seed=0)
        router.materialize(privatizer)
        router.begin(group_std)
        with router.capture():
            losses = losses_of(net, ids, attention, labels)
        router.accumulate(losses, classes, clip)
        totals = router._totals
        sums, std, keep = {}, {}, {}
        for group in resolution.groups:
            if not group.classes:
                continue
            for part in group.parts:
                key = f"{part.name}@{'+'.join(sorted(group.classes))}"
                sums[key], std[key] = totals[part.name], group_std[group.classes]
                if part.dim is None:
                    keep[key] = None
                else:
                    mask = torch.zeros(totals[part.name].shape[part.dim], dtype=torch.float64)
                    mask[list(part.index)] = 1
                    keep[key] = mask.reshape([-1 if d == part.dim else 1 for d in range(totals[part.name].dim())])
        before = {k: v.clone() for k, v in sums.items()}
        state = tuple(sums)
        noisy, _ = privatizer.update(sums, state, std=std, keep=keep)
        spacing = privatizer.spacing(0.2)
        released = torch.cat([noisy[k].flatten() for k in noisy]) / spacing
        assert torch.allclose(released, torch.round(released), atol=1e-6)
        noise = torch.cat([(noisy[k] / spacing - before[k]).flatten() for k in noisy])
        assert noise.std().item() == pytest.approx(2 ** 8 * (math.sqrt(2) if privatizer.norm == "l1" else 1),
                                                   rel=0.05)
        router.close()


def test_the_materialized_path_refuses_what_it_cannot_serve():
    net = model()
    resolution = resolve(CLASSES, describe(net))
    for mechanism in ("dp-muon",):
        router = Router(net, resolution, mechanism=mechanism, insecure_seed=0)
        with pytest.raises(ConfigError) as refused:
            router.materialize(DiscreteGaussian())
        assert refused.value.code is Code.MECHANISM_UNSUPPORTED and router.materialized is None
        router.close()
    router = Router(net, resolution, insecure_seed=0)
    router.materialize(DiscreteGaussian(dimension=10**6))
    ids, attention, labels, classes, clip = batch()
    router.begin()  # no group noise: the lattice is unknown
    with router.capture():
        losses = losses_of(net, ids, attention, labels)
    with pytest.raises(RuntimeError, match="group noise"):
        router.accumulate(losses, classes, clip)
    assert router._totals is None  # nothing summed


def test_a_chunk_over_the_size_limit_is_refused_before_anything_is_formed(monkeypatch):
    """A class whose [units, D_class] would exceed the path's limit (here a fake limit of one unit's width less
    one, so no large tensor is ever needed) is refused with materialized_too_large before any per-sample gradient
    is formed or summed; at the limit itself the same chunk goes through."""
    from govtrain.routing import persample

    net = model()
    resolution = resolve(CLASSES, describe(net))
    ids, attention, labels, classes, clip = batch()
    formed = []
    own = persample.Calls.per_sample
    monkeypatch.setattr(persample.Calls, "per_sample", lambda self, *a, **k: formed.append(1) or own(self, *a, **k))
    privatizer = Laplace(granularity_bits=8, insecure_seed=0)
    privatizer.bind(sum(p.numel() for p in net.parameters() if p.requires_grad))
    group_std = {group.classes: 0.2 for group in resolution.groups if group.classes}
    widest = max(sum(net.get_parameter(part.name).numel() for part in parts) * classes.count(c)
                 for c, parts in resolution.reach.items() if c in classes)
    for limit, refused in ((widest - 1, True), (widest, False)):
        router = Router(net, resolution, insecure_seed=0)
        router.materialize(privatizer)
        router.materialized.max_elements = limit
        router.begin(group_std)
        with router.capture():
            losses = losses_of(net, ids, attention, labels)
        if refused:
            with pytest.raises(ConfigError) as error:
                router.accumulate(losses, classes, clip)
            assert error.value.code is Code.MATERIALIZED_TOO_LARGE and str(limit) in str(error.value)
            assert formed == [] and router._totals is None and all(p.grad is None for p in router.params.values())
        else:
            router.accumulate(losses, classes, clip)
            assert formed and router._totals is not None
        router.close()
