"""Model families through the resolver and the routing layer: GPT-2 (Conv1D, fused c_attn), Llama (GQA,
RMSNorm), Mistral, Qwen2 (q/k/v biases) and GPT-NeoX (fused query_key_value), each a tiny randomly initialised
causal LM built from its transformers config. Every routed step is checked against a batch-size-1 autograd
loop in float64, and every class is checked not to reach what its profile leaves out."""

from __future__ import annotations

import math
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from govtrain.errors import ConfigError  # noqa: E402
from govtrain.resolver.model import describe, role  # noqa: E402
from govtrain.resolver.profile import resolve  # noqa: E402
from govtrain.routing.router import Router  # noqa: E402
from tests.test_resolver import cls  # noqa: E402

T = transformers
LAYERS, HEADS, KV_HEADS, HIDDEN, VOCAB = 4, 4, 2, 16, 30
DECODER = dict(hidden_size=HIDDEN, intermediate_size=24, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
               num_key_value_heads=KV_HEADS, vocab_size=VOCAB, max_position_embeddings=16, tie_word_embeddings=False)
FAMILIES = {  # name -> (config, causal LM class, the stack's prefix, LoRA target modules)
    "gpt2": (lambda: T.GPT2Config(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, vocab_size=VOCAB, n_positions=16,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
             T.GPT2LMHeadModel, "transformer.h.", ["c_attn", "c_proj"]),
    "llama": (lambda: T.LlamaConfig(**DECODER), T.LlamaForCausalLM, "model.layers.",
              ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mistral": (lambda: T.MistralConfig(**DECODER, head_dim=HIDDEN // HEADS), T.MistralForCausalLM, "model.layers.",
                ["q_proj", "v_proj", "o_proj", "down_proj"]),
    "qwen2": (lambda: T.Qwen2Config(**DECODER), T.Qwen2ForCausalLM, "model.layers.",
              ["q_proj", "k_proj", "v_proj", "gate_proj"]),
    "gpt_neox": (lambda: T.GPTNeoXConfig(**{k: v for k, v in DECODER.items() if k != "num_key_value_heads"},
                                         hidden_dropout=0.0, attention_dropout=0.0),
                 T.GPTNeoXForCausalLM, "gpt_neox.layers.", ["query_key_value", "dense"]),
}


def base(family: str, seed: int = 0):
    torch.manual_seed(seed)
    config, model_class, _, _ = FAMILIES[family]
    return model_class(config()).to(torch.float64).eval()


def with_lora(family: str):
    _, _, _, targets = FAMILIES[family]
    lora = peft.LoraConfig(r=2, target_modules=targets, init_lora_weights=False, lora_dropout=0.0,
                           fan_in_fan_out=family == "gpt2")  # GPT-2's Conv1D stores its weight [in, out]
    return peft.get_peft_model(base(family), lora).to(torch.float64).eval()


def trainable_layers(net, first: int) -> None:
    """Base weights trainable from layer `first` on (no LoRA): the modules a class then trains directly."""
    for name, param in net.named_parameters():
        layer = role(name).layer
        param.requires_grad_(layer is not None and layer >= first)


def batch(size: int = 5, length: int = 7, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (size, length), generator=generator)
    attention = torch.ones_like(ids)
    attention[::2, -2:] = 0  # right padding on some examples
    return ids, attention


def losses_of(net, ids, attention):
    """Mean next-token cross-entropy per example over its real tokens: one loss per example."""
    logits = net(input_ids=ids, attention_mask=attention).logits[:, :-1]
    targets, real = ids[:, 1:], attention[:, 1:].to(logits.dtype)
    tokens = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    return (tokens * real).sum(1) / real.sum(1)


def reference(net, resolution, ids, attention, classes, clip):
    """Per-sample gradients from a batch-size-1 autograd loop, masked to each sample's profile, clipped
    jointly to its C_i and summed: the oracle."""
    params = {n: p for n, p in net.named_parameters() if p.requires_grad}
    reach = {c: {part.name: part for part in parts} for c, parts in resolution.reach.items()}
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    for i, data_class in enumerate(classes):
        net.zero_grad(set_to_none=True)
        losses_of(net, ids[i:i + 1], attention[i:i + 1]).sum().backward()
        grads = {}
        for name, part in reach[data_class].items():
            grad = params[name].grad.clone()
            if part.dim is not None:
                keep = torch.zeros(grad.shape[part.dim], dtype=grad.dtype)
                keep[list(part.index)] = 1
                grad = grad * keep.reshape([-1 if d == part.dim else 1 for d in range(grad.dim())])
            grads[name] = grad
        norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))
        factor = min(1.0, float(clip[i]) / norm) if norm > 0 else 1.0
        for name, grad in grads.items():
            total[name] += factor * grad
    net.zero_grad(set_to_none=True)
    return total


def routed(net, resolution, ids, attention, classes, clip, **router):
    """One privatized step without noise: the clipped sum the router writes to `.grad`."""
    router = Router(net, resolution, insecure_seed=0, **router)
    with router.capture():
        losses = losses_of(net, ids, attention)
    report = router.privatize(losses, classes, clip, {}, expected_batch_size=1.0)
    router.close()
    return report, {n: p.grad for n, p in net.named_parameters() if p.requires_grad}


def assert_matches_the_loop(net, resolution, classes, **router) -> None:
    ids, attention = batch(len(classes))
    clip = torch.tensor([0.02 if i % 2 else 50.0 for i in range(len(classes))], dtype=torch.float64)
    expected = reference(net, resolution, ids, attention, classes, clip)
    report, grads = routed(net, resolution, ids, attention, classes, clip, **router)
    assert 0 < report.clipped < len(classes)  # some samples clipped, some not
    reached = {part.name for parts in resolution.reach.values() for part in parts}
    for name, grad in grads.items():
        if name not in reached:
            assert grad is None, name  # no class reaches it: frozen
            continue
        assert torch.allclose(grad, expected[name], atol=1e-10, rtol=1e-8), name


DEPTH = {
    "upper": cls("upper", fraction_u=(500_000, 1_000_000)),  # layers 2-3 of 4
    "middle": cls("middle", band=(1, 2)),
    "sparse": cls("sparse", layers=(0, 3)),
}
WHO = ["upper", "middle", "sparse", "upper", "middle", "sparse"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_describe_reads_each_familys_geometry_and_stack(family: str):
    net = with_lora(family)
    layout = describe(net)
    kv = HEADS if family in ("gpt2", "gpt_neox") else KV_HEADS
    assert (layout.num_layers, layout.num_heads, layout.num_kv_heads, layout.head_dim) == (LAYERS, HEADS, kv, 4)
    _, _, stack, _ = FAMILIES[family]
    for name in (n for n, _ in net.named_parameters()):
        r = role(name)
        if stack in name:
            assert r.layer == int(name.split(stack)[1].split(".")[0]), name
        else:
            assert r.layer is None, name
    assert layout.transposed == ({f"base_model.model.transformer.h.{i}.{m}" for i in range(LAYERS)
                                  for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
                                 if family == "gpt2" else frozenset())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_lora_depth_profiles_reach_exactly_their_layers_and_match_the_loop(family: str):
    net = with_lora(family)
    resolution = resolve(DEPTH, describe(net))
    assert {c: {role(p.name).layer for p in parts} for c, parts in resolution.reach.items()} == {
        "upper": {2, 3}, "middle": {1, 2}, "sparse": {0, 3}}
    assert all(role(p.name).peft_part in ("lora_A", "lora_B") for parts in resolution.reach.values() for p in parts)
    assert_matches_the_loop(net, resolution, WHO)

    alone = resolve({"middle": DEPTH["middle"]}, describe(net))
    ids, attention = batch()
    _, grads = routed(net, alone, ids, attention, ["middle"] * 5, torch.full((5,), 50.0, dtype=torch.float64))
    for name, grad in grads.items():
        if role(name).layer in (1, 2):
            assert grad is not None and grad.abs().max() > 0, name
        else:
            assert grad is None, name  # outside the band: no gradient, no noise, frozen


@pytest.mark.parametrize("family", list(FAMILIES))
def test_base_weights_conv1d_and_norms_match_the_loop(family: str):
    """No LoRA: the layers' own Linear or Conv1D weights and biases, LayerNorms or RMSNorms, trained directly."""
    net = base(family)
    trainable_layers(net, 1)
    kinds = {type(net.get_submodule(n.rpartition(".")[0])).__name__ for n, p in net.named_parameters()
             if p.requires_grad}
    assert kinds == ({"Conv1D", "LayerNorm"} if family == "gpt2" else {"Linear", "LayerNorm"} if family == "gpt_neox"
                     else {"Linear", f"{type(net).__name__.removesuffix('ForCausalLM')}RMSNorm"})
    classes = {"upper": DEPTH["upper"], "middle": DEPTH["middle"]}
    resolution = resolve(classes, describe(net))
    assert_matches_the_loop(net, resolution, ["upper", "middle", "upper", "middle", "upper"])


@pytest.mark.parametrize("strategy", ["ghost", "materialize"])
def test_gpt2_conv1d_heads_reach_the_rows_of_c_proj_and_match_the_loop(strategy: str):
    """c_proj's weight is [in, out]: a head's input features are its rows (dim 0). c_attn is frozen here
    (heads cannot be split out of the fused qkv projection)."""
    net = base("gpt2")
    trainable_layers(net, 2)
    for block in net.transformer.h:
        block.attn.c_attn.requires_grad_(False)
    classes = {"heads": cls("heads", band=(2, 3), heads=((3, (1, 2)),)), "whole": cls("whole", band=(3, 3))}
    resolution = resolve(classes, describe(net))
    parts = {p.name: p for p in resolution.reach["heads"]}
    proj = parts["transformer.h.3.attn.c_proj.weight"]
    assert (proj.dim, proj.index) == (0, tuple(range(4, 12)))
    assert "transformer.h.3.attn.c_proj.bias" not in parts and "transformer.h.3.mlp.c_proj.weight" not in parts
    assert "transformer.h.2.mlp.c_proj.weight" in parts  # layer 2 is in the band, unrestricted
    assert_matches_the_loop(net, resolution, ["heads", "whole", "heads", "heads", "whole"], per_sample=strategy)

    alone = resolve({"heads": classes["heads"]}, describe(net))
    ids, attention = batch()
    _, grads = routed(net, alone, ids, attention, ["heads"] * 5, torch.full((5,), 50.0, dtype=torch.float64))
    outside = [i for i in range(16) if i not in range(4, 12)]
    assert grads["transformer.h.3.attn.c_proj.weight"][outside].abs().max() == 0  # other heads' rows: exactly zero
    assert grads["transformer.h.3.attn.c_proj.weight"][4:12].abs().max() > 0
    assert grads["transformer.h.3.attn.c_proj.bias"] is None and grads["transformer.h.3.mlp.c_fc.weight"] is None


def test_gpt2_heads_on_the_fused_c_attn_are_refused():
    net = with_lora("gpt2")
    with pytest.raises(ConfigError) as info:
        resolve({"c": cls("c", band=(3, 3), heads=((3, (0,)),))}, describe(net))
    assert info.value.code.value == "profile_unresolvable" and "c_attn" in info.value.detail


def test_gpt_neox_heads_reach_the_dense_output_projection_only_when_qkv_is_frozen():
    net = with_lora("gpt_neox")
    with pytest.raises(ConfigError) as info:
        resolve({"c": cls("c", band=(3, 3), heads=((3, (0,)),))}, describe(net))
    assert info.value.code.value == "profile_unresolvable" and "query_key_value" in info.value.detail
    for name, param in net.named_parameters():
        param.requires_grad_(".lora_" in name and "attention.dense" in name)
    resolution = resolve({"c": cls("c", band=(2, 3), heads=((3, (0,)),))}, describe(net))
    parts = {p.name: p for p in resolution.reach["c"]}
    lora_a = parts["base_model.model.gpt_neox.layers.3.attention.dense.lora_A.default.weight"]
    assert (lora_a.dim, lora_a.index) == (1, tuple(range(4)))
    assert "base_model.model.gpt_neox.layers.3.attention.dense.lora_B.default.weight" not in parts
    assert_matches_the_loop(net, resolution, ["c"] * 5)


# -- grouped-query attention: 4 query heads share 2 key/value heads (kv head j serves q heads 2j, 2j+1) ------------

def gqa_net(family: str = "llama"):
    net = base(family)
    for name, param in net.named_parameters():
        param.requires_grad_(".layers.3.self_attn." in name)
    return net


def test_gqa_a_kv_head_is_reached_only_with_every_query_head_that_shares_it():
    net = gqa_net()
    ids, attention = batch()
    clip = torch.full((5,), 50.0, dtype=torch.float64)
    one = resolve({"c": cls("c", band=(3, 3), heads=((3, (0,)),))}, describe(net))
    _, grads = routed(net, one, ids, attention, ["c"] * 5, clip)
    attn = "model.layers.3.self_attn."
    assert grads[attn + "k_proj.weight"] is None and grads[attn + "v_proj.weight"] is None  # kv head 0 also serves 1
    assert grads[attn + "q_proj.weight"][4:].abs().max() == 0 and grads[attn + "q_proj.weight"][:4].abs().max() > 0
    assert grads[attn + "o_proj.weight"][:, 4:].abs().max() == 0

    pair = resolve({"c": cls("c", band=(3, 3), heads=((3, (0, 1)),))}, describe(net))
    _, grads = routed(net, pair, ids, attention, ["c"] * 5, clip)
    for proj in ("k_proj", "v_proj"):
        grad = grads[attn + proj + ".weight"]
        assert grad.shape == (8, HIDDEN) and grad[4:].abs().max() == 0 and grad[:4].abs().max() > 0  # kv head 0 rows


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # Qwen2's q/k/v biases follow their heads' rows
def test_gqa_heads_through_the_router_match_the_loop(family: str):
    net = gqa_net(family)
    classes = {"pair": cls("pair", band=(3, 3), heads=((3, (2, 3)),)),
               "one": cls("one", band=(3, 3), heads=((3, (1,)),))}
    resolution = resolve(classes, describe(net))
    k_parts = [p for p in resolution.reach["pair"] if p.name.endswith("k_proj.weight")]
    assert [(p.dim, p.index) for p in k_parts] == [(0, tuple(range(4, 8)))]  # kv head 1
    assert not any("k_proj" in p.name or "v_proj" in p.name for p in resolution.reach["one"])
    if family == "qwen2":
        bias = {p.name: p for p in resolution.reach["pair"]}["model.layers.3.self_attn.k_proj.bias"]
        assert (bias.dim, bias.index) == (0, tuple(range(4, 8)))
    assert_matches_the_loop(net, resolution, ["pair", "one", "pair", "one", "pair"])


# -- what no hook covers refuses to start -----------------------------------------------------------------------------

class Scaled(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.scale = inner, nn.Parameter(torch.ones(()))

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs) * self.scale


class GemmaStyleRMSNorm(nn.Module):
    """(1 + w) · x/rms(x): an RMSNorm by name whose per-sample rule is not w · x/rms(x)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(torch.zeros(size)), 1e-6

    def forward(self, x):
        return (1 + self.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


def test_uncovered_modules_refuse_to_start():
    net = base("llama")
    trainable_layers(net, 99)  # nothing trainable
    layer = net.model.layers[2]
    layer.mlp = Scaled(layer.mlp)  # a bare nn.Parameter in a custom module
    net.to(torch.float64)
    resolution = resolve({"c": cls("c", band=(2, 2))}, describe(net))
    with pytest.raises(ConfigError) as info:
        Router(net, resolution)
    assert info.value.code.value == "routing_uncovered" and "model.layers.2.mlp.scale" in info.value.detail
    assert "Scaled" in info.value.detail

    net = base("llama")
    trainable_layers(net, 99)
    net.model.layers[2].input_layernorm = GemmaStyleRMSNorm(HIDDEN).double()
    resolution = resolve({"c": cls("c", band=(2, 2))}, describe(net))
    with pytest.raises(ConfigError) as info:
        Router(net, resolution)
    assert info.value.code.value == "routing_uncovered" and "x / rms(x)" in info.value.detail
    # tied weights (GPT-2's wte and lm_head) are routed, and a tie with an uncovered module refused: tests/test_guards.py
