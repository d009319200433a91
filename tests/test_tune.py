"""`govtrain tune` (issue 14, item 4): every trial charged, one `tune` entry, and a verifier that recomputes it.

The end-to-end tests train a tiny BERT (tests/test_train.py's fixtures); the attacks on the `tune` entry build
their trials' spend and run entries directly, as a writer holding the ledger key could, and need no torch."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from govtrain.accounting.spend import spend_epsilon_u
from govtrain.errors import Code, GovtrainError
from govtrain.gate.admission import admit
from govtrain.ledger.entries import decode_entry, tune_entry
from govtrain.ledger.ledger import Ledger
from govtrain.verify.verifier import inspect_ledger, verify_ledger
from tests.conftest import Corpus, snapshot, record_spend, lease


def _entries(url: str, kind: str) -> list[dict]:
    with Ledger.open(url) as ledger:
        return [decode_entry(e.body, seq=e.seq, kind=e.kind) for e in ledger.store.entries(kinds=(kind,))
                if e.body is not None]


def _recomputed(url: str) -> dict[str, int]:
    """Per class, the largest epsilon any contribution's whole recorded history implies: an oracle independent
    of the tune code (the accountant over the spend entries' parameters)."""
    with Ledger.open(url) as ledger:
        classes = {row.contribution_id: row.data_class for row in ledger.store.admissions()}
    histories: dict[str, list] = {}
    recorded: dict[str, int] = {}
    for spend in _entries(url, "spend"):
        histories.setdefault(spend["contribution_id"], []).append(
            (spend["sampling_rate_u"], spend["noise_multiplier_u"], spend["steps"]))
        recorded[spend["contribution_id"]] = spend["eps_u"]
        implied = spend_epsilon_u(spend["accountant"], spend["delta_p"], histories[spend["contribution_id"]])
        assert spend["eps_u"] >= implied  # what the spend entries charge covers every step of every trial
    by_class: dict[str, int] = {}
    for cid, eps_u in recorded.items():
        by_class[classes[cid]] = max(by_class.get(classes[cid], 0), eps_u)
    return by_class


# -- attacks on the entry: no training needed ---------------------------------------------------------------

def _charged_runs(corpus: Corpus, tune_id: str, count: int, *, extra_run: str | None = None) -> list[tuple[str, bytes]]:
    """Admit two contributions of two classes, then `count` trial runs of `tune_id`, one ledger epoch each:
    spend written ahead with the accountant's epsilon, a run entry with an adapter hash, the epoch closed."""
    histories: dict[str, list] = {}
    with corpus.open() as ledger:
        for name, cls, clip in (("a", "public", 1_000_000), ("b", "sensitive", 500_000)):
            data = corpus.data(f"{name}.jsonl", 5)
            admit(ledger, corpus.attestation(data, contribution_id=name, data_class=cls, clip_norm_u=clip,
                                             eps_budget_u=3_000_000), data, now=corpus.now)
        runs = [f"{tune_id}-trial-{k}" for k in range(count)] + ([extra_run] if extra_run else [])
        trials = []
        for index, run_id in enumerate(runs):
            spends = []
            for name in ("a", "b") if index % 2 == 0 else ("a",):
                histories.setdefault(name, []).append((10_000, 1_000_000, 5))
                spends.append((name, 5, 1_000_000, spend_epsilon_u("prv", ledger.policy.delta_p, histories[name])))
            record_spend(ledger, ledger.epoch(), 10_000, spends, run_id=run_id, epoch_steps=5, now=corpus.now)
            config = hashlib.sha256(run_id.encode()).digest()
            ledger.record_run(run_id, "dpsgd", config, bytes(32), hashlib.sha256(b"adapter " + run_id.encode()).digest(),
                              now=corpus.now, run_nonce=lease(run_id))
            ledger.close_epoch(now=corpus.now)
            trials.append((run_id, config))
    return trials[:count]


def _honest(corpus: Corpus, charged, **overrides) -> dict:
    trials = overrides.pop("trials", charged)
    fields = dict(tune_id="t", config_sha256=bytes(32), grid_sha256=bytes(32), trials=trials,
                  selection_sha256=hashlib.sha256(b"held out").digest(), metric="accuracy",
                  selected_run_id=trials[-1][0])
    fields.update(overrides)
    with corpus.open() as ledger:
        return ledger.record_tune(**fields, now=corpus.now)[1]


def test_an_honest_tune_entry_states_what_the_spend_entries_charged(corpus: Corpus):
    trials = _charged_runs(corpus, "t", 3)
    fields = _honest(corpus, trials)
    assert fields["accounting"] == "composition" and [t["run_id"] for t in fields["trials"]] == [r for r, _ in trials]
    assert {item["data_class"]: item["eps_u"] for item in fields["eps_by_class"]} == _recomputed(corpus.url)
    assert fields["eps_u"] == max(_recomputed(corpus.url).values())
    assert fields["adapter_sha256"] == hashlib.sha256(b"adapter t-trial-2").digest()
    report = verify_ledger(corpus.url)
    assert report.by_kind["tune"] == 1


def _forge(corpus: Corpus, **changes) -> tuple[int, tuple]:
    """The honest entry's fields with `changes`, appended and signed with the ledger key without the writer's
    checks: what an operator holding the key can do. Returns (its seq, the snapshot before it)."""
    trials = [{"run_id": r, "config_sha256": c} for r, c in _charged_runs(corpus, "t", 2, extra_run="unrelated")]
    with corpus.open() as ledger:
        book = ledger.tune_book()
    eps_u, by_class = book.totals([t["run_id"] for t in trials])
    fields = dict(tune_id="t", config_sha256=bytes(32), grid_sha256=bytes(32), trials=trials,
                  selection_sha256=hashlib.sha256(b"held out").digest(), metric="accuracy",
                  selected_run_id="t-trial-1", adapter_sha256=book.runs["t-trial-1"][0][1], accounting="composition",
                  eps_u=eps_u, eps_by_class=by_class)
    fields.update({k: (v(fields) if callable(v) else v) for k, v in changes.items()})
    before = snapshot(corpus.url)
    with corpus.open() as ledger:
        with ledger.append(corpus.now) as appender:
            stored = appender.add("tune", corpus.now, lambda seq: tune_entry(seq, corpus.now, **fields))
    return stored.seq, before


def _understated(fields: dict) -> list[dict]:
    return [{**item, "eps_u": item["eps_u"] // 2} for item in fields["eps_by_class"]]


ATTACKS = {
    "understated_eps": {"eps_by_class": _understated, "eps_u": lambda f: max(i["eps_u"] for i in _understated(f))},
    "understated_headline": {"eps_u": lambda f: f["eps_u"] - 1},
    "dropped_class": {"eps_by_class": lambda f: [i for i in f["eps_by_class"] if i["data_class"] == "public"],
                      "eps_u": lambda f: next(i["eps_u"] for i in f["eps_by_class"] if i["data_class"] == "public")},
    "omitted_trial": {"trials": lambda f: f["trials"][:1], "selected_run_id": "t-trial-0",
                      "adapter_sha256": hashlib.sha256(b"adapter t-trial-0").digest()},
    "reordered_trials": {"trials": lambda f: f["trials"][::-1]},
    "trial_listed_twice": {"trials": lambda f: [f["trials"][0], f["trials"][0]]},
    "unrelated_run_listed": {"trials": lambda f: [*f["trials"], {"run_id": "unrelated",
                                                                "config_sha256": hashlib.sha256(b"unrelated").digest()}]},
    "selected_not_a_trial": {"selected_run_id": "unrelated",
                             "adapter_sha256": hashlib.sha256(b"adapter unrelated").digest()},
    "selected_wrong_adapter": {"adapter_sha256": bytes(32)},
    "trial_config_swapped": {"trials": lambda f: [{**f["trials"][0], "config_sha256": bytes(32)}, f["trials"][1]]},
    "unknown_accounting": {"accounting": "papernot-steinke"},
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_a_key_holder_cannot_record_a_tune_entry_the_ledger_does_not_bear_out(corpus: Corpus, attack: str):
    seq, _ = _forge(corpus, **ATTACKS[attack])
    report = inspect_ledger(corpus.url)
    assert (report.error.code, report.bad_seq) == (Code.BAD_TUNE, seq), (attack, report.error)


def test_a_tune_scored_on_admitted_data_fails_verification(corpus: Corpus):
    seq, _ = _forge(corpus)  # honest: verifies
    verify_ledger(corpus.url)
    with corpus.open() as ledger:
        admitted = ledger.store.admissions()[0].data_sha256
    seq, _ = _forge_again(corpus, "t2", selection_sha256=admitted)
    report = inspect_ledger(corpus.url)
    assert (report.error.code, report.bad_seq) == (Code.BAD_TUNE, seq), report.error
    assert "admitted contribution's data" in report.error.detail


def _forge_again(corpus: Corpus, tune_id: str, **changes) -> tuple[int, tuple]:
    """A second tune over one new trial run, on the ledger `_forge` built."""
    run_id = f"{tune_id}-trial-0"
    with corpus.open() as ledger:
        history = [(10_000, 1_000_000, 5)] * 4
        record_spend(ledger, ledger.epoch(), 10_000, [("a", 5, 1_000_000, spend_epsilon_u("prv", ledger.policy.delta_p,
                                                                                          history))],
                            run_id=run_id, epoch_steps=5, now=corpus.now)
        ledger.record_run(run_id, "dpsgd", bytes(32), bytes(32), bytes(32), now=corpus.now, run_nonce=lease(run_id))
        book = ledger.tune_book()
        eps_u, by_class = book.totals([run_id])
        fields = dict(tune_id=tune_id, config_sha256=bytes(32), grid_sha256=bytes(32),
                      trials=[{"run_id": run_id, "config_sha256": bytes(32)}], selection_sha256=bytes(32),
                      metric="accuracy", selected_run_id=run_id, adapter_sha256=bytes(32), accounting="composition",
                      eps_u=eps_u, eps_by_class=by_class)
        fields.update(changes)
        before = snapshot(corpus.url)
        with ledger.append(corpus.now) as appender:
            stored = appender.add("tune", corpus.now, lambda seq: tune_entry(seq, corpus.now, **fields))
    return stored.seq, before


def test_spend_by_a_trial_after_its_tune_is_refused_and_fails_verification(corpus: Corpus):
    from tests.test_attacks_operator import _forge_spend

    _forge(corpus)
    before = snapshot(corpus.url)
    with corpus.open() as ledger, pytest.raises(GovtrainError) as refused:  # the writer refuses it
        record_spend(ledger, ledger.epoch(), 10_000, [("a", 5, 1_000_000, 3_000_000)], run_id="t-trial-7",
                     epoch_steps=5, now=corpus.now)
    assert refused.value.code is Code.RUN_ID_TAKEN and snapshot(corpus.url) == before
    groups = [{"classes": ["public"], "s_pu": 10**12}]
    seq = _forge_spend(corpus, "a", sigma_u=1_000_000, eps_u=3_000_000, groups=groups, run_id="t-trial-7", steps=5)
    report = inspect_ledger(corpus.url)  # and one signed past the writer fails the audit
    assert (report.error.code, report.bad_seq) == (Code.BAD_SPEND, seq) and "trial of tune" in report.error.detail


@pytest.mark.parametrize("attack", ["config_swapped", "omitted", "not_a_trial", "reused_id",
                                    "admitted_selection"])
def test_the_writer_refuses_a_tune_entry_and_writes_nothing(corpus: Corpus, attack: str):
    trials = _charged_runs(corpus, "t", 2, extra_run="unrelated")
    if attack == "reused_id":
        _honest(corpus, trials)
    with corpus.open() as ledger:
        admitted = ledger.store.admissions()[0].data_sha256
    overrides = {
        # record_tune computes the totals itself: what a caller can get wrong is which trials it names
        "config_swapped": {"trials": [(trials[0][0], bytes(32)), trials[1]]},
        "omitted": {"trials": trials[:1], "selected_run_id": trials[0][0]},
        "not_a_trial": {"trials": [*trials, ("unrelated", hashlib.sha256(b"unrelated").digest())]},
        "reused_id": {},
        "admitted_selection": {"selection_sha256": admitted},
    }[attack]
    before = snapshot(corpus.url)
    with pytest.raises(GovtrainError) as info:
        _honest(corpus, trials, **overrides)
    expected = {"reused_id": Code.TUNE_EXISTS, "admitted_selection": Code.SELECTION_ADMITTED}.get(attack, Code.BAD_TUNE)
    assert info.value.code == expected
    assert snapshot(corpus.url) == before
    verify_ledger(corpus.url)


# -- govtrain tune end to end on a tiny BERT ---------------------------------------------------------------

def _grid(corpus: Corpus, body: str, select: str = 'data = "valid.jsonl"') -> Path:
    path = corpus.dir / "grid.toml"
    path.write_text(f"[grid]\n{body}\n[select]\n{select}\n")
    return path


def _valid(corpus: Corpus) -> Path:
    from tests.test_train import WORDS

    path = corpus.dir / "valid.jsonl"
    path.write_text("".join(json.dumps({"text": f"{WORDS[i % 9]} movie {WORDS[9 + i % 8]} held", "label": i % 2}) + "\n"
                            for i in range(12)))
    return path


def _tune(corpus: Corpus, model: Path, grid: Path, *extra: str, steps: int = 4):
    from click.testing import CliRunner

    from govtrain.cli.main import cli
    from tests.test_train import _config

    config = _config(corpus, model, steps)
    return CliRunner().invoke(cli, ["tune", "--config", str(config), "--grid", str(grid), "--ledger", corpus.url,
                                    "--insecure-seed", "3", "--json", *extra])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """tests/test_train.py's tiny BERT."""
    pytest.importorskip("transformers")
    from tests.test_train import save_tiny_bert

    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


def test_tune_charges_every_trial_selects_the_best_and_verifies(corpus: Corpus, tiny: Path):
    from click.testing import CliRunner

    from govtrain.cli.main import cli
    from tests.test_train import _admit

    _admit(corpus, "pub")
    _admit(corpus, "sens", data_class="sensitive", clip_norm_u=500_000, eps_budget_u=3_000_000)
    _valid(corpus)
    result = _tune(corpus, tiny, _grid(corpus, '"optimizer.lr" = [0.01, 0.05]\n"lora.r" = [2]'), "--id", "lr")
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert [t["run_id"] for t in body["trials"]] == ["lr-trial-0", "lr-trial-1"]
    assert body["accounting"] == "composition" and body["metric"] == "accuracy"
    best = max(t["score"] for t in body["trials"])  # ties: the earliest trial
    assert body["selected"]["run_id"] == next(t["run_id"] for t in body["trials"] if t["score"] == best)
    assert body["trials"][1]["eps"] >= body["trials"][0]["eps"] > 0  # cumulative: trial 1 composes on trial 0

    (tune,) = _entries(corpus.url, "tune")
    runs = {run["run_id"]: run for run in _entries(corpus.url, "run")}
    assert [t["run_id"] for t in tune["trials"]] == ["lr-trial-0", "lr-trial-1"]
    assert tune["selected_run_id"] == body["selected"]["run_id"]
    assert tune["adapter_sha256"] == runs[tune["selected_run_id"]]["adapter_sha256"]
    assert {i["data_class"]: i["eps_u"] for i in tune["eps_by_class"]} == _recomputed(corpus.url)
    assert body["eps"] == tune["eps_u"] / 1e6 == max(_recomputed(corpus.url).values()) / 1e6
    for trial in tune["trials"]:  # the trial's config, as hashed, sits beside its adapter
        index = int(trial["run_id"].rsplit("-", 1)[1])
        assert hashlib.sha256((corpus.dir / "adapter" / f"trial-{index}.json").read_bytes()).digest() == \
            trial["config_sha256"] == runs[trial["run_id"]]["config_sha256"]
    assert verify_ledger(corpus.url).by_kind["tune"] == 1

    status = json.loads(CliRunner().invoke(cli, ["ledger", "status", "--ledger", corpus.url, "--json"]).stdout)
    assert status["tunes"][0]["tune_id"] == "lr" and status["tunes"][0]["eps_u"] == tune["eps_u"]
    text = CliRunner().invoke(cli, ["ledger", "status", "--ledger", corpus.url]).stdout
    assert "total ε including tuning" in text
    mine = json.loads(CliRunner().invoke(cli, ["ledger", "status", "--ledger", corpus.url, "--contribution", "sens",
                                               "--json"]).stdout)
    assert mine["tunes"] == [{"tune_id": "lr", "seq": status["tunes"][0]["seq"], "selected_run_id": tune["selected_run_id"],
                              "eps_u": tune["eps_u"], "class_eps_u": _recomputed(corpus.url)["sensitive"]}]

    before = snapshot(corpus.url)  # the same id again: refused before any trial runs
    again = _tune(corpus, tiny, corpus.dir / "grid.toml", "--id", "lr")
    assert again.exit_code == 2 and "error[tune_exists]" in again.stderr
    assert snapshot(corpus.url) == before


BAD_GRIDS = {
    "unknown key": '"optimizer.learning_rate" = [0.1]',
    "unknown section": '"trainer.lr" = [0.1]',
    "run id": '"training.run_id" = ["a", "b"]',
    "output": '"training.output" = ["x", "y"]',
    "data": '"training.data" = ["data", "elsewhere"]',
    "performance flag": '"training.device" = ["cpu"]',
    "invalid trial": '"optimizer.lr" = [0.01, -1.0]',
    "value twice": '"optimizer.lr" = [0.01, 0.01]',
    "too many": '"optimizer.lr" = [' + ", ".join(f"0.00{i + 1}" for i in range(9)) + ']\n"lora.r" = [1, 2, 3, 4, 5, 6, 7, 8]',
    "not a list": '"optimizer.lr" = 0.1',
    "empty": '"optimizer.lr" = []',
}


@pytest.mark.parametrize("name", sorted(BAD_GRIDS))
def test_a_bad_grid_is_refused_before_anything_is_written(corpus: Corpus, name: str):
    from tests.test_train import _admit

    _admit(corpus, "pub")
    _valid(corpus)
    before = snapshot(corpus.url)
    result = _tune(corpus, Path("/nonexistent-model"), _grid(corpus, BAD_GRIDS[name]))
    assert result.exit_code == 2, (name, result.output)
    assert "error[grid_invalid]" in result.stderr and json.loads(result.stdout)["code"] == "grid_invalid"
    assert snapshot(corpus.url) == before
    assert not _entries(corpus.url, "spend")


def test_selecting_on_an_admitted_contribution_is_refused(corpus: Corpus):
    from tests.test_train import _admit

    _admit(corpus, "pub")
    before = snapshot(corpus.url)
    result = _tune(corpus, Path("/nonexistent-model"), _grid(corpus, '"optimizer.lr" = [0.01]',
                                                               'data = "data/pub.jsonl"'))
    assert result.exit_code == 2 and "error[selection_admitted]" in result.stderr, result.output
    assert snapshot(corpus.url) == before


def test_budgets_running_out_still_charge_the_trials_that_ran(corpus: Corpus, tiny: Path):
    from tests.test_train import _admit

    _admit(corpus, "tiny", eps_budget_u=400_000)  # about 10 steps at q = 0.01, sigma = 1
    _valid(corpus)
    result = _tune(corpus, tiny, _grid(corpus, '"optimizer.lr" = [0.01, 0.02]'), "--id", "out", steps=30)
    assert result.exit_code == 5, result.output
    assert "tune 'out' stopped at trial 0" in result.stderr and "no trial selected" in result.stderr, result.stderr
    (tune,) = _entries(corpus.url, "tune")
    assert [t["run_id"] for t in tune["trials"]] == ["out-trial-0"] and tune["selected_run_id"] is None
    assert {i["data_class"]: i["eps_u"] for i in tune["eps_by_class"]} == _recomputed(corpus.url)
    verify_ledger(corpus.url)


def test_a_killed_search_resumed_with_its_id_charges_what_an_uninterrupted_one_does(tmp_path: Path, tiny: Path):
    """A kill during trial 0 leaves its written-ahead spend and its run state; running the search again with the
    same id resumes that trial (same run id, its epoch's spend never written twice), runs the rest, and records
    one tune entry: the spend and the entry are those of a search that was never interrupted."""
    from govtrain.train.config import load_run_config
    from govtrain.train.tune import load_grid, tune
    from tests.conftest import make_corpus
    from tests.test_train import _admit, _config

    outcomes = []
    for name, interrupt in (("whole", None), ("killed", 3)):
        folder = tmp_path / name
        folder.mkdir()
        corpus = make_corpus(folder, f"sqlite:///{folder / 'ledger.db'}")
        _admit(corpus, "pub")
        _admit(corpus, "sens", data_class="sensitive", clip_norm_u=500_000, eps_budget_u=3_000_000)
        _valid(corpus)
        config_path = _config(corpus, tiny, 12)
        grid = load_grid(_grid(corpus, '"optimizer.lr" = [0.01, 0.05]'))
        options = dict(tune_id="again", insecure_seed=3, log=lambda line: None, now=lambda: corpus.now)
        if interrupt is not None:
            with pytest.raises(KeyboardInterrupt):
                tune(load_run_config(config_path), config_path, grid, corpus.url,
                     train_options={"interrupt_after_steps": interrupt, "checkpoint_every": 2}, **options)
            assert not _entries(corpus.url, "tune") and _entries(corpus.url, "spend")
        result = tune(load_run_config(config_path), config_path, grid, corpus.url, **options)
        outcomes.append((result, _entries(corpus.url, "spend"), _entries(corpus.url, "tune")))
        verify_ledger(corpus.url)
    (whole, whole_spend, whole_tune), (killed, killed_spend, killed_tune) = outcomes
    assert len(killed_tune) == 1 and [t["run_id"] for t in killed_tune[0]["trials"]] == ["again-trial-0",
                                                                                          "again-trial-1"]
    def strip(rows: list[dict]) -> list[dict]:  # the two ledgers differ only in clocks, admit leaves and leases
        return [{k: v for k, v in row.items() if k not in ("admit_leaf", "time", "run_nonce")} for row in rows]

    assert strip(killed_spend) == strip(whole_spend)
    assert killed_tune[0]["eps_by_class"] == whole_tune[0]["eps_by_class"]
    assert killed.selected.trial.run_id == whole.selected.trial.run_id
