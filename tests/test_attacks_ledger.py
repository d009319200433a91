"""Review items 3, 4, 5, 9 and 12: attacks on the ledger that `govtrain-verify` once passed.

Each test names its adversary: a database writer without keys (edits any table, drops the
triggers), or an operator with the ledger key against an auditor who pinned a checkpoint. Every
refusal asserts that nothing changed (size, head, admissions)."""

from __future__ import annotations

import dataclasses
import sqlite3
from pathlib import Path

import pytest

import ledger_store
from govtrain.attest.keys import generate_key_pair, load_private_key, load_public_key
from govtrain.errors import GovtrainError, IntegrityError
from govtrain.gate.gate import Gate
from govtrain.ledger.checkpoint import sign_checkpoint
from govtrain.ledger.entries import admit_entry, policy_entry
from govtrain.ledger.ledger import Ledger
from govtrain.ledger.merkle import root_of
from govtrain.policy.model import Attester, LedgerKey
from govtrain.verify.verifier import inspect_ledger, verify_ledger
from tests.conftest import Corpus, TEST_POLICY, append_runs, make_corpus, record_spend, snapshot
from tests.test_signed_ledger import _admit, _copy, _db, _latest_note, _sql, _verify_cli, real  # noqa: F401


def _raw_append(url: str, kind: str, body_at, time: int, *, signer, name: str) -> int:
    """Write an entry and a checkpoint over the whole tree straight into the file, signed by `signer`: what
    someone with file access and a key of their own (or the operator, bypassing the library) can do."""
    db = _db(url)
    connection = sqlite3.connect(db)
    seq = connection.execute("SELECT max(seq) + 1 FROM entries").fetchone()[0]
    connection.close()
    body = body_at(seq)
    _sql(db, "INSERT INTO entries (seq, kind, time, leaf_hash, body) VALUES (?, ?, ?, ?, ?)",
         params=(seq, kind, time, ledger_store.leaf_hash(body), body))
    connection = sqlite3.connect(db)
    leaves = [row[0] for row in connection.execute("SELECT leaf_hash FROM entries ORDER BY seq")]
    connection.close()
    note = sign_checkpoint("test.invalid/govtrain/1", len(leaves), root_of(leaves), signer, name).note
    _sql(db, "INSERT INTO checkpoints (size, root, note, time) VALUES (?, ?, ?, ?)",
         params=(len(leaves), root_of(leaves), note, time))
    return seq


# -- 3. a policy change authorised only by the key it introduces ----------------------------------------

def test_takeover_by_a_policy_signed_only_with_the_new_key_is_refused(real: Corpus, tmp_path: Path):
    """A database writer without the ledger key and without any attester key lists its own keys in a new
    policy (keeping the old ledger key, so pinned checkpoints still verify), lowers the floors, and admits a
    contribution with sigma 0.01 and a budget of 999."""
    pinned = tmp_path / "pinned.note"
    pinned.write_text(_latest_note(real.url))
    generate_key_pair(tmp_path, "evil-ledger")
    generate_key_pair(tmp_path, "evil-attester")
    with Ledger.open(real.url) as ledger:
        policy = ledger.policy
    evil_name = "evil.invalid/ledger"
    loose_class = dataclasses.replace(policy.classes["public"], min_noise_multiplier_u=10_000,
                                      max_eps_budget_u=999_000_000, clip_norm_u=4_000_000)
    evil = dataclasses.replace(
        policy, floor_min_noise_multiplier_u=10_000, classes={**policy.classes, "public": loose_class},
        ledger_keys=(*policy.ledger_keys, LedgerKey(name=evil_name,
                                                    public_key=load_public_key(tmp_path / "evil-ledger.pub"))),
        attesters=(*policy.attesters, Attester(name="evil", public_key=load_public_key(tmp_path / "evil-attester.pub"),
                                               classes=frozenset({"public"}))))
    signer = load_private_key(tmp_path / "evil-ledger.key")
    seq = _raw_append(real.url, "policy", lambda s: policy_entry(s, real.now, evil, bytes(32), "more keys"), real.now,
                      signer=signer, name=evil_name)
    data = real.data("stolen.jsonl")
    raw = real.attestation(data, key=load_private_key(tmp_path / "evil-attester.key"), contribution_id="stolen",
                           noise_multiplier_u=10_000, eps_budget_u=999_000_000, clip_norm_u=4_000_000)
    verified = Gate(evil).verify(raw, now=real.now)
    _raw_append(real.url, "admit", lambda s: admit_entry(s, real.now, verified), real.now, signer=signer, name=evil_name)

    for extra in ((), ("--trusted-checkpoint", str(pinned)), ("--integrity-only",),
                  ("--integrity-only", "--trusted-checkpoint", str(pinned))):
        exit_code, report, _ = _verify_cli(real.url, *extra)
        assert (exit_code, report["code"], report["first_bad_entry"]) == (4, "policy_unauthorised", seq), (extra, report)
    with pytest.raises(IntegrityError) as info:  # the operator's own tools will not work on top of it either
        Ledger.open(real.url)
    assert info.value.code.value == "policy_unauthorised"


def _rotate(corpus: Corpus, tmp_path: Path, *, keep_old: bool) -> None:
    generate_key_pair(tmp_path, "next")
    with corpus.open() as ledger:
        fresh = LedgerKey(name="test.invalid/next", public_key=load_public_key(tmp_path / "next.pub"))
        keys = (*ledger.policy.ledger_keys, fresh) if keep_old else (fresh,)
        ledger.change_policy(dataclasses.replace(ledger.policy, ledger_keys=keys), bytes(32), "rotation",
                             now=corpus.now, key=tmp_path / "next.key")


@pytest.mark.parametrize("keep_old", [True, False])
def test_genuine_rotation_verifies_with_and_without_a_checkpoint_pinned_before_it(real: Corpus, tmp_path: Path,
                                                                                   keep_old: bool):
    pinned = tmp_path / "before.note"
    pinned.write_text(_latest_note(real.url))
    _rotate(real, tmp_path, keep_old=keep_old)
    _admit(real, "after-rotation")
    after = tmp_path / "after.note"
    after.write_text(_latest_note(real.url))
    with Ledger.open(real.url) as ledger:
        covering = ledger.store.checkpoint_covering(11).note
    assert covering.count("\u2014 ") == 2  # the old key and the new key both signed the change
    for extra in ((), ("--trusted-checkpoint", str(pinned)), ("--trusted-checkpoint", str(pinned),
                                                              "--trusted-checkpoint", str(after)),
                  ("--integrity-only", "--trusted-checkpoint", str(pinned))):
        exit_code, report, _ = _verify_cli(real.url, *extra)
        assert exit_code == 0, (extra, report)


def test_a_policy_change_may_not_rename_the_ledger(real: Corpus):
    before = snapshot(real.url)
    with real.open() as ledger:
        with pytest.raises(GovtrainError) as info:
            ledger.change_policy(dataclasses.replace(ledger.policy, origin="elsewhere.invalid/1"), bytes(32), "move",
                                 now=real.now)
    assert info.value.code.value == "policy_invalid" and snapshot(real.url) == before


# -- 5. the signer signs whatever tree the database holds ----------------------------------------------

def test_signer_refuses_a_rewritten_entry_whose_later_checkpoints_were_removed(real: Corpus):
    """A database writer without the key swaps the withdraw entry (7) for another entry, deletes its
    withdrawals row and the checkpoints that signed it, and waits for the operator's next honest write."""
    from govtrain.ledger.entries import epoch_entry

    _sql(_db(real.url), "DELETE FROM withdrawals", "DELETE FROM checkpoints WHERE size > 7")
    body = epoch_entry(7, real.now, 1)  # any well-formed entry in place of the withdrawal
    _sql(_db(real.url), "UPDATE entries SET kind = 'epoch', body = ?, leaf_hash = ? WHERE seq = 7",
         params=(body, ledger_store.leaf_hash(body)))
    before = snapshot(real.url)
    with pytest.raises(IntegrityError) as info:
        _admit(real, "honest-next")
    assert info.value.code.value == "fork" and snapshot(real.url) == before
    with pytest.raises(IntegrityError) as info:
        with real.open() as ledger:
            ledger.checkpoint(now=real.now)
    assert info.value.code.value == "fork" and snapshot(real.url) == before
    exit_code, report, _ = _verify_cli(real.url)  # and the verifier does not call the tampered ledger OK
    assert exit_code == 4


def test_signer_refuses_a_database_rolled_back_under_it(real: Corpus, tmp_path: Path):
    older = _copy(real.url, tmp_path / "older.db")
    _admit(real, "newer")
    _copy(older, _db(real.url))  # a writer without keys restores yesterday's file
    before = snapshot(real.url)
    with pytest.raises(IntegrityError) as info:
        _admit(real, "after-restore")
    assert info.value.code.value == "rollback" and snapshot(real.url) == before


def test_signer_refuses_a_corrupted_subtree_hash(corpus: Corpus):
    """`tree_nodes` caches perfect subtrees (256 leaves and up) and the triggers allow inserts: a bad row
    once made the key sign a wrong root, after which the ledger never verified again."""
    with corpus.open() as ledger:
        append_runs(ledger, 300, corpus.now)
    _sql(_db(corpus.url), "UPDATE tree_nodes SET hash = zeroblob(32) WHERE height = 8 AND idx = 0")
    before = snapshot(corpus.url)
    with pytest.raises(IntegrityError) as info:
        with corpus.open() as ledger:
            ledger.close_epoch(now=corpus.now)
    assert info.value.code.value == "fork" and snapshot(corpus.url) == before
    assert verify_ledger(corpus.url).ok  # the ledger itself is intact: only the cache was bad


def test_signer_catches_up_through_signed_checkpoints_it_did_not_record(real: Corpus, tmp_path: Path, monkeypatch):
    """Two signers of one ledger (another machine with the same key): each catches up on the other's signed
    writes; neither needs the other's record."""
    monkeypatch.setenv("GOVTRAIN_SIGNER_STATE", str(tmp_path / "machine-b"))
    _admit(real, "from-b")  # machine B: first use, checks the database against its latest checkpoint
    monkeypatch.delenv("GOVTRAIN_SIGNER_STATE")
    _admit(real, "from-a")  # machine A: its record says 11; entries 11.. are covered by B's signed checkpoint
    assert verify_ledger(real.url).admissions == 8


def test_fork_error_names_where_the_entries_differ(real: Corpus, tmp_path: Path, monkeypatch):
    early = tmp_path / "early.note"
    early.write_text(_latest_note(real.url))  # 11 entries
    fork_url = _copy(real.url, tmp_path / "fork.db")
    _admit(real, "a-1")
    _admit(real, "a-2")
    trusted = tmp_path / "trusted.note"
    trusted.write_text(_latest_note(real.url))  # 13 entries of ledger A
    monkeypatch.setenv("GOVTRAIN_SIGNER_STATE", str(tmp_path / "second-signer"))
    fork = Corpus(real.dir, real.policy_path, fork_url, real.attester, real.limited, real.now)
    _admit(fork, "b-1")
    _admit(fork, "b-2")
    exit_code, report, _ = _verify_cli(fork_url, "--trusted-checkpoint", str(early), "--trusted-checkpoint",
                                       str(trusted))
    assert (exit_code, report["code"], report["first_bad_entry"]) == (4, "fork", 11)
    assert "entries 11..12" in report["detail"]


# -- 9. entry times may go backwards -------------------------------------------------------------------

def test_backdated_admission_of_an_expired_attestation_is_refused_and_flagged(real: Corpus):
    """The operator admits an attestation that expired 10 days ago by dating its entry before the expiry."""
    data = real.data("expired.jsonl")
    raw = real.attestation(data, contribution_id="expired", not_before=real.now - 40 * 86_400,
                           issued_at=real.now - 40 * 86_400, not_after=real.now - 10 * 86_400)
    backdated = real.now - 20 * 86_400
    before = snapshot(real.url)
    with real.open() as ledger:  # through the library: refused, nothing written
        verified = Gate(ledger.policy).verify(raw, now=backdated)
        with pytest.raises(GovtrainError) as info:
            with ledger.append(backdated) as appender:
                appender.add("admit", backdated, lambda seq: admit_entry(seq, backdated, verified))
    assert info.value.code.value == "clock_behind" and snapshot(real.url) == before
    seq = _raw_append(real.url, "admit", lambda s: admit_entry(s, backdated, verified), backdated,
                      signer=load_private_key(real.dir / "ledger.key"), name="test.invalid/govtrain/1")
    exit_code, report, _ = _verify_cli(real.url)  # around the library, with the key: the verifier names it
    assert (exit_code, report["code"], report["first_bad_entry"]) == (4, "time_reversed", seq)


def test_a_writer_slightly_behind_dates_its_entries_with_the_last_time(real: Corpus):
    """An honest writer that waited for the lock behind a later-dated write (within the policy's clock
    skew) dates its entry with the last entry's time, never before it."""
    with real.open() as ledger:
        epoch = ledger.close_epoch(now=real.now + 30)
        assert epoch == 3
        ledger.close_epoch(now=real.now)  # 30 s behind, skew is 60 s
        assert ledger.store.head().time == real.now + 30
    assert verify_ledger(real.url).ok


# -- 4. the sampling rate under an expected-batch-size policy -----------------------------------------------

BATCH_POLICY = TEST_POLICY.replace("sampling_rate = 0.01", "expected_batch_size = 4")


@pytest.fixture
def batched(tmp_path: Path) -> Corpus:
    corpus = make_corpus(tmp_path, f"sqlite:///{tmp_path / 'batched.db'}", BATCH_POLICY)
    for name in ("b-0", "b-1"):
        data = corpus.data(f"{name}.jsonl", records=10)
        from govtrain.gate.admission import admit

        with corpus.open() as ledger:
            admit(ledger, corpus.attestation(data, contribution_id=name), data, now=corpus.now)
    return corpus  # 20 live records: q >= 4 / 20 = 0.2


def test_record_spend_refuses_a_sampling_rate_below_the_expected_batch_over_live_records(batched: Corpus):
    before = snapshot(batched.url)
    with batched.open() as ledger:
        with pytest.raises(GovtrainError) as info:
            record_spend(ledger, 0, 1, [("b-0", 10, 1_000_000, 10_000)], run_id="r", epoch_steps=10, now=batched.now)
        assert info.value.code.value == "bad_argument" and "below 200000" in info.value.detail
        assert snapshot(batched.url) == before
        record_spend(ledger, 0, 200_000, [("b-0", 10, 1_000_000, 4_000_000)], run_id="r", epoch_steps=10,
                            now=batched.now)


def test_verifier_flags_a_spend_at_a_rate_no_run_could_sample(batched: Corpus):
    """The operator records q = 1e-6 with a matching tiny epsilon; no run samples below B / records."""
    from tests.test_signed_ledger import _spend

    _spend(batched, "b-0", eps_u=9_900, q_u=1, steps=10)
    exit_code, report, _ = _verify_cli(batched.url, "--skip-spend")
    assert (exit_code, report["code"]) == (4, "bad_spend") and "below 200000" in report["detail"]


def test_the_rate_floor_rises_when_a_contribution_withdraws(batched: Corpus):
    with batched.open() as ledger:
        ledger.withdraw("b-1", "leaving", now=batched.now)  # 10 live records: q >= 0.4
        with pytest.raises(GovtrainError) as info:
            record_spend(ledger, 0, 200_000, [("b-0", 10, 1_000_000, 4_000_000)], run_id="r", epoch_steps=10,
                                now=batched.now)
    assert "below 400000" in info.value.detail


# -- 12. spend steps unbounded below --------------------------------------------------------------------

@pytest.mark.parametrize("steps, epoch_steps", [(0, 10), (10, 11), (0, 0)])
def test_record_spend_refuses_steps_outside_the_epoch(corpus: Corpus, steps: int, epoch_steps: int):
    _admit(corpus, "a")
    before = snapshot(corpus.url)
    with corpus.open() as ledger:
        with pytest.raises(GovtrainError) as info:
            record_spend(ledger, 0, 10_000, [("a", steps, 1_000_000, 10_000)], run_id="r", epoch_steps=epoch_steps,
                                now=corpus.now)
    assert info.value.code.value == "bad_argument" and snapshot(corpus.url) == before


def test_verifier_flags_one_step_charged_for_a_full_epoch_by_a_contribution_that_did_not_retire(real: Corpus):
    from govtrain.verify.verifier import recorded_accountant
    from tests.test_signed_ledger import _spend

    _spend(real, "late-0", eps_u=300_000, steps=1, epoch_steps=10)  # budget 5: far from retiring
    assert verify_ledger(real.url, accountant=None).ok  # the shape alone is allowed (a retiring spend looks so)
    with pytest.raises(IntegrityError) as info:
        verify_ledger(real.url, accountant=recorded_accountant)
    assert info.value.code.value == "bad_spend" and "only a retiring contribution" in info.value.detail


@pytest.mark.parametrize("case", ["zero_steps", "epoch_longer_than_policy", "second_run_in_epoch",
                                  "charged_after_retiring", "run_epoch_after_short_last"])
def test_verifier_flags_spend_that_breaks_the_epoch_rules(real: Corpus, case: str):
    from tests.test_signed_ledger import _spend

    if case == "zero_steps":
        _spend(real, "late-0", eps_u=1, steps=0)
    elif case == "epoch_longer_than_policy":
        _spend(real, "late-0", eps_u=1, steps=11, epoch_steps=11)
    elif case == "second_run_in_epoch":
        _spend(real, "late-0", eps_u=200_000, run_id="run-a")
        _spend(real, "middle-0", eps_u=200_000, run_id="run-b")
    else:
        _spend(real, "late-0", eps_u=200_000, steps=3, epoch_steps=5 if case == "run_epoch_after_short_last" else 10,
               run_id="run-a")
        with real.open() as ledger:
            ledger.close_epoch(now=real.now)
        other = "middle-0" if case == "run_epoch_after_short_last" else "late-0"
        _spend(real, other, eps_u=400_000, run_id="run-a" if case == "run_epoch_after_short_last" else "run-b")
    exit_code, report, _ = _verify_cli(real.url, "--skip-spend")
    assert (exit_code, report["code"]) == (4, "bad_spend"), report
    assert report["first_bad_entry"] == snapshot(real.url)[0] - 1


def test_a_proof_built_from_altered_stored_hashes_is_never_handed_out(real: Corpus):
    """A database writer without keys alters a stored leaf hash that a contributor's proof passes through:
    `prove` checks what it built against the signed checkpoint and refuses instead of giving a bad proof."""
    _sql(_db(real.url), "UPDATE entries SET leaf_hash = zeroblob(32) WHERE seq = 3")
    with real.open() as ledger:
        with pytest.raises(IntegrityError) as info:
            ledger.prove("early-0")  # entry 1: its proof hashes leaves 2 and 3 together
    assert info.value.code.value == "fork"


def test_the_rate_floor_counts_retired_contributions_as_their_summaries_commit(tmp_path: Path):
    """Compaction drops a retired contribution's admit body; the writer and the verifier both still count its
    records (from the summary) among the contributions admitted and not withdrawn, so they agree on the floor."""
    from govtrain.gate.admission import admit

    corpus = make_corpus(tmp_path, f"sqlite:///{tmp_path / 'retired.db'}", BATCH_POLICY)
    for name in ("gone", "kept", "idle"):
        data = corpus.data(f"{name}.jsonl", records=3)
        with corpus.open() as ledger:
            admit(ledger, corpus.attestation(data, contribution_id=name), data, now=corpus.now)
    with corpus.open() as ledger:  # 9 live records: q >= 4/9
        record_spend(ledger, 0, 444_445, [("gone", 10, 1_000_000, 1_000_000), ("kept", 10, 1_000_000, 1_000_000)],
                            run_id="r", epoch_steps=10, now=corpus.now)
        ledger.withdraw("gone", "leaving", now=corpus.now)  # 6 live records: q >= 4/6
        ledger.close_epoch(now=corpus.now)
        record_spend(ledger, 1, 666_667, [("kept", 10, 1_000_000, 2_000_000)], run_id="r", epoch_steps=10,
                            now=corpus.now)
        ledger.close_epoch(now=corpus.now)
        redacted = ledger.compact(1, now=corpus.now)  # retires gone (withdrawn) and idle (3 records, live)
        assert {ledger.store.entry(s.seq).body for s in redacted} == {None}
        before = snapshot(corpus.url)
        with pytest.raises(GovtrainError) as info:
            record_spend(ledger, 2, 600_000, [("kept", 10, 1_000_000, 3_000_000)], run_id="r", epoch_steps=10,
                                now=corpus.now)
        assert "below 666667" in info.value.detail and snapshot(corpus.url) == before
        record_spend(ledger, 2, 666_667, [("kept", 10, 1_000_000, 3_000_000)], run_id="r", epoch_steps=10,
                            now=corpus.now)
    assert verify_ledger(corpus.url, accountant=None).ok


# -- issue 20 review: what the writer reads from a database it did not sign -------------------------------------


def test_a_spend_body_nulled_outside_any_summary_stops_the_writer_and_the_planner(corpus: Corpus):
    """Review finding F5: a database writer without keys NULLs a spend body. The writer used to skip it, and
    then charged a budget-retired contribution again (and the planner planned from a shortened history)."""
    from govtrain.resolver.plan import read_corpus
    from tests.test_signed_ledger import _admit as admit_one
    from tests.test_signed_ledger import _db

    admit_one(corpus, "c1")
    with Ledger.open(corpus.url) as ledger:
        record_spend(ledger, 0, 10_000, [("c1", 10, 1_000_000, 389_908)], epoch_steps=10, now=corpus.now)
        ledger.close_epoch(now=corpus.now)
        seq = ledger.size() - 2
    _sql(_db(corpus.url), f"UPDATE entries SET body = NULL WHERE seq = {seq}")
    before = snapshot(corpus.url)
    with Ledger.open(corpus.url) as ledger:
        for act in (lambda: record_spend(ledger, 1, 10_000, [("c1", 10, 1_000_000, 389_908)], epoch_steps=10,
                                         now=corpus.now, run_nonce=bytes(16)),
                    lambda: read_corpus(ledger)):
            with pytest.raises(IntegrityError) as refused:
                act()
            assert refused.value.code.value == "bad_summary"
    assert snapshot(corpus.url) == before


def test_an_edited_header_or_policy_entry_is_never_read_as_the_policy(corpus: Corpus):
    """Review finding F6: `Ledger.open` decoded the header without checking it against its signed leaf, so a
    database writer that rewrote delta to 0.05 had the writer account (and sign) spend at it."""
    from govtrain.encoding import cbor
    from tests.test_signed_ledger import _db

    with Ledger.open(corpus.url) as ledger:
        ledger.change_policy(dataclasses.replace(ledger.policy, retention_epochs=3), bytes(32), "longer",
                             now=corpus.now)
        policy_seq = ledger.size() - 1
    for seq in (0, policy_seq):
        connection = sqlite3.connect(_db(corpus.url))
        body = connection.execute("SELECT body FROM entries WHERE seq = ?", (seq,)).fetchone()[0]
        connection.close()
        entry = cbor.decode(body)
        entry["policy"]["delta_p"] = 50_000_000_000
        _sql(_db(corpus.url), "UPDATE entries SET body = ? WHERE seq = " + str(seq), params=(cbor.encode(entry),))
        with pytest.raises(IntegrityError) as refused:
            Ledger.open(corpus.url)
        assert refused.value.code.value == "leaf_hash_mismatch"
        _sql(_db(corpus.url), "UPDATE entries SET body = ? WHERE seq = " + str(seq), params=(body,))


def test_the_prv_accountant_never_states_a_negative_epsilon():
    """At a large delta prv-accountant's upper bound can come out negative (-0.041 at delta 0.05 for 10 steps at
    q 0.01, sigma 1): that is an unreliable bound, answered by the PLD fallback, never a negative charge."""
    from govtrain.accounting.accountants import PRVAccountant
    from govtrain.accounting import Bucket

    result = PRVAccountant().epsilon([Bucket(0.01, 1.0, 10)], 0.05)
    assert result.epsilon_u == 0 and result.fallback.startswith("pld (prv-accountant bounds are unreliable")


@pytest.mark.parametrize("kind", ["spend", "admit"])
def test_a_body_edited_in_place_is_never_read_by_the_writer_or_the_planner(corpus: Corpus, kind: str):
    """Second review, M1: the fix for a nulled body could be bypassed by editing the body instead (a retiring
    spend rewritten as one full step, a signed budget raised): the writer and the planner read bodies without
    checking them against their signed leaves, and the writer signed spend over the budget."""
    from govtrain.encoding import cbor
    from govtrain.resolver.plan import read_corpus
    from tests.test_signed_ledger import _admit as admit_one
    from tests.test_signed_ledger import _db

    seq = admit_one(corpus, "c1", eps_budget_u=400_000)
    with Ledger.open(corpus.url) as ledger:
        record_spend(ledger, 0, 10_000, [("c1", 10, 1_000_000, 389_908)], epoch_steps=10, now=corpus.now)
        ledger.close_epoch(now=corpus.now)
        if kind == "spend":
            seq = ledger.size() - 2
    connection = sqlite3.connect(_db(corpus.url))
    body = connection.execute("SELECT body FROM entries WHERE seq = ?", (seq,)).fetchone()[0]
    connection.close()
    entry = cbor.decode(body)
    entry.update({"steps": 1, "epoch_steps": 1, "eps_u": 120_000} if kind == "spend" else {"eps_budget_u": 9_000_000})
    _sql(_db(corpus.url), f"UPDATE entries SET body = ? WHERE seq = {seq}", params=(cbor.encode(entry),))
    before = snapshot(corpus.url)
    with Ledger.open(corpus.url) as ledger:
        for act in (lambda: record_spend(ledger, 1, 10_000, [("c1", 1, 1_000_000, 399_000)], epoch_steps=10,
                                         now=corpus.now),
                    lambda: read_corpus(ledger)):
            with pytest.raises(IntegrityError) as refused:
                act()
            assert refused.value.code.value == "leaf_hash_mismatch"
    assert snapshot(corpus.url) == before


def test_a_withdrawal_row_without_a_withdraw_entry_does_not_trap_a_run(corpus: Corpus):
    """Second review, L1: a database writer without keys inserted a `withdrawals` index row with no withdraw
    entry, and the run re-planned forever (the re-plan read the index, planning read the entries). The run
    reads withdrawals from the entries; the verifier names the forged row."""
    pytest.importorskip("transformers")
    from govtrain.train.config import load_run_config
    from govtrain.train.loop import train
    from tests.test_signed_ledger import _db
    from tests.test_train import _admit as admit_data, _config, save_tiny_bert

    admit_data(corpus, "pub")
    _sql(_db(corpus.url), "INSERT INTO withdrawals (contribution_id, seq) VALUES ('pub', 999)")
    lines: list[str] = []
    (corpus.dir.parent / "tiny").mkdir()
    model = save_tiny_bert(corpus.dir.parent / "tiny")
    result = train(load_run_config(_config(corpus, model, 12)), corpus.url, insecure_seed=1, log=lines.append)
    assert result.steps == 12 and not any("planning the epoch again" in line for line in lines)
    report = inspect_ledger(corpus.url)
    assert report.error.code.value == "index_mismatch"
