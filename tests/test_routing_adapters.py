"""Per-example adapter routing (`govtrain/routing/adapters.py`): in a captured forward each example runs through the
default adapter and its own class's adapter only. The oracle is a batch-size-1 loop in which each example's model
has only those adapters active (peft's own `set_adapter`, on a copy made before any hook of the router)."""

from __future__ import annotations

import copy
import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from govtrain.errors import ConfigError  # noqa: E402
from govtrain.resolver.model import describe  # noqa: E402
from govtrain.resolver.profile import resolve  # noqa: E402
from govtrain.routing import persample  # noqa: E402
from govtrain.routing.router import Router  # noqa: E402
from govtrain.train.config import LoraSection  # noqa: E402
from govtrain.train.model import wrap_lora  # noqa: E402
from tests.test_resolver import cls  # noqa: E402
from tests.test_routing import LAYERS, batch, losses_of  # noqa: E402

# two class adapters beside the default one; no heads profile, so that PRISM may run (it needs whole LoRA pairs)
CLASSES = {
    "public": cls("public", fraction_u=(500_000, 1_000_000), head=True),  # layers 2-3 of default, the head
    "sensitive": cls("sensitive", band=(1, 3)),
    "restricted": cls("restricted", adapter="restricted"),
    "secret": cls("secret", adapter="secret"),
}
WHO = ["public", "restricted", "sensitive", "secret", "restricted", "public"]
OWN = {"restricted": ["restricted"], "secret": ["secret"]}  # the class adapters each class passes through


def model(seed: int = 0):
    """A tiny BERT as `govtrain train` builds it (`wrap_lora`), every B factor random so that every adapter
    changes the forward, in float64."""
    torch.manual_seed(seed)
    config = transformers.BertConfig(hidden_size=16, num_hidden_layers=LAYERS, num_attention_heads=2,
                                     intermediate_size=24, vocab_size=30, max_position_embeddings=16, num_labels=3,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    net = wrap_lora(transformers.BertForSequenceClassification(config),
                    LoraSection(r=3, target_modules=["query", "value"]), ["restricted", "secret"])
    _random_b(net)
    return net.to(torch.float64).eval()


def _random_b(net) -> None:
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in net.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)


def only(net, adapters: list[str]):
    """A copy of `net` with only the default adapter and `adapters` active, trainable as `wrap_lora` leaves it."""
    twin = copy.deepcopy(net)
    twin.base_model.set_adapter(["default", *adapters])
    for name, param in twin.named_parameters():
        param.requires_grad_(".lora_" in name or ".modules_to_save." in name)
    return twin


def oracle_models(net) -> dict[str, object]:
    """Class -> its model in the batch-size-1 loop (made before a router hooks `net`)."""
    return {c: only(net, OWN.get(c, [])) for c in CLASSES}


def per_sample(models, resolution, ids, attention, labels, classes) -> list[dict[str, torch.Tensor]]:
    """Each example alone through plain autograd on its class's model, restricted to its class's profile."""
    out = []
    for i, c in enumerate(classes):
        net = models[c]
        net.zero_grad(set_to_none=True)
        losses_of(net, ids[i:i + 1], attention[i:i + 1], labels[i:i + 1]).sum().backward()
        out.append({part.name: net.get_parameter(part.name).grad.clone() for part in resolution.reach[c]
                    if net.get_parameter(part.name).grad is not None})
        net.zero_grad(set_to_none=True)
    return out


def clipped_reference(grads, clip) -> dict[str, torch.Tensor]:
    total: dict[str, torch.Tensor] = {}
    for i, sample in enumerate(grads):
        norm = math.sqrt(sum(float(g.pow(2).sum()) for g in sample.values()))
        factor = min(1.0, float(clip[i]) / norm) if norm > 0 else 1.0
        for name, g in sample.items():
            total[name] = total.get(name, 0) + factor * g
    return total


def _assert_grads(net, expected: dict, *, atol: float, rtol: float) -> None:
    """Each parameter's `.grad` is its expected gradient, and a parameter with none expected has no `.grad`."""
    for name, param in net.named_parameters():
        if name in expected:
            assert torch.allclose(param.grad, expected[name], atol=atol, rtol=rtol), name
        else:
            assert param.grad is None, name


@pytest.mark.parametrize("strategy", ["auto", "ghost", "materialize"])
def test_the_routed_clipped_sum_equals_the_loop_with_only_each_examples_adapters_active(strategy: str):
    net = model()
    models = oracle_models(net)
    resolution = resolve(CLASSES, describe(net))
    ids, attention, labels, _, clip = batch()
    expected = clipped_reference(per_sample(models, resolution, ids, attention, labels, WHO), clip)
    router = Router(net, resolution, insecure_seed=0, per_sample=strategy)
    assert router.routes.adapters == ("restricted", "secret")
    with router.capture(WHO):
        losses = losses_of(net, ids, attention, labels)
    report = router.privatize(losses, WHO, clip, {}, expected_batch_size=1.0)
    assert 0 < report.clipped < 6
    for adapter in ("restricted", "secret"):  # each class adapter trained by its own class's examples
        assert any(".lora_B." in n and f".{adapter}." in n for n in expected)
    _assert_grads(net, expected, atol=1e-10, rtol=1e-8)
    router.close()


def _per_example_routers(models, resolution, mechanism: str, ids, attention, labels, classes, clip, units=None):
    """The loop through the router itself: each clipping unit alone on its class's model, its clipped gradient
    (no noise) summed by name."""
    total: dict[str, torch.Tensor] = {}
    routers = {c: Router(models[c], resolution, mechanism=mechanism, insecure_seed=0) for c in set(classes)}
    members = [[i] for i in range(len(classes))] if units is None else \
        [[i for i, u in enumerate(units) if u == k] for k in range(len(classes))]
    for k, rows in enumerate(members):
        net, router, index = models[classes[k]], routers[classes[k]], torch.tensor(rows)
        with router.capture([classes[k]], None if units is None else [0] * len(rows)):
            losses = losses_of(net, ids[index], attention[index], labels[index])
        router.privatize(losses, [classes[k]], clip[k:k + 1], {}, expected_batch_size=1.0,
                         units=None if units is None else [0] * len(rows))
        for name, param in net.named_parameters():
            if param.grad is not None:
                total[name] = total.get(name, 0) + param.grad.clone()
                param.grad = None
    for router in routers.values():
        router.close()
    return total


@pytest.mark.parametrize("mechanism", ["dpsgd", "prism", "dp-muon"])
@pytest.mark.parametrize("by_contribution", [False, True])
def test_every_mechanism_routes_each_unit_through_its_own_adapters_as_the_loop_does(mechanism: str,
                                                                                   by_contribution: bool):
    """PRISM's tangent clipping and DP-Muon's per-parameter clipping measure per-sample gradients from the same
    captured forward: the batched result equals each clipping unit (an example, or a contribution's examples
    averaged) alone on a model with only its class's adapters active."""
    net = model()
    models = oracle_models(net)
    resolution = resolve(CLASSES, describe(net))
    ids, attention, labels, _, clip = batch()
    units = [0, 1, 2, 3, 1, 0] if by_contribution else None  # WHO's examples, a contribution per class
    classes = ["public", "restricted", "sensitive", "secret"] if by_contribution else WHO
    clip = clip[:len(classes)]
    expected = _per_example_routers(models, resolution, mechanism, ids, attention, labels, classes, clip, units)
    router = Router(net, resolution, mechanism=mechanism, insecure_seed=0)
    with router.capture(classes, units):
        losses = losses_of(net, ids, attention, labels)
    router.privatize(losses, classes, clip, {}, expected_batch_size=1.0, units=units)
    assert any(".secret." in n for n in expected) and any(".restricted." in n for n in expected)
    _assert_grads(net, expected, atol=1e-10, rtol=1e-8)
    router.close()


def test_a_class_adapter_adds_exactly_nothing_to_an_example_not_routed_through_it():
    """Bit for bit: an example of another class gets the logits of the model without that adapter, and the
    per-sample gradients the router forms for the adapter's factors are exactly zero in its row."""
    net = model()
    models = oracle_models(net)
    resolution = resolve(CLASSES, describe(net))
    ids, attention, labels, _, _ = batch()
    router = Router(net, resolution, insecure_seed=0)
    with router.capture(WHO):
        logits = net(input_ids=ids, attention_mask=attention).logits
        losses = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    for i, c in enumerate(WHO):
        with torch.no_grad():
            alone = models[c](input_ids=ids, attention_mask=attention).logits[i]
        assert torch.equal(logits[i].detach(), alone), (i, c)
    factors = {n: p for n, p in net.named_parameters() if ".restricted." in n}
    torch.autograd.grad(losses.sum(), list(factors.values()))  # the router's hooks form the per-sample gradients
    checked = 0
    for tap in router.taps.values():
        for leaf, name in tap.leaves.items():
            if name not in factors:
                continue
            kept = [(a, g) for a, g in zip(tap.inputs, tap.grads) if a is not None and g is not None]
            calls = persample.Calls(tap.module, [a for a, _ in kept], [g for _, g in kept], formed=dict(tap.formed))
            rows = calls.per_sample(leaf, torch.arange(len(WHO)))
            for i, c in enumerate(WHO):
                assert bool((rows[i] == 0).all()) is (c != "restricted"), (name, i, c)
            checked += 1
    assert checked == len(factors) == 2 * 2 * LAYERS  # A and B of query and value in every layer
    for tap in router.taps.values():
        tap.clear()
    router.close()


def test_without_the_examples_classes_a_forward_with_gradients_is_refused_and_one_without_runs_every_adapter():
    net = model()
    full = only(net, ["restricted", "secret"])  # every adapter: what wrap_lora leaves active
    resolution = resolve(CLASSES, describe(net))
    ids, attention, labels, _, clip = batch()
    router = Router(net, resolution, insecure_seed=0)
    with router.capture(), pytest.raises(RuntimeError, match="without the examples' classes"):
        losses_of(net, ids, attention, labels)
    with torch.no_grad():
        expected = full(input_ids=ids, attention_mask=attention).logits
        with router.capture():  # as the layout probe runs it
            probed = net(input_ids=ids, attention_mask=attention).logits
        outside = net(input_ids=ids, attention_mask=attention).logits  # evaluation: full rights
    assert torch.equal(probed, expected) and torch.equal(outside, expected)
    with router.capture(WHO):  # routed as public everywhere below, clipped as WHO: refused, nothing summed
        losses = losses_of(net, ids, attention, labels)
    with pytest.raises(ValueError, match="routed through the adapters of other classes"):
        router.accumulate(losses, ["public"] * 6, clip)
    router.begin()
    with router.capture(["public"] * 6):
        losses = losses_of(net, ids, attention, labels)
    with pytest.raises(ValueError, match="routed through the adapters of other classes"):
        router.accumulate(losses, WHO, clip)
    assert all(p.grad is None for p in net.parameters())
    router.close()
    assert not any(module._forward_pre_hooks for module in net.modules())  # close takes the routing hooks away


def _peft_with(**restricted):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=24, vocab_size=30, max_position_embeddings=16, num_labels=3)
    net = peft.get_peft_model(transformers.BertForSequenceClassification(config), peft.LoraConfig(
        r=2, target_modules=["query"], modules_to_save=["classifier"]))
    net.add_adapter("restricted", peft.LoraConfig(r=2, target_modules=["query"], **restricted))
    net.base_model.set_adapter(["default", "restricted"])
    for name, param in net.named_parameters():  # DoRA's magnitude vector frozen: the router covers the rest
        param.requires_grad_(".lora_A." in name or ".lora_B." in name or ".modules_to_save." in name)
    return net.eval()


@pytest.mark.parametrize("restricted, says", [
    ({"use_dora": True}, "lora_magnitude_vector"),  # DoRA: its branch is not B·A·x, even with the magnitude frozen
    ({"lora_bias": True}, "lora_B.restricted.bias"),  # a bias on lora_B reaches every example
])
def test_a_class_adapter_whose_branch_cannot_be_routed_per_example_is_refused(restricted, says):
    net = _peft_with(**restricted)
    classes = {"public": cls("public", band=(0, 1), head=True), "restricted": cls("restricted", adapter="restricted")}
    with pytest.raises(ConfigError) as info:
        Router(net, resolve(classes, describe(net)))
    assert info.value.code.value == "routing_uncovered" and says in info.value.detail
    assert not any(module._forward_pre_hooks or module._forward_hooks for module in net.modules())  # nothing left


def test_a_class_adapter_merged_into_the_weights_is_refused_at_the_forward():
    net = _peft_with()
    classes = {"public": cls("public", band=(0, 1), head=True), "restricted": cls("restricted", adapter="restricted")}
    router = Router(net, resolve(classes, describe(net)))
    net.base_model.model.bert.encoder.layer[0].attention.self.query.merge(adapter_names=["restricted"])
    with pytest.raises(ConfigError) as info, router.capture(["public"]):
        pass
    assert info.value.code.value == "routing_uncovered" and "merged" in info.value.detail
    router.close()


def test_a_causal_lm_routes_each_example_through_its_own_adapters_as_the_loop_does():
    from tests import causal_models
    from tests.test_causal_lm import TASK, _examples, _tokenizer

    tokenizer = _tokenizer()
    net = wrap_lora(causal_models.model("llama", layers=2), LoraSection(r=2, target_modules=causal_models.TARGETS[
        "llama"]), ["restricted"], heads=())
    _random_b(net)
    net = net.double().eval()
    classes = {"all": cls("all", band=(0, 1)), "restricted": cls("restricted", adapter="restricted")}
    models = {"all": only(net, []), "restricted": only(net, ["restricted"])}
    resolution = resolve(classes, describe(net))
    examples = _examples()
    who = ["restricted" if i % 2 else "all" for i in range(len(examples))]
    grads = []
    for example, c in zip(examples, who):
        alone = TASK.encode([example], tokenizer, 64, "cpu")
        models[c].zero_grad(set_to_none=True)
        TASK.per_example_loss(models[c](**alone.inputs), alone).sum().backward()
        grads.append({part.name: models[c].get_parameter(part.name).grad.clone() for part in resolution.reach[c]
                      if models[c].get_parameter(part.name).grad is not None})
    norms = [math.sqrt(sum(float(g.pow(2).sum()) for g in sample.values())) for sample in grads]
    clip = torch.tensor([n / 2 if i % 3 == 0 else 1e9 for i, n in enumerate(norms)], dtype=torch.float64)
    expected = clipped_reference(grads, clip)
    router = Router(net, resolution, insecure_seed=0)
    encoded = TASK.encode(examples, tokenizer, 64, "cpu")
    with router.capture(who):
        losses = TASK.per_example_loss(net(**encoded.inputs), encoded)
    router.privatize(losses, who, clip, {}, 1.0)
    assert any(".restricted." in n for n in expected) and any(".default." in n for n in expected)
    _assert_grads(net, expected, atol=1e-8, rtol=1e-6)
    router.close()
