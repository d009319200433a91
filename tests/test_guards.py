"""Training-health guards: a privatized gradient that would not move the model, BatchNorm in a trainable
region, modules called more than once, and losses that are not one value per example."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from torch import nn  # noqa: E402

from govtrain.errors import Code, ConfigError  # noqa: E402
from govtrain.mechanisms.update import Update  # noqa: E402
from govtrain.resolver.model import describe  # noqa: E402
from govtrain.resolver.profile import resolve  # noqa: E402
from govtrain.routing.router import Router  # noqa: E402
from tests.test_mechanism_routing import WHOLE, run_file  # noqa: E402
from tests.test_resolver import cls  # noqa: E402
from tests.test_routing import batch, losses_of, model  # noqa: E402

MECHANISMS = ["dpsgd", "prism", "dp-muon"]
LORA_B = "base_model.model.bert.encoder.layer.1.attention.self.query.lora_B.default.weight"
HEAD = "base_model.model.classifier.modules_to_save.default.weight"


def privatize(net, router) -> None:
    """One privatized gradient of the test batch, both classes, some noise on every reached group."""
    ids, attention, labels, classes, clip = batch()
    with router.capture():
        losses = losses_of(net, ids, attention, labels)
    group_std = {g.classes: 0.3 for g in router.resolution.groups if g.classes}
    router.privatize(losses, classes, clip.float(), group_std, expected_batch_size=6.0)


def snapshot(net) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def replace(net, name: str) -> nn.Parameter:
    """Put a new Parameter with the same value in `name`'s place (as user code or assign=True loading does)."""
    module_name, _, leaf = name.rpartition(".")
    module = net.get_submodule(module_name)
    old = getattr(module, leaf)
    setattr(module, leaf, nn.Parameter(old.detach().clone()))
    return old


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_normal_steps_of_every_mechanism_pass_the_stale_parameter_check(mechanism):
    net = model(torch.float32)
    router = Router(net, resolve(WHOLE, describe(net)), mechanism=mechanism, insecure_seed=0)
    update = Update.build(net, run_file(mechanism))
    before = snapshot(net)
    for _ in range(3):
        privatize(net, router)
        update.step(router.noise_std)
        update.zero_grad()
    moved = {n for n, p in net.named_parameters() if not torch.equal(p, before[n])}
    assert LORA_B in moved and HEAD in moved  # the check ran on steps that moved the stack and the head


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("name", [LORA_B, HEAD])
def test_a_parameter_replaced_after_the_run_was_built_is_refused_before_anything_moves(mechanism, name):
    """Router and update both built, then the parameter replaced: the router writes `.grad` to the old
    tensor, the optimizer would move it, and the model's new tensor would never train."""
    net = model(torch.float32)
    router = Router(net, resolve(WHOLE, describe(net)), mechanism=mechanism, insecure_seed=0)
    update = Update.build(net, run_file(mechanism))
    old = replace(net, name)
    privatize(net, router)
    assert old.grad is not None
    before, old_value = snapshot(net), old.detach().clone()
    with pytest.raises(ConfigError) as info:
        update.step(router.noise_std)
    assert info.value.code is Code.STALE_PARAMETERS and info.value.exit_code == 2
    assert name in info.value.detail and "no longer holds" in info.value.detail
    assert "build the router and the update after" in info.value.detail.lower()
    assert all(torch.equal(p, before[n]) for n, p in net.named_parameters())  # nothing moved
    assert torch.equal(old, old_value)
    assert update.optimizer is None or not update.optimizer.state
    assert update.prism is None or not update.prism.state
    assert update.muon is None or not update.muon.state


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("name", [LORA_B, HEAD])
def test_a_parameter_replaced_between_the_update_and_the_router_is_refused_before_anything_moves(mechanism, name):
    """The update holds the old tensor, the router writes `.grad` to the model's new one: no optimizer
    would apply it."""
    net = model(torch.float32)
    update = Update.build(net, run_file(mechanism))
    replace(net, name)
    router = Router(net, resolve(WHOLE, describe(net)), mechanism=mechanism, insecure_seed=0)
    privatize(net, router)
    assert net.get_parameter(name).grad is not None
    before = snapshot(net)
    with pytest.raises(ConfigError) as info:
        update.step(router.noise_std)
    assert info.value.code is Code.STALE_PARAMETERS
    assert name in info.value.detail and "no optimizer applies" in info.value.detail
    assert all(torch.equal(p, before[n]) for n, p in net.named_parameters())


def test_loading_with_assign_true_after_the_run_was_built_is_refused():
    net = model(torch.float32)
    router = Router(net, resolve(WHOLE, describe(net)), insecure_seed=0)
    update = Update.build(net, run_file("dpsgd"))
    net.load_state_dict({n: v.clone() for n, v in net.state_dict().items()}, assign=True)
    privatize(net, router)
    before = snapshot(net)
    with pytest.raises(ConfigError) as info:
        update.step(router.noise_std)
    assert info.value.code is Code.STALE_PARAMETERS
    assert all(torch.equal(p, before[n]) for n, p in net.named_parameters())


class _Skipping(torch.optim.SGD):
    """An SGD that leaves one parameter where it is, whatever its gradient."""

    def __init__(self, params, skip):
        super().__init__(params, lr=0.1)
        self.skip = skip

    def step(self, closure=None):
        grad, self.skip.grad = self.skip.grad, None
        try:
            return super().step(closure)
        finally:
            self.skip.grad = grad


def test_a_parameter_the_optimizer_skips_is_reported_after_the_step():
    net = model(torch.float32)
    router = Router(net, resolve(WHOLE, describe(net)), insecure_seed=0)
    trainable = [p for p in net.parameters() if p.requires_grad]
    update = Update("dpsgd", optimizer=_Skipping(trainable, net.get_parameter(HEAD)), model=net)
    privatize(net, router)
    with pytest.raises(ConfigError) as info:
        update.step(router.noise_std)
    assert info.value.code is Code.STALE_PARAMETERS
    assert HEAD in info.value.detail and "did not move" in info.value.detail


def test_a_fused_optimizer_which_writes_without_bumping_versions_is_no_false_positive():
    net = model(torch.float32)
    router = Router(net, resolve(WHOLE, describe(net)), insecure_seed=0)
    trainable = [p for p in net.parameters() if p.requires_grad]
    update = Update("dpsgd", optimizer=torch.optim.Adam(trainable, lr=0.1, fused=True), model=net)
    before = snapshot(net)
    privatize(net, router)
    update.step(router.noise_std)
    assert not torch.equal(net.get_parameter(HEAD), before[HEAD])


@pytest.mark.parametrize("shape", ["batch_mean", "per_token", "too_few", "too_many"])
def test_a_loss_that_is_not_one_value_per_example_is_refused_before_anything_changes(shape):
    net = model()
    router = Router(net, resolve(WHOLE, describe(net)), insecure_seed=0)
    privatize(net, router)  # every reached parameter now holds a privatized gradient
    grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    assert grads
    drawn = router.generator.get_state()
    ids, attention, labels, classes, clip = batch()
    with router.capture():
        logits = net(input_ids=ids, attention_mask=attention).logits
    per_example = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    losses = {"batch_mean": per_example.mean(),  # the usual non-private reduction
              "per_token": per_example.unsqueeze(1).expand(6, 7),  # [B, T]
              "too_few": per_example[:5],
              "too_many": torch.cat([per_example, per_example[:1]])}[shape]
    for call in (lambda: router.privatize(losses, classes, clip, {}, expected_batch_size=6.0),
                 lambda: router.accumulate(losses, classes, clip)):
        router.begin()
        with pytest.raises(ValueError, match=r"one loss per example, shape \(6,\).*reduction='none'"):
            call()
        assert router._totals is None  # nothing summed into the step
    assert torch.equal(router.generator.get_state(), drawn)  # no noise drawn
    assert {n for n, p in net.named_parameters() if p.grad is not None} == set(grads)
    assert all(torch.equal(net.get_parameter(n).grad, g) for n, g in grads.items())


# -- BatchNorm -------------------------------------------------------------------------------------------

class _ThenBatchNorm(nn.Module):
    """A block's MLP followed by a BatchNorm over its channels ([B, T, D] seen as [B, D, T])."""

    def __init__(self, inner: nn.Module, width: int, **options) -> None:
        super().__init__()
        self.inner, self.norm = inner, nn.BatchNorm1d(width, **options)

    def forward(self, x):
        return self.norm(self.inner(x).transpose(1, 2)).transpose(1, 2)


def _with_batch_norm(layer: int, **options):
    """Tiny float64 GPT-2 whose base weights train from layer 1 on, a frozen BatchNorm (eval mode, random
    running statistics) after layer `layer`'s MLP."""
    from tests.test_families import HIDDEN, base, trainable_layers

    net = base("gpt2")
    trainable_layers(net, 1)
    block = net.transformer.h[layer]
    block.mlp = _ThenBatchNorm(block.mlp, HIDDEN, **options).double().eval()
    norm = block.mlp.norm
    norm.requires_grad_(False)
    if norm.running_mean is not None:
        generator = torch.Generator().manual_seed(5)
        norm.running_mean.copy_(torch.randn(HIDDEN, generator=generator, dtype=torch.float64))
        norm.running_var.copy_(torch.rand(HIDDEN, generator=generator, dtype=torch.float64) + 0.5)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3, generator=torch.Generator().manual_seed(6))
    return net, norm


@pytest.mark.parametrize("layer", [0, 2])
def test_a_frozen_batch_norm_in_eval_mode_is_a_per_example_map_and_matches_the_loop(layer):
    """Below every trainable parameter (layer 0) or between them (layer 2): each example is normalized with
    fixed statistics, and the routed step equals the batch-size-1 loop."""
    from tests.test_families import DEPTH, assert_matches_the_loop

    net, norm = _with_batch_norm(layer)
    calls = []
    norm.register_forward_hook(lambda *_: calls.append(1))
    resolution = resolve({"upper": DEPTH["upper"], "middle": DEPTH["middle"]}, describe(net))
    assert_matches_the_loop(net, resolution, ["upper", "middle", "upper", "middle", "upper"])
    assert calls and not norm.training  # it ran in every forward, and nothing switched it to train mode


@pytest.mark.parametrize("case", ["train_mode_below_everything", "train_mode_between", "no_running_stats",
                                  "trainable"])
def test_a_batch_norm_that_mixes_examples_or_trains_refuses_to_start(case):
    layer = 0 if case == "train_mode_below_everything" else 2
    net, norm = _with_batch_norm(layer, **({"track_running_stats": False} if case == "no_running_stats" else {}))
    if case.startswith("train_mode"):
        norm.train()
    if case == "trainable":
        norm.weight.requires_grad_(True)
    resolution = resolve({"c": cls("c", band=(1, 3))}, describe(net))
    with pytest.raises(ConfigError) as info:
        Router(net, resolution)
    detail = info.value.detail
    assert info.value.code is Code.ROUTING_UNCOVERED and f"transformer.h.{layer}.mlp.norm" in detail
    assert "BatchNorm mixes examples in a batch" in detail and "GroupNorm or LayerNorm" in detail
    assert "freeze it and put it in eval mode" in detail
    assert {"train_mode_below_everything": "train mode", "train_mode_between": "train mode",
            "no_running_stats": "track_running_stats=False", "trainable": "trainable weight"}[case] in detail
    assert not any(hook for m in net.modules() for hook in m._forward_hooks.values())  # nothing left tapped


def test_a_batch_norm_switched_to_train_mode_after_the_router_was_built_is_refused_at_the_step():
    from tests.test_families import batch as lm_batch, losses_of as lm_losses

    net, norm = _with_batch_norm(2)
    router = Router(net, resolve({"c": cls("c", band=(1, 3))}, describe(net)), insecure_seed=0)
    net.train()
    ids, attention = lm_batch()
    with router.capture():
        losses = lm_losses(net, ids, attention)
    drawn = router.generator.get_state()
    router.begin()
    with pytest.raises(ConfigError) as info:
        router.accumulate(losses, ["c"] * 5, [1.0] * 5)
    assert info.value.code is Code.ROUTING_UNCOVERED and "train mode" in info.value.detail
    assert router._totals is None and torch.equal(router.generator.get_state(), drawn)
    assert all(p.grad is None for p in net.parameters())


# -- modules called more than once -------------------------------------------------------------------

class _Twice(nn.Module):
    """An embedding looked up twice per forward, at the ids and at the ids in reverse order: every row an
    example uses gets gradient from both calls (the norm of their sum, not the sum of their norms)."""

    def __init__(self, inner: nn.Embedding) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, ids):
        return self.inner(ids) + 0.5 * self.inner(ids.flip(1))


def _reusing(family_base):
    """Tiny float64 GPT-2 (base weights trained from layer 1) that calls modules more than once per forward:
    layer 2's ln_1 also serves as its ln_2, layer 2's MLP output projection (Conv1D) is also layer 3's, and
    the (untied) token embedding is looked up twice."""
    net = family_base("gpt2")
    from tests.test_families import trainable_layers

    trainable_layers(net, 1)
    net.lm_head.weight = nn.Parameter(net.lm_head.weight.detach().clone(), requires_grad=False)  # untie
    h = net.transformer.h
    h[2].ln_2 = h[2].ln_1
    h[3].mlp.c_proj = h[2].mlp.c_proj
    net.transformer.wte = _Twice(net.transformer.wte)
    net.transformer.wte.inner.weight.requires_grad_(True)
    return net


@pytest.mark.parametrize("strategy", ["auto", "ghost", "materialize"])
def test_a_module_called_more_than_once_sums_every_call_and_matches_the_loop(strategy):
    from tests.test_families import assert_matches_the_loop, base

    net = _reusing(base)
    reused = ("transformer.h.2.ln_1", "transformer.h.2.mlp.c_proj", "transformer.wte.inner")
    counts = dict.fromkeys(reused, 0)
    for name in reused:
        net.get_submodule(name).register_forward_hook(lambda *_, name=name: counts.__setitem__(name, counts[name] + 1))
    trainable = {n for n, p in net.named_parameters() if p.requires_grad}
    assert {f"{name}.weight" for name in reused} <= trainable
    classes = {"upper": cls("upper", band=(2, 3), head=True), "middle": cls("middle", band=(1, 2))}
    resolution = resolve(classes, describe(net))
    # the head class on the examples clipped hard (odd ones): the embedding's norm decides their clipping
    assert_matches_the_loop(net, resolution, ["middle", "upper", "middle", "upper", "upper"], per_sample=strategy)
    assert set(counts.values()) == {2 * 6}  # twice per forward: the routed batch and the loop's five examples


class _Projection(nn.Module):
    """An output projection no per-sample rule covers, holding the embedding's matrix (a custom tied head)."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return x @ self.weight.T


@pytest.mark.parametrize("strategy", ["auto", "ghost", "materialize"])
def test_gpt2_tied_embeddings_sum_both_uses_per_sample_and_match_the_loop(strategy):
    """wte looks rows up and lm_head multiplies by the same matrix: a sample's gradient of it is the sum of
    both, clipped jointly with the layers it trains. The head class sits on the examples clipped hard."""
    from tests.test_families import assert_matches_the_loop, base, trainable_layers

    net = base("gpt2")
    trainable_layers(net, 2)
    net.transformer.wte.weight.requires_grad_(True)
    assert net.lm_head.weight is net.transformer.wte.weight
    classes = {"upper": cls("upper", band=(2, 3), head=True), "middle": cls("middle", band=(1, 2))}
    resolution = resolve(classes, describe(net))
    assert "transformer.wte.weight" in {p.name for p in resolution.reach["upper"]}
    assert_matches_the_loop(net, resolution, ["middle", "upper", "middle", "upper", "upper"], per_sample=strategy)


def test_a_tie_with_a_module_no_per_sample_rule_covers_refuses_to_start():
    from tests.test_families import base, trainable_layers

    net = base("gpt2")
    trainable_layers(net, 99)
    net.lm_head = _Projection(net.transformer.wte.weight)
    net.transformer.wte.weight.requires_grad_(True)
    resolution = resolve({"c": cls("c", band=(1, 1), head=True)}, describe(net))
    with pytest.raises(ConfigError) as info:
        Router(net, resolution)
    detail = info.value.detail
    assert info.value.code is Code.ROUTING_UNCOVERED
    assert "transformer.wte.weight is also lm_head.weight (tied weights)" in detail and "_Projection" in detail
    assert "freeze it or untie it" in detail
    assert not any(hook for m in net.modules() for hook in m._forward_hooks.values())  # nothing left tapped


def test_a_model_moved_after_the_run_was_built_is_refused_before_anything_moves():
    """A device move after the run was built, as `model.to(device)` does when torch overwrites module parameters
    on conversion (torch.__future__.set_overwrite_module_params_on_conversion): every parameter is a new
    tensor, the optimizer keeps stepping the old ones and the model would never train."""
    net = model(torch.float32)
    router = Router(net, resolve(WHOLE, describe(net)), insecure_seed=0)
    update = Update.build(net, run_file("dpsgd"))
    overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        net._apply(lambda t: t.clone())  # Module.to's conversion, to the same device (this machine may have one)
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(overwrite)
    privatize(net, router)
    before = snapshot(net)
    with pytest.raises(ConfigError) as info:
        update.step(router.noise_std)
    assert info.value.code is Code.STALE_PARAMETERS and "nothing moved" in info.value.detail
    assert all(torch.equal(p, before[n]) for n, p in net.named_parameters())


# -- batch independence -------------------------------------------------------------------------------

def _causal_lora(dropout: float = 0.0):
    """A tiny random Llama with peft's default LoRA init (lora_B zero, so lora_A gets no gradient yet)."""
    from govtrain.train.config import LoraSection
    from govtrain.train.model import wrap_lora
    from tests import causal_models

    tokenizer = causal_models.tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    net = wrap_lora(causal_models.model("llama", layers=2), LoraSection(r=2, dropout=dropout,
                                                                       target_modules=["q_proj", "v_proj"]), [],
                    heads=())
    return net, tokenizer


def test_the_batch_independence_probe_runs_in_eval_mode_restores_every_mode_and_writes_no_grad():
    """LoRA dropout 0.5 in train mode would make two forwards of one example differ: the probe runs in eval
    mode, then gives each module back its own mode. Nothing reaches `.grad`, and the router, built on the same
    model, records nothing outside its capture."""
    from govtrain.routing.independence import BATCHES, check_batch_independence
    from govtrain.tasks import CausalLM

    net, tokenizer = _causal_lora(dropout=0.5)
    router = Router(net, resolve({"c": cls("c", band=(0, 1))}, describe(net)), insecure_seed=0)
    net.train()
    net.base_model.model.model.layers[0].eval()  # a mixed state, restored module by module
    modes = {name: module.training for name, module in net.named_modules()}
    measured = check_batch_independence(net, CausalLM(), tokenizer, 16, torch.device("cpu"))
    assert measured.compared == sum(map(len, BATCHES)) and measured.worst < 1e-5  # lora_B's gradients: not vacuous
    assert {name: module.training for name, module in net.named_modules()} == modes
    assert all(p.grad is None for p in net.parameters())
    assert all(not tap.inputs and not tap.shapes for tap in router.taps.values())


def test_a_batch_independence_probe_that_can_tell_nothing_refuses_the_run():
    """Both LoRA factors at zero: every probe gradient is zero, so no comparison says anything."""
    from govtrain.routing.independence import check_batch_independence
    from govtrain.tasks import CausalLM

    net, tokenizer = _causal_lora()
    with torch.no_grad():
        for name, param in net.named_parameters():
            if ".lora_A." in name:
                param.zero_()
    with pytest.raises(ConfigError) as info:
        check_batch_independence(net, CausalLM(), tokenizer, 16, torch.device("cpu"))
    assert info.value.code is Code.BATCH_COUPLED and info.value.exit_code == 2
    assert "probe is vacuous: every trainable parameter's gradient is zero" in info.value.detail
    assert "lora_B starts at zero" in info.value.detail and "\n" not in info.value.line()


def test_the_modes_a_probe_restores_are_what_train_on_each_module_in_turn_restores():
    """`restore_modes` (the batch-independence probe's and a rehearsal's) against its oracle, `module.train(mode)` on
    each module in `modules()` order: the same flag on every module of a LoRA model whose modes are mixed, and the
    classes that override `train` (transformers' models) still have it called."""
    from govtrain.routing.independence import restore_modes, saved_modes

    calls = []

    class Counted(nn.Linear):
        def train(self, mode: bool = True):
            calls.append(mode)
            return super().train(mode)

    def mixed():
        net = model(torch.float32)
        net.base_model.model.bert.encoder.layer[1].add_module("extra", Counted(2, 2))
        for i, module in enumerate(net.modules()):
            module.training = i % 3 == 0
        return net

    expected, got = mixed(), mixed()
    saved = [(name, module.training) for name, module in expected.named_modules()]
    modes = saved_modes(got)
    for net in (expected, got):
        net.eval()
    for (name, training), module in zip(saved, expected.modules()):
        module.train(training)
    calls.clear()
    restore_modes(got, modes)
    assert [m.training for m in got.modules()] == [m.training for m in expected.modules()] == [t for _, t in saved]
    # the override called (also through its ancestors' overrides, as `train` recurses), last with its saved flag
    assert calls and calls[-1] is dict(saved)["base_model.model.bert.encoder.layer.1.extra"]
