"""A database writer without keys against planning and the spend rules (issue 34 item 7; govtrain/ledger/verified.py).

`read_corpus` (the planner's and a run's view of what it may train on) and `read_spend_state` (what a new spend is
checked against) selected rows by the store's `kind` column, and the tune rules, a withdrawal and a run's written
plan read the admissions and withdrawals index tables. The writer relabels or deletes such rows with raw SQL (after
dropping the triggers): on the old readers a withdrawal or a spend vanished from planning and the rules (a run
planned a withdrawn contribution, or charged below what was spent) while `govtrain-verify` still saw it, after the
run had trained. Every reader now reads every row from the bodies that hash to their leaves: a relabelled row is
refused (`bad_entry`), a deleted one too (`sequence_gap`), and nothing is written; an index row that merely lies
makes no difference.

Each test runs on SQLite, and on PostgreSQL where GOVTRAIN_TEST_PG_URL is set.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from govtrain.errors import GovtrainError
from govtrain.ledger.ledger import Ledger
from govtrain.resolver.plan import plan_run
from tests.conftest import Corpus, lease, noise_groups_for, snapshot
from tests.test_signed_ledger import _admit

EPOCH_STEPS = 10


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request) -> Corpus:  # type: ignore[no-untyped-def]
    """An initialised ledger on each store (PostgreSQL skips loudly without GOVTRAIN_TEST_PG_URL)."""
    return request.getfixturevalue("corpus" if request.param == "sqlite" else "pg_corpus")


def _tamper(corpus: Corpus, *statements: str) -> None:
    """The writer without keys: turns the store's guards off (SQLite: drops its triggers; PostgreSQL: disables every
    trigger, foreign keys included), then runs `statements`."""
    if corpus.url.startswith("sqlite"):
        connection = sqlite3.connect(Path(corpus.url.removeprefix("sqlite:///")))
        for (name,) in connection.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'").fetchall():
            connection.execute(f"DROP TRIGGER {name}")
        for statement in statements:
            connection.execute(statement)
        connection.commit()
        connection.close()
        return
    from sqlalchemy import create_engine

    engine = create_engine(corpus.url)
    with engine.begin() as connection:
        for table in ("entries", "admissions", "withdrawals", "summaries", "checkpoints"):
            connection.exec_driver_sql(f"ALTER TABLE {table} DISABLE TRIGGER ALL")
        for statement in statements:
            connection.exec_driver_sql(statement)
    engine.dispose()


def _seq(corpus: Corpus, kind: str) -> int:
    """The sequence number of the last entry of `kind` (before any tampering)."""
    with corpus.open() as ledger:
        return [e.seq for e in ledger.store.entries(kinds=(kind,))][-1]


def _planned(corpus: Corpus) -> dict[str, float]:
    """contribution id -> its ε now, of every contribution `govtrain plan` would train on."""
    with corpus.open() as ledger:
        plan = plan_run(ledger, EPOCH_STEPS)
    return {row["contribution_id"]: row["eps_now"] for row in plan["contributions"]}


def _refused(call, code: str) -> GovtrainError:  # type: ignore[no-untyped-def]
    with pytest.raises(GovtrainError) as info:
        call()
    assert info.value.code.value == code, info.value
    return info.value


def _spend(corpus: Corpus, epoch: int, records: list[tuple[str, int, int, int]], groups: list[dict],
           run_id: str = "r"):  # type: ignore[no-untyped-def]
    with corpus.open() as ledger:
        return ledger.record_spend(epoch, 10_000, records, run_id=run_id, run_nonce=lease(run_id),
                                   epoch_steps=EPOCH_STEPS, noise_groups=groups, now=corpus.now)


@pytest.fixture
def withdrawn(store: Corpus) -> tuple[Corpus, list[dict]]:
    """"a" and "b" admitted, "a" withdrawn, then an epoch closed (so the withdrawal is no tail entry). Returns the
    noise schedule a spend of "a" in epoch 1 would record (read before any tampering)."""
    _admit(store, "a")
    _admit(store, "b")
    with store.open() as ledger:
        groups = noise_groups_for(ledger, ["a"])
        ledger.withdraw("a", "consent withdrawn", now=store.now)
        ledger.close_epoch(now=store.now)
    assert set(_planned(store)) == {"b"}
    return store, groups


# -- (a) a withdraw entry relabelled in its kind column --------------------------------------------------------


def test_a_relabelled_withdraw_entry_is_refused_by_planning_and_the_spend_rules(withdrawn):
    """The writer calls the withdraw entry a `header` and deletes its index row. Before: the planner planned "a" again
    and the rules took a spend of it. Now both refuse (`bad_entry`), and the spend writes nothing."""
    corpus, groups = withdrawn
    _tamper(corpus, "UPDATE entries SET kind = 'header' WHERE kind = 'withdraw'", "DELETE FROM withdrawals")
    _refused(lambda: _planned(corpus), "bad_entry")
    before = snapshot(corpus.url)
    _refused(lambda: _spend(corpus, 1, [("a", 10, 1_000_000, 100_000)], groups), "bad_entry")
    assert snapshot(corpus.url) == before


# -- (b) a withdrawal's rows deleted ----------------------------------------------------------------------------


def test_a_deleted_withdraw_entry_is_refused_by_planning_and_the_spend_rules(withdrawn):
    """The writer deletes the withdraw entry's row and its index row. Before: the planner planned "a" again. Now a
    gap in the sequence numbers refuses (`sequence_gap`), before the signer would have (`fork`)."""
    corpus, groups = withdrawn
    seq = _seq(corpus, "withdraw")
    _tamper(corpus, "DELETE FROM withdrawals", f"DELETE FROM entries WHERE seq = {seq}")
    _refused(lambda: _planned(corpus), "sequence_gap")
    before = snapshot(corpus.url)
    _refused(lambda: _spend(corpus, 1, [("a", 10, 1_000_000, 100_000)], groups), "sequence_gap")
    assert snapshot(corpus.url) == before


def test_a_deleted_withdrawals_row_makes_no_difference(withdrawn):
    """Only the index row goes: planning still leaves "a" out, and the rules still refuse its spend (a guard: the
    old readers did not read that table either)."""
    corpus, groups = withdrawn
    _tamper(corpus, "DELETE FROM withdrawals")
    assert set(_planned(corpus)) == {"b"}
    before = snapshot(corpus.url)
    _refused(lambda: _spend(corpus, 1, [("a", 10, 1_000_000, 100_000)], groups), "already_withdrawn")
    assert snapshot(corpus.url) == before


# -- (c) a spend hidden -----------------------------------------------------------------------------------------


@pytest.fixture
def spent(store: Corpus) -> tuple[Corpus, list[dict]]:
    """"a" admitted and charged ε 0.5 in epoch 0 (then closed), "b" admitted after the spend."""
    _admit(store, "a")
    with store.open() as ledger:
        groups = noise_groups_for(ledger, ["a"])
    _spend(store, 0, [("a", EPOCH_STEPS, 1_000_000, 500_000)], groups)
    _admit(store, "b")
    with store.open() as ledger:
        ledger.close_epoch(now=store.now)
    assert _planned(store)["a"] == 0.5
    return store, groups


@pytest.mark.parametrize("edit", ["relabelled", "deleted"])
def test_a_hidden_spend_is_refused_by_planning_and_the_spend_rules(spent, edit):
    """The writer relabels the spend entry a `header`, or deletes its row. Before: the planner started "a" from ε 0,
    and the rules took a cumulative ε below the 0.5 already spent (an over-spend of its budget). Now both refuse."""
    corpus, groups = spent
    seq = _seq(corpus, "spend")
    code = "bad_entry" if edit == "relabelled" else "sequence_gap"
    _tamper(corpus, f"UPDATE entries SET kind = 'header' WHERE seq = {seq}" if edit == "relabelled"
            else f"DELETE FROM entries WHERE seq = {seq}")
    _refused(lambda: _planned(corpus), code)
    before = snapshot(corpus.url)
    _refused(lambda: _spend(corpus, 1, [("a", EPOCH_STEPS, 1_000_000, 100_000)], groups, run_id="s"), code)
    assert snapshot(corpus.url) == before


def test_a_relabelled_epoch_entry_does_not_move_the_spend_rules_epoch(spent):
    """The writer calls the entry that closed epoch 0 a `header`, so the kind column counts no epoch: the rules took
    a spend of "b" for epoch 0 (run "r" holds it) while the ledger is in epoch 1. Now they refuse (`bad_entry`)."""
    corpus, _ = spent
    with corpus.open() as ledger:
        groups = noise_groups_for(ledger, ["a", "b"])
    _tamper(corpus, f"UPDATE entries SET kind = 'header' WHERE seq = {_seq(corpus, 'epoch')}")
    before = snapshot(corpus.url)
    _refused(lambda: _spend(corpus, 0, [("b", EPOCH_STEPS, 1_000_000, 100_000)], groups), "bad_entry")
    assert snapshot(corpus.url) == before


# -- (d) an admission relabelled ---------------------------------------------------------------------------------


def test_a_relabelled_admit_entry_is_refused_by_planning(store: Corpus):
    """The writer calls an admit entry a `header`. Before: the planner passed over it without a word. Now it refuses."""
    _admit(store, "a")
    _admit(store, "b")
    with store.open() as ledger:
        ledger.close_epoch(now=store.now)
    _tamper(store, f"UPDATE entries SET kind = 'header' WHERE seq = {_seq(store, 'epoch') - 1}")
    _refused(lambda: _planned(store), "bad_entry")


def test_an_admissions_row_relabelled_to_another_class_does_not_move_a_tunes_totals(spent):
    """The writer moves "a" to another class in the admissions index. Before: the tune rules (`TuneBook`, which a
    `tune` entry's ε per class is checked against) read classes from that index; now from the admit entries."""
    corpus, _ = spent
    with corpus.open() as ledger:
        truth = ledger.tune_book().totals(["r"])
    assert truth[1] == [{"data_class": "public", "eps_u": 500_000}]
    _tamper(corpus, "UPDATE admissions SET data_class = 'sensitive' WHERE contribution_id = 'a'")
    with corpus.open() as ledger:
        assert ledger.tune_book().totals(["r"]) == truth


def test_a_replay_through_a_deleted_admissions_row_is_refused_by_the_gate_and_by_planning(store: Corpus):
    """The writer deletes the admissions row of "a", and its attestation (public, in the admit entry) is submitted
    again. The gate's replay check reads the admit entries besides that index: `replay`, nothing written. A duplicate
    admission that was signed all the same (as a gate that read only the index signed it: written here past the
    gate's lookup) stops planning (`bad_admission`) rather than have its data planned under two budgets."""
    from govtrain.gate.admission import _write, admit
    from govtrain.gate.gate import Gate

    data = store.data("a.jsonl")
    attestation = store.attestation(data, contribution_id="a")
    with store.open() as ledger:
        admit(ledger, attestation, data, now=store.now)
    _tamper(store, "DELETE FROM admissions WHERE contribution_id = 'a'")
    before = snapshot(store.url)
    with store.open() as ledger:
        _refused(lambda: admit(ledger, attestation, data, now=store.now), "replay")
    assert snapshot(store.url) == before
    with store.open() as ledger:
        gate = Gate(ledger.policy)
        (verified,) = gate.verify_many([attestation], now=store.now, epoch=0)
        _write(ledger, [verified], store.now, gate)  # the index no longer knows it
    _refused(lambda: _planned(store), "bad_admission")


# -- a withdrawal the index would refuse -------------------------------------------------------------------------


@pytest.mark.parametrize("edit", ["admission deleted", "withdrawal forged"])
def test_an_index_that_hides_an_admission_or_forges_a_withdrawal_does_not_stop_a_withdrawal(store: Corpus, edit):
    """The writer deletes the admissions row of "a" (before: `unknown_contribution`), or inserts a withdrawals row
    for it (before: `already_withdrawn`), to keep it from withdrawing. The entries decide: the withdrawal is
    written, and planning leaves "a" out."""
    _admit(store, "a")
    _admit(store, "b")
    _tamper(store, "DELETE FROM admissions WHERE contribution_id = 'a'" if edit == "admission deleted"
            else f"INSERT INTO withdrawals (contribution_id, seq) VALUES ('a', {_seq(store, 'header')})")
    with store.open() as ledger:
        stored = ledger.withdraw("a", "consent withdrawn", now=store.now)
    assert stored.kind == "withdraw"
    assert set(_planned(store)) == {"b"}
    with store.open() as ledger:
        _refused(lambda: ledger.withdraw("a", "again", now=store.now), "already_withdrawn")


def test_a_relabelled_summary_is_refused_by_the_readers_of_what_it_retired(store: Corpus):
    """The writer calls a retention summary a `header`. Before: `RetiredKeys` (which keeps a retired contribution out of
    planning, a spend and a withdrawal) and `Redacted` found summaries by the kind column, and saw none. A summary is
    now found by its body, and its relabelled row is refused (`bad_entry`) by them and by planning."""
    from govtrain.ledger import retention

    _admit(store, "a")
    with store.open() as ledger:
        for _ in range(3):
            ledger.close_epoch(now=store.now)
        ledger.compact(1, now=store.now)
    _tamper(store, "UPDATE entries SET kind = 'header' WHERE kind = 'summary'")
    with store.open() as ledger:
        _refused(lambda: retention.RetiredKeys.read(ledger.store), "bad_entry")
    _refused(lambda: _planned(store), "bad_entry")


def test_an_open_run_refuses_a_relabelled_withdrawal(tmp_path: Path):
    """End to end: a run opened on a ledger whose withdraw entry was relabelled refuses (`bad_entry`) before it
    draws anything or writes any spend; before, it trained on the withdrawn contribution."""
    pytest.importorskip("transformers")
    import govtrain
    from tests.test_api import QUIET, _config, _corpus
    from tests.test_train import save_tiny_bert

    (tmp_path / "model").mkdir()
    model = save_tiny_bert(tmp_path / "model")
    corpus = _corpus(tmp_path, "run")
    with Ledger.open(corpus.url) as ledger:
        ledger.withdraw("sens", "consent withdrawn", now=corpus.now)
    _tamper(corpus, "UPDATE entries SET kind = 'header' WHERE kind = 'withdraw'", "DELETE FROM withdrawals")
    before = snapshot(corpus.url)
    drawn: list[set[str]] = []
    config = _config(corpus, model, 4, extra="expected_batch_size = 16")

    def train() -> None:
        with govtrain.GovernedRun.open(config, corpus.url, insecure_seed=4,
                                       observe=lambda step, ids: drawn.append(set(ids)), **QUIET) as run:
            for batch in run.batches():
                run.step(run.per_example_loss(run.model(**batch.inputs), batch))

    _refused(train, "bad_entry")
    assert drawn == [] and snapshot(corpus.url) == before
