"""Mixture of experts (Mixtral-style, transformers' fused MixtralExperts and MixtralTopKRouter): `experts`
profiles reach only their experts' slices, routers only with `router = true`, and the routed step equals a
batch-size-1 autograd loop in float64."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from govtrain.errors import ConfigError  # noqa: E402
from govtrain.resolver.model import ModelLayout, Param, describe, role  # noqa: E402
from govtrain.resolver.profile import resolve  # noqa: E402
from govtrain.routing.router import Router  # noqa: E402
from tests.test_families import VOCAB, assert_matches_the_loop, base, batch, routed  # noqa: E402
from tests.test_resolver import cls  # noqa: E402

EXPERTS = 4
L0 = "model.layers.0.mlp."
L1 = "model.layers.1.mlp."


def mixtral(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.MixtralConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                        max_position_embeddings=16, num_local_experts=EXPERTS, num_experts_per_tok=2,
                                        router_jitter_noise=0.0, tie_word_embeddings=False,
                                        experts_implementation="eager")  # grouped_mm takes no float64
    net = transformers.MixtralForCausalLM(config).to(torch.float64).eval()
    for name, param in net.named_parameters():
        param.requires_grad_(role(name).layer is not None)  # every layer's attention, norms, router and experts
    return net


CLASSES = {
    "experts": cls("experts", band=(0, 1), experts=((0, (1,)), (1, (1, 2)))),
    "routed": cls("routed", band=(1, 1), router=True),
    "depth": cls("depth", band=(0, 0)),
}


def test_describe_and_resolve_experts_and_routers():
    net = mixtral()
    layout = describe(net)
    assert (layout.num_layers, layout.num_heads, layout.num_kv_heads, layout.num_experts) == (2, 4, 2, EXPERTS)
    resolution = resolve(CLASSES, layout)
    reach = {c: {p.name: p for p in parts} for c, parts in resolution.reach.items()}
    assert set(reach["experts"]) == {L0 + "experts.gate_up_proj", L0 + "experts.down_proj",
                                     L1 + "experts.gate_up_proj", L1 + "experts.down_proj"}  # nothing else there
    assert reach["experts"][L0 + "experts.gate_up_proj"].index == (1,)
    down = reach["experts"][L1 + "experts.down_proj"]
    assert (down.dim, down.index) == (0, (1, 2)) and down.describe() == f"{L1}experts.down_proj[experts 1-2]"
    assert L1 + "gate.weight" in reach["routed"] and reach["routed"][L1 + "gate.weight"].dim is None
    assert L0 + "gate.weight" not in reach["depth"]  # a router needs router = true, whatever the depth
    assert reach["depth"][L0 + "experts.gate_up_proj"].dim is None  # an unrestricted layer: every expert


@pytest.mark.parametrize("seed", [0, 1])
def test_experts_routers_and_the_rest_of_the_layers_match_the_loop(seed: int):
    net = mixtral(seed)
    resolution = resolve(CLASSES, describe(net))
    assert_matches_the_loop(net, resolution, ["experts", "routed", "depth", "experts", "routed", "depth"])


def test_a_class_reaches_only_its_experts_slices_and_no_router():
    net = mixtral()
    ids, attention = batch()
    clip = torch.full((5,), 50.0, dtype=torch.float64)
    resolution = resolve({"one": cls("one", band=(0, 0), experts=((0, (1,)),))}, describe(net))
    _, grads = routed(net, resolution, ids, attention, ["one"] * 5, clip)
    for leaf in ("gate_up_proj", "down_proj"):
        grad = grads[L0 + "experts." + leaf]
        assert grad[1].abs().max() > 0  # expert 1 was routed some tokens and learns
        assert all(grad[e].abs().max() == 0 for e in range(EXPERTS) if e != 1), leaf  # the others: exactly zero
    reached = {L0 + "experts.gate_up_proj", L0 + "experts.down_proj"}
    assert all(grad is None for name, grad in grads.items() if name not in reached)  # router, attention, norms

    granted = resolve({"one": cls("one", band=(0, 0), experts=((0, (1,)),), router=True)}, describe(net))
    _, grads = routed(net, granted, ids, attention, ["one"] * 5, clip)
    assert grads[L0 + "gate.weight"].abs().max() > 0 and grads[L1 + "gate.weight"] is None


def test_the_layout_probe_passes_for_the_flattened_tokens():
    net = mixtral()
    router = Router(net, resolve(CLASSES, describe(net)), insecure_seed=0)
    router.probe([{"input_ids": torch.randint(1, VOCAB, (size, 7))} for size in (2, 3)])
    router.close()


def test_experts_profiles_the_model_cannot_satisfy_are_refused():
    with pytest.raises(ConfigError) as info:
        resolve({"c": cls("c", band=(0, 0), experts=((0, (EXPERTS,)),))}, describe(mixtral()))
    assert info.value.code.value == "profile_out_of_range" and f"expert {EXPERTS}" in info.value.detail
    with pytest.raises(ConfigError) as info:
        resolve({"c": cls("c", band=(0, 0), experts=((0, (0,)),))}, describe(base("llama")))
    assert info.value.code.value == "profile_unresolvable" and "mixture-of-experts" in info.value.detail


def test_a_block_that_does_not_flatten_tokens_sample_by_sample_is_refused():
    """The per-sample rules read token n as sample n // T: a block that flattens sequence-first breaks that."""
    net = mixtral()
    block = net.model.layers[0].mlp

    def sequence_first(self, hidden_states):
        batch_size, length, dim = hidden_states.shape
        flat = hidden_states.transpose(0, 1).reshape(-1, dim)
        _, weights, index = self.gate(flat)
        return self.experts(flat, index, weights).reshape(length, batch_size, dim).transpose(0, 1)

    block.forward = types.MethodType(sequence_first, block)  # bound to the block, and to the copy a check makes
    with pytest.raises(ConfigError) as info:
        Router(net, resolve(CLASSES, describe(net)))
    assert info.value.code.value == "routing_uncovered" and "model.layers.0.mlp" in info.value.detail
    assert "flattened sample by sample" in info.value.detail


def test_routers_found_by_their_class_need_router_true():
    """DBRX keeps its router's Linear at `ffn.router.layer`: `describe` names the router by its class."""
    params = [Param("transformer.blocks.0.ffn.router.layer.weight", (EXPERTS, 16)),
              Param("transformer.blocks.0.ffn.experts.mlp.w1", (EXPERTS, 24, 16))]
    layout = ModelLayout.from_params(params, num_experts=EXPERTS, routers={"transformer.blocks.0.ffn.router"})
    depth = resolve({"c": cls("c", band=(0, 0))}, layout).reach["c"]
    assert [p.name for p in depth] == ["transformer.blocks.0.ffn.experts.mlp.w1"]
    granted = resolve({"c": cls("c", band=(0, 0), router=True)}, layout).reach["c"]
    assert {p.name for p in granted} == {p.name for p in params}
    assert describe(mixtral()).routers == {f"model.layers.{i}.mlp.gate" for i in range(2)}


def test_lora_attention_with_trainable_experts_matches_the_loop():
    net = peft.get_peft_model(mixtral(), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"],
                                                         init_lora_weights=False, lora_dropout=0.0))
    for name, param in net.named_parameters():
        param.requires_grad_(".lora_" in name or ".experts." in name or name.endswith("gate.weight"))
    net.to(torch.float64).eval()
    resolution = resolve(CLASSES, describe(net))
    experts_reach = {p.name for p in resolution.reach["experts"]}
    assert experts_reach == {f"base_model.model.{L}experts.{leaf}" for L in (L0, L1)
                             for leaf in ("gate_up_proj", "down_proj")}  # no LoRA of the experts' layers' attention
    assert_matches_the_loop(net, resolution, ["experts", "routed", "depth", "routed", "depth"])


def test_removing_one_example_moves_the_clipped_sum_by_at_most_its_clip_norm():
    from tests.test_families import losses_of
    from tests.test_routing import assert_removing_one_moves_the_release_by_at_most_its_clip_norm

    net = mixtral()
    router = Router(net, resolve(CLASSES, describe(net)), insecure_seed=0)
    ids, attention = batch(6)
    who = ["experts", "routed", "depth", "experts", "routed", "depth"]
    clip = torch.tensor([0.02, 50.0, 0.05, 50.0, 0.01, 0.03], dtype=torch.float64)

    def released(keep):
        with router.capture():
            losses = losses_of(net, ids[keep], attention[keep])
        router.privatize(losses, [who[i] for i in keep], clip[keep], {}, expected_batch_size=1.0)
        return {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}

    assert_removing_one_moves_the_release_by_at_most_its_clip_norm(released, clip)


def fused_lora(seed: int = 0):
    """peft's LoRA on both fused expert parameters (target_parameters), factors random (not B = 0), float64."""
    config = peft.LoraConfig(r=2, target_modules=[], init_lora_weights=False,
                             target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    torch.manual_seed(seed)
    return peft.get_peft_model(mixtral(seed), config).to(torch.float64).eval()


def test_lora_on_the_fused_expert_parameters_matches_the_loop():
    """The factors are multiplied into the weight (W + s·B·A) and never called on tokens: their per-sample
    gradients come from the fused weight's, by the chain rule. Whole layers and an experts profile."""
    net = fused_lora()
    classes = {"all": cls("all", band=(0, 1)), "one": cls("one", band=(0, 1), experts=((0, (1,)), (1, (2, 3))))}
    resolution = resolve(classes, describe(net))
    factors = [p.name for p in resolution.reach["all"] if ".lora_" in p.name]
    assert len(factors) == 8  # A and B on gate_up_proj and down_proj, in both layers
    assert_matches_the_loop(net, resolution, ["all", "one", "all", "one", "one", "all"])


def test_an_experts_profile_reaches_only_its_experts_factor_rows_and_columns():
    net = fused_lora(1)
    ids, attention = batch()
    clip = torch.full((5,), 50.0, dtype=torch.float64)
    resolution = resolve({"one": cls("one", band=(0, 0), experts=((0, (1,)),))}, describe(net))
    _, grads = routed(net, resolution, ids, attention, ["one"] * 5, clip)
    factors = {n: g for n, g in grads.items() if ".lora_" in n and role(n).layer == 0}
    assert len(factors) == 4
    for name, grad in factors.items():
        rank = 2
        if ".lora_A." in name:  # [E·r, in]: expert e's rows e·r … e·r+r−1
            mine = grad.reshape(EXPERTS, rank, -1)
            assert mine[1].abs().max() > 0, name
            assert all(mine[e].abs().max() == 0 for e in range(EXPERTS) if e != 1), name
        else:  # [out, r·E]: expert e's columns k·E + e
            mine = grad.reshape(grad.shape[0], rank, EXPERTS)
            assert mine[:, :, 1].abs().max() > 0, name
            assert all(mine[:, :, e].abs().max() == 0 for e in range(EXPERTS) if e != 1), name
    assert all(grad is None for name, grad in grads.items() if name not in factors)


def test_the_factor_rows_and_columns_of_an_expert_are_the_ones_peft_multiplies_into_its_slice():
    """The resolver's layout of expert e's factors (lora_A rows e·r…, lora_B columns k·E+e), checked against
    peft's own delta weight: zeroing them zeroes expert e's slice of W + s·B·A and leaves the others."""
    net = fused_lora()
    wrapper = next(m for m in net.modules() if type(m).__name__ == "ParamWrapper" and m.parameter_name == "down_proj")
    resolution = resolve({"one": cls("one", band=(0, 1), experts=((0, (2,)), (1, (2,))))}, describe(net))
    parts = {p.name: p for p in resolution.reach["one"]}
    with torch.no_grad():
        before = wrapper.get_delta_weight("default").clone()
        for factor in (wrapper.lora_A["default"].weight, wrapper.lora_B["default"].weight):
            name = next(n for n, p in net.named_parameters() if p is factor)
            index = torch.tensor(parts[name].index)
            factor.index_fill_(parts[name].dim, index, 0.0)
            after = wrapper.get_delta_weight("default")
            assert after[2].abs().max() == 0 and before[2].abs().max() > 0
            assert all(torch.equal(after[e], before[e]) for e in range(EXPERTS) if e != 2)


def test_prism_refuses_lora_on_fused_expert_parameters():
    net = fused_lora()
    with pytest.raises(ConfigError) as info:
        Router(net, resolve({"c": cls("c", band=(0, 1))}, describe(net)), mechanism="prism")
    assert info.value.code.value == "routing_uncovered" and "one pair per expert" in info.value.detail


def test_one_module_per_expert_is_reached_whole_or_not_at_all():
    """The older Mixtral layout (`block_sparse_moe.experts.N.w1`, LoRA on each expert's Linear) by name."""
    stem = "model.layers.0.block_sparse_moe."
    params = [Param(stem + f"experts.{e}.w1.lora_{f}.default.weight", (2, 16) if f == "A" else (24, 2))
              for e in range(EXPERTS) for f in "AB"] + [Param(stem + "gate.weight", (EXPERTS, 16)),
                                                        Param("model.layers.0.self_attn.q_proj.weight", (16, 16))]
    layout = ModelLayout.from_params(params, num_experts=EXPERTS)
    reach = resolve({"c": cls("c", band=(0, 0), experts=((0, (0, 2)),))}, layout).reach["c"]
    assert {p.name for p in reach} == {stem + f"experts.{e}.w1.lora_{f}.default.weight" for e in (0, 2) for f in "AB"}
    assert all(p.dim is None for p in reach)
