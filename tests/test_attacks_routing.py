"""Module calls whose leading dimension is not the batch (review item 2): the routing layer refuses them.

A call on a tensor the whole batch shares (DeBERTa-v2/v3 applies `query_proj` and `key_proj` to its relative
position embeddings, [1, 2k, D]) or laid out sequence-first ([T, B, D]) has an output gradient already summed
over the batch. Read row by row as per-sample gradients, it misattributes samples, and one example moves the
clipped sum by more than its C_i while σ_i is charged. Each negative test asserts the error code and that
nothing changed: no `.grad` written, nothing per-sample kept, and through `train` the ledger as it was.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from torch import nn  # noqa: E402

from govtrain.errors import ConfigError  # noqa: E402
from govtrain.resolver.model import describe  # noqa: E402
from govtrain.resolver.profile import resolve  # noqa: E402
from govtrain.routing.router import Router  # noqa: E402
from tests.conftest import Corpus, snapshot  # noqa: E402
from tests.test_resolver import cls  # noqa: E402
from tests.test_routing import (CLASSES, assert_removing_one_moves_the_release_by_at_most_its_clip_norm, batch,  # noqa: E402
                                losses_of, model, reference)

BAND = {"public": CLASSES["public"], "sensitive": cls("sensitive", band=(1, 2))}


def deberta_config(layers: int = 4, **overrides):
    """A DeBERTa-v3-shaped config: relative attention with the content projections shared with the position
    embeddings (share_att_key), so query_proj and key_proj also run on rel_embeddings [1, 2k, D]."""
    settings = dict(hidden_size=16, num_hidden_layers=layers, num_attention_heads=2, intermediate_size=24,
                    vocab_size=30, max_position_embeddings=64, num_labels=3, relative_attention=True,
                    pos_att_type=["p2c", "c2p"], share_att_key=True, position_buckets=5, max_relative_positions=-1,
                    norm_rel_ebd="layer_norm", type_vocab_size=0, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0, pooler_dropout=0.0)
    settings.update(overrides)
    return transformers.DebertaV2Config(**settings)


def deberta(targets: list[str], dtype=torch.float64):
    torch.manual_seed(0)
    base = transformers.DebertaV2ForSequenceClassification(deberta_config())
    lora = peft.LoraConfig(task_type="SEQ_CLS", r=3, target_modules=targets, init_lora_weights=False, lora_dropout=0.0)
    return peft.get_peft_model(base, lora).to(dtype).eval()


def probes(ids, attention=None) -> list[dict]:
    """Probe batches of 2 and 3 examples from the test batch (7 tokens each)."""
    return [{"input_ids": ids[:n], **({"attention_mask": attention[:n]} if attention is not None else {})}
            for n in (2, 3)]


def assert_untouched(net, router) -> None:
    assert all(p.grad is None for p in net.parameters()), "a refused step wrote a gradient"
    assert all(not t.inputs and not t.outputs for t in router.taps.values())


# -- DeBERTa: projections applied to the shared relative embeddings ---------------------------------------------


def test_deberta_lora_on_query_and_key_projections_is_refused_before_any_gradient():
    net = deberta(["query_proj", "key_proj", "value_proj"])
    router = Router(net, resolve(BAND, describe(net)), insecure_seed=0)
    ids, attention, labels, classes, clip = batch()
    with pytest.raises(ConfigError) as info:
        router.probe(probes(ids, attention))
    assert info.value.code.value == "routing_uncovered"
    assert ("query_proj" in info.value.detail or "key_proj" in info.value.detail) and "not the batch (2)" in info.value.detail
    assert "\n" not in info.value.detail
    assert_untouched(net, router)
    # A step the probe did not precede is refused by its own check, before autograd runs.
    with router.capture():
        losses = losses_of(net, ids, attention, labels)
    with pytest.raises(ConfigError) as info:
        router.privatize(losses, classes, clip, {}, expected_batch_size=1.0)
    assert info.value.code.value == "routing_uncovered" and "not the batch (6)" in info.value.detail
    assert_untouched(net, router)


def test_deberta_lora_on_batch_first_projections_only_passes_the_probe_and_matches_the_loop():
    """value_proj and the attention output dense only ever see hidden states [B, T, D]: not refused, and
    exact against the batch-size-1 loop (with a trainable head, LayerNorm and embedding besides)."""
    net = deberta(["value_proj", "attention.output.dense"])
    inner = net.base_model.model.deberta
    inner.embeddings.word_embeddings.weight.requires_grad_(True)
    inner.encoder.layer[3].output.LayerNorm.weight.requires_grad_(True)
    resolution = resolve(BAND, describe(net))
    ids, attention, labels, classes, clip = batch()
    expected = reference(net, resolution, ids, attention, labels, classes, clip)
    router = Router(net, resolution, insecure_seed=0)
    router.probe(probes(ids, attention))
    assert all(p.grad is None for p in net.parameters())  # the probe is forward only
    with router.capture():
        losses = losses_of(net, ids, attention, labels)
    report = router.privatize(losses, classes, clip, {}, expected_batch_size=1.0)
    assert 0 < report.clipped < 6
    written = {n for n, p in net.named_parameters() if p.grad is not None}
    kinds = ("value_proj", "attention.output.dense", "classifier", "word_embeddings", "LayerNorm")
    assert {k for k in kinds for n in written if k in n} == set(kinds)
    for name in written:
        assert torch.allclose(net.get_parameter(name).grad, expected[name], atol=1e-10, rtol=1e-8), name


# -- a sequence-first module -------------------------------------------------------------------------------------


class SequenceFirst(nn.Module):
    """A toy classifier whose one layer runs sequence-first: its Linear sees [T, B, D]."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(30, 8)
        self.layer = nn.ModuleList([nn.ModuleDict({"mix": nn.Linear(8, 8)})])
        self.classifier = nn.Linear(8, 3)

    def forward(self, input_ids, attention_mask=None):  # noqa: ARG002
        x = self.embed(input_ids).transpose(0, 1)  # [T, B, D]
        x = torch.tanh(self.layer[0]["mix"](x)).transpose(0, 1)
        return self.classifier(x.mean(1))


def sequence_first():
    torch.manual_seed(0)
    net = SequenceFirst().double().eval()
    net.embed.weight.requires_grad_(False)
    net.classifier.requires_grad_(False)
    router = Router(net, resolve({"c": cls("c", band=(0, 0))}, describe(net)), insecure_seed=0)
    return net, router


def toy_step(net, router, size: int, length: int):
    generator = torch.Generator().manual_seed(size * 100 + length)
    ids = torch.randint(0, 30, (size, length), generator=generator)
    labels = torch.randint(0, 3, (size,), generator=generator)
    with router.capture():
        losses = torch.nn.functional.cross_entropy(net(ids), labels, reduction="none")
    router.privatize(losses, ["c"] * size, [0.1] * size, {}, expected_batch_size=1.0)


def test_a_sequence_first_call_with_as_many_positions_as_examples_is_refused_by_the_probe():
    net, router = sequence_first()
    ids = torch.randint(0, 30, (3, 4))
    toy_step(net, router, size=4, length=4)  # T = B: one step's shapes cannot tell; the probe must
    net.zero_grad(set_to_none=True)
    with pytest.raises(ConfigError) as info:
        router.probe(probes(ids))
    assert info.value.code.value == "routing_uncovered" and "layer.0.mix" in info.value.detail
    assert "first dimension (4) is not the batch (2)" in info.value.detail
    assert_untouched(net, router)


def test_a_sequence_first_call_is_refused_by_the_step_when_positions_and_examples_differ():
    net, router = sequence_first()
    with pytest.raises(ConfigError) as info:
        toy_step(net, router, size=4, length=6)
    assert info.value.code.value == "routing_uncovered" and "layer.0.mix" in info.value.detail
    assert "first dimension (6) is not the batch (4)" in info.value.detail
    assert_untouched(net, router)


def test_a_probe_that_cannot_tell_the_batch_apart_is_a_programmer_error():
    net, router = sequence_first()
    ids = torch.randint(0, 30, (3, 3))
    for bad in ([{"input_ids": ids}, {"input_ids": ids[:2, :2]}],  # a batch size equal to the sequence length
                [{"input_ids": ids}, {"input_ids": ids[:, :2]}],  # one batch size only
                [{"input_ids": ids[:1, :2]}, {"input_ids": ids[:, :2]}]):  # a batch of one
        with pytest.raises(ValueError):
            router.probe(bad)
    assert_untouched(net, router)


# -- drop-one sensitivity at B = 128 -----------------------------------------------------------------------------


@pytest.mark.parametrize("build", [
    lambda: model(),  # tiny BERT: every tapped call batch-first
    lambda: deberta(["query_proj", "key_proj", "value_proj"]),  # shared rel_embeddings calls: must be refused
], ids=["bert", "deberta-qkv"])
def test_removing_one_of_128_examples_moves_the_clipped_sum_by_at_most_its_clip_norm_or_is_refused(build):
    net = build()
    router = Router(net, resolve(BAND, describe(net)), insecure_seed=0)
    ids, attention, labels, classes, clip = batch(128)
    clip = torch.full((128,), 0.05, dtype=torch.float64)  # every example clipped: the bound is tight

    def released(keep):
        with router.capture():
            losses = losses_of(net, ids[keep], attention[keep], labels[keep])
        router.privatize(losses, [classes[i] for i in keep], clip[keep], {}, expected_batch_size=1.0)
        return {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}

    try:
        router.probe(probes(ids, attention))
    except ConfigError as refused:
        assert refused.code.value == "routing_uncovered" and "_proj.lora_" in refused.detail
        assert_untouched(net, router)
        return
    assert_removing_one_moves_the_release_by_at_most_its_clip_norm(released, clip)


# -- through `govtrain train`: refused before the first write-ahead spend ----------------------------------------


@pytest.fixture(scope="module")
def tiny_deberta(tmp_path_factory):
    from tests.test_train import WORDS

    folder = tmp_path_factory.mktemp("tiny-deberta")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    transformers.BertTokenizerFast(vocab=str(folder / "vocab.txt")).save_pretrained(folder)
    torch.manual_seed(0)
    config = deberta_config(layers=6, vocab_size=len(vocab), num_labels=2)
    transformers.DebertaV2ForSequenceClassification(config).save_pretrained(folder)
    return folder


def test_train_refuses_deberta_query_and_key_lora_before_writing_any_spend(corpus: Corpus, tiny_deberta):
    from govtrain.train.config import load_run_config
    from govtrain.train.loop import STATE_FILE, train
    from tests.test_train import _admit, _config

    _admit(corpus, "pub")
    path = _config(corpus, tiny_deberta, 5)
    path.write_text(path.read_text().replace('target_modules = ["query", "value", "attention.output.dense"]',
                                             'target_modules = ["query_proj", "key_proj", "value_proj"]'))
    before = snapshot(corpus.url)
    with pytest.raises(ConfigError) as info:
        train(load_run_config(path), corpus.url, insecure_seed=1, log=lambda line: None)
    assert info.value.code.value == "routing_uncovered"
    assert ("query_proj" in info.value.detail or "key_proj" in info.value.detail) and "is not the batch" in info.value.detail
    assert snapshot(corpus.url) == before  # no spend, no run entry: the ledger's size and head are unchanged
    assert not (corpus.dir / "adapter" / STATE_FILE).exists()
