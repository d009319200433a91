"""Retention (compaction) under attack: one test per attack, each asserting the specific error code and,
where the ledger refuses, that nothing changed.

Two attackers: a database writer without keys (raw sqlite3, triggers dropped first) and an operator
with the ledger key (who can append, and redact, whatever it signs), against an auditor who pinned a
checkpoint before the compaction.
"""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import pytest

import ledger_store
from govtrain.encoding import cbor
from govtrain.errors import AdmissionError, GovtrainError, IntegrityError, RejectedError
from govtrain.gate.admission import admit
from govtrain.ledger.entries import SPECS, admit_entry, summary_entry
from govtrain.verify.verifier import VerificationReport, inspect_ledger
from tests.conftest import Corpus, snapshot, record_spend


def _fake_accountant(name: str, delta_p: int, history) -> int:
    """1000 µε per step: cheap, and strict enough to show a history that lost an epoch."""
    return sum(steps for _, _, steps in history) * 1000


def _db(url: str) -> Path:
    return Path(url.removeprefix("sqlite:///"))


def _sql(url: str, *statements: str) -> None:
    """A database writer without keys: drops the triggers, then edits whatever it likes."""
    connection = sqlite3.connect(_db(url))
    for (name,) in connection.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'").fetchall():
        connection.execute(f"DROP TRIGGER {name}")
    for statement in statements:
        connection.execute(statement)
    connection.commit()
    connection.close()


def _verify(url: str, *trusted: str) -> VerificationReport:
    return inspect_ledger(url, trusted_checkpoints=trusted, accountant=_fake_accountant)


def _fails(report: VerificationReport, code: str, seq: int | None) -> None:
    assert report.error is not None, "the verifier said OK"
    assert (report.error.code.value, report.bad_seq) == (code, seq), report.error.detail


def _note(corpus: Corpus) -> str:
    with corpus.open() as ledger:
        return ledger.store.latest_checkpoint().note


def _data(corpus: Corpus, name: str) -> Path:
    return corpus.dir / f"{name}.jsonl"


def _attestation(corpus: Corpus, name: str) -> bytes:
    overrides = {"data_class": "sensitive", "clip_norm_u": 500_000, "eps_budget_u": 3_000_000} \
        if name == "sens" else {}
    return corpus.attestation(_data(corpus, name), contribution_id=name, **overrides)


def _age(corpus: Corpus) -> Corpus:
    """10 entries over two closed epochs (retention is 1 epoch, so epoch 0 may be compacted):

      1 admit gone   2 admit kept   3 admit sens (sensitive)   4 spend gone e0   5 spend kept e0
      6 withdraw gone   7 epoch 0   8 spend kept e1   9 epoch 1

    compact(1) retires gone (1, 4, 6) and sens (3); kept is still spending after epoch 0.
    """
    with corpus.open() as ledger:
        for name in ("gone", "kept", "sens"):
            corpus.data(f"{name}.jsonl")
            admit(ledger, _attestation(corpus, name), _data(corpus, name), now=corpus.now)
        record_spend(ledger, 0, 10_000, [("gone", 10, 1_000_000, 10_000), ("kept", 10, 1_000_000, 10_000)],
                            run_id="r", epoch_steps=10, now=corpus.now)
        ledger.withdraw("gone", "asked to leave", now=corpus.now)
        ledger.close_epoch(now=corpus.now)
        record_spend(ledger, 1, 10_000, [("kept", 10, 1_000_000, 20_000)], run_id="r", epoch_steps=10,
                            now=corpus.now)
        ledger.close_epoch(now=corpus.now)
    assert _verify(corpus.url).ok
    return corpus


@pytest.fixture
def aged(corpus: Corpus) -> Corpus:
    return _age(corpus)


def _summaries(corpus: Corpus) -> dict[str, dict]:
    with corpus.open() as ledger:
        return {entry["data_class"]: {**entry, "seq": s.seq} for s in ledger.store.entries(kinds=("summary",))
                for entry in [cbor.decode(s.body)]}


def _leaves(corpus: Corpus, seqs) -> list[bytes]:
    with corpus.open() as ledger:
        return [ledger.store.entry(seq).leaf_hash for seq in seqs]


def _retired(corpus: Corpus, admit_seq: int, entry_seqs: list[int], withdraw_seq: int | None = None) -> dict:
    with corpus.open() as ledger:
        entry = cbor.decode(ledger.store.entry(admit_seq).body)
        bodies = [cbor.decode(ledger.store.entry(seq).body) for seq in entry_seqs[1:] if seq != withdraw_seq]
    spends = [{"seq": b["seq"], **{k: b[k] for k in ("run_id", "run_nonce", "epoch", "epoch_steps", "steps",
                                                     "sampling_rate_u", "noise_multiplier_u", "eps_u", "noise_groups",
                                                     "privatizer") if k in b}}  # privatizer: since it is recorded
              for b in bodies]
    return {"contribution_id": entry["contribution_id"], "data_class": entry["data_class"], "admit_seq": admit_seq,
            "descriptor_sha256": entry["descriptor_sha256"], "attestation_sha256": entry["attestation_sha256"],
            "data_sha256": entry["data_sha256"], "records": entry["records"], "clip_norm_u": entry["clip_norm_u"],
            "noise_multiplier_u": entry["noise_multiplier_u"], "eps_budget_u": entry["eps_budget_u"],
            "withdraw_seq": withdraw_seq, "entry_seqs": entry_seqs,
            "spends": spends, "eps_u": spends[-1]["eps_u"] if spends else 0}


def _operator_summary(corpus: Corpus, *, data_class: str, before_epoch: int, retired: list[dict],
                      redact: bool, **overrides) -> int:
    """What an operator holding the ledger key can write: any summary it likes, signed, and the redaction of
    every entry it names, in one transaction. Fields are honest unless overridden."""
    seqs = overrides.pop("seqs", None) or sorted(s for r in retired for s in r["entry_seqs"])
    digest = hashlib.sha256(b"".join(_leaves(corpus, seqs))).digest()
    fields = {"data_class": data_class, "before_epoch": before_epoch, "first_seq": seqs[0], "last_seq": seqs[-1],
              "entries": len(seqs), "admitted": len(retired),
              "withdrawn": sum(r["withdraw_seq"] is not None for r in retired), "spend_u": 0,
              "entries_sha256": digest, "range_sha256": digest, "retired": retired, **overrides}
    fields = {k: v for k, v in fields.items() if k in SPECS["summary"]}  # the format of the code under test
    with corpus.open() as ledger:
        with ledger.append(corpus.now) as appender:
            stored = appender.add("summary", corpus.now, lambda seq: summary_entry(seq, corpus.now, **fields),
                                  summary={"data_class": data_class, "first_seq": seqs[0], "last_seq": seqs[-1]})
            if redact:
                appender.redact(seqs)
    return stored.seq


# -- honest retention ---------------------------------------------------------------------


def test_honest_compaction_verifies_with_and_without_a_pinned_checkpoint(aged: Corpus):
    pinned = _note(aged)
    expected = {"public": [_retired(aged, 1, [1, 4, 6], withdraw_seq=6)], "sensitive": [_retired(aged, 3, [3])]}
    with aged.open() as ledger:
        summarized = ledger.compact(1, now=aged.now)
    assert [s.seq for s in summarized] == [1, 3, 4, 6]
    with aged.open() as ledger:
        assert [e.seq for e in ledger.store.entries() if e.body is None] == [1, 3, 4, 6]
    summaries = _summaries(aged)
    assert {name: s["retired"] for name, s in summaries.items()} == expected
    assert (summaries["public"]["spend_u"], summaries["public"]["admitted"], summaries["public"]["withdrawn"]) \
        == (10_000, 1, 1)
    for trusted in ((), (pinned,), (pinned, _note(aged))):
        report = _verify(aged.url, *trusted)
        assert report.ok, report.error
        assert report.redacted == 4


def _interrupted_compaction(corpus: Corpus, monkeypatch) -> None:
    def crash(self, seqs):
        raise RuntimeError("power cut between the summary and the redaction")

    with monkeypatch.context() as patch:
        patch.setattr(ledger_store.Appender, "redact", crash)
        with corpus.open() as ledger, pytest.raises(RuntimeError, match="power cut"):
            ledger.compact(1, now=corpus.now)
    assert set(_summaries(corpus)) == {"public", "sensitive"}


def test_verifying_between_the_summary_and_the_redaction_checks_every_field(aged: Corpus, monkeypatch):
    """Compaction appends its summaries, then redacts in a second transaction: a ledger stopped in between
    (bodies still present) verifies, with every aggregate recomputed; compacting again finishes the job."""
    pinned = _note(aged)
    _interrupted_compaction(aged, monkeypatch)
    report = _verify(aged.url, pinned)
    assert report.ok, report.error
    assert report.redacted == 0
    with aged.open() as ledger, pytest.raises(RejectedError) as info:
        ledger.withdraw("sens", "too late", now=aged.now)  # retired, though its body is still there
    assert info.value.code.value == "redacted"
    with aged.open() as ledger:
        assert [s.seq for s in ledger.compact(1, now=aged.now)] == [1, 3, 4, 6]
        assert len(list(ledger.store.entries(kinds=("summary",)))) == 2  # finished, not summarized twice
    assert _verify(aged.url, pinned).ok


def test_an_interrupted_compaction_on_postgresql(pg_corpus: Corpus, monkeypatch):
    _age(pg_corpus)
    _interrupted_compaction(pg_corpus, monkeypatch)
    assert _verify(pg_corpus.url).ok
    with pg_corpus.open() as ledger:
        assert [s.seq for s in ledger.compact(1, now=pg_corpus.now)] == [1, 3, 4, 6]
    assert _verify(pg_corpus.url).redacted == 4


def test_compaction_does_not_redact_a_contribution_named_after_its_summary(aged: Corpus, monkeypatch):
    """A spend for a retired contribution, appended between the summaries and the redaction (as a racing
    writer could), stops the redaction: the re-check against the bodies refuses, and nothing changes."""
    from tests.test_signed_ledger import _spend

    _interrupted_compaction(aged, monkeypatch)
    _spend(aged, "sens", eps_u=10_000, epoch=2)
    before = snapshot(aged.url)
    with aged.open() as ledger, pytest.raises(IntegrityError) as info:
        ledger.compact(1, now=aged.now)
    assert info.value.code.value == "bad_summary" and "sens" in info.value.detail
    assert snapshot(aged.url) == before
    with aged.open() as ledger:
        assert not [e for e in ledger.store.entries() if e.body is None]
    _fails(_verify(aged.url), "bad_summary", before[0] - 1)  # the spend names a retired contribution


def test_a_compaction_with_nothing_to_retire_writes_nothing(aged: Corpus):
    with aged.open() as ledger:
        ledger.compact(1, now=aged.now)
    before = snapshot(aged.url)
    with aged.open() as ledger, pytest.raises(RejectedError) as info:
        ledger.compact(1, now=aged.now)  # kept is still spending after epoch 0
    assert info.value.code.value == "retention_horizon"
    assert snapshot(aged.url) == before


# -- defect 6: index rows of retired contributions -------------------------------------------


def _rename_retired_rows(corpus: Corpus) -> None:
    """Give the retired contribution's index rows a new id and new digests, so the gate no longer sees it."""
    _sql(corpus.url,
         "UPDATE admissions SET contribution_id = 'renamed', descriptor_sha256 = randomblob(32), "
         "attestation_sha256 = randomblob(32), data_sha256 = randomblob(32) WHERE contribution_id = 'gone'",
         "UPDATE withdrawals SET contribution_id = 'renamed' WHERE contribution_id = 'gone'")


def test_6a_renamed_index_rows_of_a_retired_contribution_are_detected(aged: Corpus):
    pinned = _note(aged)
    with aged.open() as ledger:
        ledger.compact(1, now=aged.now)
    _rename_retired_rows(aged)
    _fails(_verify(aged.url, pinned), "index_mismatch", 1)


def test_6a_a_withdrawn_retired_contribution_cannot_be_admitted_again(aged: Corpus):
    with aged.open() as ledger:
        ledger.compact(1, now=aged.now)
    _rename_retired_rows(aged)
    before = snapshot(aged.url)
    with aged.open() as ledger, pytest.raises(AdmissionError) as info:
        admit(ledger, _attestation(aged, "gone"), _data(aged, "gone"), now=aged.now)
    assert info.value.code.value == "replay"
    assert snapshot(aged.url) == before


def test_6a_a_replayed_admit_written_past_the_gate_is_flagged(aged: Corpus):
    """The operator signs an admit that replays a retired contribution (whose index rows were renamed)."""
    from govtrain.gate.gate import Gate

    pinned = _note(aged)
    with aged.open() as ledger:
        ledger.compact(1, now=aged.now)
    _rename_retired_rows(aged)
    with aged.open() as ledger:
        verified = Gate(ledger.policy).verify(_attestation(aged, "gone"), now=aged.now)
        with ledger.append(aged.now) as appender:
            stored = appender.add("admit", aged.now, lambda seq: admit_entry(seq, aged.now, verified))
    _fails(_verify(aged.url, pinned), "replay", stored.seq)


def test_6b_a_withdrawal_row_moved_onto_a_live_contribution_is_detected(aged: Corpus):
    pinned = _note(aged)
    with aged.open() as ledger:
        ledger.compact(1, now=aged.now)
    _sql(aged.url, "UPDATE withdrawals SET contribution_id = 'kept' WHERE contribution_id = 'gone'")
    with aged.open() as ledger:
        assert "kept" in ledger.store.withdrawals()  # kept would be excluded, with no withdraw entry
    _fails(_verify(aged.url, pinned), "index_mismatch", 6)


# -- defect 7: compaction trusted the admissions.data_class column ---------------------------


def test_7_an_edited_data_class_column_does_not_reach_a_signed_summary(aged: Corpus):
    pinned = _note(aged)
    _sql(aged.url, "UPDATE admissions SET data_class = 'sensitive' WHERE contribution_id = 'gone'")
    with aged.open() as ledger:
        ledger.compact(1, now=aged.now)
    summaries = _summaries(aged)
    assert (summaries["public"]["admitted"], summaries["public"]["withdrawn"]) == (1, 1)  # gone, by its admit body
    assert (summaries["sensitive"]["admitted"], summaries["sensitive"]["withdrawn"]) == (1, 0)  # sens only
    _fails(_verify(aged.url, pinned), "index_mismatch", 1)


# -- defect 8: summaries bound to the horizon and to what they redact (operator with the key) --


def test_8_redacting_a_live_spend_under_a_summary_that_claims_nothing(aged: Corpus):
    """The refund: kept's epoch-0 spend vanishes under a summary retiring nothing, and kept's next spend is
    charged over two epochs instead of three."""
    pinned = _note(aged)
    _operator_summary(aged, data_class="public", before_epoch=1, retired=[], redact=True, seqs=[5],
                      entries=1)
    before = snapshot(aged.url)
    with aged.open() as ledger, pytest.raises(GovtrainError) as refused:  # the writer reads no shortened history
        record_spend(ledger, 2, 10_000, [("kept", 10, 1_000_000, 20_000)], run_id="r", epoch_steps=10,
                     now=aged.now)  # truly 30_000
    assert refused.value.code.value == "bad_summary" and snapshot(aged.url) == before
    _fails(_verify(aged.url, pinned), "bad_entry", 5)


def test_8_a_live_contribution_retired_by_a_false_summary_cannot_spend_again(aged: Corpus):
    pinned = _note(aged)
    _operator_summary(aged, data_class="public", before_epoch=1, retired=[_retired(aged, 2, [2, 5])],
                      redact=True)
    _fails(_verify(aged.url, pinned), "bad_summary", 8)  # kept's epoch-1 spend names a retired contribution


def test_8_a_summary_must_list_every_entry_of_what_it_retires(aged: Corpus):
    pinned = _note(aged)
    seq = _operator_summary(aged, data_class="public", before_epoch=1, retired=[_retired(aged, 2, [2, 5])],
                            redact=False)
    report = _verify(aged.url, pinned)
    _fails(report, "bad_summary", seq)
    assert "entry_seqs" in report.error.detail  # kept's entry 8 is missing from the list


@pytest.mark.parametrize("before_epoch", [2, 1], ids=["beyond_the_horizon", "range_past_the_boundary"])
def test_8_a_summary_beyond_the_retention_horizon(aged: Corpus, before_epoch: int):
    """Epoch 2 is current and retention is 1 epoch: only epoch 0 may be summarized, and only entries before
    the `epoch` entry that closes it (seq 7)."""
    pinned = _note(aged)
    seq = _operator_summary(aged, data_class="public", before_epoch=before_epoch,
                            retired=[_retired(aged, 2, [2, 5, 8])], redact=True, spend_u=20_000)
    _fails(_verify(aged.url, pinned), "bad_summary", seq)


@pytest.mark.parametrize("field", ["spend_u", "withdrawn", "records", "data_sha256", "entry_seqs"])
def test_8_every_aggregate_is_checked_while_the_bodies_are_present(aged: Corpus, field: str):
    retired = _retired(aged, 1, [1, 4, 6], withdraw_seq=6)
    overrides: dict = {"spend_u": 10_000}
    if field in ("spend_u", "withdrawn"):
        overrides[field] = 0
    elif field == "entry_seqs":
        retired["entry_seqs"] = [1, 4]  # the withdrawal left out: gone would look as if it never withdrew
        retired["withdraw_seq"] = None
    else:
        retired[field] = 1 if field == "records" else bytes(32)
    seq = _operator_summary(aged, data_class="public", before_epoch=1, retired=[retired], redact=False, **overrides)
    report = _verify(aged.url, _note(aged))
    _fails(report, "bad_summary", seq)
    assert field in report.error.detail


# -- the summary's nested shape -----------------------------------------------------------


@pytest.mark.parametrize("change", [
    lambda r: r.update(extra=1),
    lambda r: r.pop("records"),
    lambda r: r.update(data_sha256=bytes(31)),
    lambda r: r.update(withdraw_seq="6"),
    lambda r: r.update(entry_seqs=[1, "4"]),
    lambda r: r.update(entry_seqs=[1, -4]),
], ids=["unknown_field", "missing_field", "short_digest", "withdraw_seq_text", "entry_seq_text", "negative_seq"])
def test_a_malformed_retired_map_is_a_bad_entry(aged: Corpus, change):
    from govtrain.ledger.entries import decode_entry

    retired = _retired(aged, 1, [1, 4, 6], withdraw_seq=6)
    change(retired)
    seq = _operator_summary(aged, data_class="public", before_epoch=1, retired=[retired], redact=False,
                            seqs=[1, 4, 6], spend_u=10_000)
    with aged.open() as ledger:
        body = ledger.store.entry(seq).body
    with pytest.raises(IntegrityError) as info:
        decode_entry(body, seq=seq, kind="summary")
    assert info.value.code.value == "bad_entry"
    _fails(_verify(aged.url), "bad_entry", seq)
