"""The signed ledger: tamper matrix, rollback and fork, withdrawal, retention, proofs, status."""

from __future__ import annotations

import base64
import json
import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import ledger_store
from govtrain.cli.main import cli
from govtrain.cli.verify import verify_cli
from govtrain.encoding import cbor
from govtrain.errors import IntegrityError
from govtrain.gate.admission import admit
from govtrain.ledger.checkpoint import sign_checkpoint
from govtrain.ledger.ledger import Ledger
from govtrain.verify.verifier import verify_ledger
from tests.conftest import Corpus, append_runs, snapshot, lease, noise_groups_for

ORIGIN = "test.invalid/govtrain/1"  # TEST_POLICY's origin


def _db(url: str) -> Path:
    return Path(url.removeprefix("sqlite:///"))


def _copy(url: str, target: Path) -> str:
    source, copy = sqlite3.connect(_db(url)), sqlite3.connect(target)
    source.backup(copy)  # consistent, WAL included
    source.close()
    copy.close()
    return f"sqlite:///{target}"


def _admit(corpus: Corpus, name: str, **overrides) -> int:
    data = corpus.data(f"{name}.jsonl")
    with corpus.open() as ledger:
        return admit(ledger, corpus.attestation(data, contribution_id=name, **overrides), data, now=corpus.now).seq


@pytest.fixture
def real(corpus: Corpus) -> Corpus:
    """A ledger with admissions over three epochs and one withdrawal: 11 entries, 11 checkpoints."""
    for i in range(3):
        _admit(corpus, f"early-{i}")
    with corpus.open() as ledger:
        ledger.close_epoch(now=corpus.now)
    _admit(corpus, "middle-0")
    _admit(corpus, "middle-1", data_class="sensitive", clip_norm_u=500_000, eps_budget_u=3_000_000)
    with corpus.open() as ledger:
        ledger.withdraw("early-1", "asked to leave", now=corpus.now)
        ledger.close_epoch(now=corpus.now)
    _admit(corpus, "late-0")
    with corpus.open() as ledger:
        ledger.close_epoch(now=corpus.now)
    return corpus


def _verify_cli(url: str, *extra: str) -> tuple[int, dict, str]:
    result = CliRunner().invoke(verify_cli, ["--ledger", url, "--json", *extra])
    return result.exit_code, json.loads(result.stdout), result.stderr


def test_real_ledger_verifies(real: Corpus):
    report = verify_ledger(real.url)
    assert report.entries == 11 and report.checkpoints == 11 and report.epochs == 3
    assert (report.admissions, report.withdrawals) == (6, 1)
    code, body, _ = _verify_cli(real.url)
    assert code == 0 and body["ok"]


def _sql(db: Path, *statements: str, params: tuple = ()) -> None:
    connection = sqlite3.connect(db)
    for name in [r[0] for r in connection.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'")]:
        connection.execute(f"DROP TRIGGER {name}")  # an attacker with file access drops the triggers first
    for statement in statements:
        connection.execute(statement, params) if params else connection.execute(statement)
    connection.commit()
    connection.close()


def _row(db: Path, seq: int) -> tuple[bytes, bytes]:
    connection = sqlite3.connect(db)
    body, leaf = connection.execute("SELECT body, leaf_hash FROM entries WHERE seq = ?", (seq,)).fetchone()
    connection.close()
    return body, leaf


def _flip_byte(db: Path) -> None:
    body, _ = _row(db, 4)
    changed = bytearray(body)
    changed[30] ^= 1
    _sql(db, "UPDATE entries SET body = ? WHERE seq = 4", params=(bytes(changed),))


def _delete(db: Path) -> None:
    _sql(db, "DELETE FROM admissions WHERE seq = 5", "DELETE FROM entries WHERE seq = 5")


def _swap(db: Path) -> None:
    body5, leaf5 = _row(db, 5)
    body6, leaf6 = _row(db, 6)
    _sql(db, "UPDATE entries SET leaf_hash = zeroblob(32) WHERE seq = 5")
    _sql(db, "UPDATE entries SET body = ?, leaf_hash = ? WHERE seq = 6", params=(body5, leaf5))
    _sql(db, "UPDATE entries SET body = ?, leaf_hash = ? WHERE seq = 5", params=(body6, leaf6))


def _truncate(db: Path) -> None:
    _sql(db, "DELETE FROM admissions WHERE seq >= 9", "DELETE FROM entries WHERE seq >= 9")


def _append_forged(db: Path) -> None:
    body = cbor.encode({"v": 1, "seq": 11, "kind": "epoch", "time": 4_000_000_000, "epoch": 3})
    _sql(db, "INSERT INTO entries (seq, kind, time, leaf_hash, body) VALUES (11, 'epoch', 4000000000, ?, ?)",
         params=(ledger_store.leaf_hash(body), body))


def _replace_root(db: Path) -> None:
    connection = sqlite3.connect(db)
    note, = connection.execute("SELECT note FROM checkpoints WHERE size = 6").fetchone()
    connection.close()
    lines = note.split("\n")
    lines[2] = base64.b64encode(b"\x07" * 32).decode()
    _sql(db, "UPDATE checkpoints SET note = ?, root = ? WHERE size = 6", params=("\n".join(lines), b"\x07" * 32))


def _resign_with_other_key(db: Path) -> None:
    connection = sqlite3.connect(db)
    size, root = connection.execute("SELECT size, root FROM checkpoints WHERE size = 8").fetchone()
    connection.close()
    forged = sign_checkpoint("test.invalid/govtrain/1", size, root, Ed25519PrivateKey.generate())
    _sql(db, "UPDATE checkpoints SET note = ? WHERE size = 8", params=(forged.note,))


TAMPERS = {
    # name: (tamper, code, first_bad_entry, bad_checkpoint-or-None)
    "body_byte_changed": (_flip_byte, "leaf_hash_mismatch", 4, None),
    "entry_deleted": (_delete, "sequence_gap", 5, None),
    "entries_swapped": (_swap, "bad_entry", 5, None),
    "tail_truncated": (_truncate, "truncated", 9, 10),
    "forged_entry_appended": (_append_forged, "unsigned_tail", 11, None),
    "checkpoint_root_replaced": (_replace_root, "bad_checkpoint", 5, 6),
    "checkpoint_signed_by_other_key": (_resign_with_other_key, "bad_checkpoint", 7, 8),
}


@pytest.mark.parametrize("name", sorted(TAMPERS))
def test_tamper_matrix(real: Corpus, tmp_path: Path, name: str):
    tamper, code, seq, checkpoint = TAMPERS[name]
    url = _copy(real.url, tmp_path / "copy.db")
    tamper(_db(url))
    exit_code, report, stderr = _verify_cli(url)
    assert exit_code == 4, report
    assert (report["code"], report["first_bad_entry"]) == (code, seq), report
    if checkpoint is not None:
        assert report["bad_checkpoint"] == checkpoint
    assert stderr.startswith(f"error[{code}]") and stderr.count("\n") == 1


def _latest_note(url: str) -> str:
    with Ledger.open(url) as ledger:
        return ledger.store.latest_checkpoint().note


def test_rollback_is_detected_with_a_newer_trusted_checkpoint(real: Corpus, tmp_path: Path):
    older = _copy(real.url, tmp_path / "older.db")  # the auditor later receives this old copy
    _admit(real, "after-copy")
    trusted = tmp_path / "trusted.note"
    trusted.write_text(_latest_note(real.url))  # the auditor trusts the newer state
    assert _verify_cli(real.url, "--trusted-checkpoint", str(trusted))[0] == 0
    exit_code, report, _ = _verify_cli(older, "--trusted-checkpoint", str(trusted))
    assert (exit_code, report["code"], report["first_bad_entry"]) == (4, "rollback", 11)


def test_fork_is_detected_against_the_same_trusted_checkpoint(real: Corpus, tmp_path: Path, monkeypatch):
    fork_url = _copy(real.url, tmp_path / "fork.db")
    shared = tmp_path / "shared.note"
    shared.write_text(_latest_note(real.url))  # both ledgers agree up to here (11 entries)
    _admit(real, "only-in-a")
    trusted_a = tmp_path / "a.note"
    trusted_a.write_text(_latest_note(real.url))
    fork = Corpus(real.dir, real.policy_path, fork_url, real.attester, real.limited, real.now)
    # The signer remembers signing 12 entries: it will not sign the 11-entry copy forward...
    with pytest.raises(IntegrityError) as refused:
        _admit(fork, "only-in-b")
    assert refused.value.code.value == "rollback"
    # ...so an operator who forks must sign from a second, fresh signer state (another machine).
    monkeypatch.setenv("GOVTRAIN_SIGNER_STATE", str(tmp_path / "second-signer"))
    _admit(fork, "only-in-b")
    # Each ledger verifies on its own...
    assert _verify_cli(fork_url)[0] == 0
    # ...but the fork does not contain what the auditor's trusted checkpoint of ledger A signed.
    exit_code, report, _ = _verify_cli(fork_url, "--trusted-checkpoint", str(shared),
                                       "--trusted-checkpoint", str(trusted_a))
    assert (exit_code, report["code"], report["first_bad_entry"]) == (4, "fork", 11)
    assert report["trusted_checkpoints"] == 2


def test_trusted_checkpoint_from_another_ledger_key_is_refused(real: Corpus, tmp_path: Path):
    note = tmp_path / "other.note"
    note.write_text(sign_checkpoint("test.invalid/govtrain/1", 3, b"\x01" * 32, Ed25519PrivateKey.generate()).note)
    exit_code, report, _ = _verify_cli(real.url, "--trusted-checkpoint", str(note))
    assert (exit_code, report["code"]) == (4, "fork")


# -- withdrawal -------------------------------------------------------------------------


def test_withdraw_cli(real: Corpus):
    runner = CliRunner()
    result = runner.invoke(cli, ["withdraw", "middle-0", "--ledger", real.url, "--reason", "consent revoked",
                                 "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["seq"] == 11
    before = snapshot(real.url)
    for contribution in ("middle-0", "nobody"):
        result = runner.invoke(cli, ["withdraw", contribution, "--ledger", real.url, "--reason", "again", "--json"])
        assert result.exit_code == 3
        assert json.loads(result.stdout)["code"] == ("already_withdrawn" if contribution == "middle-0"
                                                     else "unknown_contribution")
        assert snapshot(real.url) == before
    report = verify_ledger(real.url)
    assert report.withdrawals == 2
    status = json.loads(runner.invoke(cli, ["ledger", "status", "--ledger", real.url, "--contribution",
                                            "middle-0", "--json"]).stdout)
    assert status["withdrawn_seq"] == 11 and status["admit_seq"] == 5


def test_withdrawal_never_touches_earlier_entries(real: Corpus):
    with Ledger.open(real.url) as ledger:
        before = [(e.seq, e.leaf_hash, e.body) for e in ledger.store.entries()]
        ledger.withdraw("late-0", "bye", now=real.now)
        after = [(e.seq, e.leaf_hash, e.body) for e in ledger.store.entries()]
    assert after[: len(before)] == before and len(after) == len(before) + 1


# -- retention --------------------------------------------------------------------------


def test_compaction_keeps_every_root_and_proof(real: Corpus, tmp_path: Path):
    old_note = tmp_path / "before.note"
    old_note.write_text(_latest_note(real.url))
    proof_before = CliRunner().invoke(cli, ["ledger", "prove", "late-0", "--ledger", real.url]).stdout
    result = CliRunner().invoke(cli, ["ledger", "compact", "--ledger", real.url, "--before-epoch", "2", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["redacted"] == 6  # the 5 admits and 1 withdrawal of epochs 0 and 1
    with Ledger.open(real.url) as ledger:
        redacted = [e.seq for e in ledger.store.entries() if e.body is None]
        kinds = [e.kind for e in ledger.store.entries()][-3:]
    assert redacted == [1, 2, 3, 5, 6, 7] and kinds == ["epoch", "summary", "summary"]  # public, sensitive
    report = verify_ledger(real.url, trusted_checkpoints=[old_note.read_text()])
    assert report.redacted == 6
    # Proofs made before, and after, still verify; a summarized entry can no longer be proven.
    pub = str(real.dir / "ledger.pub")
    proof = tmp_path / "late.proof"
    proof.write_text(proof_before)
    verified = CliRunner().invoke(cli, ["ledger", "verify-proof", str(proof), "--key", pub, "--origin", ORIGIN])
    assert verified.exit_code == 0
    assert CliRunner().invoke(cli, ["ledger", "prove", "late-0", "--ledger", real.url]).exit_code == 0
    gone = CliRunner().invoke(cli, ["ledger", "prove", "early-0", "--ledger", real.url])
    assert gone.exit_code == 3 and "redacted" in gone.stderr


def test_compaction_respects_the_horizon_and_refuses_other_updates(real: Corpus):
    before = snapshot(real.url)
    result = CliRunner().invoke(cli, ["ledger", "compact", "--ledger", real.url, "--before-epoch", "3"])
    assert result.exit_code == 3 and result.stderr.startswith("error[retention_horizon]")
    assert snapshot(real.url) == before
    connection = sqlite3.connect(_db(real.url))
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        connection.execute("UPDATE entries SET body = NULL WHERE seq = 1")  # not summarized: refused
    connection.close()


def test_redacting_more_than_summarized_is_detected(real: Corpus, tmp_path: Path):
    with Ledger.open(real.url) as ledger:
        ledger.compact(2, now=real.now)
    url = _copy(real.url, tmp_path / "copy.db")
    _sql(_db(url), "UPDATE entries SET body = NULL WHERE seq = 9")  # the late admission, never summarized
    exit_code, report, _ = _verify_cli(url)
    assert (exit_code, report["code"], report["first_bad_entry"]) == (4, "bad_entry", 9)


# -- proofs, checkpoints, status --------------------------------------------------------


def test_prove_and_verify_offline(real: Corpus, tmp_path: Path):
    runner = CliRunner()
    out = tmp_path / "p.proof"
    result = runner.invoke(cli, ["ledger", "prove", "middle-1", "--ledger", real.url, "--out", str(out)])
    assert result.exit_code == 0 and result.stdout.startswith("c2sp.org/tlog-proof@v1\nextra ")
    assert "\nindex 6\n" in result.stdout
    pub = str(real.dir / "ledger.pub")
    ok = runner.invoke(cli, ["ledger", "verify-proof", str(out), "--key", pub, "--origin", ORIGIN, "--json"])
    assert ok.exit_code == 0 and json.loads(ok.stdout)["contribution_id"] == "middle-1"
    bad = tmp_path / "bad.proof"
    lines = out.read_text().split("\n")
    lines[3] = base64.b64encode(b"\x00" * 32).decode()
    bad.write_text("\n".join(lines))
    assert runner.invoke(cli, ["ledger", "verify-proof", str(bad), "--key", pub, "--origin", ORIGIN]).exit_code == 4
    other = tmp_path / "other.pub"
    from govtrain.attest.keys import public_key_pem

    other.write_bytes(public_key_pem(Ed25519PrivateKey.generate().public_key()))
    assert runner.invoke(cli, ["ledger", "verify-proof", str(out), "--key", str(other),
                               "--origin", ORIGIN]).exit_code == 4
    mine = real.dir / "mine.cose"
    mine.write_bytes(real.attestation(real.data("x.jsonl")))
    assert runner.invoke(cli, ["ledger", "verify-proof", str(out), "--key", pub, "--origin", ORIGIN,
                               "--attestation", str(mine)]).exit_code == 4
    unknown = runner.invoke(cli, ["ledger", "prove", "nobody", "--ledger", real.url])
    assert unknown.exit_code == 3


def test_checkpoint_command(real: Corpus, tmp_path: Path):
    out = tmp_path / "cp.note"
    result = CliRunner().invoke(cli, ["ledger", "checkpoint", "--ledger", real.url, "--out", str(out)])
    assert result.exit_code == 0 and result.stdout == out.read_text()
    assert result.stdout.startswith("test.invalid/govtrain/1\n11\n")
    assert verify_ledger(real.url).checkpoints == 12


def test_status(real: Corpus):
    result = CliRunner().invoke(cli, ["ledger", "status", "--ledger", real.url, "--json"])
    status = json.loads(result.stdout)
    assert status["entries"] == 11 and status["epoch"] == 3 and status["last_checkpoint"]["size"] == 11
    counts = {name: {k: row[k] for k in ("admitted", "withdrawn", "charged")} for name, row in status["classes"].items()}
    assert counts["public"] == {"admitted": 5, "withdrawn": 1, "charged": 0}
    assert counts["sensitive"] == {"admitted": 1, "withdrawn": 0, "charged": 0}
    assert status["classes"]["public"]["eps_max"] == 0 and status["runs"] == []
    text = CliRunner().invoke(cli, ["ledger", "status", "--ledger", real.url]).stdout
    assert "11 entries, epoch 3" in text and "public" in text


# -- spend: the rules the verifier applies, and the accountant seam ----------------------


def _spend(real: Corpus, contribution: str, *, eps_u: int, epoch: int | None = None, sigma_u: int = 1_000_000,
           steps: int = 10, accountant: str = "prv", q_u: int = 10_000, delta_p: int = 10_000_000,
           run_id: str = "run-a", epoch_steps: int = 10) -> None:
    from govtrain.ledger.entries import spend_entry

    with Ledger.open(real.url) as ledger:
        admission = ledger.store.admission(contribution)
        leaf = ledger.store.entry(admission.seq).leaf_hash
        epoch = ledger.epoch() if epoch is None else epoch
        groups = noise_groups_for(ledger, [contribution])
        with ledger.append(real.now) as appender:
            appender.add("spend", real.now, lambda seq: spend_entry(
                seq, real.now, contribution_id=contribution, admit_leaf=leaf, run_id=run_id, run_nonce=lease(run_id),
                epoch=epoch, epoch_steps=epoch_steps, steps=steps, sampling_rate_u=q_u, noise_multiplier_u=sigma_u,
                accountant=accountant, delta_p=delta_p, privacy_unit="example", eps_u=eps_u, noise_groups=groups))


def _fake_accountant(name: str, delta_p: int, history) -> int:
    """A stand-in with the accountant's signature (issue 4 supplies the real ones): 1000 µε per step."""
    return sum(steps for _, _, steps in history) * 1000


def test_valid_spend_verifies_and_is_recomputed(real: Corpus):
    _spend(real, "late-0", eps_u=10_000)
    with Ledger.open(real.url) as ledger:
        ledger.close_epoch(now=real.now)
    _spend(real, "late-0", eps_u=25_000)
    report = verify_ledger(real.url, accountant=_fake_accountant)
    assert report.spend_recomputed and report.by_kind["spend"] == 2
    status = json.loads(CliRunner().invoke(cli, ["ledger", "status", "--ledger", real.url, "--contribution",
                                                 "late-0", "--json"]).stdout)
    assert status["eps_u"] == 25_000 and [s["epoch"] for s in status["spend"]] == [3, 4]


@pytest.mark.parametrize("case", [
    "over_budget", "refund", "below_signed_sigma", "wrong_accountant", "wrong_delta", "wrong_rate",
    "after_withdrawal", "wrong_epoch", "twice_in_epoch", "under_recomputed",
])
def test_bad_spend_is_named(real: Corpus, case: str):
    if case == "over_budget":
        _spend(real, "late-0", eps_u=5_000_001)
    elif case == "refund":  # the first record over-charges (allowed), the second refunds (not)
        _spend(real, "late-0", eps_u=1_000_000)
        with Ledger.open(real.url) as ledger:
            ledger.close_epoch(now=real.now)
        _spend(real, "late-0", eps_u=900_000)
    elif case == "below_signed_sigma":
        _spend(real, "late-0", eps_u=1, sigma_u=999_999)
    elif case == "wrong_accountant":
        _spend(real, "late-0", eps_u=1, accountant="rdp")
    elif case == "wrong_delta":
        _spend(real, "late-0", eps_u=1, delta_p=20_000_000)
    elif case == "wrong_rate":
        _spend(real, "late-0", eps_u=1, q_u=20_000)
    elif case == "after_withdrawal":
        _spend(real, "early-1", eps_u=1)
    elif case == "wrong_epoch":
        _spend(real, "late-0", eps_u=1, epoch=7)
    elif case == "twice_in_epoch":
        _spend(real, "late-0", eps_u=1_000_000)
        _spend(real, "late-0", eps_u=2_000_000)
    elif case == "under_recomputed":
        _spend(real, "late-0", eps_u=9_999, steps=10)
    report = CliRunner().invoke(verify_cli, ["--ledger", real.url, "--json"]) if case != "under_recomputed" else None
    if report is not None:
        body = json.loads(report.stdout)
        assert (report.exit_code, body["code"]) == (4, "bad_spend"), body
        assert body["first_bad_entry"] == snapshot(real.url)[0] - 1
    else:
        from govtrain.errors import IntegrityError

        verify_ledger(real.url, accountant=None)  # without recomputation the record is consistent
        with pytest.raises(IntegrityError) as info:
            verify_ledger(real.url, accountant=_fake_accountant)
        assert info.value.code.value == "bad_spend"


def test_key_rotation_through_a_policy_entry(real: Corpus, tmp_path: Path):
    import dataclasses

    from govtrain.attest.keys import generate_key_pair, load_public_key
    from govtrain.policy.model import LedgerKey

    generate_key_pair(tmp_path, "next")
    with Ledger.open(real.url) as ledger:
        rotated = dataclasses.replace(ledger.policy, ledger_keys=(
            LedgerKey(name="test.invalid/govtrain/1", public_key=load_public_key(tmp_path / "next.pub")),))
        ledger.change_policy(rotated, bytes(32), "key rotation", now=real.now, key=tmp_path / "next.key")
    _admit(real, "after-rotation")  # signed with the new key, read from the recorded path
    report = verify_ledger(real.url)
    assert report.by_kind["policy"] == 1 and report.admissions == 7
    with Ledger.open(real.url) as ledger:
        assert ledger.policy.ledger_keys == rotated.ledger_keys


INTEGRITY_ONLY = {  # the same tampering, caught without decoding a single entry
    "body_byte_changed": ("leaf_hash_mismatch", 4),
    "entry_deleted": ("sequence_gap", 5),
    "entries_swapped": ("bad_checkpoint", 5),  # leaf hashes moved with their bodies: the roots break
    "tail_truncated": ("truncated", 9),
    "forged_entry_appended": ("unsigned_tail", 11),
    "checkpoint_root_replaced": ("bad_checkpoint", 5),
    "checkpoint_signed_by_other_key": ("bad_checkpoint", 7),
}


@pytest.mark.parametrize("name", sorted(INTEGRITY_ONLY))
def test_tamper_matrix_integrity_only(real: Corpus, tmp_path: Path, name: str):
    code, seq = INTEGRITY_ONLY[name]
    url = _copy(real.url, tmp_path / "copy.db")
    TAMPERS[name][0](_db(url))
    exit_code, report, _ = _verify_cli(url, "--integrity-only")
    assert (exit_code, report["code"], report["first_bad_entry"]) == (4, code, seq), report


def test_integrity_only_passes_and_catches_rollback_and_fork(real: Corpus, tmp_path: Path, monkeypatch):
    assert _verify_cli(real.url, "--integrity-only")[0] == 0
    older = _copy(real.url, tmp_path / "older.db")
    _admit(real, "newer")
    trusted = tmp_path / "t.note"
    trusted.write_text(_latest_note(real.url))
    assert _verify_cli(older, "--integrity-only", "--trusted-checkpoint", str(trusted))[1]["code"] == "rollback"
    fork = Corpus(real.dir, real.policy_path, older, real.attester, real.limited, real.now)
    monkeypatch.setenv("GOVTRAIN_SIGNER_STATE", str(tmp_path / "second-signer"))  # this signer would refuse
    _admit(fork, "other")
    assert _verify_cli(older, "--integrity-only", "--trusted-checkpoint", str(trusted))[1]["code"] == "fork"


def test_parallel_integrity_pass_on_a_large_ledger(corpus: Corpus, tmp_path: Path):
    from govtrain.ledger.merkle import fold_right
    from govtrain.verify import integrity

    with corpus.open() as ledger:
        append_runs(ledger, 70_000, corpus.now)
        store = ledger.store
        total = store.size()
        wanted = sorted({p for size in (total, 65_536, 65_537, 12_345, 1) for p in integrity.prefix_parts(size)})
        nodes = integrity._tree_nodes(store, total, wanted)  # two processes: total >= 2^16
        leaves = [leaf for rows in store.leaf_rows() for _, leaf, _ in rows]
        assert nodes == integrity._extract(integrity._build_levels(leaves), 0, wanted)
        assert fold_right([nodes[p] for p in integrity.prefix_parts(total)]) == ledger.tree().root()
    assert verify_ledger(corpus.url, integrity_only=True).entries == 70_001
    for seq, tamper, code in ((60_000, "flip", "leaf_hash_mismatch"), (1_234, "delete", "sequence_gap")):
        url = _copy(corpus.url, tmp_path / f"{tamper}.db")
        if tamper == "flip":
            body, _ = _row(_db(url), seq)
            _sql(_db(url), "UPDATE entries SET body = ? WHERE seq = ?", params=(body[:-1] + bytes([body[-1] ^ 1]), seq))
        else:
            _sql(_db(url), f"DELETE FROM entries WHERE seq = {seq}")
        exit_code, report, _ = _verify_cli(url, "--integrity-only")
        assert (exit_code, report["code"], report["first_bad_entry"]) == (4, code, seq), report
