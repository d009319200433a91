"""Review of issue 34 item 7 (govtrain/ledger/verified.py): what the verified pass and its neighbours still let a
database writer without keys change about what a run trains on or is charged for.

The verified pass reads every row from seq 1 in order and checks each body against its own leaf column. Three gaps
follow, each proven end to end or at the ledger's API:

- rows below seq 1 are read by nobody but `count_kind`, which close_epoch, compact and a resume still count epochs
  with: a phantom `epoch` row with seq -1 (a plain INSERT: no trigger guards inserts) moves those counts and nothing
  else;
- a row appended after the last signed checkpoint is believed: its leaf is its own body's hash, and the pass never
  asks whether a checkpoint signed that leaf. A run that resumes inside its own written-ahead epoch writes nothing
  before it trains, so no signer looks either;
- the index tables still decide a withdrawal's and an admission's refusals, so a deleted index row makes the key sign
  an entry the verifier fails for good.

The second gap has its remedy in the tree already: `ledger/signed.py` (`read_log`) reads entries as a verified
checkpoint signs them, counts an unsigned tail (`SignedLog.tail`) and takes a body-less row only on a summary that
checkpoint signs; `train/resume.py` (`recorded_entry`) refuses such a tail with `fork`. The verified pass, and the
per-step withdrawal reader, do neither. Besides: a tail deleted with its checkpoint rows is invisible to a write-ahead
whose signer did not sign it, and a cell of the wrong type escapes the pass as an internal error.

Each test fails on the code under review and states the behaviour a fix must give. Ledger-level tests run on SQLite
and, where GOVTRAIN_TEST_PG_URL is set, PostgreSQL.
"""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import pytest

from govtrain.errors import GovtrainError
from govtrain.ledger.entries import decode_entry, spend_entry, summary_entry
from govtrain.ledger.ledger import Ledger
from govtrain.verify.verifier import inspect_ledger
from tests.conftest import Corpus, lease, noise_groups_for, snapshot
from tests.test_attacks_ledger_index import _planned, _refused, _seq, _tamper, store  # noqa: F401 (a fixture)
from tests.test_signed_ledger import _admit


def _insert(corpus: Corpus, seq: int, kind: str, time: int, body: bytes | None, leaf: bytes | None = None) -> None:
    """The writer without keys appends a row (no trigger guards INSERT on either store)."""
    leaf = leaf if leaf is not None else hashlib.sha256(b"\x00" + (body or b"")).digest()
    if corpus.url.startswith("sqlite"):
        connection = sqlite3.connect(Path(corpus.url.removeprefix("sqlite:///")))
        connection.execute("INSERT INTO entries (seq, kind, time, leaf_hash, body) VALUES (?, ?, ?, ?, ?)",
                           (seq, kind, time, leaf, body))
        connection.commit()
        connection.close()
        return
    from sqlalchemy import create_engine, text

    engine = create_engine(corpus.url)
    with engine.begin() as connection:
        connection.execute(text("INSERT INTO entries (seq, kind, time, leaf_hash, body) VALUES (:s, :k, :t, :l, :b)"),
                           {"s": seq, "k": kind, "t": time, "l": leaf, "b": body})
    engine.dispose()


def _phantom_epoch(corpus: Corpus) -> None:
    """A row no reader of entries 1.. ever meets, that `count_kind("epoch")` counts."""
    _insert(corpus, -1, "epoch", 0, None, leaf=bytes(32))


def _entries(url: str) -> list[dict]:
    with Ledger.open(url) as ledger:
        return [decode_entry(e.body, seq=e.seq, kind=e.kind) for e in ledger.store.entries(start=1)
                if e.body is not None]


def _verifies(url: str) -> bool:
    return inspect_ledger(url).error is None


# -- end to end: what a run trains against what its spend charged --------------------------------------------------


def _sqlite(corpus: Corpus, *statements: str, params: tuple = ()) -> None:
    connection = sqlite3.connect(Path(corpus.url.removeprefix("sqlite:///")))
    for statement in statements:
        connection.execute(statement, params) if params else connection.execute(statement)
    connection.commit()
    connection.close()


def _train(config, corpus: Corpus, drawn: dict[int, set[str]], *, stop_after: int | None = None,
           after_first_step=None) -> None:  # type: ignore[no-untyped-def]
    """A user's loop; `stop_after` steps then leave (the run state is kept: a kill between steps); `after_first_step`
    runs once, after this process's first step (the writer cleaning up)."""
    import govtrain
    from tests.test_api import QUIET

    taken = 0
    with govtrain.GovernedRun.open(config, corpus.url, insecure_seed=4, observe=lambda step, ids: drawn.update(
            {step: set(ids)}), **QUIET) as run:
        for batch in run.batches():
            if run.step(run.per_example_loss(run.model(**batch.inputs), batch)) is None:
                continue
            taken += 1
            if taken == 1 and after_first_step is not None:
                after_first_step()
            if stop_after is not None and taken == stop_after:
                return


@pytest.fixture
def model(tmp_path: Path) -> Path:
    pytest.importorskip("transformers")
    from tests.test_train import save_tiny_bert

    (tmp_path / "model").mkdir()
    return save_tiny_bert(tmp_path / "model")


def test_a_phantom_epoch_row_lets_a_run_train_every_epoch_under_its_first_epochs_spend(tmp_path: Path, model: Path):
    """HIGH. Attack: before a run starts, the writer inserts one row (seq -1, kind `epoch`, no body); no trigger
    refuses an INSERT. The verified pass starts at seq 1 and never sees it; `Ledger.close_epoch` counts
    `count_kind("epoch")` = 1 and so refuses to close epoch 0 (`epoch=0` is "no longer current"). The run's next
    `plan_epoch` reads epoch 0 again from the verified pass, `write_ahead` finds epoch 0 held by its own lease and
    returns True without writing, and `written_plan` hands it epoch 0's spend once more.
    Impact (measured): 6 steps trained (3 epochs of 2), 2 steps charged: one spend per contribution, ε frozen at the
    first epoch's (public 2.93). Expected: every step a run takes is covered by a spend of its epoch, i.e. close_epoch
    (and every epoch count) reads the same verified entries the spend rules read, or the run is refused."""
    from tests.test_api import _config, _corpus

    corpus = _corpus(tmp_path, "run")
    _phantom_epoch(corpus)
    drawn: dict[int, set[str]] = {}
    config = _config(corpus, model, 6, extra="expected_batch_size = 16\nepoch_steps = 2")
    try:
        _train(config, corpus, drawn)
    except GovtrainError:
        pass  # a refusal is a fix too: what matters is what was trained against what was charged
    charged = {(s["epoch"], s["epoch_steps"]) for s in _entries(corpus.url) if s["kind"] == "spend"}
    assert len(drawn) <= sum(steps for _, steps in charged), (sorted(drawn), sorted(charged))


def test_a_phantom_epoch_row_on_resume_retrains_the_written_epoch_from_where_the_kill_left_it(tmp_path: Path,
                                                                                              model: Path):
    """MEDIUM-HIGH. Attack: a run (8 steps, epochs of 4) is killed after step 1; while it is down the writer inserts the
    phantom `epoch` row (seq -1), and removes it again after the resumed run's first step. `Run._start` drops the
    pending epoch when `ledger.epoch()` (the kind column's count, 1) exceeds it (0), "closed just before the kill";
    `plan_epoch` then plans epoch 0 afresh from step 1 (the verified count is still 0) for a whole epoch of 4 steps,
    and `write_ahead` trains it under the spend written before the kill. Impact: epoch 0 trains 5 steps on a 4-step
    charge (steps 0..4); with the row left in place, `close_epoch` never closes an epoch (see the test above).
    Expected: the resume check counts epochs from the verified entries (or refuses): no step goes uncharged."""
    from tests.test_api import _config, _corpus

    corpus = _corpus(tmp_path, "run")
    drawn: dict[int, set[str]] = {}
    config = _config(corpus, model, 8, extra="expected_batch_size = 16\nepoch_steps = 4")
    _train(config, corpus, drawn, stop_after=1)
    _phantom_epoch(corpus)

    def clean_up() -> None:
        _tamper(corpus, "DELETE FROM entries WHERE seq = -1")

    try:
        _train(config, corpus, drawn, after_first_step=clean_up)
    except GovtrainError:
        pass
    charged = {(s["epoch"], s["epoch_steps"]) for s in _entries(corpus.url) if s["kind"] == "spend"}
    assert len(drawn) <= sum(steps for _, steps in charged), (sorted(drawn), sorted(charged))


def test_an_unsigned_tail_spend_lets_a_resumed_run_draw_a_contribution_no_spend_charged(tmp_path: Path, model: Path):
    """HIGH. Attack: a run (4 steps, one epoch) is killed after step 1; "late" is admitted while it is down. The writer
    appends one row at the tail: a spend body for "late" copied from the run's own epoch-0 spend (its lease nonce is
    in that body), with the leaf column set to its hash. No checkpoint signs it and the verified pass does not ask.
    The resumed run's `write_ahead` finds epoch 0 held by its lease and writes nothing; `written_plan` reads the
    forged spend into `allowed`, so "late" is drawn. After the first resumed step the writer deletes the row; the run
    closes its epoch and records its run entry, and `govtrain-verify` passes.
    Impact (measured): "late" drawn at steps 1, 2, 3; no spend entry names it; the ledger verifies. Expected: a run
    reads only entries a verified signed checkpoint covers (an unsigned tail is refused, e.g. `fork`, before a step),
    so "late" is never drawn in an epoch whose spend does not charge it."""
    from tests.test_api import _config, _corpus
    from tests.test_train import _admit as admit_with_data

    corpus = _corpus(tmp_path, "run")
    drawn: dict[int, set[str]] = {}
    config = _config(corpus, model, 4, extra="expected_batch_size = 16")
    _train(config, corpus, drawn, stop_after=1)
    admit_with_data(corpus, "late")
    with corpus.open() as ledger:
        rows = list(ledger.store.entries(start=1))
    late = next(r for r in rows if r.kind == "admit" and decode_entry(r.body, seq=r.seq, kind="admit")[
        "contribution_id"] == "late")
    real = next(decode_entry(r.body, seq=r.seq, kind="spend") for r in rows if r.kind == "spend")
    fields = {k: v for k, v in real.items() if k not in ("v", "seq", "kind", "time")}
    fields.update(contribution_id="late", admit_leaf=late.leaf_hash)
    seq, time = rows[-1].seq + 1, rows[-1].time
    _insert(corpus, seq, "spend", time, spend_entry(seq, time, **fields))

    cleaned: list[bool] = []

    def clean_up() -> None:
        _tamper(corpus, f"DELETE FROM entries WHERE seq = {seq}")
        cleaned.append(True)

    try:
        _train(config, corpus, drawn, after_first_step=clean_up)
    except GovtrainError as e:
        assert e.code.value in ("unsigned_tail", "fork"), e  # refused before a step, for the unsigned tail
    if not cleaned:  # a refused run took no step: the writer removes its row all the same, leaving no trace
        clean_up()
    charged = {s["contribution_id"] for s in _entries(corpus.url) if s["kind"] == "spend"}
    assert "late" not in charged
    assert all("late" not in ids for ids in drawn.values()), drawn


def test_an_unsigned_tail_summary_hides_a_withdrawal_from_a_resumed_run(tmp_path: Path, model: Path):
    """HIGH. Attack: a run (4 steps) is killed after step 1 and "sens" withdraws (a signed entry W). The writer nulls
    W's body, sets its kind column to `admit`, and appends an unsigned `summary` row whose `retired` list claims W as
    the admit of a contribution "ghost" (a summary is found by its body: `read_summaries`). The verified pass and the
    per-step reader (`train/withdrawals.py`) take a body-less row that a summary records as what it says: W reads as
    ghost's retired admission, and no withdrawal of "sens" exists. The resumed run writes nothing before it trains
    (its epoch is held by its lease). After its first step the writer restores W and deletes the summary; the per-step
    reader never reads W again, and the ledger verifies.
    Impact: "sens" is drawn after its withdrawal, and nothing in the ledger shows it. Expected: a body-less row counts
    as redacted only by a summary a verified signed checkpoint covers (or the run refuses): "sens" is never drawn
    after its withdrawal."""
    from tests.test_api import _config, _corpus

    corpus = _corpus(tmp_path, "run")
    drawn: dict[int, set[str]] = {}
    config = _config(corpus, model, 4, extra="expected_batch_size = 16")
    _train(config, corpus, drawn, stop_after=1)
    with corpus.open() as ledger:
        withdrawal = ledger.withdraw("sens", "consent withdrawn", now=corpus.now)
        admit = decode_entry(ledger.store.entry(_seq(corpus, "admit")).body, seq=_seq(corpus, "admit"), kind="admit")
    w, time = withdrawal.seq, withdrawal.time
    ghost = {"contribution_id": "ghost", "data_class": "public", "admit_seq": w,
             "descriptor_sha256": hashlib.sha256(b"g1").digest(), "attestation_sha256": hashlib.sha256(b"g2").digest(),
             "data_sha256": hashlib.sha256(b"g3").digest(), "records": 1, "clip_norm_u": admit["clip_norm_u"],
             "noise_multiplier_u": admit["noise_multiplier_u"], "eps_budget_u": admit["eps_budget_u"],
             "withdraw_seq": None, "entry_seqs": [w], "spends": [], "eps_u": 0}
    digest = hashlib.sha256(withdrawal.leaf_hash).digest()
    body = summary_entry(w + 1, time, data_class="public", before_epoch=0, first_seq=w, last_seq=w, entries=1,
                         admitted=1, withdrawn=0, spend_u=0, entries_sha256=digest, range_sha256=digest,
                         retired=[ghost])
    _tamper(corpus, f"UPDATE entries SET body = NULL, kind = 'admit' WHERE seq = {w}")
    _insert(corpus, w + 1, "summary", time, body)

    restored: list[bool] = []

    def restore() -> None:
        if corpus.url.startswith("sqlite"):
            _sqlite(corpus, f"DELETE FROM entries WHERE seq = {w + 1}")
            _sqlite(corpus, f"UPDATE entries SET body = ?, kind = 'withdraw' WHERE seq = {w}",
                    params=(withdrawal.body,))
        restored.append(True)

    try:
        _train(config, corpus, drawn, after_first_step=restore)
    except GovtrainError as e:
        assert e.code.value in ("unsigned_tail", "fork", "bad_summary"), e  # refused before a step
    if not restored:  # a refused run took no step: the writer restores the ledger all the same
        restore()
    assert _verifies(corpus.url)  # the writer left no trace
    assert all("sens" not in drawn[step] for step in drawn if step >= 1), drawn


# -- ledger level: the kind-column epoch count ---------------------------------------------------------------------


def test_a_phantom_epoch_row_makes_the_key_sign_a_misnumbered_epoch_entry(store: Corpus):
    """MEDIUM. Attack: the writer inserts the phantom `epoch` row (seq -1), then an operator closes the epoch
    (`govtrain ledger close-epoch`, `Ledger.close_epoch()` without `epoch`). It counts the kind column (1) and signs
    "epoch 1" as the ledger's first epoch entry. The writer deletes the phantom row. Impact: the signed ledger now
    fails `govtrain-verify` for good (`bad_epoch`: entries cannot be removed), and `compact(1)` finds no entry closing
    epoch 0. A writer without keys made the key sign an entry the verifier refuses. Expected: the epoch entry states the
    epoch the verified entries are in (0), or close_epoch refuses; either way the ledger verifies."""
    _admit(store, "a")
    _phantom_epoch(store)
    with store.open() as ledger:
        try:
            ledger.close_epoch(now=store.now)
        except GovtrainError:
            pass  # a refusal is a fix too: nothing misnumbered gets signed
    _tamper(store, "DELETE FROM entries WHERE seq = -1")
    epochs = [e["epoch"] for e in _entries(store.url) if e["kind"] == "epoch"]
    assert epochs == list(range(len(epochs))), epochs
    assert _verifies(store.url)


def test_phantom_epoch_rows_let_a_compaction_retire_inside_the_retention_horizon(store: Corpus):
    """LOW-MEDIUM. Attack: with epochs 0 and 1 closed and `retention_epochs = 1`, compaction may retire only what was
    admitted before epoch 0 closed (`before_epoch` <= 1). The writer inserts one phantom `epoch` row (seq -1): `compact`
    counts the kind column (3 epochs), its horizon becomes 2, and `compact(2)` retires "b", admitted in epoch 1, a
    whole retention epoch early: its bodies are dropped and it can no longer withdraw (`redacted`). Expected:
    `retention_horizon`, nothing written."""
    _admit(store, "a")
    with store.open() as ledger:
        ledger.close_epoch(now=store.now)
    _admit(store, "b")
    with store.open() as ledger:
        ledger.close_epoch(now=store.now)
        with pytest.raises(GovtrainError) as honest:
            ledger.compact(2, now=store.now)
        assert honest.value.code.value == "retention_horizon"
    _phantom_epoch(store)
    before = snapshot(store.url)
    with store.open() as ledger:
        _refused(lambda: ledger.compact(2, now=store.now), "retention_horizon")
    assert snapshot(store.url) == before


# -- ledger level: index tables that still decide a refusal --------------------------------------------------------


def test_a_deleted_withdrawals_row_makes_the_key_sign_a_second_withdrawal(store: Corpus):
    """MEDIUM. Attack: "a" withdrew; the writer deletes its `withdrawals` row, and anyone asks to withdraw "a" again.
    `Ledger.withdraw` asks the index (`_indexed_admit`: admitted, no withdrawals row) and, finding it, never reads the
    entries, so the key signs a second withdraw entry of "a". Impact: `govtrain-verify` fails for good
    (`bad_withdrawal`: "already withdrawn by entry 3"); every auditor sees a broken ledger that no one can repair.
    Expected: `already_withdrawn` (the entries decide, as they already do for the opposite refusal), nothing written."""
    _admit(store, "a")
    _admit(store, "b")
    with store.open() as ledger:
        withdrawal = ledger.withdraw("a", "consent withdrawn", now=store.now)
    _tamper(store, "DELETE FROM withdrawals")
    before = snapshot(store.url)
    with store.open() as ledger:
        _refused(lambda: ledger.withdraw("a", "again", now=store.now), "already_withdrawn")
    assert snapshot(store.url) == before
    # The deleted index row is itself reported (index_mismatch) and is repairable from the entries; what must not
    # happen is a signed entry that fails the verifier for good. With the row put back, the ledger verifies.
    assert inspect_ledger(store.url).error.code.value == "index_mismatch"
    _tamper(store, f"INSERT INTO withdrawals (contribution_id, seq) VALUES ('a', {withdrawal.seq})")
    assert _verifies(store.url)


def test_a_deleted_admissions_row_makes_the_gate_sign_a_replay_that_stops_every_later_plan(store: Corpus):
    """MEDIUM (the listed gap, exploited). Attack: the writer deletes the `admissions` row of "a"; its attestation (in
    its admit entry) is submitted again. The gate's replay check reads that index (`admission_conflicts`), so the gate
    signs a second admit of "a". The verified pass then refuses the whole ledger (`bad_admission`): planning, every
    write-ahead, tune and withdrawal stop for good, since a signed entry cannot be removed (a keyless writer's
    permanent denial of service; `govtrain-verify` fails too). Expected: the gate refuses the replay (`replay`) from
    the entries (e.g. `entries_holding` on the attestation digest, one indexed search), and writes nothing."""
    from govtrain.gate.admission import admit

    data = store.data("a.jsonl")
    attestation = store.attestation(data, contribution_id="a")
    with store.open() as ledger:
        admit(ledger, attestation, data, now=store.now)
    _tamper(store, "DELETE FROM admissions WHERE contribution_id = 'a'")
    before = snapshot(store.url)
    with store.open() as ledger:
        _refused(lambda: admit(ledger, attestation, data, now=store.now), "replay")
    assert snapshot(store.url) == before
    assert set(_planned(store)) == {"a"}


# -- the pass itself -----------------------------------------------------------------------------------------------


def test_a_row_of_the_wrong_cell_type_is_a_one_line_refusal_of_planning_not_an_internal_error(corpus: Corpus):
    """LOW. Attack: the writer appends a row whose body is TEXT (SQLite keeps any type). The store raises `TamperedRow`
    (a `ledger_store` exception, no `GovtrainError`) from inside the verified pass; `govtrain-verify` maps it to
    `bad_entry`, but planning, the spend rules and a run's per-step withdrawal read let it through as a crash
    (`error[internal]`, exit code of a bug). Expected: the verifier's mapping (`bad_entry`), one line."""
    _admit(corpus, "a")
    with corpus.open() as ledger:
        head = ledger.store.head()
    connection = sqlite3.connect(Path(corpus.url.removeprefix("sqlite:///")))
    connection.execute("INSERT INTO entries (seq, kind, time, leaf_hash, body) VALUES (?, 'withdraw', ?, ?, 'text')",
                       (head.seq + 1, head.time, bytes(32)))
    connection.commit()
    connection.close()
    _refused(lambda: _planned(corpus), "bad_entry")


# -- a tail deleted with its checkpoints, against a writer whose signer did not sign it ----------------------------


@pytest.mark.xfail(strict=True, reason="a known limit (docs/threat-model.md, ledger/verified.py): a tail deleted with "
                   "its checkpoints is seen only by a writer whose signer state signed it; two signer states share no "
                   "head, and only a witness (issue 39's ledger work) closes it. strict: it fails the suite once fixed")
def test_a_withdrawal_deleted_with_its_checkpoint_is_hidden_from_a_run_whose_signer_did_not_sign_it(
        store: Corpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """MEDIUM (the listed gap; the claim that a run catches it at its write-ahead does not hold). Setting: the
    withdrawal desk signs with its own signer state (another host, or $GOVTRAIN_SIGNER_STATE elsewhere; the policy
    supports several writers). Attack: the writer deletes the withdraw entry of "a", its withdrawals row and the
    checkpoint row that signed it (SQLite reuses the checkpoint id, so no gap is left). The training host's signer
    last signed the tree before the withdrawal, so `Ledger._signed_prefix` finds the database exactly as it
    remembers it: `record_spend` signs a spend of the withdrawn "a", and planning plans it.
    Impact: a withdrawn contribution is written ahead and trained; only the withdrawal desk's next write (`rollback`)
    or an auditor who pinned the later checkpoint shows it, after the run trained. Expected: the write-ahead is refused
    (e.g. `rollback`) and nothing is written: a write-ahead must check the ledger against a head that every writer
    of the ledger advances (a shared signer state, or a witness), not only its own signer's."""
    _admit(store, "a")
    _admit(store, "b")
    with store.open() as ledger:
        groups = noise_groups_for(ledger, ["a"])
    monkeypatch.setenv("GOVTRAIN_SIGNER_STATE", str(tmp_path / "withdrawal-desk"))
    with store.open() as ledger:
        withdrawal = ledger.withdraw("a", "consent withdrawn", now=store.now)
    monkeypatch.delenv("GOVTRAIN_SIGNER_STATE")
    _tamper(store, f"DELETE FROM entries WHERE seq = {withdrawal.seq}", "DELETE FROM withdrawals",
            f"DELETE FROM checkpoints WHERE size = {withdrawal.seq + 1}")
    before = snapshot(store.url)
    with store.open() as ledger:
        try:
            ledger.record_spend(0, 10_000, [("a", 10, 1_000_000, 100_000)], run_id="r", run_nonce=lease("r"),
                                epoch_steps=10, noise_groups=groups, now=store.now)
        except GovtrainError:
            pass
    assert snapshot(store.url) == before, "a spend of the withdrawn contribution was signed"
