"""Attacks by user code inside the documented loop (review issue 20, items 2 and 6).

The adversary is the code a user writes around `GovernedRun` (docs/python-api.md): the loop over
`run.batches()`, its forward of `run.model`, its loss and `run.step`, and the model and tokenizer it chooses
(a decoder classifier whose tokenizer pads left, a wrapper around the model, a loss of its own).

It can: pick any tokenizer and padding side, choose, wrap or patch the model the run loads, change the task's
loss, call `run.model` and any of its submodules with or without gradients, and read or write the tensors of
the batch it was handed. It cannot: edit govtrain, the ledger's store, the policy or the keys; nor move the
parameters by hand (`param.data`, an optimizer of its own, `torch.func.functional_call`): code that does is not
training under govtrain, and no hook can see it. Not covered here: the batch-independence probe runs once, as
the run opens, on the model and the task's own loss; a loss the loop computes itself is checked for its shape
only (`run.step`), and a hook added to the model after the run opened is not probed.

What each test proves: a batch the sampler did not draw never reaches a step (`ungoverned_batch`), and under
the run's model and task an example's gradient does not depend on the other examples of its batch
(`batch_coupled`, or, for left padding, batches right-padded whatever the tokenizer says), so one example
moves the clipped sum by at most its C_i. Every refusal leaves the ledger, the trainable weights and the run's
step as they were.
"""

from __future__ import annotations

import contextlib
import math
import json
from pathlib import Path
from typing import Callable

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

import govtrain  # noqa: E402
from govtrain.errors import Code, ConfigError  # noqa: E402
from govtrain.ledger.ledger import Ledger  # noqa: E402
from govtrain.routing.independence import BATCHES, TOLERANCE, measure_batch_independence  # noqa: E402
from govtrain.tasks.base import Batch  # noqa: E402
from govtrain.tasks.causal_lm import CausalLM, token_losses  # noqa: E402
from govtrain.tasks.classification import Classification  # noqa: E402
from govtrain.train.config import load_run_config  # noqa: E402
from tests import run_state_keys  # noqa: E402
from govtrain.train.run import STATE_FILE, Chunk, Run  # noqa: E402
from govtrain.verify.verifier import verify_ledger  # noqa: E402
from tests import causal_models  # noqa: E402
from tests.conftest import TEST_POLICY, Corpus, make_corpus, rates_met, snapshot  # noqa: E402
from tests.test_api import _corpus, _same, _trainable, past_rehearsal  # noqa: E402
from tests.test_train import _config, save_tiny_bert, tiny_model  # noqa: E402,F401

QUIET = {"log": lambda line: None}
BATCH_POLICY = TEST_POLICY.replace("sampling_rate = 0.01", "expected_batch_size = 4")
TARGETS = {"bert": ["query", "value"], "gpt2": ["c_attn", "c_proj"], "llama": ["q_proj", "v_proj"]}
WORDS = causal_models.WORDS


def save_classifier(folder: Path, family: str, padding_side: str) -> Path:
    """A tiny random 6-layer sequence classifier of `family` whose saved tokenizer pads on `padding_side`
    (GPT-2 and Llama: the word-level tokenizer, padding with EOS, as decoder classifiers usually do)."""
    folder.mkdir(parents=True)
    if family == "bert":
        save_tiny_bert(folder)
    else:
        tokenizer = causal_models.tokenizer()
        tokenizer.pad_token = tokenizer.eos_token
        tokenizer.save_pretrained(folder)
        config = causal_models.config(family, layers=6)
        config.num_labels, config.pad_token_id = 2, tokenizer.pad_token_id
        torch.manual_seed(0)
        transformers.AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**settings, "padding_side": padding_side}))
    return folder


def admit_rows(corpus: Corpus, name: str, rows: list[dict], **overrides) -> None:
    from govtrain.gate.admission import admit

    path = corpus.dir / "data" / f"{name}.jsonl"
    path.parent.mkdir(exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with corpus.open() as ledger:
        admit(ledger, corpus.attestation(path, contribution_id=name, **overrides), path, now=corpus.now)


def short_rows(count: int) -> list[dict]:
    return [{"text": f"{WORDS[i % 9]} movie {WORDS[9 + i % 8]}", "label": i % 2} for i in range(count)]


def rows(count: int) -> list[dict]:
    """Labelled texts of 2 to 7 words: batches with padding."""
    return [{"text": " ".join(WORDS[(i + k) % len(WORDS)] for k in range(2 + i % 6)), "label": i % 2}
            for i in range(count)]


def run_toml(corpus: Corpus, model: Path, family: str, steps: int = 2, max_length: int = 64,
             task: str = "sequence-classification") -> Path:
    path = corpus.dir / "run.toml"
    path.write_text(f"""
[model]
base = "{model}"
task = "{task}"
max_length = {max_length}
[lora]
r = 2
target_modules = {json.dumps(TARGETS[family])}
[optimizer]
lr = 0.01
[training]
steps = {steps}
data = "data"
output = "adapter"
run_id = "user-run"
""")
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """`models(family, side, task)`: a tiny saved model, built once per module."""
    built: dict[tuple[str, str, str], Path] = {}

    def get(family: str, side: str = "right", task: str = "sequence-classification") -> Path:
        if (family, side, task) not in built:
            folder = tmp_path_factory.mktemp(f"{family}-{side}") / "model"
            built[family, side, task] = (causal_models.save(folder, family, layers=6) if task == "causal-lm"
                                         else save_classifier(folder, family, side))
        return built[family, side, task]

    return get


def corpus_with(tmp_path: Path, rows_: list[dict]) -> Corpus:
    corpus = make_corpus(tmp_path, f"sqlite:///{tmp_path / 'ledger.db'}", BATCH_POLICY)
    admit_rows(corpus, "pub", rows_)
    return corpus


def clipped_sum(run: Run, indices: list[int]) -> dict[str, torch.Tensor]:
    """The routed, clipped sum of the examples `indices` without noise, through the run's own phases:
    encode, the forward under `run.forward(chunk)`, `router.accumulate`."""
    owners = [run.examples.owner[i] for i in indices]
    chunk = Chunk(indices, None, owners, [run.classes[c] for c in owners], [run.signed_clip[c] for c in owners])
    run.router.begin()
    batch = run.encode(chunk)
    with run.forward(chunk):
        output = run.model(**batch.inputs)
    run.router.accumulate(run.task.per_example_loss(output, batch), chunk.classes, chunk.clips)
    run.router.finish({}, 1.0)  # no group noised: .grad holds the clipped sum
    return {n: p.grad.double().clone() for n, p in run.model.named_parameters() if p.grad is not None}


# -- item 2: padding on the tokenizer's side couples examples ---------------------------------------


def test_one_long_example_moves_a_left_padding_gpt2_classifiers_clipped_sum_by_at_most_its_clip_norm(
        tmp_path: Path):
    """The review's measurement: D is 16 short examples and one long one, D' the same without the long one.
    With left padding, every short example's positions depended on the long one, and the clipped sums of D and
    D' differed by 1.23 C (1.09 C at 8 short examples, 1.51 C at 24). Batches are now right-padded whatever the
    tokenizer's side, so the difference is the long example's own clipped gradient: at most C."""
    model = save_classifier(tmp_path / "gpt2-left", "gpt2", "left")
    corpus = make_corpus(tmp_path, f"sqlite:///{tmp_path / 'ledger.db'}", BATCH_POLICY)
    long_row = {"text": " ".join(WORDS[i % len(WORDS)] for i in range(60)), "label": 1}
    admit_rows(corpus, "pub", [*short_rows(16), long_row])
    with Ledger.open(corpus.url) as ledger:
        run = Run(load_run_config(run_toml(corpus, model, "gpt2")), ledger, insecure_seed=0, **QUIET)
        run.prepare()
        assert run.tokenizer.padding_side == "left"  # the user's tokenizer, as it was given
        with_long = clipped_sum(run, list(range(17)))
        without = clipped_sum(run, list(range(16)))
        run.router.close()
    difference = sum(float((with_long[n] - without[n]).pow(2).sum()) for n in with_long) ** 0.5
    clip = run.signed_clip["pub"]
    assert clip == 1.0 and difference <= clip * (1 + 1e-5), difference


def left_padded(self, examples, tokenizer, max_length, device) -> Batch:
    """`Classification.encode` as it was before the fix, for a tokenizer that pads left."""
    inputs = tokenizer([e.text for e in examples], padding=True, padding_side="left", truncation=True,
                       max_length=max_length, return_tensors="pt").to(device)
    return Batch(dict(inputs), torch.tensor([e.label for e in examples], dtype=torch.long, device=device))


def refused_before_any_spend(corpus: Corpus, config: Path) -> ConfigError:
    """Opening the run is refused as batch-coupled, with the ledger and the output folder as they were."""
    before = snapshot(corpus.url)
    with pytest.raises(ConfigError) as refused:
        govtrain.GovernedRun.open(config, corpus.url, **QUIET)
    error = refused.value
    assert error.code is Code.BATCH_COUPLED and error.exit_code == 2 and "\n" not in error.line()
    assert "depends on the other examples in its batch" in error.detail and "most in base_model.model." in error.detail
    assert "left padding" in error.detail and "attention_mask" in error.detail  # the usual causes, named
    assert snapshot(corpus.url) == before and not (corpus.dir / "adapter" / STATE_FILE).exists()
    return error


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_left_padding_forced_past_the_task_is_refused_before_any_spend(tmp_path: Path, monkeypatch, models,
                                                                        family: str):
    """The batch-independence probe sees what the task's right padding prevents: with the old left-padding
    encode, GPT-2's and BERT's absolute positions move with the batch's width (probe: 0.96 and 0.11 relative)."""
    corpus = corpus_with(tmp_path, rows(40))
    config = run_toml(corpus, models(family, "left"), family)
    monkeypatch.setattr(Classification, "encode", left_padded)
    refused_before_any_spend(corpus, config)


@pytest.mark.parametrize("normalise", ["batch token count", "batch mean"])
def test_a_loss_normalised_over_the_batch_is_refused_before_any_spend(tmp_path: Path, monkeypatch, models,
                                                                       normalise: str):
    """A causal LM's loss divided by the batch's token count, or by the batch mean of the per-example losses:
    one value per example, of the right shape, yet each depends on the others (probe: 0.95 and 1.0)."""
    from click.testing import CliRunner

    from govtrain.cli.main import cli

    def per_example_loss(self, output, batch):
        total, count = token_losses(output, batch)
        if normalise == "batch token count":
            return total / count.sum()
        losses = total / count
        return losses / losses.mean()

    corpus = corpus_with(tmp_path, [{"text": row["text"]} for row in rows(40)])
    config = run_toml(corpus, models("llama", task="causal-lm"), "llama", task="causal-lm")
    monkeypatch.setattr(CausalLM, "per_example_loss", per_example_loss)
    refused_before_any_spend(corpus, config)
    before = snapshot(corpus.url)
    result = CliRunner().invoke(cli, ["train", "--config", str(config), "--ledger", corpus.url])
    assert result.exit_code == 2 and result.stderr.startswith("error[batch_coupled]: ") and \
        len(result.stderr.strip().splitlines()) == 1
    assert snapshot(corpus.url) == before


def test_a_model_that_ignores_attention_mask_is_refused_before_any_spend(tmp_path: Path, monkeypatch, models):
    """A BERT whose encoder never sees the attention mask: real tokens attend to the padding the batch's width
    sets (probe: 4.9e-3 relative on this tiny random BERT, 0.66 on the demo's MiniLM)."""
    import govtrain.train.model as loading

    load = loading.load_model

    def ignoring_the_mask(config, adapters):
        model, tokenizer, path = load(config, adapters)
        model.base_model.model.bert.register_forward_pre_hook(
            lambda module, args, kwargs: (args, {k: v for k, v in kwargs.items() if k != "attention_mask"}),
            with_kwargs=True)
        return model, tokenizer, path

    corpus = corpus_with(tmp_path, rows(40))
    config = run_toml(corpus, models("bert"), "bert")
    monkeypatch.setattr(loading, "load_model", ignoring_the_mask)
    refused_before_any_spend(corpus, config)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_a_tokenizer_that_pads_left_still_gets_right_padded_batches_passes_the_probe_and_trains(
        tmp_path: Path, models, family: str, side: str):
    """Whatever side the user's tokenizer pads on: its object is left as it was, every batch is right-padded,
    the probe measures far below its tolerance, the model's forward writes none of the batch's tensors (the
    step checks their versions) and the run trains and verifies."""
    corpus = corpus_with(tmp_path, rows(40))
    padded = 0
    with govtrain.GovernedRun.open(run_toml(corpus, models(family, side), family, steps=3), corpus.url,
                                   insecure_seed=3, **QUIET) as run:
        assert run.tokenizer.padding_side == side
        measured = measure_batch_independence(run.model, run._run.task, run.tokenizer, 64, run._run.device)
        assert measured.compared == sum(map(len, BATCHES)) and measured.worst < TOLERANCE / 100
        weights = _trainable(run)
        for batch in run.batches():
            mask = batch.inputs["attention_mask"]
            assert bool((mask[:, :-1] >= mask[:, 1:]).all())  # real tokens first, padding after
            padded += bool((mask == 0).any())
            versions = [t._version for t in batch.inputs.values()]
            out = run.model(**batch.inputs)
            assert [t._version for t in batch.inputs.values()] == versions
            run.step(run.per_example_loss(out, batch))
        run.save()
        assert not _same(weights, run)
    assert padded and run.tokenizer.padding_side == side
    assert verify_ledger(corpus.url).by_kind["run"] == 1


# -- item 6: the batch as drawn, exactly its inputs, and the model's inner modules --------------------


def open_first_batch(tmp_path: Path, tiny_model: Path, name: str):
    """A run on the tiny BERT with its first batch handed out (its epoch's spend written ahead), the trainable
    weights and the ledger as they then are."""
    corpus = _corpus(tmp_path, name)
    run = govtrain.GovernedRun.open(_config(corpus, tiny_model, 4), corpus.url, insecure_seed=1, **QUIET)
    batches = run.batches()
    batch = past_rehearsal(run, batches)
    return corpus, run, batches, batch, _trainable(run), snapshot(corpus.url)


def assert_nothing_changed(corpus: Corpus, run, weights: dict, written: tuple) -> None:
    """Weights, ledger and step as they were; nothing summed into the step and no `.grad` written."""
    assert _same(weights, run) and snapshot(corpus.url) == written and run.steps == 0
    assert run._run.router._totals is None and run._run._drawn == 0
    assert all(p.grad is None for p in run.model.parameters())


def never_admitted(run, batch) -> dict[str, torch.Tensor]:
    """The batch's inputs for a row no contribution holds, in every row, at the batch's width."""
    width = batch.inputs["input_ids"].shape[1]
    return dict(run.tokenizer(["awful plot never admitted"] * len(batch), padding="max_length", max_length=width,
                              truncation=True, return_tensors="pt"))


@pytest.mark.parametrize("how", ["in place", "through .data", "through numpy", "replaced"])
def test_rows_written_into_the_drawn_batch_before_its_forward_are_refused_and_nothing_changes(
        tmp_path: Path, tiny_model: Path, how: str):
    """The review's item 6a: the drawn tensors overwritten with a never-admitted row (34 of 34 rows trained,
    the run saved and verified). The forward refuses it; so would the step, which never runs."""
    corpus, run, batches, batch, weights, written = open_first_batch(tmp_path, tiny_model, "overwrite")
    with run:
        other = never_admitted(run, batch)
        ids = batch.inputs["input_ids"]
        if how == "in place":
            ids.copy_(other["input_ids"])
        elif how == "through .data":  # bumps no version counter: the values are compared too
            ids.data.copy_(other["input_ids"])
        elif how == "through numpy":
            ids.numpy()[:] = other["input_ids"].numpy()
        else:
            batch.inputs["input_ids"] = other["input_ids"]
        with pytest.raises(ConfigError) as refused:
            run.model(**batch.inputs)
        assert refused.value.code is Code.UNGOVERNED_BATCH and "input_ids" in refused.value.detail
        assert ("not one of the waiting batch's inputs" if how == "replaced" else
                "batch.inputs['input_ids'] was written after the batch was drawn") in refused.value.detail
        with pytest.raises(ConfigError, match="before run.model ran"):
            run.step(torch.zeros(len(batch)))
        assert_nothing_changed(corpus, run, weights, written)
        batches.close()


@pytest.mark.parametrize("how", ["inputs in place", "targets in place", "targets replaced", "inputs replaced"])
def test_a_batch_changed_between_its_forward_and_its_step_is_refused_and_nothing_changes(
        tmp_path: Path, tiny_model: Path, how: str):
    corpus, run, batches, batch, weights, written = open_first_batch(tmp_path, tiny_model, "after")
    with run:
        out = run.model(**batch.inputs)
        if how == "inputs in place":
            batch.inputs["attention_mask"].zero_()
        elif how == "targets in place":
            batch.targets.fill_(1)
        elif how == "targets replaced":
            batch.targets = 1 - batch.targets
        else:
            batch.inputs["input_ids"] = never_admitted(run, batch)["input_ids"]
        losses = run.per_example_loss(out, batch)
        with pytest.raises(ConfigError) as refused:
            run.step(losses)
        where = "batch.targets" if "targets" in how else "batch.inputs"
        assert refused.value.code is Code.UNGOVERNED_BATCH and refused.value.detail.startswith(where)
        assert ("was replaced" if "replaced" in how else "was written") in refused.value.detail
        assert_nothing_changed(corpus, run, weights, written)
        batches.close()


@pytest.mark.parametrize("how", ["extra keyword tensor", "labels", "missing input", "an object"])
def test_a_governed_forward_gets_exactly_the_batchs_input_tensors(tmp_path: Path, tiny_model: Path, how: str):
    corpus, run, batches, batch, weights, written = open_first_batch(tmp_path, tiny_model, "exact")
    with run:
        ids = batch.inputs["input_ids"]
        call = {"extra keyword tensor": lambda: run.model(**batch.inputs, position_ids=torch.zeros_like(ids)),
                "labels": lambda: run.model(**batch.inputs, labels=batch.targets),  # a batch-mean loss inside
                "missing input": lambda: run.model(input_ids=ids),
                "an object": lambda: run.model(**batch.inputs, past_key_values=transformers.DynamicCache())}[how]
        with pytest.raises(ConfigError) as refused:
            call()
        detail = refused.value.detail
        assert refused.value.code is Code.UNGOVERNED_BATCH
        assert {"extra keyword tensor": "tensor keyword position_ids, which is not one of the waiting batch's inputs",
                "labels": "tensor keyword labels, which is not one of",
                "missing input": "without the waiting batch's token_type_ids, attention_mask",
                "an object": "keyword past_key_values of type DynamicCache"}[how] in detail
        assert_nothing_changed(corpus, run, weights, written)
        # plain options pass, and the batch, untouched, still trains
        out = run.model(**batch.inputs, return_dict=True, output_hidden_states=True)
        assert run.step(run.per_example_loss(out, batch)) is not None and run.steps == 1
        batches.close()


@pytest.mark.parametrize("module", ["base_model.model", "a LoRA factor", "the head"])
@pytest.mark.parametrize("when", ["batch waiting", "batch forwarded", "between batches"])
def test_a_forward_of_an_inner_module_with_gradients_is_refused_while_iterating(tmp_path: Path, tiny_model: Path,
                                                                               module: str, when: str):
    """The review's item 6b: `run.model.base_model.model` (or any module holding a trainable parameter) called
    with gradients outside the governed forward, then `.backward()`: the call is refused, whatever the
    inputs, and under `torch.no_grad()` it runs."""
    corpus, run, batches, batch, weights, written = open_first_batch(tmp_path, tiny_model, "inner")
    with run:
        inner = run.model.base_model.model
        name = {"base_model.model": "base_model.model.bert.encoder.layer.0.attention.self.query.lora_A.default",
                "a LoRA factor": "base_model.model.bert.encoder.layer.5.attention.self.value.lora_A.default",
                "the head": "base_model.model.classifier.modules_to_save.default"}[module]
        target = run.model.get_submodule(name)
        call = {"base_model.model": lambda: inner(**batch.inputs).logits.sum().backward(),
                "a LoRA factor": lambda: target(torch.randn(2, 3, 16)).sum().backward(),
                "the head": lambda: target(torch.randn(2, 16)).sum().backward()}[module]
        if when != "batch waiting":
            out = run.model(**batch.inputs)
        if when == "between batches":
            run.step(run.per_example_loss(out, batch))
            weights, written = _trainable(run), snapshot(corpus.url)
        with pytest.raises(ConfigError) as refused:
            call()
        assert refused.value.code is Code.UNGOVERNED_BATCH
        assert f"a forward of {name} (it holds trainable parameters) with gradients enabled" in refused.value.detail
        assert _same(weights, run) and snapshot(corpus.url) == written
        assert all(p.grad is None for p in run.model.parameters())
        with torch.no_grad():
            call_without_grad = {"base_model.model": lambda: inner(**batch.inputs),
                                 "a LoRA factor": lambda: target(torch.randn(2, 3, 16)),
                                 "the head": lambda: target(torch.randn(2, 16))}[module]
            call_without_grad()
        batches.close()


def test_every_hook_of_the_guard_is_removed_by_save(tmp_path: Path, tiny_model: Path):
    corpus = _corpus(tmp_path, "hooks")
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 2), corpus.url, insecure_seed=1, **QUIET) as run:
        model = run.model
        holders = [m for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]
        assert holders and all(m._forward_pre_hooks for m in holders)
        for batch in run.batches():
            run.step(run.per_example_loss(run.model(**batch.inputs), batch))
        run.save()
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    model.base_model.model(**run.tokenizer(["good movie"], return_tensors="pt")).logits.sum().backward()


# -- review 2: the draw's record is the run's (P8, P9) ------------------------------------------------------


def rewrite_the_batchs_record(batch) -> None:
    """What the loop can write into a batch about its draw: every clipping norm a million times the signed C,
    and its place in its step (a step's last chunk made to look like one with more to come, so that the step
    would be dropped and drawn again: rejection sampling of the Poisson draw)."""
    for value in list(vars(batch).values()):
        if isinstance(value, Chunk):
            value.clips[:] = [1e6] * len(value.clips)
    place = dict(chunk=0, chunks=batch.chunk + 2)
    vars(batch).update(place)
    for name, value in place.items():
        try:
            setattr(batch, name, value)
        except AttributeError:  # read-only
            pass


def test_a_batchs_record_of_its_draw_rewritten_in_the_loop_changes_no_clipping_norm_and_drops_no_draw(
        tmp_path: Path, tiny_model: Path):
    """P8 and P9: with the review's one-line edits in the loop, no example was clipped (the sum was 2152 C) and
    every released step held the row the loop wanted (5 of 5 at q = 0.05). The run clips and closes each step
    from its own copy of the draw: every example clipped to the signed C = 0.001, one draw per step."""
    corpus = make_corpus(tmp_path, f"sqlite:///{tmp_path / 'ledger.db'}", BATCH_POLICY)
    from tests.test_train import _admit

    _admit(corpus, "pub", clip_norm_u=1000)
    draws, reports = [], []
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 4), corpus.url, insecure_seed=1,
                                   observe=lambda step, ids: draws.append(step), **QUIET) as run:
        router = run._run.router
        accumulate = router.accumulate  # instrumentation: what the router clips with, and what it clipped
        router.accumulate = lambda losses, classes, clips, units=None, **options: reports.append(  # the rehearsal's
            (list(clips), accumulate(losses, classes, clips, units, **options))) or reports[-1][1] if run.rehearsed \
            else accumulate(losses, classes, clips, units, **options)
        for batch in run.batches():
            rewrite_the_batchs_record(batch)
            run.step(run.per_example_loss(run.model(**batch.inputs), batch))
        assert run.save().steps == 4
    assert draws == [0, 1, 2, 3] and reports
    assert all(clips == [0.001] * report.batch_size and report.clipped == report.batch_size
               for clips, report in reports)
    assert verify_ledger(corpus.url).by_kind["run"] == 1


@pytest.mark.parametrize("how", ["closed before its forward", "closed after its forward", "next() before step",
                                 "loop broken after a chunk"])
def test_a_step_left_mid_way_is_completed_as_drawn_when_the_loop_iterates_again(tmp_path: Path, tiny_model: Path,
                                                                                how: str):
    """P9's other route: leave `batches()` before a step's last chunk is stepped and iterate again, to have the
    step drawn afresh. The run hands out the same draw's remaining chunks instead, the one handed out and not
    stepped first (fresh tensors, the same rows), and draws once per step."""
    corpus = _corpus(tmp_path, "abandon")
    draws: list[int] = []
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 3, extra="physical_batch = 1"), corpus.url,
                                   insecure_seed=1, observe=lambda step, ids: draws.append(step), **QUIET) as run:
        batches = run.batches()
        first = past_rehearsal(run, batches)
        if how == "loop broken after a chunk":
            run.step(run.per_example_loss(run.model(**first.inputs), first))
            first = next(batches)
        if how == "closed after its forward":
            run.model(**first.inputs)
        if how == "next() before step":
            run.model(**first.inputs)
            with pytest.raises(RuntimeError, match="run.step"):
                next(batches)
        batches.close()
        again = run.batches()
        batch = next(again)
        assert draws == [0] and (batch.step, batch.chunk, batch.chunks) == (first.step, first.chunk, first.chunks)
        assert all(torch.equal(batch.inputs[k], first.inputs[k]) for k in first.inputs) and batch is not first
        run.step(run.per_example_loss(run.model(**batch.inputs), batch))
        for batch in again:
            run.step(run.per_example_loss(run.model(**batch.inputs), batch))
        assert run.save().steps == 3
    assert draws == [0, 1, 2]
    assert verify_ledger(corpus.url).by_kind["run"] == 1


@pytest.mark.parametrize("how", ["the with block left mid-step", "a kill after the checkpoint"])
def test_a_step_run_again_in_a_new_process_draws_the_same_batch(tmp_path: Path, tiny_model: Path, how: str):
    """P9's last route: leave the run's `with` block in the middle of a step (or kill the process) and open the
    config again, to have the step drawn afresh until the draw suits. Each step's draw is a function of the
    run's secret sampling key (in the run state, 0600) and the step: the re-run step draws the same rows. No
    `insecure_seed` here: the key is the OS's, kept in the state."""
    import stat

    from govtrain.train.config import load_run_config
    from govtrain.train.loop import train

    corpus = _corpus(tmp_path, "redraw")
    config = _config(corpus, tiny_model, 8)
    first: dict[int, list[str]] = {}
    again: dict[int, list[str]] = {}
    if how == "the with block left mid-step":
        with govtrain.GovernedRun.open(config, corpus.url, observe=lambda step, ids: first.setdefault(step, ids),
                                       **QUIET) as run:
            batches = run.batches()
            for batch in batches:
                if batch.step == 2:
                    break  # step 2 drawn, seen, not stepped: leave
                run.step(run.per_example_loss(run.model(**batch.inputs), batch))
            batches.close()
        resumed_at = 2
    else:
        with pytest.raises(KeyboardInterrupt):
            train(load_run_config(config), corpus.url, checkpoint_every=2, interrupt_after_steps=5,
                  observe=lambda step, ids: first.setdefault(step, ids), **QUIET)
        resumed_at = 4  # the checkpoint before the kill: steps 4 and 5 run again
    state = corpus.dir / "adapter" / STATE_FILE
    assert stat.S_IMODE(state.stat().st_mode) == 0o600
    assert resumed_at in first  # the step that runs again was drawn (and seen) before
    with govtrain.GovernedRun.open(config, corpus.url, observe=lambda step, ids: again.setdefault(step, ids),
                                   **QUIET) as run:
        assert run.steps == resumed_at
        for batch in run.batches():
            run.step(run.per_example_loss(run.model(**batch.inputs), batch))
        run.save()
    repeated = sorted(set(first) & set(again))
    assert repeated and all(sorted(first[step]) == sorted(again[step]) for step in repeated), (first, again)
    assert any(first[step] for step in repeated)  # not only empty draws
    assert verify_ledger(corpus.url).by_kind["run"] == 1


# -- review 2: the governed forward's inputs cannot be swapped after the checks (P1, P6) ------------------


def swap_in(rows: dict[str, torch.Tensor]):
    """A forward pre-hook (with kwargs) that replaces the batch's inputs with `rows`."""
    return lambda module, args, kwargs: (args, {**kwargs, **rows})


def _bert(run):
    return run.model.base_model.model.bert


SWAPS = {  # how the loop changes run.model after the run opened -> (do it, undo it)
    "a pre-hook on run.model": lambda run, rows: run.model.register_forward_pre_hook(
        swap_in(rows), with_kwargs=True).remove,
    "a pre-hook put before the run's": lambda run, rows: run.model.register_forward_pre_hook(
        swap_in(rows), with_kwargs=True, prepend=True).remove,
    "a forward hook mixing an inner module's rows": lambda run, rows: _bert(run).embeddings.register_forward_hook(
        lambda module, args, out: out.flip(0)).remove,
    "a global forward pre-hook": lambda run, rows: torch.nn.modules.module.register_module_forward_pre_hook(
        lambda module, args: tuple(rows["input_ids"] if a is not None and a.dtype == torch.long and a.dim() == 2
                                   else a for a in args) if module is _bert(run).embeddings.word_embeddings
        else None).remove,
    "run.model.forward replaced": lambda run, rows: (
        setattr(run.model, "forward", lambda *a, forward=run.model.forward, **k: forward(*a, **{**k, **rows})),
        lambda: delattr(run.model, "forward"))[1],
    "an inner module's forward replaced": lambda run, rows: (
        setattr(_bert(run), "forward", lambda *a, forward=_bert(run).forward, **k: forward(*a, **{**k, **rows})),
        lambda: delattr(_bert(run), "forward"))[1],
    "a submodule replaced": lambda run, rows: (
        setattr(_bert(run), "embeddings", _Swapped(_bert(run).embeddings, rows["input_ids"])),
        lambda: setattr(_bert(run), "embeddings", _bert(run).embeddings.inner))[1],
}


class _Swapped(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module, ids: torch.Tensor) -> None:
        super().__init__()
        self.inner, self.ids = inner, ids

    def forward(self, input_ids=None, **kwargs):
        return self.inner(input_ids=self.ids, **kwargs)


@pytest.mark.parametrize("how", sorted(SWAPS))
def test_code_added_to_the_model_after_the_run_opened_is_refused_at_the_governed_forward(
        tmp_path: Path, tiny_model: Path, how: str):
    """P1: a pre-hook added after `open` runs after the guard's own and replaced the checked inputs with a row
    no contribution admitted (4 of 4 governed forwards, the run recorded; the injected row moved the clipped
    sum by 4.86 C). The model as the run opened it (modules, types, instance methods, hooks, torch's global
    hooks) is checked at every governed forward; put back as it was, the batch trains."""
    corpus, run, batches, batch, weights, written = open_first_batch(tmp_path, tiny_model, "swap")
    with run:
        undo = SWAPS[how](run, never_admitted(run, batch))
        try:
            with pytest.raises(ConfigError) as refused:
                run.model(**batch.inputs)
        finally:
            undo()
        assert refused.value.code is Code.UNGOVERNED_BATCH and "\n" not in refused.value.line()
        assert "run.model changed after the run opened" in refused.value.detail, refused.value.detail
        assert_nothing_changed(corpus, run, weights, written)
        batches.close()
        again = run.batches()
        batch = next(again)  # the same draw's chunk, handed out again
        assert run.step(run.per_example_loss(run.model(**batch.inputs), batch)) is not None and run.steps == 1
        again.close()


def test_a_patched_class_that_swaps_the_token_ids_is_refused_by_the_input_embedding(
        tmp_path: Path, tiny_model: Path, monkeypatch):
    """Patching a library class is beyond any check of the model's instances, but the input embedding checks
    in the governed forward that it gets the drawn input_ids by value."""
    from transformers.models.bert import modeling_bert

    corpus, run, batches, batch, weights, written = open_first_batch(tmp_path, tiny_model, "class")
    with run:
        other, forward = never_admitted(run, batch)["input_ids"], modeling_bert.BertModel.forward
        monkeypatch.setattr(modeling_bert.BertModel, "forward",
                            lambda self, input_ids=None, *a, **k: forward(self, other, *a, **k))
        with pytest.raises(ConfigError) as refused:
            run.model(**batch.inputs)
        assert refused.value.code is Code.UNGOVERNED_BATCH and "input embedding got other token ids" in \
            refused.value.detail
        assert_nothing_changed(corpus, run, weights, written)
        batches.close()


def test_a_patched_tokenizer_changes_no_row_the_run_draws(tmp_path: Path, tiny_model: Path):
    """P1: `run.tokenizer` was the object every draw was encoded with, so patching it trained on any rows. The
    run encodes with its own copy: the patch reaches the user's calls only."""
    corpus = _corpus(tmp_path, "tokenizer")
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 3), corpus.url, insecure_seed=1, **QUIET) as run:
        base = type(run.tokenizer)

        class Patched(base):
            def __call__(self, text, *args, **kwargs):
                return base.__call__(self, ["awful plot never admitted"] * len(text) if isinstance(text, list)
                                     else text, *args, **kwargs)

        run.tokenizer.__class__ = Patched
        secret = run.tokenizer(["awful plot never admitted"])["input_ids"][0]
        for batch in run.batches():
            rows = [[t for t, m in zip(r, k) if m] for r, k in zip(batch.inputs["input_ids"].tolist(),
                                                                   batch.inputs["attention_mask"].tolist())]
            assert secret not in rows
            run.step(run.per_example_loss(run.model(**batch.inputs), batch))
        assert run.save().steps == 3


@pytest.mark.parametrize("how", ["input_ids and attention_mask swapped", "positionally", "also under another keyword"])
def test_each_of_the_batchs_tensors_goes_under_its_own_keyword(tmp_path: Path, tiny_model: Path, how: str):
    """P6: the guard compared the set of tensors, so the batch's input_ids and attention_mask passed under each
    other's keyword passed it (a GPT-2 classifier's clipped sum moved by 1.61 C). Keyword by keyword now, and
    the batch's tensors go by keyword only."""
    corpus, run, batches, batch, weights, written = open_first_batch(tmp_path, tiny_model, "keys")
    with run:
        i = batch.inputs
        call = {"input_ids and attention_mask swapped": lambda: run.model(
                    **{**i, "input_ids": i["attention_mask"], "attention_mask": i["input_ids"]}),
                "positionally": lambda: run.model(i["input_ids"], **{k: v for k, v in i.items() if k != "input_ids"}),
                "also under another keyword": lambda: run.model(**i, position_ids=i["attention_mask"])}[how]
        with pytest.raises(ConfigError) as refused:
            call()
        assert refused.value.code is Code.UNGOVERNED_BATCH and "goes under the keyword it was drawn under" in \
            refused.value.detail
        assert_nothing_changed(corpus, run, weights, written)
        assert run.step(run.per_example_loss(run.model(**i), batch)) is not None
        batches.close()


@pytest.mark.parametrize("how", ["backward, graph kept", "autograd.grad, graph kept", "backward"])
def test_a_backward_through_the_governed_forward_before_its_step_is_refused(tmp_path: Path, tiny_model: Path,
                                                                           how: str):
    """The review's low finding (b): an extra backward of the governed output crashed the step
    (AttributeError). It is refused, with nothing summed and the weights and ledger as they were."""
    corpus, run, batches, batch, weights, written = open_first_batch(tmp_path, tiny_model, "backward")
    with run:
        out = run.model(**batch.inputs)
        losses = run.per_example_loss(out, batch)
        trainable = [p for p in run.model.parameters() if p.requires_grad]
        {"backward, graph kept": lambda: out.logits.sum().backward(retain_graph=True),
         "autograd.grad, graph kept": lambda: torch.autograd.grad(out.logits.sum(), trainable, retain_graph=True),
         "backward": lambda: out.logits.sum().backward()}[how]()
        with pytest.raises(ConfigError) as refused:
            run.step(losses)
        assert refused.value.code is Code.UNGOVERNED_BATCH and "backward" in refused.value.detail
        assert _same(weights, run) and snapshot(corpus.url) == written and run.steps == 0
        assert run._run.router._totals is None and run._run._drawn == 0
        batches.close()


@pytest.mark.parametrize("family, pad", [("gpt2", "none"), ("llama", "tokenizer only")])
def test_a_decoder_classifier_without_a_pad_token_pads_with_eos_and_trains(tmp_path: Path, family: str, pad: str):
    """The review's low finding (a): a GPT-2 classifier as shipped (no pad token anywhere) crashed with a raw
    ValueError, a Llama one whose config has no pad_token_id with "Cannot handle batch sizes > 1". EOS pads, as
    for a causal LM, and the classifier pools each example's last token before the padding: the probe passes
    and the run trains and verifies."""
    folder = tmp_path / "model"
    folder.mkdir()
    tokenizer = causal_models.tokenizer()
    if pad != "none":
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.save_pretrained(folder)
    config = causal_models.config(family, layers=6)
    config.num_labels, config.pad_token_id = 2, None
    torch.manual_seed(0)
    transformers.AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    corpus = corpus_with(tmp_path, rows(40))
    with govtrain.GovernedRun.open(run_toml(corpus, folder, family), corpus.url, insecure_seed=3, **QUIET) as run:
        assert run.tokenizer.pad_token_id == run.model.config.pad_token_id == tokenizer.eos_token_id
        for batch in run.batches():
            run.step(run.per_example_loss(run.model(**batch.inputs), batch))
        assert run.save().steps == 2
    assert verify_ledger(corpus.url).by_kind["run"] == 1


# -- review 3: a step is one transaction; the weights move only in governed steps (F1, F2, F5, F6) ---------


def _step_once(run, corpus: Corpus) -> tuple[dict, tuple]:
    """Step 0 taken (one chunk) and the loop left between steps: the trainable weights and the ledger as then."""
    batches = run.batches()
    batch = past_rehearsal(run, batches)
    run.step(run.per_example_loss(run.model(**batch.inputs), batch))
    batches.close()
    return _trainable(run), snapshot(corpus.url)


def _loop(run) -> None:
    for batch in run.batches():
        run.step(run.per_example_loss(run.model(**batch.inputs), batch))


def _raise_in_the_sum(run, batch):
    """A hook of the loop's on the forward's output that raises while the step sums the chunk's clipped
    per-sample gradients (after the draw): the error the loop would catch to have the step drawn again."""
    output = run.model(**batch.inputs)
    output.logits.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("not this draw")))
    return run.per_example_loss(output, batch)


def _swap_a_parameter(run, batch):
    """F2 (b): a trainable parameter swapped for an equal copy after the forward: the update raises."""
    losses = run.per_example_loss(run.model(**batch.inputs), batch)
    lora = [m for n, m in run.model.named_modules() if n.endswith("lora_A.default")][-1]
    lora.weight = torch.nn.Parameter(lora.weight.detach().clone())
    return losses


@pytest.mark.parametrize("how", ["raised in the sum", "parameter swapped under the update"])
def test_an_error_inside_a_step_stops_the_run_in_this_process_and_a_reopened_run_draws_the_same_rows(
        tmp_path: Path, tiny_model: Path, how: str):
    """Review 3, F1 and F2: an exception between a step's draw and its update lost the draw, and the loop that
    caught it had the step drawn again (41 draws for 3 released steps, each holding the row it wanted; the
    ledger verified). Now the run stops in this process: batches() and step() refuse (`step_failed`), leaving
    the block saves nothing, and the config opened again resumes from its last checkpoint with the same rows."""
    corpus = _corpus(tmp_path, "broken")
    config = _config(corpus, tiny_model, 3, extra="physical_batch = 1")
    first: list[tuple[int, list[str]]] = []
    again: list[tuple[int, list[str]]] = []
    attack = _raise_in_the_sum if how == "raised in the sum" else _swap_a_parameter
    with govtrain.GovernedRun.open(config, corpus.url, insecure_seed=1, observe=lambda s, ids: first.append((s, ids)),
                                   **QUIET) as run:
        batches = run.batches()
        batch = past_rehearsal(run, batches)
        while not batch.last:  # the last chunk of step 0: its step() runs the update
            run.step(run.per_example_loss(run.model(**batch.inputs), batch))
            batch = next(batches)
        losses = attack(run, batch)
        with pytest.raises((RuntimeError, ConfigError)):
            run.step(losses)
        batches.close()
        written = snapshot(corpus.url)
        for retry in (lambda: next(run.batches()), lambda: run.step(losses), run.save):
            with pytest.raises(ConfigError) as refused:
                retry()
            assert refused.value.code is Code.STEP_FAILED and "open the same config again" in refused.value.detail
        assert run.steps == 0 and snapshot(corpus.url) == written
    assert [s for s, _ in first] == [0]  # drawn once: nothing drew it again
    with govtrain.GovernedRun.open(config, corpus.url, insecure_seed=1, observe=lambda s, ids: again.append((s, ids)),
                                   **QUIET) as run:
        assert run.steps == 0
        _loop(run)
        assert run.save().steps == 3
    assert sorted(again[0][1]) == sorted(first[0][1])
    assert verify_ledger(corpus.url).by_kind["run"] == 1


def test_an_observer_that_raises_cannot_have_a_step_drawn_again(tmp_path: Path, tiny_model: Path):
    """F2 (a): `observe` raised before the draw was recorded, and the loop iterated again for another draw (101
    draws for 3 steps). It is called once the draw is the run's: iterating again continues the same draw."""
    corpus = _corpus(tmp_path, "observer")
    seen: list[int] = []

    def observe(step: int, ids: list[str]) -> None:
        seen.append(step)
        if len(seen) == 1:
            raise RuntimeError("not this draw")

    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 3), corpus.url, insecure_seed=1, observe=observe,
                                   **QUIET) as run:
        with pytest.raises(RuntimeError, match="not this draw"):
            _loop(run)
        _loop(run)
        assert run.save().steps == 3
    assert seen == [0, 1, 2]
    assert verify_ledger(corpus.url).by_kind["run"] == 1


def test_a_loss_of_a_tensor_subclass_is_refused_before_anything_is_summed(tmp_path: Path, tiny_model: Path):
    """F6: a loss whose `detach()` raised once the chunk was summed had the chunk handed out and summed again (2 C
    per example). Only a plain torch.Tensor is taken, and its sum is read before anything is summed."""

    class Once(torch.Tensor):
        def detach(self):
            raise RuntimeError("boom")

    corpus, run, batches, batch, weights, written = open_first_batch(tmp_path, tiny_model, "subclass")
    with run:
        losses = run.per_example_loss(run.model(**batch.inputs), batch)
        with pytest.raises(ValueError, match="needs a torch.Tensor of losses, not a Once"):
            run.step(losses.as_subclass(Once))
        assert_nothing_changed(corpus, run, weights, written)
        run.step(losses)  # the plain tensor is taken: the run was not broken by a refusal
        batches.close()


def _own_optimizer_step(run) -> None:
    """F5 (a): an optimizer of the loop's own on the admitted rows, not clipped, noised, sampled or charged."""
    mine = torch.optim.SGD([p for p in run.model.parameters() if p.requires_grad], lr=0.1)
    rows = run.tokenizer([e.text for e in run.admitted_rows.examples[:8]], padding=True, return_tensors="pt")
    labels = torch.tensor([e.label for e in run.admitted_rows.examples[:8]])
    torch.nn.functional.cross_entropy(run.model(**rows).logits, labels).backward()
    mine.step()
    mine.zero_grad()


WRITES = {
    "own optimizer": _own_optimizer_step,
    "in place": lambda run: next(p for p in run.model.parameters() if p.requires_grad).data.add_(0.01),
    "frozen weight": lambda run: run.model.get_input_embeddings().weight.mul_(1.01),
    "requires_grad switched": lambda run: run.model.get_input_embeddings().weight.requires_grad_(True),
}


@pytest.mark.parametrize("how", sorted(WRITES))
def test_weights_written_outside_a_governed_step_are_refused_at_the_next_step_and_at_save(
        tmp_path: Path, tiny_model: Path, how: str):
    """F5 (a): 200 non-private Adam steps between the last governed step and save() moved the weights 27.1 against
    the governed steps' 0.48, and the run recorded them. Weights written outside a governed step are refused at
    the next draw, forward, update and at save (`ungoverned_update`), nothing recorded; leaving the block saves
    nothing, and the run resumes from its last checkpoint."""
    corpus = _corpus(tmp_path, "written")
    config = _config(corpus, tiny_model, 2)
    with govtrain.GovernedRun.open(config, corpus.url, insecure_seed=1, **QUIET) as run:
        batches = run.batches()
        batch = past_rehearsal(run, batches)
        run.step(run.per_example_loss(run.model(**batch.inputs), batch))  # step 0 (one chunk)
        governed, written = _trainable(run), snapshot(corpus.url)
        with torch.no_grad() if how != "own optimizer" else contextlib.nullcontext():
            batches.close()
            WRITES[how](run)
        with pytest.raises(ConfigError) as refused:
            next(run.batches())
        assert refused.value.code is Code.UNGOVERNED_UPDATE and "outside a governed step" in refused.value.detail
        assert run.steps == 1 and snapshot(corpus.url) == written
    state = run_state_keys.read(corpus.dir / "adapter" / STATE_FILE, corpus)
    assert state["step"] == 0  # nothing saved on leaving: the last checkpoint (the epoch's write-ahead) stays
    with govtrain.GovernedRun.open(config, corpus.url, insecure_seed=1, **QUIET) as run:  # resumed from it
        assert run.steps == 0 and not _same(governed, run)
        _loop(run)
        WRITES[how](run) if how == "own optimizer" else torch.no_grad()(WRITES[how])(run)
        with pytest.raises(ConfigError) as refused:
            run.save()
        assert refused.value.code is Code.UNGOVERNED_UPDATE
    assert verify_ledger(corpus.url).by_kind.get("run") is None


def test_weights_written_in_the_middle_of_a_step_are_refused_at_its_forward(tmp_path: Path, tiny_model: Path):
    """Gradients taken at weights other code moved are a query the ledger never saw: refused at the forward,
    nothing summed."""
    corpus, run, batches, batch, weights, written = open_first_batch(tmp_path, tiny_model, "mid-step")
    with run:
        lora = next(p for p in run.model.parameters() if p.requires_grad)
        kept = lora.detach().clone()
        with torch.no_grad():
            lora.add_(1.0)
        with pytest.raises(ConfigError) as refused:
            run.model(**batch.inputs)
        assert refused.value.code is Code.UNGOVERNED_UPDATE and "at a governed forward" in refused.value.detail
        with torch.no_grad():
            lora.copy_(kept)
        assert_nothing_changed(corpus, run, weights, written)
        batches.close()


@pytest.mark.parametrize("when", ["before the run opens", "between steps"])
def test_torchs_global_optimizer_hooks_are_refused(tmp_path: Path, tiny_model: Path, when: str):
    """F1: a global optimizer step pre-hook that raised unless the draw held a target row (3 of 3 released
    steps held it), and a post-hook that raised after the update (10 updates for 3 charged steps). The hooks run
    inside every governed update: refused at open, and at the next step when registered later."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    corpus = _corpus(tmp_path, "hooks")
    written = snapshot(corpus.url)
    hook = register_optimizer_step_post_hook(lambda optimizer, args, kwargs: None) if when != "between steps" else None
    try:
        if hook is not None:
            with pytest.raises(ConfigError) as refused:
                govtrain.GovernedRun.open(_config(corpus, tiny_model, 2), corpus.url, insecure_seed=1, **QUIET)
            assert refused.value.code is Code.UNGOVERNED_UPDATE and snapshot(corpus.url) == written
            return
        with govtrain.GovernedRun.open(_config(corpus, tiny_model, 2), corpus.url, insecure_seed=1, **QUIET) as run:
            batches = run.batches()
            batch = past_rehearsal(run, batches)
            run.step(run.per_example_loss(run.model(**batch.inputs), batch))
            batches.close()
            hook = register_optimizer_step_post_hook(lambda optimizer, args, kwargs: None)
            written, weights = snapshot(corpus.url), _trainable(run)
            with pytest.raises(ConfigError) as refused:
                next(run.batches())
            assert refused.value.code is Code.UNGOVERNED_UPDATE and "global optimizer" in refused.value.detail
            assert run.steps == 1 and snapshot(corpus.url) == written and _same(weights, run)
    finally:
        if hook is not None:
            hook.remove()


# -- review 3: what picks the attention, after the run opened (F3, F4); transformers' own output hooks (L1) --


@pytest.fixture
def registries(monkeypatch):
    """transformers' attention and attention-mask registries as copies of their own for the test, made before
    the run opens (so they are the registries as opened) and put back after it: what `register` writes goes."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for kind in (AttentionInterface, AttentionMaskInterface):
        monkeypatch.setattr(kind, "_global_mapping", dict(kind._global_mapping))
    for registry in (ALL_ATTENTION_FUNCTIONS, ALL_MASK_ATTENTION_FUNCTIONS):
        monkeypatch.setattr(registry, "_local_mapping", dict(registry._local_mapping))


def mixing(module, query, key, value, attention_mask, **kwargs):
    """F3's attention: every example's values plus 100 times the batch's sum, so each example's gradient
    depends on the other examples of its batch."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value + 100 * value.sum(0, keepdim=True), attention_mask,
                                  **kwargs)


def injecting(hidden: torch.Tensor):
    """F4's attention: every drawn example's values replaced by 100 times those the layer's own (LoRA-wrapped)
    value projection computes, inside the governed forward, from `hidden`, a row no contribution admitted."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, **kwargs):
        b, h, t, d = value.shape
        rows = torch.zeros(b, t, hidden.shape[-1])
        rows[:, :min(t, hidden.shape[1])] = hidden[0, :t]
        value = 100 * module.value(rows).view(b, t, h, d).transpose(1, 2)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    return attention


def _select(run, name: str, attention) -> Callable[[], None]:
    from transformers import AttentionInterface

    AttentionInterface.register(name, attention)
    run.model.base_model.model.set_attn_implementation(name)

    def undo() -> None:
        run.model.base_model.model.set_attn_implementation("sdpa")
        del AttentionInterface._global_mapping[name]

    return undo


def _register(kind: str, name: str, function) -> Callable[[], None]:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    registry = {"attention": AttentionInterface, "mask": AttentionMaskInterface}[kind]
    before = registry._global_mapping[name]
    registry.register(name, function)
    return lambda: registry.register(name, before)


def _in_all_attention_functions(name: str, function) -> Callable[[], None]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS[name] = function
    return lambda: ALL_ATTENTION_FUNCTIONS.__delitem__(name)


def _layer_config(run) -> Callable[[], None]:
    import copy

    layer = _bert(run).encoder.layer[0].attention.self
    config = layer.config
    layer.config = copy.deepcopy(config)
    layer.config._attn_implementation = "eager"
    return lambda: setattr(layer, "config", config)


def _hidden(run, batch) -> torch.Tensor:
    with torch.no_grad():
        return _bert(run).embeddings(input_ids=never_admitted(run, batch)["input_ids"][:1])


ATTENTIONS = {  # how the loop changes what picks the attention after the run opened -> (do it, undo it), where
    "F3: an attention mixing the batch's examples, registered and selected": (
        lambda run, batch: _select(run, "mixing", mixing), "base_model.model.config._attn_implementation_internal"),
    "F4: an attention injecting a never-admitted row's values, registered and selected": (
        lambda run, batch: _select(run, "injecting", injecting(_hidden(run, batch))),
        "base_model.model.config._attn_implementation_internal"),
    "sdpa registered again as an attention mixing the batch": (
        lambda run, batch: _register("attention", "sdpa", mixing),
        "transformers.modeling_utils.AttentionInterface._global_mapping['sdpa']"),
    "sdpa set in ALL_ATTENTION_FUNCTIONS": (
        lambda run, batch: _in_all_attention_functions("sdpa", mixing),
        "transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS._local_mapping['sdpa']"),
    "sdpa's attention mask registered again": (
        lambda run, batch: _register("mask", "sdpa", lambda *args, **kwargs: None),
        "transformers.masking_utils.AttentionMaskInterface._global_mapping['sdpa']"),
    "one layer given a config of its own": (
        lambda run, batch: _layer_config(run), "base_model.model.bert.encoder.layer.0.attention.self.config"),
}


@pytest.mark.parametrize("how", sorted(ATTENTIONS))
def test_the_attention_changed_after_the_run_opened_is_refused_at_the_governed_forward(
        tmp_path: Path, tiny_model: Path, registries, how: str):
    """F3 and F4: transformers' public `AttentionInterface.register` and `set_attn_implementation`, called after
    the run opened, changed what every attention layer computes without changing a module, method or hook: the
    name lives in the config the layers share, the function in transformers' registries, and the
    batch-independence probe had checked the attention the run opened with. An attention mixing the batch's
    examples moved the clipped sum by 1.34 C for one example (F3), one replacing the drawn examples' values with
    a never-admitted row's by 5.85 C (F4); the runs were recorded and verified. The configs the model's modules
    hold, the implementations they name and the registries' functions are part of the model as opened now: the
    governed forward is refused, and with the attention put back the batch trains."""
    corpus, run, batches, batch, weights, written = open_first_batch(tmp_path, tiny_model, "attention")
    with run:
        change, where = ATTENTIONS[how]
        undo = change(run, batch)
        try:
            with pytest.raises(ConfigError) as refused:
                run.model(**batch.inputs)
        finally:
            undo()
        assert refused.value.code is Code.UNGOVERNED_BATCH and "\n" not in refused.value.line()
        assert f"run.model's attention changed after the run opened ({where} " in refused.value.detail, \
            refused.value.detail
        assert "set the attention implementation before opening the run" in refused.value.detail
        assert_nothing_changed(corpus, run, weights, written)
        batches.close()
        again = run.batches()
        batch = next(again)  # the same draw's chunk, handed out again
        assert run.step(run.per_example_loss(run.model(**batch.inputs), batch)) is not None and run.steps == 1
        again.close()


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_hidden_states_and_attentions_asked_for_in_the_loop_train(tmp_path: Path, tiny_model: Path, models,
                                                                   family: str):
    """L1: transformers 5 installs the hooks that capture `output_hidden_states` and `output_attentions` on the
    model's layers the first time a forward asks for them, after the run opened: the next governed forward
    found the model changed and was refused. The guard installs them before it takes the model as opened (they
    record only in a forward that asks), and takes them away with its own."""
    if family == "bert":
        corpus = _corpus(tmp_path, "outputs")
        config = _config(corpus, tiny_model, 3)
    else:
        corpus = corpus_with(tmp_path, [{"text": " ".join(WORDS[(i + k) % len(WORDS)] for k in range(3 + i % 4))}
                                        for i in range(40)])
        config = run_toml(corpus, models("llama", task="causal-lm"), "llama", steps=3, task="causal-lm")
    asked = {"output_hidden_states": True, "output_attentions": True}
    with govtrain.GovernedRun.open(config, corpus.url, insecure_seed=1, **QUIET) as run:
        model = run.model
        for batch in run.batches():
            out = run.model(**batch.inputs, **asked)
            assert len(out.hidden_states) == 7  # the embeddings' output and each of the 6 layers'
            run.step(run.per_example_loss(out, batch))
            with torch.no_grad():  # an evaluation between steps, asking for them too
                run.model(**batch.inputs, **asked)
        assert run.save().steps == 3
    assert verify_ledger(corpus.url).by_kind["run"] == 1
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    out = model(**run.tokenizer(["good movie"], return_tensors="pt"), output_hidden_states=True)
    assert len(out.hidden_states) == 7  # transformers installs its hooks again when next asked


# -- review 4: the update's state is the run's (F2) -----------------------------------------------------------


def _forge_adam(view, model, name: str, target: torch.Tensor) -> dict:
    """Review 4's F2: Adam moments and step count that make the next governed update land parameter `name` on
    `target`, whatever its noise (the noise divided by 1e6), as the Trainer's optimizer view's state_dict."""
    import math

    p = dict(model.named_parameters())[name]
    index = next(i for i, q in enumerate(q for g in view.param_groups for q in g["params"]) if q is p)
    forged = view.state_dict()
    group = next(g for g in forged["optimizer"]["param_groups"] if index in g["params"])
    lr, (b1, b2), decay = group["lr"], group["betas"], group["weight_decay"]
    scale = 1e6
    forged["optimizer"]["state"][index] = {
        "step": torch.tensor(1e7), "exp_avg": scale * math.sqrt(b2) * (p.detach() * (1 - lr * decay) - target) / (lr * b1),
        "exp_avg_sq": torch.full_like(p, scale * scale)}
    return forged


@pytest.mark.parametrize("how", ["load_state_dict", "state written in place"])
def test_the_updates_state_written_outside_a_governed_step_is_refused(tmp_path: Path, tiny_model: Path, how: str):
    """Review 4, F2: forged Adam moments, loaded through the Trainer's optimizer view (`GovernedOptimizer`, which
    a callback is handed), made the next governed update put admitted token ids into the head exactly, and the
    run was recorded. The view loads only the update's own state, and the state as the last step left it is
    checked with the weights (`ungoverned_update`): nothing changed."""
    from govtrain.integrations.hf import GovernedOptimizer

    corpus = _corpus(tmp_path, "forged")
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 3), corpus.url, insecure_seed=1, **QUIET) as run:
        batches = run.batches()
        batch = past_rehearsal(run, batches)
        run.step(run.per_example_loss(run.model(**batch.inputs), batch))  # step 0: the moments exist
        batches.close()
        view, head = GovernedOptimizer(run), "base_model.model.classifier.modules_to_save.default.weight"
        view.load_state_dict(view.state_dict())  # its own state, as accelerate loads it back: nothing happens
        weights, written = _trainable(run), snapshot(corpus.url)
        target = torch.full_like(dict(run.model.named_parameters())[head], 7.0)
        forged = _forge_adam(view, run.model, head, target)
        if how == "load_state_dict":
            with pytest.raises(ConfigError) as refused:
                view.load_state_dict(forged)
            assert refused.value.code is Code.UNGOVERNED_UPDATE
        else:
            index = next(iter(k for k, v in forged["optimizer"]["state"].items() if v["step"] > 1e6))
            p = [q for g in view.param_groups for q in g["params"]][index]
            view.state[p]["exp_avg"].copy_(forged["optimizer"]["state"][index]["exp_avg"])
            with pytest.raises(ConfigError) as refused:
                next(run.batches())
            assert refused.value.code is Code.UNGOVERNED_UPDATE and "update's state" in refused.value.detail
        assert run.steps == 1 and snapshot(corpus.url) == written and _same(weights, run)


class _Rate(float):
    """Review 5's learning rate: a float whose division, inside the governed update (after every check, before
    the step's weights are kept), writes the weights."""

    model: torch.nn.Module | None = None

    def __truediv__(self, other):
        with torch.no_grad():
            next(p for p in self.model.parameters() if p.requires_grad).fill_(7.0)
        return float(self) / other


@pytest.mark.parametrize("rate", ["a float subclass", "a tensor", "nan"])
def test_a_learning_rate_that_is_not_a_finite_float_is_refused_before_the_update(tmp_path: Path, tiny_model: Path,
                                                                                  rate: str):
    """Review 5, F1: learning rates are the schedule's, left out of the update's state; a float subclass set as
    one ran its code inside the governed update and the weights it wrote were released as the step's (the
    ledger verified). A rate must be a finite float or int, checked with the weights (`ungoverned_update`)."""
    from govtrain.integrations.hf import GovernedOptimizer

    corpus = _corpus(tmp_path, "rate")
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 3), corpus.url, insecure_seed=1, **QUIET) as run:
        weights, written = _step_once(run, corpus)
        _Rate.model = run.model
        group = GovernedOptimizer(run).param_groups[0]  # the run's optimizer's own group, as a callback gets it
        group["lr"] = {"a float subclass": _Rate(0.01), "a tensor": torch.tensor(0.01), "nan": math.nan}[rate]
        with pytest.raises(ConfigError) as refused:
            next(run.batches())
        assert refused.value.code is Code.UNGOVERNED_UPDATE and "not a finite float" in refused.value.detail
        assert run.steps == 1 and snapshot(corpus.url) == written and _same(weights, run)
        group["lr"] = 0.01  # a plain rate again: the run goes on
        _loop(run)
        assert run.save().steps == 3


class _Moment(torch.Tensor):
    """Review 6's moment: equal values, and code of its own wherever torch runs an op on it (the update)."""

    ran = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        _Moment.ran += 1
        return super().__torch_function__(func, types, args, kwargs or {})


class _State(dict):
    pass


class _Betas(tuple):
    pass


class _Params(list):
    pass


def _swap_state(view, how: str) -> None:
    """Put an object of the loop's, equal in value, where the update reads its state."""
    p = next(p for g in view.param_groups for p in g["params"] if view.state.get(p))
    if how == "a tensor subclass in the state":
        view.state[p]["exp_avg"] = view.state[p]["exp_avg"].as_subclass(_Moment)
    elif how == "a dict subclass as a parameter's state":
        view.state[p] = _State(view.state[p])
    elif how == "a list subclass as a group's parameters":
        view.param_groups[0]["params"] = _Params(view.param_groups[0]["params"])
    else:
        view.param_groups[0]["betas"] = _Betas(view.param_groups[0]["betas"])


@pytest.mark.parametrize("how", ["a tensor subclass in the state", "a dict subclass as a parameter's state",
                                 "a tuple subclass as betas", "a list subclass as a group's parameters"])
def test_objects_of_the_loops_own_in_the_updates_state_are_refused(tmp_path: Path, tiny_model: Path, how: str):
    """Review 6, F1: a tensor, dict or tuple subclass equal in value passed the state's comparison, and its code
    ran inside the governed update and wrote admitted token ids into the released weights (the ledger verified).
    Only exact dicts, lists, tuples and plain tensors are the run's state: refused (`ungoverned_update`)."""
    from govtrain.integrations.hf import GovernedOptimizer

    corpus = _corpus(tmp_path, "objects")
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 3), corpus.url, insecure_seed=1, **QUIET) as run:
        weights, written = _step_once(run, corpus)
        _Moment.ran = 0
        _swap_state(GovernedOptimizer(run), how)
        with pytest.raises(ConfigError) as refused:
            next(run.batches())
        assert refused.value.code is Code.UNGOVERNED_UPDATE and "update's state" in refused.value.detail
        assert run.steps == 1 and snapshot(corpus.url) == written and _same(weights, run)


def test_a_numpy_learning_rate_from_a_schedule_of_ones_own_trains(tmp_path: Path, tiny_model: Path,
                                                                     monkeypatch):
    """Review 6, F3: a LambdaLR whose factor is numpy's writes np.float64 rates; numpy's floats are exact types
    whose arithmetic is numpy's own, so they pass, and the update meets them as plain floats. The rates it writes
    must be the run's schedule's (issue 34, item 8: here the linear one set before the first step)."""
    import numpy as np

    from govtrain.integrations.hf import GovernedOptimizer

    corpus = _corpus(tmp_path, "numpy")
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 3), corpus.url, insecure_seed=1, **QUIET) as run:
        run.set_schedule("linear")
        view = GovernedOptimizer(run)
        schedule = torch.optim.lr_scheduler.LambdaLR(view, lambda s: np.float64(3 - s) / 3)
        met = rates_met(monkeypatch, run._run.update.optimizer, lambda o: type(o.param_groups[0]["lr"]))
        for batch in run.batches():
            loss = run.step(run.per_example_loss(run.model(**batch.inputs), batch))
            if loss is not None:
                view.step()  # checks that the governed step ran
                schedule.step()
        assert type(view.param_groups[0]["lr"]) is np.float64 and view.param_groups[0]["lr"] == 0.0
        assert met == [float] * 3
        assert run.save().steps == 3


class _Loud(torch.nn.Parameter):
    """Review 7's parameter class: the same object, values and version, and code of its own on every op."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


class _Truthy:
    def __bool__(self) -> bool:
        return False


def _reach(view, run, how: str) -> None:
    """Put code of the loop's where the update or its zero_grad would run it, through public objects."""
    if how == "a parameter's class swapped":
        next(p for p in run.model.parameters() if p.requires_grad).__class__ = _Loud
    elif how == "the state's factory":
        view.state.default_factory = lambda: {}
    else:
        view.defaults["foreach"] = _Truthy()


@pytest.mark.parametrize("how", ["a parameter's class swapped", "the state's factory", "a defaults value"])
def test_code_placed_where_the_update_runs_it_is_refused(tmp_path: Path, tiny_model: Path, how: str):
    """Review 7, F1-F3: a parameter whose class was swapped in place (same object, values and version), the
    optimizer state's default_factory, and a `defaults` value whose `__bool__` torch's zero_grad reads ran the
    loop's code inside the governed update or after it, before the weights were kept, and wrote admitted token
    ids into the released adapter (the ledger verified). Each is refused at the next check."""
    from govtrain.integrations.hf import GovernedOptimizer

    corpus = _corpus(tmp_path, "reach")
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 3), corpus.url, insecure_seed=1, **QUIET) as run:
        weights, written = _step_once(run, corpus)
        _reach(GovernedOptimizer(run), run, how)
        with pytest.raises(ConfigError) as refused:
            next(run.batches())
        assert refused.value.code is Code.UNGOVERNED_UPDATE
        assert ("changed class" if how.startswith("a parameter") else "update's state") in refused.value.detail
        assert run.steps == 1 and snapshot(corpus.url) == written


def test_hooks_can_be_registered_on_the_trainers_optimizer_view(tmp_path: Path, tiny_model: Path):
    """Review 7, H1: torch's public hook registration raised on the view (its tables were plain dicts, which
    torch's handles cannot weakly reference). They register on the view, which runs them around its own step."""
    from govtrain.integrations.hf import GovernedOptimizer

    corpus = _corpus(tmp_path, "view-hooks")
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 2), corpus.url, insecure_seed=1, **QUIET) as run:
        view, seen = GovernedOptimizer(run), []
        handles = [view.register_step_pre_hook(lambda opt, args, kwargs: seen.append("pre")),
                   view.register_step_post_hook(lambda opt, args, kwargs: seen.append("post")),
                   view.register_state_dict_pre_hook(lambda opt: None),
                   view.register_load_state_dict_post_hook(lambda opt: None)]
        for batch in run.batches():
            if run.step(run.per_example_loss(run.model(**batch.inputs), batch)) is not None:
                view.step()
        for handle in handles:
            handle.remove()
        assert run.save().steps == 2 and seen[:2] == ["pre", "post"]


# -- review 8: nothing of the loop's runs between the update and the weights' snapshot, or in save() -----------


class _Losses(list):
    """Review 8's record: a list whose `append`, which the run called right after each update and before the
    weights were kept, writes the weights."""

    model: torch.nn.Module | None = None
    ran = 0

    def append(self, item) -> None:
        _Losses.ran += 1
        with torch.no_grad():
            next(p for p in self.model.parameters() if p.requires_grad).fill_(7.0)
        super().append(item)


def test_the_runs_record_is_a_copy_so_nothing_of_the_loops_runs_in_its_bookkeeping(tmp_path: Path,
                                                                                    tiny_model: Path):
    """Review 8, G1: `run.result` was the run's own record, written after each update and pickled at each
    checkpoint before the weights were kept: a list subclass put in it wrote admitted token ids into the
    released adapter (the ledger verified). `run.result` is a copy, and the weights are kept right after the
    update, before any bookkeeping."""
    corpus = _corpus(tmp_path, "record")
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 3), corpus.url, insecure_seed=1, **QUIET) as run:
        _Losses.model, _Losses.ran = run.model, 0
        run.result.losses = _Losses(run.result.losses)
        assert type(run.result.losses) is list  # the run's own is untouched
        _loop(run)
        result = run.save()
    assert _Losses.ran == 0 and result.steps == 3 and len(result.losses) == 3
    assert verify_ledger(corpus.url).by_kind["run"] == 1


@pytest.mark.parametrize("hook", ["state_dict post-hook", "state_dict pre-hook", "save_pretrained replaced"])
def test_code_added_to_what_save_writes_is_refused_and_nothing_is_recorded(tmp_path: Path, tiny_model: Path,
                                                                           hook: str):
    """Review 8, G2: a state_dict post-hook added after the last step rewrote the tensors `save()` wrote (the
    weights in memory untouched, so every weight check passed) and the run entry signed that file. save() checks
    the model as opened, state_dict hooks included: refused (`ungoverned_batch`), nothing recorded."""
    corpus = _corpus(tmp_path, "saved")
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 2), corpus.url, insecure_seed=1, **QUIET) as run:
        _loop(run)
        if hook == "state_dict post-hook":
            run.model.register_state_dict_post_hook(lambda module, state, prefix, local: None)
        elif hook == "state_dict pre-hook":
            run.model.base_model.register_state_dict_pre_hook(lambda module, prefix, keep_vars: None)
        else:
            run.model.save_pretrained = lambda *args, **kwargs: None
        written = snapshot(corpus.url)
        with pytest.raises(ConfigError) as refused:
            run.save()
        assert refused.value.code is Code.UNGOVERNED_BATCH and "changed after the run opened" in refused.value.detail
        assert snapshot(corpus.url) == written
    assert verify_ledger(corpus.url).by_kind.get("run") is None


class _Configs(dict):
    """Review 9's `peft_config`: a dict whose `keys()`, which peft's save_pretrained calls first, writes the
    weights."""

    model: torch.nn.Module | None = None

    def keys(self):
        with torch.no_grad():
            next(p for p in self.model.parameters() if p.requires_grad).fill_(7.0)
        return super().keys()


def _leave_a_file(run) -> None:
    folder = run.config.output_dir / "leak"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "notes.txt").write_text(run.admitted_rows.examples[0].text)


RELEASES = {
    "peft_config replaced": lambda run: setattr(run.model.base_model, "peft_config",
                                                _Configs(run.model.base_model.peft_config)),
    "a file left in the output folder": _leave_a_file,
    "admitted text in the adapter config": lambda run: setattr(run.model.peft_config["default"], "revision",
                                                               run.admitted_rows.examples[0].text),
    "lora_alpha rescaled": lambda run: setattr(run.model.peft_config["default"], "lora_alpha", 16000),
}


@pytest.mark.parametrize("how", sorted(RELEASES))
def test_what_save_writes_is_the_runs_adapter_or_nothing_is_recorded(tmp_path: Path, tiny_model: Path, how: str):
    """Review 9: a dict subclass as `peft_config` ran inside save_pretrained and wrote admitted token ids into the
    saved weights; an adapter and a text file left in the output folder were hashed into the run entry (and the
    loader took the adapter); admitted text went into adapter_config.json; lora_alpha was rescaled after training.
    save() reads what it wrote (the files, the configs and model card as when the run opened, the tensors as the
    last governed step left them) before it hashes and records anything (`ungoverned_update`)."""
    corpus = _corpus(tmp_path, "release")
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 2), corpus.url, insecure_seed=1, **QUIET) as run:
        _loop(run)
        _Configs.model = run.model
        RELEASES[how](run)
        written = snapshot(corpus.url)
        with pytest.raises(ConfigError) as refused:
            run.save()
        assert refused.value.code is Code.UNGOVERNED_UPDATE and "nothing is recorded" in refused.value.detail
        assert snapshot(corpus.url) == written
    assert verify_ledger(corpus.url).by_kind.get("run") is None
