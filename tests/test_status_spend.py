"""`govtrain ledger status`: ε spent per class and per run, equal to what the ledger records per contribution and
to what the verifier's accountant recomputes from the recorded parameters, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from click.testing import CliRunner

from govtrain.accounting.spend import spend_epsilon_u
from govtrain.cli.main import cli
from govtrain.gate.admission import admit
from govtrain.ledger.entries import decode_stored
from govtrain.ledger.status import contribution_status
from govtrain.verify.verifier import recorded_accountant, verify_ledger
from tests.conftest import Corpus, record_spend


def _status(url: str) -> dict:
    result = CliRunner().invoke(cli, ["ledger", "status", "--ledger", url, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _admit(corpus: Corpus, name: str, **overrides) -> None:
    data = corpus.data(f"{name}.jsonl", records=4)
    with corpus.open() as ledger:
        admit(ledger, corpus.attestation(data, contribution_id=name, **overrides), data, now=corpus.now)


def _recomputed(url: str) -> dict[str, tuple[str, int, int, dict[str, int]]]:
    """Per contribution: (class, signed budget, ε the verifier's accountant implies for its whole recorded history,
    per run the ε it implies for the history up to that run's last spend), all in micro-units."""
    from govtrain.ledger.ledger import Ledger

    found: dict[str, list] = {}
    with Ledger.open(url) as ledger:
        policy = ledger.policy
        for stored in ledger.store.entries(start=1, kinds=("admit", "spend")):
            entry = decode_stored(stored)
            if stored.kind == "admit":
                found[entry["contribution_id"]] = [entry["data_class"], entry["eps_budget_u"], [], {}]
                continue
            row = found[entry["contribution_id"]]
            row[2].append((entry["sampling_rate_u"], entry["noise_multiplier_u"], entry["steps"]))
            row[3][entry["run_id"]] = recorded_accountant(policy.accountant, policy.delta_p, row[2])
    return {cid: (c, b, recorded_accountant(policy.accountant, policy.delta_p, h) if h else 0, runs)
            for cid, (c, b, h, runs) in found.items()}


def _expected(per_contribution: dict[str, int], budgets: dict[str, int]) -> dict:
    values = list(per_contribution.values())
    return {"eps_max": max(values) / 1e6, "eps_median": statistics.median(values) / 1e6,
            "eps_budget": min(budgets[c] for c in per_contribution) / 1e6,
            "eps_left_min": min(budgets[c] - e for c, e in per_contribution.items()) / 1e6}


def _check_against_the_ledger(url: str) -> dict:
    """The status's ε figures against the per-contribution ε that `ledger status --contribution` reports and the
    verifier's accountant recomputes."""
    from govtrain.ledger.ledger import Ledger

    status = _status(url)
    recomputed = _recomputed(url)
    with Ledger.open(url) as ledger:
        recorded = {cid: contribution_status(ledger, cid)["eps_u"] for cid in recomputed}
    assert recorded == {cid: r[2] for cid, r in recomputed.items()}  # recorded exactly as the accountant implies
    budgets = {cid: r[1] for cid, r in recomputed.items()}
    for name, row in status["classes"].items():
        members = {cid: recorded[cid] for cid, r in recomputed.items() if r[0] == name}
        if not members:
            assert row["eps_max"] == 0 and row["eps_budget"] is None
            continue
        assert {k: row[k] for k in ("eps_max", "eps_median", "eps_budget", "eps_left_min")} == pytest.approx(
            _expected(members, budgets), abs=1e-6)
        assert row["charged"] == sum(1 for e in members.values() if e) and row["admitted"] == len(members)
    runs = {run["run_id"]: run for run in status["runs"]}
    expected_runs = {run for r in recomputed.values() for run in r[3]}
    assert set(runs) == expected_runs
    for run_id, run in runs.items():
        for name, row in run["classes"].items():
            members = {cid: r[3][run_id] for cid, r in recomputed.items() if r[0] == name and run_id in r[3]}
            assert row["contributions"] == len(members)
            assert {k: row[k] for k in ("eps_max", "eps_median", "eps_budget", "eps_left_min")} == pytest.approx(
                _expected(members, budgets), abs=1e-6)
    return status


def _spend_epochs(corpus: Corpus, run_id: str, plan: dict[str, int], epochs: int) -> None:
    """`epochs` ledger epochs of spend by `run_id`, each charging the contributions of `plan` (id -> σ_u) at the ε the
    verifier's accountant implies, as a run records it."""
    from govtrain.ledger.ledger import Ledger

    history: dict[str, list] = {}
    with Ledger.open(corpus.url) as ledger:
        for stored in ledger.store.entries(start=1, kinds=("spend",)):
            entry = decode_stored(stored)
            history.setdefault(entry["contribution_id"], []).append(
                (entry["sampling_rate_u"], entry["noise_multiplier_u"], entry["steps"]))
        for _ in range(epochs):
            records = []
            for cid, sigma_u in plan.items():
                history.setdefault(cid, []).append((10_000, sigma_u, 10))
                records.append((cid, 10, sigma_u, spend_epsilon_u("prv", 10_000_000, history[cid])))
            record_spend(ledger, ledger.epoch(), 10_000, records, run_id=run_id, epoch_steps=10, now=corpus.now)
            ledger.close_epoch(now=corpus.now)


def _two_runs(corpus: Corpus) -> None:
    _admit(corpus, "p1")
    _admit(corpus, "p2", eps_budget_u=2_000_000)
    _admit(corpus, "p3")  # never charged: counts 0 in its class's median
    _admit(corpus, "s1", data_class="sensitive", clip_norm_u=500_000, eps_budget_u=3_000_000)
    _spend_epochs(corpus, "run-a", {"p1": 1_000_000, "p2": 1_000_000, "s1": 1_000_000}, 2)
    _spend_epochs(corpus, "run-b", {"p1": 1_000_000}, 1)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_status_shows_eps_per_class_and_per_run(request, backend):
    corpus = request.getfixturevalue("corpus" if backend == "sqlite" else "pg_corpus")
    _two_runs(corpus)
    verify_ledger(corpus.url, accountant=recorded_accountant)
    status = _check_against_the_ledger(corpus.url)
    public = status["classes"]["public"]
    assert public["charged"] == 2 and public["admitted"] == 3
    assert [r["run_id"] for r in status["runs"]] == ["run-a", "run-b"]
    assert status["runs"][0]["epochs"] == [0, 1] and status["runs"][1]["epochs"] == [2]
    assert set(status["runs"][1]["classes"]) == {"public"} and status["runs"][1]["classes"]["public"]["contributions"] == 1
    # run-b's row is p1's cumulative ε after run-b, which is what the class's largest now is
    assert status["runs"][1]["classes"]["public"]["eps_max"] == public["eps_max"]
    text = CliRunner().invoke(cli, ["ledger", "status", "--ledger", corpus.url]).stdout
    assert "ε max" in text and "ε median" in text and "ε budget" in text and "run-a" in text and "run-b" in text
    assert f"{public['eps_max']:.3f}" in text and "epsilon" not in text.lower()


def test_status_after_compaction_counts_redacted_spend_as_summarized(corpus: Corpus):
    _two_runs(corpus)
    before = _status(corpus.url)
    with corpus.open() as ledger:
        for _ in range(2):
            ledger.close_epoch(now=corpus.now)
        redacted = ledger.compact(ledger.epoch() - 1, now=corpus.now)
    assert redacted
    after = _status(corpus.url)
    assert after["classes"] == before["classes"] and after["runs"] == before["runs"]


def test_status_after_a_real_run_equals_the_verifiers_accountant(corpus: Corpus, tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.test_train import _admit as admit_rows, _config, save_tiny_bert

    model = save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))
    admit_rows(corpus, "pub")
    admit_rows(corpus, "pub2", eps_budget_u=4_000_000)
    admit_rows(corpus, "sens", data_class="sensitive", clip_norm_u=500_000, eps_budget_u=3_000_000)
    result = CliRunner().invoke(cli, ["train", "--config", str(_config(corpus, model, 12)), "--ledger", corpus.url,
                                      "--insecure-seed", "1", "--json"])
    assert result.exit_code == 0, result.output
    status = _check_against_the_ledger(corpus.url)
    eps_by_class = json.loads(result.stdout)["eps_by_class"]  # what the run reported, epoch by epoch
    assert {name: row["eps_max"] for name, row in status["runs"][0]["classes"].items()} == pytest.approx(
        {name: values[-1] for name, values in eps_by_class.items() if values[-1]}, abs=1e-6)
