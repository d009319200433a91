"""PRISM and DP-Muon inside the routing layer: against batch-size-1 oracles, with per-class depth masks."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from govtrain.errors import ConfigError  # noqa: E402
from govtrain.mechanisms.tangent_space import canonical, tangent_dimension, tangent_matrix  # noqa: E402
from govtrain.mechanisms.update import Update  # noqa: E402
from govtrain.resolver.model import describe  # noqa: E402
from govtrain.resolver.profile import resolve  # noqa: E402
from govtrain.resolver.reach import lora_pairs  # noqa: E402
from govtrain.routing.router import Router  # noqa: E402
from govtrain.train.config import RunFile  # noqa: E402
from tests.test_resolver import cls  # noqa: E402
from tests.test_routing import (CLASSES, assert_removing_one_moves_the_release_by_at_most_its_clip_norm, batch,  # noqa: E402
                                clipped_sums, losses_of, model, per_sample, three_steps)

# PRISM needs whole LoRA pairs: a band instead of the heads profile of tests/test_routing.py
WHOLE = {"public": CLASSES["public"], "sensitive": cls("sensitive", band=(1, 2))}


def oracle_tangent(A, B, gA, gB):
    """P_{A,B}(G) from the factor gradients, with explicit pseudo-inverses and m × n matrices:
    Π_A G = A M† gBᵀ, G Π_B = gA N† Bᵀ, Π_A G Π_B = A M† Aᵀ gA N† Bᵀ."""
    Mp, Np = torch.linalg.pinv(A.T @ A), torch.linalg.pinv(B.T @ B)
    return A @ Mp @ gB.T + gA @ Np @ B.T - A @ Mp @ A.T @ gA @ Np @ B.T


def test_prism_clipped_sum_equals_the_batch_size_one_loop_in_the_tangent_space():
    net = model()
    resolution = resolve(WHOLE, describe(net))
    ids, attention, labels, classes, clip = batch()
    params = dict(net.named_parameters())
    pairs = lora_pairs(n for n, p in params.items() if p.requires_grad)
    assert len(pairs) == 12  # three modules in each of four layers
    factors = {b: (params[b].detach(), params[a].detach().T) for b, a in pairs.items()}
    expected_pair = {b: 0 for b in pairs}
    expected_other: dict[str, torch.Tensor] = {}
    for i, grads in enumerate(per_sample(net, resolution, ids, attention, labels, classes)):
        tangent = {b: oracle_tangent(*factors[b], grads[b], grads[a].T) for b, a in pairs.items() if b in grads}
        other = {n: g for n, g in grads.items() if n not in pairs and n not in pairs.values()}
        norm = math.sqrt(sum(float(z.pow(2).sum()) for z in tangent.values())
                         + sum(float(g.pow(2).sum()) for g in other.values()))
        factor = min(1.0, float(clip[i]) / norm)
        for b, z in tangent.items():
            expected_pair[b] = expected_pair[b] + factor * z
        for n, g in other.items():
            expected_other[n] = expected_other.get(n, 0) + factor * g
    router = Router(net, resolution, mechanism="prism", insecure_seed=0)
    with router.capture():
        losses = losses_of(net, ids, attention, labels)
    report = router.privatize(losses, classes, clip, {}, expected_batch_size=1.0)
    assert 0 < report.clipped < 6
    for b, a in pairs.items():
        A, B = factors[b]
        if ".layer.0." in b:
            assert params[b].grad is None and params[a].grad is None  # no class reaches layer 0
            continue
        gA, gB = params[b].grad, params[a].grad.T
        assert torch.allclose(tangent_matrix(A, B, gA, gB), expected_pair[b], atol=1e-10), b
        canonical_A, canonical_B = canonical(A, B, gA, gB)  # what is written is the canonical lift
        assert torch.allclose(canonical_A, gA, atol=1e-10) and torch.allclose(canonical_B, gB, atol=1e-10)
    assert expected_other  # the classifier, the embedding and the layer norm go through the Euclidean path
    for name, value in expected_other.items():
        assert torch.allclose(params[name].grad, value, atol=1e-10), name


def test_prism_sensitivity_in_the_intrinsic_metric_is_the_clip_norm():
    net = model()
    resolution = resolve(WHOLE, describe(net))
    ids, attention, labels, classes, clip = batch()
    router = Router(net, resolution, mechanism="prism", insecure_seed=0)
    params = dict(net.named_parameters())
    pairs = router.pairs

    def released(keep):
        with router.capture():
            losses = losses_of(net, ids[keep], attention[keep], labels[keep])
        router.privatize(losses, [classes[i] for i in keep], clip[keep], {}, expected_batch_size=1.0)
        out = {}
        for name, param in params.items():
            if param.grad is None or name in pairs.values():
                continue
            out[name] = (tangent_matrix(param.detach(), params[pairs[name]].detach().T, param.grad,
                                        params[pairs[name]].grad.T) if name in pairs else param.grad.clone())
        return out

    assert_removing_one_moves_the_release_by_at_most_its_clip_norm(released, clip)


def test_dp_muon_sensitivity_is_the_clip_norm_although_each_matrix_is_clipped_on_its_own():
    net = model()
    resolution = resolve(CLASSES, describe(net))
    router = Router(net, resolution, mechanism="dp-muon", insecure_seed=0)
    assert_removing_one_moves_the_release_by_at_most_its_clip_norm(clipped_sums(net, router), batch()[-1])


def test_prism_noise_is_the_groups_standard_deviation_on_each_tangent_space():
    net = model(torch.float32)
    resolution = resolve(WHOLE, describe(net))
    router = Router(net, resolution, mechanism="prism", insecure_seed=11)
    stds = {group.classes: 0.5 + i for i, group in enumerate(g for g in resolution.groups if g.classes)}
    params = dict(net.named_parameters())
    ratios, euclidean = [], []
    for _ in range(40):
        router.noise_only(stds, expected_batch_size=4.0)
        for group in (g for g in resolution.groups if g.classes):
            std = stds[group.classes] / 4.0
            for part in group.parts:
                name = part.name
                if name in router.pairs:
                    A, B = params[name].detach(), params[router.pairs[name]].detach().T
                    dZ = tangent_matrix(A, B, params[name].grad, params[router.pairs[name]].grad.T)
                    ratios.append(float(dZ.pow(2).sum()) / (std ** 2 * tangent_dimension(A.shape[0], B.shape[0], 3)))
                    assert router.noise_std[name] == pytest.approx(std)
                elif name not in router.pairs.values():  # E[g²] = std², pooled over every coordinate
                    euclidean.append((float(params[name].grad.pow(2).sum()), params[name].numel() * std ** 2))
    assert len(ratios) == 40 * 9  # nine pairs reached (three modules in layers 1-3), one ratio each per draw
    assert abs(sum(ratios) / len(ratios) - 1) < 0.03
    assert abs(sum(s for s, _ in euclidean) / sum(e for _, e in euclidean) - 1) < 0.05


def test_prism_refuses_a_heads_profile_that_splits_a_lora_pair():
    net = model(torch.float32)
    resolution = resolve(CLASSES, describe(net))  # "sensitive" reaches head 1 of layer 3: rows of lora_B only
    with pytest.raises(ConfigError) as info:
        Router(net, resolution, mechanism="prism")
    assert info.value.code.value == "mechanism_unsupported" and "'sensitive'" in info.value.detail
    Router(net, resolution, mechanism="dp-muon")  # per-matrix clipping has no such limit
    with pytest.raises(ValueError):
        Router(net, resolution, mechanism="magic")


def test_dp_muon_clips_every_parameter_on_its_own_to_its_share_of_the_clip_norm():
    net = model()
    resolution = resolve(CLASSES, describe(net))  # heads included
    ids, attention, labels, classes, clip = batch()
    units = {c: len(parts) for c, parts in resolution.reach.items()}
    expected: dict[str, torch.Tensor] = {}
    for i, grads in enumerate(per_sample(net, resolution, ids, attention, labels, classes)):
        share = float(clip[i]) / math.sqrt(units[classes[i]])
        contribution = 0.0
        for name, g in grads.items():
            norm = float(g.norm())
            clipped = g * min(1.0, share / norm) if norm > 0 else g
            contribution += float(clipped.pow(2).sum())
            expected[name] = expected.get(name, 0) + clipped
        assert math.sqrt(contribution) <= float(clip[i]) * (1 + 1e-12)  # the joint norm stays within C_i
    router = Router(net, resolution, mechanism="dp-muon", insecure_seed=0)
    with router.capture():
        losses = losses_of(net, ids, attention, labels)
    report = router.privatize(losses, classes, clip, {}, expected_batch_size=1.0)
    assert report.clipped > 0
    for name, param in net.named_parameters():
        if name in expected:
            assert torch.allclose(param.grad, expected[name], atol=1e-10), name


def run_file(mechanism: str, **sections) -> RunFile:
    return RunFile.model_validate({"model": {"base": "minilm"}, "optimizer": {"name": "adamw", "lr": 0.1},
                                   "training": {"mechanism": mechanism, "steps": 1, "data": "d", "output": "o"},
                                   **sections})


def update_step(router, update):
    def step() -> None:
        update.step(router.noise_std)
        update.zero_grad()

    return step


@pytest.mark.parametrize("mechanism", ["prism", "dp-muon"])
def test_out_of_band_parameters_never_move_and_each_parameter_has_one_owner(mechanism):
    net = model(torch.float32)
    classes = {"sensitive": cls("sensitive", band=(1, 1), head=True)}
    resolution = resolve(classes, describe(net))
    router = Router(net, resolution, mechanism=mechanism, insecure_seed=3)
    update = Update.build(net, run_file(mechanism))
    trainable = {n for n, p in net.named_parameters() if p.requires_grad}
    optimizer_params = {id(p) for g in (update.optimizer.param_groups if update.optimizer else []) for p in g["params"]}
    owned = {n for n, p in net.named_parameters() if id(p) in optimizer_params}
    if mechanism == "prism":
        special = {n for pair in update.prism.pairs.values() for n, p in net.named_parameters() if p is pair[0] or p is pair[1]}
    else:
        special = set(update.muon.params)
        assert all(".lora_" in n for n in special)  # the stack's matrices; the classifier stays with AdamW
    assert special and owned and not special & owned and special | owned == trainable
    outside = {n: p.detach().clone() for n, p in net.named_parameters()
               if p.requires_grad and ".layer.1." not in n and "classifier" not in n and "word_embeddings" not in n}
    before = {n: p.detach().clone() for n, p in net.named_parameters() if ".layer.1." in n and p.requires_grad}
    three_steps(net, resolution, router, update_step(router, update))
    for name, value in outside.items():
        assert torch.equal(net.get_parameter(name), value), name
    assert all(not torch.equal(net.get_parameter(n), v) for n, v in before.items())  # what is reached moves
    if update.optimizer is not None:
        for param in update.optimizer.state:
            assert any(param is net.get_parameter(n) for n in trainable if ".layer.1." in n or "classifier" in n
                       or "word_embeddings" in n)
    state = update.state_dict()
    again = Update.build(net, run_file(mechanism))
    again.load_state_dict(state)
    with pytest.raises(ValueError):
        Update.build(net, run_file("dpsgd")).load_state_dict(state)


def test_dp_muon_leaves_the_coordinates_a_heads_profile_does_not_reach():
    net = model(torch.float32)
    classes = {"sensitive": cls("sensitive", band=(3, 3), heads=((3, (1,)),))}
    resolution = resolve(classes, describe(net))
    router = Router(net, resolution, mechanism="dp-muon", insecure_seed=4)
    update = Update.build(net, run_file("dp-muon"))
    parts = {part.name: part for part in resolution.reach["sensitive"]}
    before = {name: net.get_parameter(name).detach().clone() for name in parts}
    three_steps(net, resolution, router, update_step(router, update))
    for name, part in parts.items():
        after = net.get_parameter(name).detach()
        assert part.dim is not None
        moved = (after - before[name]).abs().sum(dim=1 - part.dim) > 0
        assert moved.nonzero().flatten().tolist() == list(part.index), name
