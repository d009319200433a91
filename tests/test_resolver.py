"""The resolver: class -> depth profile -> exactly the parameters (rows, columns) of a model it reaches."""

from __future__ import annotations

import os

import pytest

from govtrain.errors import ConfigError
from govtrain.policy.model import DataClass, DepthProfile
from govtrain.resolver.model import ModelLayout, Param, describe, role
from govtrain.resolver.profile import profile_layers, resolve

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

HEADS, HEAD_DIM, LAYERS = 4, 8, 6


def cls(name: str, **profile) -> DataClass:
    kind = next(k for k in ("band", "fraction_u", "layers", "adapter") if k in profile)
    return DataClass(name=name, clip_norm_u=1_000_000, min_noise_multiplier_u=1_000_000, eps_budget_u=1_000_000,
                     max_eps_budget_u=1_000_000,
                     profile=DepthProfile(kind=kind.removesuffix("_u"), **profile))


def tiny_bert(layers: int = LAYERS):
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=HEADS * HEAD_DIM, num_hidden_layers=layers, num_attention_heads=HEADS,
                                     intermediate_size=37, vocab_size=50, max_position_embeddings=16, num_labels=2)
    return transformers.BertForSequenceClassification(config)


def peft_bert(**lora):
    config = peft.LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["query", "value", "attention.output.dense"],
                             init_lora_weights=False, **lora)
    return peft.get_peft_model(tiny_bert(), config)


def layers_of(parts) -> set[int | None]:
    return {role(p.name).layer for p in parts}


@pytest.fixture(scope="module")
def bert():
    return describe(tiny_bert())


def test_band_reaches_exactly_its_layers(bert: ModelLayout):
    result = resolve({"sensitive": cls("sensitive", band=(4, 5))}, bert)
    parts = result.reach["sensitive"]
    assert layers_of(parts) == {4, 5}
    expected = {p.name for p in bert.params if role(p.name).layer in (4, 5)}
    assert {p.name for p in parts} == expected and all(p.dim is None for p in parts)
    assert result.layers["sensitive"] == (4, 5)


@pytest.mark.parametrize("fraction, layers, expected", [
    ((500_000, 1_000_000), 6, (3, 4, 5)),
    ((700_000, 1_000_000), 6, (5,)),       # 0.7 * 6 = 4.2: layer 4 is only partly inside, so it is left out
    ((700_000, 1_000_000), 12, (9, 10, 11)),  # 8.4 rounds up to 9
    ((0, 340_000), 6, (0, 1)),              # 0.34 * 6 = 2.04: layer 2 would end at 3/6 = 0.5 > 0.34
    ((0, 1_000_000), 6, (0, 1, 2, 3, 4, 5)),
    ((333_333, 666_667), 3, (1,)),          # thirds: exact integer arithmetic, no float slop
])
def test_fraction_reaches_layers_wholly_inside_it(fraction, layers, expected):
    assert profile_layers(DepthProfile(kind="fraction", fraction_u=fraction), layers) == expected


def test_fraction_narrower_than_a_layer_is_an_error(bert: ModelLayout):
    with pytest.raises(ConfigError) as info:
        resolve({"thin": cls("thin", fraction_u=(700_000, 800_000))}, bert)
    assert info.value.code.value == "profile_unmatched" and "no whole layer" in info.value.detail
    with pytest.raises(ConfigError):  # 0.333334 > 1/3: the middle third is not wholly inside
        profile_layers(DepthProfile(kind="fraction", fraction_u=(333_334, 666_667)), 3)


def test_fraction_through_resolve_and_sparse_layers(bert: ModelLayout):
    result = resolve({"top": cls("top", fraction_u=(500_000, 1_000_000)), "sparse": cls("sparse", layers=(0, 2, 5))},
                     bert)
    assert layers_of(result.reach["top"]) == {3, 4, 5}
    assert layers_of(result.reach["sparse"]) == {0, 2, 5}


def test_parameters_outside_the_stack_need_head_true(bert: ModelLayout):
    outside = {p.name for p in bert.params if role(p.name).layer is None}
    assert {"classifier.weight", "classifier.bias", "bert.pooler.dense.weight",
            "bert.embeddings.word_embeddings.weight"} <= outside
    with_head = resolve({"c": cls("c", band=(5, 5), head=True)}, bert).reach["c"]
    without = resolve({"c": cls("c", band=(5, 5))}, bert).reach["c"]
    assert outside <= {p.name for p in with_head}
    assert not outside & {p.name for p in without}


def test_heads_reach_their_rows_and_columns_only(bert: ModelLayout):
    result = resolve({"h": cls("h", band=(4, 5), heads=((5, (1, 3)),))}, bert)
    parts = {p.name: p for p in result.reach["h"]}
    rows = tuple(range(8, 16)) + tuple(range(24, 32))
    prefix = "bert.encoder.layer.5.attention."
    for name in ("self.query.weight", "self.query.bias", "self.key.weight", "self.value.bias"):
        assert (parts[prefix + name].dim, parts[prefix + name].index) == (0, rows)
    assert (parts[prefix + "output.dense.weight"].dim, parts[prefix + "output.dense.weight"].index) == (1, rows)
    for name in ("output.dense.bias", "output.LayerNorm.weight"):
        assert prefix + name not in parts  # mixes every head
    assert not any(n.startswith("bert.encoder.layer.5.intermediate") for n in parts)
    layer4 = [p for n, p in parts.items() if ".layer.4." in n]
    assert len(layer4) == sum(".layer.4." in p.name for p in bert.params) and all(p.dim is None for p in layer4)


def test_heads_on_lora_factors():
    layout = describe(peft_bert())
    result = resolve({"h": cls("h", band=(5, 5), heads=((5, (2,)),))}, layout)
    parts = {p.name: p for p in result.reach["h"]}
    query = "base_model.model.bert.encoder.layer.5.attention.self.query."
    out = "base_model.model.bert.encoder.layer.5.attention.output.dense."
    assert (parts[query + "lora_B.default.weight"].dim, parts[query + "lora_B.default.weight"].index) == (
        0, tuple(range(16, 24)))
    assert query + "lora_A.default.weight" not in parts  # lora_A of q feeds every head's output
    assert (parts[out + "lora_A.default.weight"].dim, parts[out + "lora_A.default.weight"].index) == (
        1, tuple(range(16, 24)))
    assert out + "lora_B.default.weight" not in parts


def test_grouped_query_attention_heads_on_a_llama_style_model():
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
    layout = describe(transformers.LlamaForCausalLM(config))
    assert (layout.num_layers, layout.num_heads, layout.num_kv_heads, layout.head_dim) == (4, 4, 2, 8)
    assert role("model.layers.3.self_attn.q_proj.weight").layer == 3
    both = resolve({"c": cls("c", band=(2, 3), heads=((3, (0, 1)),))}, layout).reach["c"]
    parts = {p.name: p for p in both}
    assert parts["model.layers.3.self_attn.q_proj.weight"].index == tuple(range(16))
    assert parts["model.layers.3.self_attn.k_proj.weight"].index == tuple(range(8))  # kv head 0, shared by 0 and 1
    assert parts["model.layers.3.self_attn.o_proj.weight"].dim == 1
    split = {p.name for p in resolve({"c": cls("c", band=(3, 3), heads=((3, (1, 2)),))}, layout).reach["c"]}
    assert "model.layers.3.self_attn.k_proj.weight" not in split  # each kv head is shared with an unlisted head
    assert "model.layers.3.self_attn.q_proj.weight" in split
    assert {role(n).layer for n in split} == {3}
    head = resolve({"c": cls("c", band=(3, 3), head=True)}, layout).reach["c"]
    assert {"lm_head.weight", "model.norm.weight", "model.embed_tokens.weight"} <= {p.name for p in head}


def test_peft_multi_adapter_routing():
    model = peft_bert()
    model.add_adapter("restricted", peft.LoraConfig(task_type="SEQ_CLS", r=2, target_modules=["query"]))
    for name, param in model.named_parameters():
        if ".lora_" in name or "modules_to_save" in name:
            param.requires_grad_(True)
    layout = describe(model)
    classes = {"public": cls("public", fraction_u=(500_000, 1_000_000), head=True),
               "restricted": cls("restricted", adapter="restricted")}
    result = resolve(classes, layout)
    restricted = {p.name for p in result.reach["restricted"]}
    assert restricted and all(".restricted." in n for n in restricted)
    assert "base_model.model.classifier.modules_to_save.restricted.weight" in restricted
    public = {p.name for p in result.reach["public"]}
    assert not any(".restricted." in n for n in public)
    assert "base_model.model.classifier.modules_to_save.default.weight" in public
    assert not any("base_layer" in n or "original_module" in n for n in public | restricted)  # frozen base weights
    with pytest.raises(ConfigError) as info:
        resolve({"x": cls("x", adapter="missing")}, layout)
    assert info.value.code.value == "profile_unmatched" and "default, restricted" in info.value.detail


def test_groups_partition_every_trainable_coordinate():
    layout = describe(peft_bert())
    classes = {"public": cls("public", fraction_u=(500_000, 1_000_000), head=True),
               "sensitive": cls("sensitive", band=(4, 5), heads=((5, (0, 1)),))}
    result = resolve(classes, layout)
    params = {p.name: p for p in layout.trainable()}
    coverage = {name: torch.zeros(p.shape, dtype=torch.int64) for name, p in params.items()}
    for group in result.groups:
        for part in group.parts:
            index = [slice(None)] * len(params[part.name].shape)
            if part.dim is not None:
                index[part.dim] = list(part.index)
            coverage[part.name][tuple(index)] += 1
    assert all(bool((c == 1).all()) for c in coverage.values())
    assert sum(g.numel for g in result.groups) == sum(p.numel for p in params.values())
    signatures = {g.classes for g in result.groups}
    assert frozenset({"public", "sensitive"}) in signatures and frozenset({"public"}) in signatures
    assert frozenset() in signatures  # the LoRA factors of layers 0-2: nobody's, frozen
    assert set(result.class_groups()["sensitive"]) == {frozenset({"public", "sensitive"})}


def test_a_profile_that_reaches_nothing_is_an_error():
    layout = describe(peft_bert(layers_to_transform=[0, 1]))  # LoRA only in layers 0-1
    with pytest.raises(ConfigError) as info:
        resolve({"sensitive": cls("sensitive", band=(4, 5))}, layout)
    assert info.value.code.value == "profile_unmatched"
    assert "reaches no trainable parameter" in info.value.detail and "layers 0-1" in info.value.detail


@pytest.mark.parametrize("profile, code", [
    ({"band": (4, 7)}, "profile_out_of_range"),
    ({"layers": (1, 6)}, "profile_out_of_range"),
    ({"band": (5, 5), "heads": ((5, (4,)),)}, "profile_out_of_range"),
])
def test_layers_and_heads_the_model_lacks(bert: ModelLayout, profile, code):
    with pytest.raises(ConfigError) as info:
        resolve({"c": cls("c", **profile)}, bert)
    assert info.value.code.value == code and info.value.exit_code == 2


def test_fused_attention_cannot_be_split_by_heads():
    config = transformers.GPT2Config(n_embd=32, n_layer=3, n_head=4, vocab_size=64, n_positions=32)
    layout = describe(transformers.GPT2LMHeadModel(config))
    assert layers_of(resolve({"c": cls("c", band=(1, 2))}, layout).reach["c"]) == {1, 2}
    with pytest.raises(ConfigError) as info:
        resolve({"c": cls("c", band=(2, 2), heads=((2, (0,)),))}, layout)
    assert info.value.code.value == "profile_unresolvable" and "c_attn" in info.value.detail


def test_two_layer_stacks_are_refused():
    params = [Param("encoder.block.0.layer.0.SelfAttention.q.weight", (4, 4)),
              Param("decoder.block.0.layer.0.SelfAttention.q.weight", (4, 4))]
    with pytest.raises(ConfigError) as info:
        ModelLayout.from_params(params)
    assert info.value.code.value == "profile_unresolvable" and "2 layer stacks" in info.value.detail


@pytest.mark.slow
def test_minilm_real_module_names():
    from govtrain.resolver.load import load_layout

    layout = load_layout("minilm")
    assert (layout.num_layers, layout.num_heads, layout.head_dim) == (6, 12, 32)
    names = {p.name for p in layout.params}
    assert "bert.encoder.layer.5.attention.self.query.weight" in names and "classifier.weight" in names
    classes = {"public": cls("public", fraction_u=(500_000, 1_000_000), head=True),
               "sensitive": cls("sensitive", band=(4, 5), heads=((5, (0, 11)),))}
    result = resolve(classes, layout)
    assert result.layers["public"] == (3, 4, 5) and layers_of(result.reach["sensitive"]) == {4, 5}
    query = next(p for p in result.reach["sensitive"] if p.name == "bert.encoder.layer.5.attention.self.query.weight")
    assert query.index == tuple(range(32)) + tuple(range(352, 384))
    # every BERT layer holds 16 tensors; layer 5 under heads keeps q/k/v weight+bias and the output weight
    assert len(result.reach["sensitive"]) == 16 + 7
