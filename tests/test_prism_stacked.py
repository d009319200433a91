"""PRISM in the routing layer moves its LoRA pairs as stacks of one shape (`routing.tangent`): against the
per-pair computation, and its noise against the distribution it must have.

The model has pairs of three shapes and two ranks (so two eigendecompositions per step, one of them for two
stacks), one pair starting at zero (a rank-deficient Gram matrix inside a stack), and two classes that reach
different pairs in one batch, so that each stack holds pairs of three noise groups.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from govtrain.mechanisms.tangent_space import (canonical, gram, grams, projected_sq_norm,  # noqa: E402
                                               tangent_dimension, tangent_lift, tangent_matrix, tangent_noise)
from govtrain.resolver.reach import lora_pairs  # noqa: E402
from govtrain.mechanisms.stacking import shape_groups  # noqa: E402
from govtrain.resolver.model import describe  # noqa: E402
from govtrain.resolver.profile import resolve  # noqa: E402
from govtrain.routing.router import Router  # noqa: E402
from tests.test_resolver import cls  # noqa: E402
from tests.test_routing import batch, losses_of, per_sample  # noqa: E402

F64 = torch.float64
CLASSES = {"public": cls("public", fraction_u=(500_000, 1_000_000), head=True),  # layers 2-3 and the head
           "sensitive": cls("sensitive", band=(1, 2))}  # layers 1-2


def model(seed: int = 0):
    """A four-layer BERT with LoRA on five projections: (m, n, r) = (16, 16, 3) for query, value and the
    attention output, (24, 16, 2) for the intermediate and (16, 24, 3) for the output dense; an embedding, a
    LayerNorm and the classifier trainable beside them (the Euclidean path)."""
    torch.manual_seed(seed)
    config = transformers.BertConfig(hidden_size=16, num_hidden_layers=4, num_attention_heads=2, intermediate_size=24,
                                     vocab_size=30, max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    lora = peft.LoraConfig(task_type="SEQ_CLS", r=3, rank_pattern={"intermediate.dense": 2},
                           target_modules=["query", "value", "attention.output.dense", "intermediate.dense",
                                           "output.dense"], init_lora_weights=False, lora_dropout=0.0)
    net = peft.get_peft_model(transformers.BertForSequenceClassification(config), lora).to(F64)
    inner = net.base_model.model.bert
    inner.embeddings.word_embeddings.weight.requires_grad_(True)
    inner.encoder.layer[3].output.LayerNorm.weight.requires_grad_(True)
    with torch.no_grad():  # a pair at peft's initialization: A = 0, M† = 0
        inner.encoder.layer[2].attention.self.query.lora_B.default.weight.zero_()
    net.eval()
    return net


def shapes_of(net) -> set[tuple[int, int, int]]:
    params = dict(net.named_parameters())
    return {(params[b].shape[0], params[a].shape[1], params[b].shape[1]) for b, a in lora_pairs(params).items()}


def reference_step(net, resolution, seed, ids, attention, labels, classes, clip, group_std, expected_batch_size):
    """The step pair by pair, from batch-size-1 gradients, through the per-pair functions: each sample
    clipped by the norm of its pairs' tangent parts and its other gradients, each pair's sum lifted, and
    noise drawn from a generator seeded as the router's, in the order the router documents (Ω_A, then Ω_B,
    of each stack of one shape; then the Euclidean parameters' noise, group by group). Returns the expected
    `.grad` of every parameter and every sample's norm."""
    params = {n: p for n, p in net.named_parameters() if p.requires_grad}
    pairs = lora_pairs(params)
    reached = {part.name for parts in resolution.reach.values() for part in parts}
    factors = {b: (params[b].detach(), params[a].detach().T) for b, a in pairs.items() if b in reached}
    pair_grams = {b: (gram(A), gram(B)) for b, (A, B) in factors.items()}
    sums = {n: torch.zeros_like(p) for n, p in params.items()}
    norms = []
    for i, grads in enumerate(per_sample(net, resolution, ids, attention, labels, classes)):
        square = sum(float(projected_sq_norm(*factors[name], g, grads[pairs[name]].T, grams=pair_grams[name]))
                     if name in pairs else float(g.pow(2).sum())
                     for name, g in grads.items() if name not in pairs.values())
        norms.append(math.sqrt(square))
        factor = min(1.0, float(clip[i]) / norms[-1])
        for name, g in grads.items():
            sums[name] += factor * g
    groups = [(g, float(group_std.get(g.classes, 0.0))) for g in resolution.groups if g.classes]
    std_of = {part.name: std for g, std in groups for part in g.parts}
    generator = torch.Generator().manual_seed(seed)
    for keys in shape_groups(factors, lambda f: (f[0].shape, f[1].shape)):
        (m, r), n = factors[keys[0]][0].shape, factors[keys[0]][1].shape[0]
        omega_A = torch.randn((len(keys), m, r), generator=generator, dtype=F64)
        omega_B = torch.randn((len(keys), n, r), generator=generator, dtype=F64)
        for i, b in enumerate(keys):
            A, B = factors[b]
            a = pairs[b]
            dA, dB = tangent_lift(A, B, sums[b], sums[a].T, grams=pair_grams[b])
            xi_A, xi_B = canonical(A, B, *tangent_noise(A, B, std_of[b], None, grams=pair_grams[b],
                                                        omega=(omega_A[i], omega_B[i])))
            sums[b], sums[a] = dA + xi_A, (dB + xi_B).T
    for g, std in groups:
        for part in g.parts:
            if part.name not in pairs and part.name not in pairs.values():
                assert part.dim is None  # no heads profile here
                sums[part.name] += torch.normal(0.0, std, size=sums[part.name].shape, generator=generator, dtype=F64)
    return {n: sums[n] / expected_batch_size if n in std_of else None for n in params}, norms


@pytest.mark.parametrize("chunks", [1, 2])
def test_the_stacked_step_is_the_per_pair_step_noise_included(chunks: int):
    net = model()
    assert shapes_of(net) == {(16, 16, 3), (24, 16, 2), (16, 24, 3)}
    resolution = resolve(CLASSES, describe(net))
    ids, attention, labels, classes, clip = batch(size=8)
    group_std = {g.classes: 0.3 + 0.2 * i for i, g in enumerate(g for g in resolution.groups if g.classes)}
    assert len(group_std) == 3  # {public}, {sensitive}, {public, sensitive}
    expected, norms = reference_step(net, resolution, 7, ids, attention, labels, classes, clip, group_std, 3.0)
    router = Router(net, resolution, mechanism="prism", insecure_seed=7)
    assert sorted(len(s.lora_B) for s in router.tangent.stacks) == [3, 3, 9]  # layers 1-3: 3 modules, 1, 1
    router.begin()
    reports = []
    for part in torch.arange(8).chunk(chunks):  # each sample clipped on its own, in whichever chunk it is
        with router.capture():
            losses = losses_of(net, ids[part], attention[part], labels[part])
        reports.append(router.accumulate(losses, [classes[i] for i in part], clip[part]))
    router.finish(group_std, 3.0)
    assert sum(r.clipped for r in reports) == sum(n > float(c) for n, c in zip(norms, clip))
    assert 0 < sum(r.clipped for r in reports) < 8
    assert max(r.max_norm for r in reports) == pytest.approx(max(norms), rel=1e-10)
    for name, param in net.named_parameters():
        if not param.requires_grad:
            continue
        if expected[name] is None:
            assert param.grad is None, name  # layer 0: no class reaches it
        else:
            assert torch.allclose(param.grad, expected[name], atol=1e-10, rtol=0), name


def test_the_stacked_noiseless_step_is_the_per_pair_step():
    net = model(seed=3)
    resolution = resolve(CLASSES, describe(net))
    ids, attention, labels, classes, clip = batch(size=6, seed=4)
    expected, _ = reference_step(net, resolution, 0, ids, attention, labels, classes, clip, {}, 1.0)
    router = Router(net, resolution, mechanism="prism", insecure_seed=0)
    with router.capture():
        losses = losses_of(net, ids, attention, labels)
    router.privatize(losses, classes, clip, {}, expected_batch_size=1.0)
    for name, value in expected.items():
        got = dict(net.named_parameters())[name].grad
        assert (got is None) == (value is None), name
        if value is not None:
            assert torch.allclose(got, value, atol=1e-10, rtol=0), name


def tangent_bases(A, B):
    """Orthonormal bases, as m·n × k matrices acting on row-major vec(Z), of the three orthogonal blocks of
    the tangent space at A Bᵀ (full rank): Π_A Z Π_B, Π_A Z (I − Π_B) and (I − Π_A) Z Π_B."""
    r = A.shape[1]
    U_A = torch.linalg.svd(A)[0]  # m × m: the first r columns span A's columns
    U_B = torch.linalg.svd(B)[0]
    Q_A, P_A, Q_B, P_B = U_A[:, :r], U_A[:, r:], U_B[:, :r], U_B[:, r:]
    return torch.kron(Q_A, Q_B), torch.kron(Q_A, P_B), torch.kron(P_A, Q_B)


def test_the_stacked_noise_is_isotropic_on_each_tangent_space_with_its_groups_std():
    """Noise alone, many times: each pair's dZ lies in its tangent space, is written as its canonical lift,
    and in an orthonormal basis of the tangent space has mean 0 and covariance std² I, with the std of the
    pair's own group (the three groups' stds differ). The bounds are wide enough for the fixed seed's draws
    and fail for a std off by 10 % in any block or a covariance twice as large in some direction."""
    draws = 800
    net = model()
    with torch.no_grad():  # full rank everywhere, so that the block dimensions are r², r(n − r), (m − r)r
        net.base_model.model.bert.encoder.layer[2].attention.self.query.lora_B.default.weight.normal_()
    resolution = resolve(CLASSES, describe(net))
    router = Router(net, resolution, mechanism="prism", insecure_seed=11)
    groups = [g for g in resolution.groups if g.classes]
    stds = {g.classes: 0.5 + i for i, g in enumerate(groups)}
    params = dict(net.named_parameters())
    pairs = {b: a for b, a in router.pairs.items() if any(b in {p.name for p in g.parts} for g in groups)}
    assert len(pairs) == 15  # five modules in each of layers 1-3
    samples: dict[str, list[torch.Tensor]] = {b: [] for b in pairs}
    for draw in range(draws):
        router.noise_only(stds, expected_batch_size=2.0)
        for b, a in pairs.items():
            A, B, gA, gB = params[b].detach(), params[a].detach().T, params[b].grad, params[a].grad.T
            samples[b].append(tangent_matrix(A, B, gA, gB).flatten() / router.noise_std[b])
            if draw < 3:  # what is written is the canonical lift
                cA, cB = canonical(A, B, gA, gB)
                assert torch.allclose(cA, gA, atol=1e-10) and torch.allclose(cB, gB, atol=1e-10)
    group_of = {part.name: g.classes for g in groups for part in g.parts}
    energy: dict[tuple, list[float]] = {}  # (group, block) -> [Σ of squared coordinates, their count]
    for b, a in pairs.items():
        A, B = params[b].detach(), params[a].detach().T
        (m, r), n = A.shape, B.shape[0]
        Z = torch.stack(samples[b])  # draws × m·n, standardized
        blocks = tangent_bases(A, B)
        U = torch.cat(blocks, 1)
        assert U.shape[1] == tangent_dimension(m, n, r)
        coordinates = Z @ U
        off = Z.pow(2).sum(1) - coordinates.pow(2).sum(1)  # the part outside the tangent space
        assert float(off.abs().max()) < 1e-10 * float(Z.pow(2).sum(1).min()), b
        assert float(coordinates.mean(0).abs().max()) < 5 / math.sqrt(draws), b
        for k, basis in enumerate(blocks):
            total = energy.setdefault((group_of[b], k), [0.0, 0.0])
            total[0] += float((Z @ basis).pow(2).sum())
            total[1] += draws * basis.shape[1]
        # isotropy: the sample covariance's eigenvalues stay inside the Marchenko-Pastur bulk of a white one
        q = U.shape[1] / draws
        values = torch.linalg.eigvalsh(coordinates.T @ coordinates / draws)
        assert 0.9 * (1 - math.sqrt(q)) ** 2 < float(values.min()), b
        assert float(values.max()) < 1.1 * (1 + math.sqrt(q)) ** 2, b
    assert len(energy) == 3 * 3
    for key, (total, count) in energy.items():
        assert abs(total / count - 1) < 0.05, key


def test_grams_of_several_stacks_in_one_call_are_each_stacks_gram():
    generator = torch.Generator().manual_seed(0)
    factors = [torch.randn(3, 12, 4, generator=generator, dtype=F64), torch.randn(7, 4, generator=generator, dtype=F64),
               torch.randn(2, 5, 9, 4, generator=generator, dtype=F64), torch.zeros(2, 6, 4, dtype=F64)]
    for got, F in zip(grams(*factors), factors):
        want = gram(F)
        assert got.inverse.shape == want.inverse.shape == (*F.shape[:-2], 4, 4)
        assert torch.equal(got.rank, want.rank)
        assert torch.allclose(got.inverse, want.inverse, atol=1e-12)
        assert torch.allclose(got.inverse_sqrt, want.inverse_sqrt, atol=1e-12)
        assert torch.allclose(got.inverse, torch.linalg.pinv(F.mT @ F, hermitian=True), atol=1e-8)
    with pytest.raises(ValueError):
        grams(factors[0], torch.randn(5, 3, dtype=F64))
