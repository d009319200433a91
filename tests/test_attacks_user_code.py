"""Attacks by user code inside the documented loop (review issue 20, items 2 and 6).

The adversary is the code a user writes around `GovernedRun` (README "Python API"): the loop over
`run.batches()`, its forward of `run.model`, its loss and `run.step`, and the model and tokenizer it chooses
(a decoder classifier whose tokenizer pads left, a wrapper around the model, a loss of its own).

It can: pick any tokenizer and padding side, wrap or patch the model's forward, write its own per-example
loss, call `run.model` and any of its submodules with or without gradients, and read or write the tensors of
the batch it was handed. It cannot: edit govtrain, the ledger's store, the policy or the keys; nor move the
parameters by hand (`param.data`, an optimizer of its own, `torch.func.functional_call`): code that does is not
training under govtrain, and no hook can see it.

What each test proves: a batch the sampler did not draw never reaches a step (`ungoverned_batch`), and an
example's gradient never depends on the other examples of its batch (`batch_coupled`, or, for left padding,
batches that are right-padded whatever the tokenizer says), so one example moves the clipped sum by at most
its C_i. Every refusal leaves the ledger, the trainable weights and the run's step as they were.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from govtrain.ledger.ledger import Ledger  # noqa: E402
from govtrain.train.config import load_run_config  # noqa: E402
from govtrain.train.run import Chunk, Run  # noqa: E402
from tests import causal_models  # noqa: E402
from tests.conftest import TEST_POLICY, Corpus, make_corpus  # noqa: E402
from tests.test_train import save_tiny_bert  # noqa: E402

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


def run_toml(corpus: Corpus, model: Path, family: str, steps: int = 2, max_length: int = 64) -> Path:
    path = corpus.dir / "run.toml"
    path.write_text(f"""
[model]
base = "{model}"
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


def clipped_sum(run: Run, indices: list[int]) -> dict[str, torch.Tensor]:
    """The routed, clipped sum of the examples `indices` without noise, through the run's own phases:
    encode, the forward under `run.forward()`, `router.accumulate`."""
    owners = [run.examples.owner[i] for i in indices]
    chunk = Chunk(indices, None, owners, [run.classes[c] for c in owners], [run.signed_clip[c] for c in owners])
    run.router.begin()
    batch = run.encode(chunk)
    with run.forward():
        output = run.model(**batch.inputs)
    run.router.accumulate(run.task.per_example_loss(output, batch), chunk.classes, chunk.clips)
    run.router.finish({}, 1.0)  # no group noised: .grad holds the clipped sum
    return {n: p.grad.double().clone() for n, p in run.model.named_parameters() if p.grad is not None}


# -- item 2: padding on the tokenizer's side couples examples ---------------------------------------


def test_one_long_example_moves_a_left_padding_gpt2_classifiers_clipped_sum_by_at_most_its_clip_norm(
        tmp_path: Path):
    """The review's measurement: D is 16 short examples and one long one, D' the same without the long one.
    With left padding, every short example's positions depended on the long one, and the clipped sums of D and
    D' differed by 1.09 C at 8 short examples (1.51 C at 24). Batches are now right-padded whatever the
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
