"""`[model] pooling = "mean"` and `[lora] layers`: each example's pooled vector is a function of that example
alone (padding never enters), the routing layer's per-sample gradients still equal the batch-size-1 loop,
and what cannot be honoured is refused before anything loads."""

from __future__ import annotations

import peft
import pytest
import torch
import transformers

from govtrain.errors import Code, ConfigError
from govtrain.resolver.model import describe
from govtrain.resolver.profile import resolve
from govtrain.routing.router import Router
from govtrain.train.config import LoraSection, ModelSection
from govtrain.train.model import wrap_lora
from govtrain.models.pooling import MaskedMean, token_mask, use_pooling
from tests.test_routing import batch, cls, losses_of, reference


def bert(seed: int = 0, layers: int = 4) -> transformers.BertForSequenceClassification:
    torch.manual_seed(seed)
    config = transformers.BertConfig(hidden_size=16, num_hidden_layers=layers, num_attention_heads=2,
                                     intermediate_size=24, vocab_size=30, max_position_embeddings=16, num_labels=3)
    return transformers.BertForSequenceClassification(config).eval()


def padded(size: int = 4):
    ids = torch.randint(1, 30, (size, 7), generator=torch.Generator().manual_seed(3))
    attention = torch.ones_like(ids)
    for i in range(size):
        attention[i, 7 - i:] = 0  # example i has i padding tokens
    return ids, attention


def test_mean_pooling_is_the_mean_over_the_example_own_tokens_whatever_the_padding():
    net = use_pooling(bert().double(), "mean")
    ids, attention = padded()
    together = net(input_ids=ids, attention_mask=attention).logits
    for i in range(len(ids)):
        n = int(attention[i].sum())
        alone = net(input_ids=ids[i:i + 1, :n], attention_mask=attention[i:i + 1, :n]).logits
        assert torch.allclose(together[i], alone[0], atol=1e-12), i
        hidden = net.bert(input_ids=ids[i:i + 1, :n]).last_hidden_state
        assert torch.allclose(net.bert(input_ids=ids[i:i + 1, :n]).pooler_output, hidden.mean(1), atol=1e-12)
    # The classifier really reads the mean: the architecture's own [CLS] pooler would give other logits.
    assert not torch.allclose(together, bert().double()(input_ids=ids, attention_mask=attention).logits, atol=1e-3)


def test_a_four_dimensional_boolean_mask_pools_like_the_two_dimensional_one():
    ids, attention = padded()
    four = (attention.bool()[:, None, None, :]).expand(-1, 1, 7, -1)
    assert torch.equal(token_mask(four), attention.bool())
    with pytest.raises(ValueError, match="2-D attention mask or a 4-D boolean"):
        token_mask(torch.zeros(4, 1, 7, 7))  # an additive float mask: which tokens are real is not asked for
    pooler = MaskedMean()
    pooler.mask = attention.bool()
    hidden = torch.randn(4, 7, 5)
    first = pooler(hidden)
    assert pooler.mask is None  # a mask serves one forward only
    assert torch.allclose(first[3], hidden[3, :4].mean(0))


def test_per_sample_gradients_through_mean_pooling_and_lora_on_some_layers_equal_the_loop():
    net = use_pooling(bert(layers=4), "mean")
    lora = LoraSection(r=3, target_modules=["query", "value", "attention.output.dense"], layers=[2, 3])
    net = wrap_lora(net, lora, []).double()
    for name, module in net.named_modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            assert any(f"layer.{i}." in name for i in (2, 3)), name  # LoRA only where `layers` says
    for name, param in net.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)  # peft starts lora_B at zero: make lora_A's gradient non-zero
    classes = {"public": cls("public", band=(2, 3), head=True), "sensitive": cls("sensitive", band=(3, 3))}
    resolution = resolve(classes, describe(net))
    ids, attention, labels, names, clip = batch()
    names = ["public" if i % 3 else "sensitive" for i in range(len(names))]
    expected = reference(net, resolution, ids, attention, labels, names, clip)
    router = Router(net, resolution, insecure_seed=0)
    with router.capture():
        losses = losses_of(net, ids, attention, labels)
    router.privatize(losses, names, clip, {}, expected_batch_size=1.0)
    checked = 0
    for name, param in net.named_parameters():
        if param.requires_grad and param.grad is not None:
            assert torch.allclose(param.grad, expected[name], atol=1e-10, rtol=1e-8), name
            checked += 1
    assert checked >= 2 * 3 * 2 + 2  # both layers' three LoRA pairs and the classifier


def test_mean_pooling_on_a_model_without_a_pooler_is_refused():
    config = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=30, n_positions=16, num_labels=2)
    model = transformers.GPT2ForSequenceClassification(config)
    with pytest.raises(ConfigError) as error:
        use_pooling(model, "mean")
    assert error.value.code == Code.RUN_CONFIG_INVALID and "pooling" in str(error.value)
    assert use_pooling(model, "model") is model


def test_bad_pooling_and_layer_settings_are_config_errors():
    with pytest.raises(ValueError, match="pooling"):
        ModelSection(base="minilm", pooling="max")
    with pytest.raises(ValueError, match="layers lists a layer twice"):
        LoraSection(layers=[4, 4])
    with pytest.raises(ValueError):
        LoraSection(layers=[])
    with pytest.raises(ValueError):
        LoraSection(layers=[-1])


def test_lora_layers_the_model_does_not_have_are_a_config_error():
    with pytest.raises(ConfigError) as error:
        wrap_lora(bert(layers=4), LoraSection(layers=[10]), [])
    assert error.value.code == Code.RUN_CONFIG_INVALID and "layers [10]" in str(error.value)
