"""A non-finite per-example loss (issue 34, item 2): a unit whose per-sample norm is nan or inf contributes exactly
zero, in every per-sample source and mechanism, so that the step releases, bit for bit and under the same noise,
what it releases with that unit's loss multiplied by 0, and every released coordinate is finite.

On main the clip's coefficient of a nan norm was 1 (nan > C is false) and the unit's nan reached `.grad`."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from govtrain.errors import Code, ConfigError  # noqa: E402
from govtrain.mechanisms.update import Update  # noqa: E402
from govtrain.privatizers.families.discrete_gaussian import DiscreteGaussian  # noqa: E402
from govtrain.resolver.model import describe  # noqa: E402
from govtrain.resolver.profile import resolve  # noqa: E402
from govtrain.routing.router import Router  # noqa: E402
from tests import test_families as families  # noqa: E402
from tests import test_routing as routing  # noqa: E402
from tests.test_mechanism_routing import WHOLE, run_file  # noqa: E402
from tests.test_resolver import cls  # noqa: E402

BAD = [math.nan, math.inf]
STD = 0.7  # every reached group gets noise: the comparison is under the same noise draws


def _grads(net) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in net.named_parameters()
            if p.requires_grad}


def release(net, resolution, losses_of, classes, clip, factor, *, units=None, seed: int = 5, **options):
    """One privatized step with noise, each example's loss times `factor`: (report, every `.grad`)."""
    make = options.pop("make_privatizer", None)  # a fresh one per step: a seeded privatizer's own state advances
    router = Router(net, resolution, insecure_seed=seed, **options,
                    **({} if make is None else {"privatizer": make()}))
    try:
        with router.capture():
            losses = losses_of(net) * factor
        group_std = {g.classes: STD for g in resolution.groups if g.classes}
        report = router.privatize(losses, classes, clip, group_std, expected_batch_size=4.0, units=units)
        return report, _grads(net)
    finally:
        router.close()
        net.zero_grad(set_to_none=True)


def assert_taken_out(net, resolution, losses_of, classes, clip, bad_example: int, bad: float, *, examples=None,
                     **options) -> None:
    """The step with example `bad_example`'s loss times `bad` releases exactly what it releases with that loss
    times 0, every coordinate finite, and counts one non-finite unit."""
    size = len(classes) if examples is None else examples
    factor = torch.ones(size, dtype=torch.float64)
    factor[bad_example] = bad
    report, grads = release(net, resolution, losses_of, classes, clip, factor, **options)
    factor[bad_example] = 0.0
    expected_report, expected = release(net, resolution, losses_of, classes, clip, factor, **options)
    released = [n for n, g in grads.items() if g is not None]
    assert released, "nothing was released: the comparison would be empty"
    for name, grad in grads.items():
        if grad is None:
            assert expected[name] is None, name
            continue
        assert bool(torch.isfinite(grad).all()), name
        assert torch.equal(grad, expected[name]), name
    assert report.nonfinite == 1 and expected_report.nonfinite == 0
    assert math.isfinite(report.max_norm)


def _bert_losses(net):
    ids, attention, labels, _, _ = routing.batch()
    return routing.losses_of(net, ids, attention, labels)


def _bert(dtype=torch.float64):
    net = routing.model(dtype)
    _, _, _, classes, clip = routing.batch()
    return net, classes, clip.to(dtype)


# -- every per-sample source: LoRA (Linear), an embedding, a LayerNorm, the head (Linear) -------------------

@pytest.mark.parametrize("bad", BAD, ids=["nan", "inf"])
@pytest.mark.parametrize("strategy", ["auto", "ghost", "materialize"])
def test_a_non_finite_loss_contributes_exactly_zero_to_lora_linear_embedding_and_layer_norm(bad, strategy):
    net, classes, clip = _bert()
    resolution = resolve(routing.CLASSES, describe(net))
    for k in (0, 1):  # a sensitive example (heads mask) and a public one (embeddings, LayerNorm, head)
        assert_taken_out(net, resolution, _bert_losses, classes, clip, k, bad, per_sample=strategy)


def test_main_released_nan_for_a_nan_loss_and_a_finite_batch_without_it():
    """The defect as the review measured it: with one unit's loss nan, the router's coefficient was 1 and nan
    reached `.grad` in every coordinate that unit reaches; here none does."""
    net, classes, clip = _bert()
    resolution = resolve(routing.CLASSES, describe(net))
    factor = torch.ones(len(classes), dtype=torch.float64)
    factor[1] = math.nan
    report, grads = release(net, resolution, _bert_losses, classes, clip, factor)
    assert all(bool(torch.isfinite(g).all()) for g in grads.values() if g is not None)
    assert report.nonfinite == 1


def test_a_nan_in_some_parameters_of_a_unit_zeroes_that_unit_in_all_of_them():
    """A nan that reaches only some of a unit's parameters (an output gradient made nan above layer 3's query
    LoRA, nothing else of the step) makes the unit's joint norm nan: its finite per-sample gradients elsewhere
    (the other layers, the embedding, the head) are taken out with it, and no other unit is touched."""
    net, classes, clip = _bert()
    resolution = resolve(routing.CLASSES, describe(net))
    target = net.get_submodule("base_model.model.bert.encoder.layer.3.attention.self.query.lora_B.default")
    poisoned = {"row": None}

    def forward_hook(_module, _args, output):  # registered before the router's: its tensor hook runs first
        if poisoned["row"] is not None and output.requires_grad:
            row = poisoned["row"]
            output.register_hook(lambda g: torch.where(torch.arange(g.shape[0])[:, None, None] == row, math.nan, g))

    handle = target.register_forward_hook(forward_hook)
    try:
        poisoned["row"] = 2  # a sensitive example: reaches layer 3's head 1 (query LoRA) and layers 1-2
        factor = torch.ones(len(classes), dtype=torch.float64)
        report, grads = release(net, resolution, _bert_losses, classes, clip, factor)
        poisoned["row"] = None
        factor[2] = 0.0
        _, expected = release(net, resolution, _bert_losses, classes, clip, factor)
    finally:
        handle.remove()
    for name, grad in grads.items():
        assert (grad is None) == (expected[name] is None), name
        if grad is not None:
            assert torch.equal(grad, expected[name]), name
    assert report.nonfinite == 1


@pytest.mark.parametrize("bad", BAD, ids=["nan", "inf"])
def test_conv1d_and_tied_embeddings_gpt2(bad):
    net = families.base("gpt2")
    families.trainable_layers(net, 2)
    net.transformer.wte.weight.requires_grad_(True)  # tied with lm_head: `persample.Shared`
    resolution = resolve({"upper": cls("upper", band=(2, 3), head=True), "middle": cls("middle", band=(1, 2))},
                         describe(net))
    ids, attention = families.batch(5)
    classes = ["middle", "upper", "middle", "upper", "upper"]
    clip = torch.tensor([0.02 if i % 2 else 50.0 for i in range(5)], dtype=torch.float64)
    for k in (0, 3):
        assert_taken_out(net, resolution, lambda m: families.losses_of(m, ids, attention), classes, clip, k, bad)


@pytest.mark.parametrize("bad", BAD, ids=["nan", "inf"])
def test_gpt2_lora_conv1d(bad):
    net = families.with_lora("gpt2")
    resolution = resolve(families.DEPTH, describe(net))
    ids, attention = families.batch(6)
    clip = torch.tensor([0.02 if i % 2 else 50.0 for i in range(6)], dtype=torch.float64)
    assert_taken_out(net, resolution, lambda m: families.losses_of(m, ids, attention), families.WHO, clip, 1, bad)


@pytest.mark.parametrize("bad", BAD, ids=["nan", "inf"])
def test_experts_routers_and_rms_norms(bad):
    from tests.test_moe import CLASSES, mixtral

    net = mixtral()
    resolution = resolve(CLASSES, describe(net))
    who = ["experts", "routed", "depth", "experts", "routed", "depth"]
    ids, attention = families.batch(6)
    clip = torch.tensor([0.02 if i % 2 else 50.0 for i in range(6)], dtype=torch.float64)
    for k in (0, 1):
        assert_taken_out(net, resolution, lambda m: families.losses_of(m, ids, attention), who, clip, k, bad)


@pytest.mark.parametrize("bad", BAD, ids=["nan", "inf"])
def test_contribution_units_take_the_whole_contribution_out(bad):
    """Unit = contribution: one nan example of a contribution takes all of that contribution's examples out."""
    net, _, _ = _bert()
    resolution = resolve(routing.CLASSES, describe(net))
    units = [0, 0, 1, 1, 2, 2]
    who = ["public", "sensitive", "public"]
    clip = torch.tensor([10.0, 0.05, 0.05], dtype=torch.float64)
    factor = torch.ones(6, dtype=torch.float64)
    factor[3] = bad  # one example of contribution 1
    report, grads = release(net, resolution, _bert_losses, who, clip, factor, units=units)
    factor[2:4] = 0.0  # the whole contribution out
    _, expected = release(net, resolution, _bert_losses, who, clip, factor, units=units)
    for name, grad in grads.items():
        if grad is not None:
            assert bool(torch.isfinite(grad).all()) and torch.equal(grad, expected[name]), name
    assert report.nonfinite == 1


# -- the mechanisms, the compiled stage, per-microbatch noise, the materialized path ----------------------------

@pytest.mark.parametrize("mechanism", ["prism", "dp-muon"])
@pytest.mark.parametrize("bad", BAD, ids=["nan", "inf"])
def test_prism_and_dp_muon(mechanism, bad):
    net, classes, clip = _bert()
    resolution = resolve(WHOLE, describe(net))
    for k in (0, 1):
        assert_taken_out(net, resolution, _bert_losses, classes, clip, k, bad, mechanism=mechanism)


# long tier for dpsgd: the compiled stage releases the hooks' bits (tests/test_compiled_routing.py, default tier), and
# the hooks take non-finite units out under every mechanism above; dp-muon's compiled stage stays in the default tier
@pytest.mark.parametrize("mechanism", [pytest.param("dpsgd", marks=pytest.mark.long), "dp-muon"])
def test_the_compiled_stage(mechanism):
    net, classes, clip = _bert()
    resolution = resolve(WHOLE if mechanism != "dpsgd" else routing.CLASSES, describe(net))
    for bad in BAD:
        assert_taken_out(net, resolution, _bert_losses, classes, clip, 1, bad, compiled=True, mechanism=mechanism)


@pytest.mark.parametrize("bad", BAD, ids=["nan", "inf"])
def test_per_microbatch_noise(bad):
    """Two microbatches, the non-finite unit in the second: its sum is noised on its own and still finite."""
    net, classes, clip = _bert()
    resolution = resolve(routing.CLASSES, describe(net))
    ids, attention, labels, _, _ = routing.batch()
    group_std = {g.classes: STD for g in resolution.groups if g.classes}

    def step(factor):
        router = Router(net, resolution, insecure_seed=11, microbatches=2)
        router.begin(group_std)
        counts = []
        for m, part in enumerate(([0, 1, 2], [3, 4, 5])):
            with router.capture():
                losses = routing.losses_of(net, ids[part], attention[part], labels[part]) * factor[part]
            report = router.accumulate(losses, [classes[i] for i in part], clip[part], microbatch=m)
            counts.append(getattr(report, "nonfinite", None))
        total = getattr(router, "nonfinite", None)
        router.finish(group_std, expected_batch_size=4.0)
        router.close()
        grads = _grads(net)
        net.zero_grad(set_to_none=True)
        return counts, total, grads

    factor = torch.ones(6, dtype=torch.float64)
    factor[4] = bad
    counts, total, grads = step(factor)
    factor[4] = 0.0
    _, _, expected = step(factor)
    for name, grad in grads.items():
        if grad is not None:
            assert bool(torch.isfinite(grad).all()) and torch.equal(grad, expected[name]), name
    assert counts == [0, 1] and total == 1


@pytest.mark.parametrize("bad", BAD, ids=["nan", "inf"])
def test_the_materialized_path_of_the_noise_families(bad):
    net, classes, clip = _bert()
    resolution = resolve(routing.CLASSES, describe(net))

    for k in (0, 1):
        assert_taken_out(net, resolution, _bert_losses, classes, clip, k, bad,
                         make_privatizer=lambda: DiscreteGaussian(granularity_bits=8, insecure_seed=3))


# -- the release and the update refuse a non-finite gradient ---------------------------------------------------

def test_a_non_finite_noised_sum_is_refused_before_any_grad_is_written(monkeypatch):
    """Impossible by construction; if the sum were non-finite (here: the privatizer made so), nothing is written."""
    net, classes, clip = _bert(torch.float32)
    resolution = resolve(routing.CLASSES, describe(net))
    router = Router(net, resolution, insecure_seed=0)
    original = router.privatizer.update

    def poisoned(sums, state, **kwargs):
        noisy, state = original(sums, state, **kwargs)
        first = next(iter(noisy))
        noisy[first] = noisy[first] * math.nan
        return noisy, state

    monkeypatch.setattr(router.privatizer, "update", poisoned)
    with router.capture():
        losses = _bert_losses(net).float()
    with pytest.raises(ConfigError) as caught:
        router.privatize(losses, classes, clip, {g.classes: STD for g in resolution.groups if g.classes}, 4.0)
    assert caught.value.code == Code.NONFINITE_RELEASE
    assert all(p.grad is None for p in net.parameters())


def test_the_update_refuses_a_non_finite_gradient_before_anything_moves():
    net = routing.model(torch.float32)
    update = Update.build(net, run_file("dpsgd"))
    trainable = [p for p in net.parameters() if p.requires_grad]
    for p in trainable:
        p.grad = torch.zeros_like(p)
    trainable[0].grad[0] = math.nan
    weights = {n: p.detach().clone() for n, p in net.named_parameters()}
    with pytest.raises(ConfigError) as caught:
        update.step({})
    assert caught.value.code == Code.NONFINITE_RELEASE
    assert all(torch.equal(p, weights[n]) for n, p in net.named_parameters())
    assert not update.optimizer.state  # no moment, no step count
