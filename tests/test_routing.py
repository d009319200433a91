"""The routing layer against an obviously correct batch-size-1 loop, and its privacy invariants."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import torch.nn.functional as F  # noqa: E402

from govtrain.errors import ConfigError  # noqa: E402
from govtrain.resolver.model import describe  # noqa: E402
from govtrain.resolver.profile import resolve  # noqa: E402
from govtrain.routing.router import Router  # noqa: E402
from tests.test_resolver import cls  # noqa: E402

LAYERS = 4


def model(dtype=torch.float64, seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.BertConfig(hidden_size=16, num_hidden_layers=LAYERS, num_attention_heads=2,
                                     intermediate_size=24, vocab_size=30, max_position_embeddings=16, num_labels=3,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    base = transformers.BertForSequenceClassification(config)
    lora = peft.LoraConfig(task_type="SEQ_CLS", r=3, target_modules=["query", "value", "attention.output.dense"],
                           init_lora_weights=False, lora_dropout=0.0)
    wrapped = peft.get_peft_model(base, lora).to(dtype)
    inner = wrapped.base_model.model.bert
    inner.embeddings.word_embeddings.weight.requires_grad_(True)  # an Embedding
    inner.encoder.layer[3].output.LayerNorm.weight.requires_grad_(True)  # a LayerNorm
    inner.encoder.layer[3].output.LayerNorm.bias.requires_grad_(True)
    wrapped.eval()
    return wrapped


CLASSES = {
    "public": cls("public", fraction_u=(500_000, 1_000_000), head=True),  # layers 2-3, classifier, embeddings
    "sensitive": cls("sensitive", band=(1, 3), heads=((3, (1,)),)),  # layers 1-2 whole, head 1 of layer 3
}


def batch(size: int = 6, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 30, (size, 7), generator=generator)
    ids[:, -2:] = torch.where(torch.arange(size).unsqueeze(1) % 2 == 0, 0, ids[:, -2:])  # some padding
    attention = (ids != 0).long()
    labels = torch.randint(0, 3, (size,), generator=generator)
    classes = ["public" if i % 3 else "sensitive" for i in range(size)]
    clip = torch.tensor([0.05 if i % 2 else 10.0 for i in range(size)], dtype=torch.float64)  # some clip, some not
    return ids, attention, labels, classes, clip


def losses_of(net, ids, attention, labels):
    return F.cross_entropy(net(input_ids=ids, attention_mask=attention).logits, labels, reduction="none")


def per_sample(net, resolution, ids, attention, labels, classes) -> list[dict[str, torch.Tensor]]:
    """Per-sample gradients one example at a time with plain autograd, masked to each sample's class
    (parameters the class does not reach are left out)."""
    params = {n: p for n, p in net.named_parameters() if p.requires_grad}
    reach = {c: {part.name: part for part in parts} for c, parts in resolution.reach.items()}
    out = []
    for i in range(len(classes)):
        net.zero_grad(set_to_none=True)
        losses_of(net, ids[i:i + 1], attention[i:i + 1], labels[i:i + 1]).sum().backward()
        grads = {}
        for name, param in params.items():
            part = reach[classes[i]].get(name)
            if part is None or param.grad is None:
                continue
            grad = param.grad.clone()
            if part.dim is not None:
                keep = torch.zeros(param.shape[part.dim], dtype=grad.dtype)
                keep[list(part.index)] = 1
                grad = grad * keep.reshape([-1 if d == part.dim else 1 for d in range(grad.dim())])
            grads[name] = grad
        out.append(grads)
    net.zero_grad(set_to_none=True)
    return out


def reference(net, resolution, ids, attention, labels, classes, clip):
    """The batch-size-1 loop's per-sample gradients, clipped jointly and summed."""
    total = {n: torch.zeros_like(p) for n, p in net.named_parameters() if p.requires_grad}
    for i, grads in enumerate(per_sample(net, resolution, ids, attention, labels, classes)):
        norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))
        factor = min(1.0, float(clip[i]) / norm) if norm > 0 else 1.0
        for name, grad in grads.items():
            total[name] += factor * grad
    return total


@pytest.mark.parametrize("strategy", ["auto", "ghost", "materialize"])
def test_per_sample_clipped_sum_equals_the_batch_size_one_loop(strategy: str):
    """Two profiles in one batch (one of them a heads mask), every layer type, and each way of measuring a
    Linear weight's per-sample norms (ghost norms, the materialized gradient, or per layer)."""
    net = model()
    resolution = resolve(CLASSES, describe(net))
    ids, attention, labels, classes, clip = batch()
    expected = reference(net, resolution, ids, attention, labels, classes, clip)
    router = Router(net, resolution, insecure_seed=0, per_sample=strategy)
    with router.capture():
        losses = losses_of(net, ids, attention, labels)
    report = router.privatize(losses, classes, clip, {}, expected_batch_size=1.0)
    assert report.batch_size == 6 and 0 < report.clipped < 6
    kinds = {"lora_A", "lora_B", "modules_to_save", "word_embeddings", "LayerNorm"}
    seen = set()
    for name, param in net.named_parameters():
        if not param.requires_grad:
            continue
        if all(name not in {p.name for p in parts} for parts in resolution.reach.values()):
            assert param.grad is None, name  # reached by no class: no gradient at all
            continue
        seen |= {k for k in kinds if k in name}
        assert torch.allclose(param.grad, expected[name], atol=1e-10, rtol=1e-8), name
    assert seen == kinds
    assert all(not t.inputs and not t.outputs for t in router.taps.values())  # nothing per-sample survives


def test_sensitivity_removing_one_example_moves_the_sum_by_at_most_its_clip_norm():
    net = model()
    resolution = resolve(CLASSES, describe(net))
    ids, attention, labels, classes, clip = batch()
    router = Router(net, resolution, insecure_seed=0)

    assert_removing_one_moves_the_release_by_at_most_its_clip_norm(clipped_sums(net, router), clip)


def clipped_sums(net, router):
    """keep -> the clipped sum (no noise) the router writes for those examples of the test batch."""
    ids, attention, labels, classes, clip = batch()

    def clipped_sum(keep):
        with router.capture():
            losses = losses_of(net, ids[keep], attention[keep], labels[keep])
        router.privatize(losses, [classes[i] for i in keep], clip[keep], {}, expected_batch_size=1.0)
        return {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}

    return clipped_sum


def assert_removing_one_moves_the_release_by_at_most_its_clip_norm(released, clip) -> None:
    """`released(keep)` is what a step releases (before noise) from the examples `keep`: dropping any one
    example i from the full batch must move it by at most C_i (the Euclidean norm over everything)."""
    everyone = list(range(len(clip)))
    full = released(everyone)
    for drop in everyone:
        without = released([i for i in everyone if i != drop])
        distance = math.sqrt(sum(float((full[n] - without.get(n, 0)).pow(2).sum()) for n in full))
        assert distance <= float(clip[drop]) * (1 + 1e-9)


def test_noise_per_group_matches_its_standard_deviation_and_the_expected_batch_size():
    net = model(torch.float32)
    resolution = resolve(CLASSES, describe(net))
    router = Router(net, resolution, insecure_seed=7)
    stds = {group.classes: 0.5 + i for i, group in enumerate(g for g in resolution.groups if g.classes)}
    samples: dict[frozenset, list] = {s: [] for s in stds}
    for _ in range(20):
        router.noise_only(stds, expected_batch_size=4.0)
        for group in resolution.groups:
            if group.classes:
                for part in group.parts:
                    grad = net.get_parameter(part.name).grad
                    values = grad if part.dim is None else grad.index_select(part.dim, torch.tensor(part.index))
                    samples[group.classes].append(values.flatten())
    for signature, std in stds.items():
        observed = float(torch.cat(samples[signature]).std()) * 4.0  # the step divides by the expected batch size
        count = torch.cat(samples[signature]).numel()
        assert count > 2000 and abs(observed - std) <= 0.03 * std, (sorted(signature), observed, std)


@pytest.mark.parametrize("make", [
    lambda params: torch.optim.AdamW(params, lr=0.1, weight_decay=0.1),
    lambda params: torch.optim.Adam(params, lr=0.1),
    lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1),
], ids=["adamw", "adam", "sgd"])
def test_out_of_band_parameters_and_their_optimizer_state_do_not_move(make):
    net = model(torch.float32)
    classes = {"sensitive": cls("sensitive", band=(1, 1))}
    resolution = resolve(classes, describe(net))
    router = Router(net, resolution, insecure_seed=3)
    optimizer = make([p for p in net.parameters() if p.requires_grad])
    outside = {n: p.detach().clone() for n, p in net.named_parameters() if p.requires_grad and ".layer.1." not in n}
    three_steps(net, resolution, router, optimizer.step)
    for name, before in outside.items():
        param = net.get_parameter(name)
        assert torch.equal(param, before), name
        assert param not in optimizer.state or not optimizer.state[param], name  # the optimizer never touched it
    inside = [p for n, p in net.named_parameters() if ".layer.1." in n and p.requires_grad]
    assert inside and all(optimizer.state[p] for p in inside) or isinstance(optimizer, torch.optim.SGD)


def three_steps(net, resolution, router, step) -> None:
    """Three privatized steps of one class ("sensitive") on the test batch, each followed by `step()`."""
    ids, attention, labels, _, clip = batch()
    group = next(g.classes for g in resolution.groups if g.classes)
    for _ in range(3):
        with router.capture():
            losses = losses_of(net, ids, attention, labels)
        router.privatize(losses, ["sensitive"] * 6, clip.float(), {group: 0.3}, expected_batch_size=6.0)
        step()


def test_a_trainable_parameter_no_hook_covers_refuses_to_start():
    config = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=30, n_positions=16)
    net = transformers.GPT2LMHeadModel(config)
    for param in net.parameters():
        param.requires_grad_(False)
    net.transformer.h[1].extra = torch.nn.PReLU()  # a trainable weight in a module no per-sample rule covers
    resolution = resolve({"c": cls("c", band=(1, 1))}, describe(net))
    with pytest.raises(ConfigError) as info:
        Router(net, resolution)
    assert info.value.code.value == "routing_uncovered" and "PReLU" in info.value.detail
    assert "transformer.h.1.extra.weight" in info.value.detail


def test_bad_inputs_are_refused():
    net = model()
    router = Router(net, resolve(CLASSES, describe(net)), insecure_seed=0)
    ids, attention, labels, classes, clip = batch()
    for args in [(classes[:-1], clip), (["nobody"] * 6, clip), (classes, -clip)]:
        with router.capture():
            losses = losses_of(net, ids, attention, labels)
        with pytest.raises(ValueError):
            router.privatize(losses, *args, {}, expected_batch_size=1.0)


def test_poisson_sampler_rate_empty_batches_and_eligibility():
    import numpy as np

    from govtrain.routing.sampler import PoissonSampler

    eligible = np.arange(0, 2000, 2)  # odd examples belong to a withdrawn contribution
    sampler = PoissonSampler(0.01, insecure_seed=5)
    sizes = []
    for _ in range(3000):
        drawn = sampler.sample(eligible)
        assert np.isin(drawn, eligible).all() and not (drawn % 2).any()
        sizes.append(len(drawn))
    assert abs(np.mean(sizes) - 10) < 0.5 and np.var(sizes) == pytest.approx(10 * 0.99, rel=0.15)
    assert any(len(PoissonSampler(0.001, insecure_seed=s).sample(np.arange(100))) == 0 for s in range(5))
    # Seeded from the OS by default: two samplers disagree; the insecure seed repeats.
    assert not np.array_equal(PoissonSampler(0.5).sample(np.arange(256)), PoissonSampler(0.5).sample(np.arange(256)))
    assert np.array_equal(PoissonSampler(0.5, insecure_seed=1).sample(np.arange(256)),
                          PoissonSampler(0.5, insecure_seed=1).sample(np.arange(256)))
    with pytest.raises(ValueError):
        PoissonSampler(0.0)


# adapter profiles on a multi-adapter model, each example routed through its own adapters: tests/test_routing_adapters.py


def test_weight_decay_is_refused_where_a_heads_profile_reaches_part_of_a_parameter():
    from govtrain.train.loop import check_weight_decay

    net = model(torch.float32)
    with_heads = resolve(CLASSES, describe(net))  # "sensitive" reaches head 1 of layer 3 only
    with pytest.raises(ConfigError) as info:
        check_weight_decay(with_heads, 0.01)
    assert info.value.code.value == "run_config_invalid" and "heads profile" in info.value.detail
    check_weight_decay(with_heads, 0.0)
    check_weight_decay(resolve({"public": CLASSES["public"]}, describe(net)), 0.01)  # whole parameters only


def test_a_keyed_sampler_draws_each_step_from_the_key_and_the_step_alone():
    """With the run's key, step t's draw is fixed by (key, t): the same in a new process, unaffected by which
    other units are eligible (a unit's inclusion is its own uniform), independent across steps and units at
    rate q, and another key draws otherwise."""
    import os

    import numpy as np

    from govtrain.routing.sampler import PoissonSampler, unit_identities

    def sampler(key: bytes) -> PoissonSampler:
        drawn = PoissonSampler(0.1)
        drawn.key = key
        return drawn

    key, units = os.urandom(32), 500
    identities = unit_identities(str(unit) for unit in range(units))
    everyone, some = np.arange(units), np.arange(0, units, 3)
    a, b = sampler(key), sampler(key)
    a.at_step(7)
    b.at_step(7)
    full = a.sample(everyone, identities=identities)
    assert np.array_equal(full, b.sample(everyone, identities=identities))
    b.at_step(7)
    assert np.array_equal(b.sample(some, identities=identities), full[np.isin(full, some)])  # the others are unmoved
    b.at_step(8)
    assert not np.array_equal(b.sample(everyone, identities=identities), full)
    other = sampler(os.urandom(32))
    other.at_step(7)
    assert not np.array_equal(other.sample(everyone, identities=identities), full)
    counts = np.zeros(units)
    pairs = 0
    for step in range(2000):
        a.at_step(step)
        drawn = np.isin(everyone, a.sample(everyone, identities=identities))
        counts += drawn
        pairs += drawn[0] and drawn[1]
    assert np.abs(counts / 2000 - 0.1).max() < 0.05 and abs(pairs / 2000 - 0.01) < 0.008  # rate q, independent
    members = np.arange(40)
    c, d = sampler(key), sampler(key)
    c.at_step(3)
    d.at_step(3)
    d.sample(everyone, identities=identities)  # draws made before it do not move one unit's examples
    assert np.array_equal(c.take(members, 4, identity=identities[9]), d.take(members, 4, identity=identities[9]))
