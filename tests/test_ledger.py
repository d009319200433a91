"""The ledger store (append-only, dense sequence numbers under concurrency) and the verifier."""

from __future__ import annotations

import json
import multiprocessing
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import ledger_store
from govtrain.cli.verify import verify_cli
from govtrain.encoding import cbor
from govtrain.errors import Code, ConfigError, IntegrityError
from govtrain.gate.admission import admit, admit_many
from govtrain.ledger.ledger import Ledger
from govtrain.policy.config import load_policy
from govtrain.verify.verifier import verify_ledger
from tests.conftest import REPO, Corpus, snapshot, lease


def _db(url: str) -> Path:
    return Path(url.removeprefix("sqlite:///"))


@pytest.fixture
def populated(corpus: Corpus) -> Corpus:
    with corpus.open() as ledger:
        for i in range(4):
            data = corpus.data(f"c{i}.jsonl", records=2 + i)
            admit(ledger, corpus.attestation(data), data, now=corpus.now)
    return corpus


def test_header_records_the_policy(corpus: Corpus):
    with corpus.open() as ledger:
        policy, _ = load_policy(corpus.policy_path)
        assert ledger.policy.to_record() == policy.to_record()
        assert ledger.size() == 1 and ledger.epoch() == 0
        assert ledger.ledger_key_path() == str((corpus.dir / "ledger.key").resolve())
    assert oct(_db(corpus.url).stat().st_mode & 0o777) == "0o600"


@pytest.mark.parametrize("statement", [
    "UPDATE entries SET body = x'00' WHERE seq = 1",
    "UPDATE entries SET kind = 'admit' WHERE seq = 0",
    "DELETE FROM entries WHERE seq = 1",
    "UPDATE admissions SET data_class = 'public'",
    "DELETE FROM admissions",
])
def test_triggers_refuse_update_and_delete(populated: Corpus, statement: str):
    before = snapshot(populated.url)
    connection = sqlite3.connect(_db(populated.url))
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        connection.execute(statement)
        connection.commit()
    connection.close()
    assert snapshot(populated.url) == before


def test_init_refuses_an_existing_ledger(corpus: Corpus):
    policy, digest = load_policy(corpus.policy_path)
    before = snapshot(corpus.url)
    with pytest.raises(ConfigError) as info:
        Ledger.init(corpus.url, policy, digest, key_path=corpus.dir / "ledger.key")
    assert info.value.code == Code.LEDGER_EXISTS
    assert snapshot(corpus.url) == before


def test_open_never_creates_a_file(tmp_path):
    with pytest.raises(ConfigError) as info:
        Ledger.open(f"sqlite:///{tmp_path / 'none.db'}")
    assert info.value.code == Code.LEDGER_MISSING and not (tmp_path / "none.db").exists()
    for unsupported in ("mysql://localhost/ledger", "postgresql+psycopg2://localhost/ledger", "sqlite://"):
        with pytest.raises(ConfigError) as info:
            Ledger.open(unsupported)
        assert info.value.code == Code.LEDGER_URL


@pytest.mark.parametrize("url", [
    "postgresql+psycopg://gt:s3cr3t-pw@db.internal/ledger",
    "postgresql+psycopg://gt:s3cr3t-pw@db.internal:notaport/ledger",  # SQLAlchemy cannot parse it
    "postgresql+psycopg://gt:s3cr3t@-pw@db.internal/ledger",  # an '@' the URL should have escaped
    "postgresql+psycopg://gt:s3cr3t/-pw@db.internal/ledger",  # a '/' likewise
    "postgresql+psycopg://gt@db.internal/ledger?sslmode=require&password=s3cr3t-pw",
])
def test_a_ledger_url_is_never_shown_with_its_password(url: str):
    """A message that names the ledger names it redacted: the password can write the ledger."""
    shown = ledger_store.redacted_url(url)
    assert "s3cr3t" not in shown and "-pw" not in shown and "db.internal" in shown
    assert ledger_store.redacted_url("sqlite:////srv/a@b/ledger.db") == "sqlite:////srv/a@b/ledger.db"
    if "notaport" in url:
        with pytest.raises(ConfigError) as refused:
            Ledger.open(url)
        assert refused.value.code == Code.LEDGER_URL and "s3cr3t" not in refused.value.line()


def _append_many(url: str, worker: int, count: int) -> None:
    store = ledger_store.LedgerStore.open(url)
    for i in range(count):
        with store.append() as appender:
            appender.add("test", i, lambda seq, w=worker, n=i: cbor.encode({"seq": seq, "w": w, "n": n}))
    store.close()


def test_concurrent_writers_never_duplicate_or_skip(tmp_path):
    url = f"sqlite:///{tmp_path / 'race.db'}"
    ledger_store.LedgerStore.create(url).close()
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_append_many, args=(url, w, 40)) for w in range(4)]
    for p in workers:
        p.start()
    for p in workers:
        p.join(timeout=120)
        assert p.exitcode == 0
    store = ledger_store.LedgerStore.open(url)
    entries = list(store.entries())
    store.close()
    assert [e.seq for e in entries] == list(range(160))
    assert all(cbor.decode(e.body)["seq"] == e.seq for e in entries)
    assert sorted((cbor.decode(e.body)["w"], cbor.decode(e.body)["n"]) for e in entries) == \
        [(w, n) for w in range(4) for n in range(40)]


def test_unique_constraints_stop_a_replay_that_races_the_lookup(populated: Corpus):
    with populated.open() as ledger:
        row = ledger.store.admissions()[0]
        before = snapshot(populated.url)
        with pytest.raises(ledger_store.Conflict):
            with ledger.store.append() as appender:
                appender.add("admit", 0, lambda seq: b"\xa0", {
                    "contribution_id": row.contribution_id, "data_class": "public",
                    "descriptor_sha256": b"\x01" * 32, "attestation_sha256": b"\x02" * 32,
                    "data_sha256": b"\x03" * 32})
    assert snapshot(populated.url) == before


def test_batch_admission_commits_admitted_and_reports_rejected(corpus: Corpus):
    items = []
    for i in range(25):
        data = corpus.data(f"b{i}.jsonl", records=1 + i % 3)
        overrides = {"noise_multiplier_u": 100_000} if i % 10 == 3 else {}
        items.append((data.name, corpus.attestation(data, **overrides), data))
    items.append(("dup", items[0][1], items[0][2]))  # a replay inside the batch
    with corpus.open() as ledger:
        outcomes = admit_many(ledger, items, now=corpus.now, batch_size=7)
    rejected = [o for o in outcomes if o.error]
    assert [o.error.code.value for o in rejected] == ["below_corpus_floor"] * 3 + ["replay"]
    assert snapshot(corpus.url)[0] == 1 + 22
    verify_ledger(corpus.url)


# -- verifier --------------------------------------------------------------------------


def test_verify_ok(populated: Corpus):
    report = verify_ledger(populated.url)
    assert report.entries == 5 and report.admissions == 4 and report.by_kind == {"header": 1, "admit": 4}
    result = CliRunner().invoke(verify_cli, ["--ledger", populated.url, "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["ok"] is True


def _tamper(db: Path, *statements: str) -> None:
    connection = sqlite3.connect(db)
    connection.execute("DROP TRIGGER IF EXISTS entries_no_update")
    connection.execute("DROP TRIGGER IF EXISTS entries_no_delete")
    connection.execute("DROP TRIGGER IF EXISTS admissions_no_update")
    connection.execute("DROP TRIGGER IF EXISTS admissions_no_delete")
    for statement in statements:
        connection.execute(statement)
    connection.commit()
    connection.close()


def _flip_body_byte(seq: int, offset: int):
    def run(db: Path) -> None:
        connection = sqlite3.connect(db)
        body = bytearray(connection.execute("SELECT body FROM entries WHERE seq = ?", (seq,)).fetchone()[0])
        connection.close()
        body[offset] ^= 0x01
        _tamper(db, f"UPDATE entries SET body = x'{body.hex()}' WHERE seq = {seq}")
    return run


def _rehashed_body(seq: int, change):
    """The attacker also recomputes the leaf hash: the content checks must catch it."""
    def run(db: Path) -> None:
        connection = sqlite3.connect(db)
        body = connection.execute("SELECT body FROM entries WHERE seq = ?", (seq,)).fetchone()[0]
        connection.close()
        entry = cbor.decode(body)
        change(entry)
        new = cbor.encode(entry)
        _tamper(db, f"UPDATE entries SET body = x'{new.hex()}', leaf_hash = x'{ledger_store.leaf_hash(new).hex()}' "
                    f"WHERE seq = {seq}")
    return run


def _swap_entries(a: int, b: int):
    def run(db: Path) -> None:
        connection = sqlite3.connect(db)
        rows = {seq: (body, leaf) for seq, body, leaf in
                connection.execute("SELECT seq, body, leaf_hash FROM entries WHERE seq IN (?, ?)", (a, b))}
        connection.close()
        # Park a's leaf hash first: leaf hashes are unique.
        _tamper(db, f"UPDATE entries SET leaf_hash = zeroblob(32) WHERE seq = {a}",
                f"UPDATE entries SET body = x'{rows[a][0].hex()}', leaf_hash = x'{rows[a][1].hex()}' WHERE seq = {b}",
                f"UPDATE entries SET body = x'{rows[b][0].hex()}', leaf_hash = x'{rows[b][1].hex()}' WHERE seq = {a}")
    return run


TAMPERS = {
    "entries_reordered": (_swap_entries(2, 3), "bad_entry", 2),
    "body_byte_changed": (_flip_body_byte(2, 40), "leaf_hash_mismatch", 2),
    "entry_deleted": (lambda db: _tamper(db, "DELETE FROM admissions WHERE seq = 3",
                                         "DELETE FROM entries WHERE seq = 3"), "sequence_gap", 3),
    "budget_raised_and_rehashed": (_rehashed_body(2, lambda e: e.update(eps_budget_u=9_999_999)), "bad_admission", 2),
    "class_changed_and_rehashed": (_rehashed_body(4, lambda e: e.update(data_class="sensitive")), "bad_admission", 4),
    "noise_lowered_and_rehashed": (_rehashed_body(3, lambda e: e.update(noise_multiplier_u=100_000)),
                                   "bad_admission", 3),
    # A class loosened past the corpus floor. (A rewrite that stays self-consistent, with every leaf
    # hash recomputed, needs the signed checkpoints of the next issue to be caught.)
    "policy_loosened_and_rehashed": (
        _rehashed_body(0, lambda e: e["policy"]["classes"]["public"].update(clip_norm_u=9_000_000)),
        "bad_ledger_header", 0),
    "seq_field_rewritten": (_rehashed_body(1, lambda e: e.update(seq=7)), "bad_entry", 1),
    "index_row_deleted": (lambda db: _tamper(db, "DELETE FROM admissions WHERE seq = 2"), "index_mismatch", 2),
    "body_redacted": (lambda db: _tamper(db, "UPDATE entries SET body = NULL WHERE seq = 4"), "bad_entry", 4),
}


@pytest.mark.parametrize("name", sorted(TAMPERS))
def test_tamper_is_detected(populated: Corpus, tmp_path: Path, name: str):
    tamper, code, seq = TAMPERS[name]
    copy = tmp_path / "copy.db"
    source, target = sqlite3.connect(_db(populated.url)), sqlite3.connect(copy)
    source.backup(target)  # a consistent copy, WAL included
    source.close(), target.close()
    tamper(copy)
    with pytest.raises(IntegrityError) as info:
        verify_ledger(f"sqlite:///{copy}")
    assert info.value.code.value == code and getattr(info.value, "seq") == seq
    result = CliRunner().invoke(verify_cli, ["--ledger", f"sqlite:///{copy}", "--json"])
    report = json.loads(result.stdout)
    assert result.exit_code == 4 and report["code"] == code and report["first_bad_entry"] == seq
    assert result.stderr.startswith(f"error[{code}]")


def test_verifier_does_not_import_torch(populated: Corpus):
    code = (
        "import sys; from govtrain.cli.verify import verify_cli; "
        f"from govtrain.verify.verifier import verify_ledger; verify_ledger({populated.url!r}); "
        "assert 'torch' not in sys.modules, 'torch was imported'; print('clean')"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "clean" in result.stdout, result.stderr


def test_floors_are_checked_without_reverifying_attestations(populated: Corpus, tmp_path: Path):
    copy = tmp_path / "floors.db"
    source, target = sqlite3.connect(_db(populated.url)), sqlite3.connect(copy)
    source.backup(target)
    source.close(), target.close()
    _rehashed_body(2, lambda e: e.update(eps_budget_u=99_000_000))(copy)
    result = CliRunner().invoke(verify_cli, ["--ledger", f"sqlite:///{copy}", "--json", "--skip-attestations"])
    report = json.loads(result.stdout)
    assert (result.exit_code, report["code"], report["first_bad_entry"]) == (4, "bad_admission", 2)
    assert report["attestations_verified"] is False


def test_a_run_naming_an_unknown_mechanism_is_refused_and_flagged(corpus: Corpus):
    from govtrain.ledger.entries import run_entry

    before = snapshot(corpus.url)
    with corpus.open() as ledger:
        with pytest.raises(ValueError):
            ledger.record_run("r", "magic", bytes(32), bytes(32), None, now=corpus.now, run_nonce=lease("r"))
    assert snapshot(corpus.url) == before  # nothing written
    with corpus.open() as ledger:
        for mechanism in ("dpsgd", "prism", "dp-muon"):
            ledger.record_run(f"run-{mechanism}", mechanism, bytes(32), bytes(32), None, now=corpus.now,
                              run_nonce=lease(f"run-{mechanism}"))
    verify_ledger(corpus.url)
    with corpus.open() as ledger:  # written past record_run's check, as a forger would
        with ledger.append(corpus.now) as appender:
            appender.add("run", corpus.now, lambda seq: run_entry(seq, corpus.now, run_id="r", run_nonce=lease("r"), mechanism="magic",
                                                                  device="cpu", precision="fp32",
                                                                  config_sha256=bytes(32), base_model_sha256=bytes(32),
                                                                  adapter_sha256=None))
        seq = ledger.store.size() - 1
    with pytest.raises(IntegrityError) as info:
        verify_ledger(corpus.url)
    assert info.value.code.value == "bad_entry" and getattr(info.value, "seq") == seq and "magic" in info.value.detail
