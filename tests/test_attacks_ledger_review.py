"""Adversarial review of the ledger under load (issue 23 item 3): the retried write, its `landed` check, the
snapshot read and the errors a database that misbehaves produces. Each test asserts the correct behaviour and
failed on the code it was written against (branch i23-load); its docstring names the adversary and the defect."""

from __future__ import annotations

import sqlite3
import threading
import time
from contextlib import contextmanager

import pytest

from govtrain.errors import Code, ConfigError, GovtrainError
from govtrain.gate.admission import admit, admit_many
from govtrain.verify.verifier import verify_ledger
from tests.conftest import Corpus, snapshot

ADVISORY_LOCK = 0x67766E74  # ledger_store.store.ADVISORY_LOCK: what PostgreSQL writers serialise on


class _Lost(Exception):
    """Raised inside the store's transaction so that it rolls back, as a connection cut before COMMIT would."""


def _lose_next_write(ledger, *, then=lambda added, signed: None, skip: int = 0) -> list[int]:
    """After `skip` writes that go through, the store's next write transaction is lost: rolled back, and
    `ledger_unavailable` raised as a connection dropped while committing would (the writer cannot tell whether
    COMMIT reached the server). `then(added, signed)` runs in between, while the writer is cut off: `added` are
    the entries the lost transaction wrote, `signed` its checkpoint row (size, root, note, time)."""
    original, calls = ledger.store.append, [0]

    @contextmanager
    def append():
        calls[0] += 1
        if calls[0] != skip + 1:
            with original() as appender:
                yield appender
            return
        signed: dict = {}
        try:
            with original() as appender:
                add_checkpoint = appender.add_checkpoint

                def capture(size, root, note, now):  # type: ignore[no-untyped-def]
                    signed.update(size=size, root=root, note=note, time=now)
                    return add_checkpoint(size, root, note, now)

                appender.add_checkpoint = capture
                yield appender
                raise _Lost
        except _Lost:
            pass
        then(list(appender.added), signed)
        raise ConfigError(Code.LEDGER_UNAVAILABLE, "connection lost while committing (simulated)")

    ledger.store.append = append
    return calls


def _admitted(corpus: Corpus, *names: str) -> None:
    with corpus.open() as ledger:
        for name in names:
            data = corpus.data(f"{name}.jsonl")
            admit(ledger, corpus.attestation(data, contribution_id=name), data, now=corpus.now)


def _sqlite_path(corpus: Corpus) -> str:
    return corpus.url.removeprefix("sqlite:///")


# -- the landed check ------------------------------------------------------------------------------------------------


def test_a_forged_row_with_the_expected_leaf_hash_is_not_taken_for_the_lost_write(corpus: Corpus):
    """Adversary: a database writer without keys who sees the writer's transaction (the server's operator, a
    statement log, a proxy) and cuts its connection at COMMIT.

    Defect: `availability.landed` decides that a lost write committed from the `leaf_hash` column and the
    checkpoint row's (size, root) columns alone. The adversary rolls the transaction back and inserts, in its
    place, a withdraw row whose leaf_hash column is the expected one but whose body is not the entry signed,
    and a checkpoint row with the expected size and root but no signature. The writer reports the withdrawal
    as written (and records the tree as signed); the verifier then refuses the ledger.
    Fix: compare what landed with what was written, byte for byte: each body (re-hashed, not the column) and
    the checkpoint note verbatim; a row there that is not ours is `fork`, never success and never a rerun."""
    _admitted(corpus, "c1")
    path = _sqlite_path(corpus)

    def forge(added, signed):  # type: ignore[no-untyped-def]
        with sqlite3.connect(path) as db:
            for entry in added:
                db.execute("INSERT INTO entries (seq, kind, time, leaf_hash, body) VALUES (?, ?, ?, ?, ?)",
                           (entry.seq, entry.kind, entry.time, entry.leaf_hash, b"forged: not the entry signed"))
            db.execute("INSERT INTO checkpoints (size, root, note, time) VALUES (?, ?, ?, ?)",
                       (signed["size"], signed["root"], "forged: no signature", signed["time"]))

    with corpus.open() as ledger:
        _lose_next_write(ledger, then=forge)
        with pytest.raises(GovtrainError) as info:
            ledger.withdraw("c1", "asked", now=corpus.now)
    assert info.value.code is not Code.LEDGER_UNAVAILABLE
    with pytest.raises(GovtrainError):  # what the writer would have reported as written does not verify
        verify_ledger(corpus.url)


def test_a_lost_checkpoint_is_not_reported_as_stored(corpus: Corpus):
    """Adversary: a network (or server restart) that cuts the connection while `Ledger.checkpoint()` commits,
    before COMMIT reaches the server.

    Defect: a checkpoint-only write appends no entries, so `landed` compares an empty list of leaf hashes
    (always equal) and asks for a checkpoint of (size, root): the one signed before, which `_signed_prefix`
    requires to have exactly that size and root. The lost checkpoint is taken as landed, nothing is retried,
    and `checkpoint()` returns the previous checkpoint as if it were the new one: success for something that
    was never stored.
    Fix: identify the write by something only it stored (the checkpoint note verbatim, or the checkpoint row's
    id above the latest one seen before the write), not by (size, root)."""
    _admitted(corpus, "c1")
    with corpus.open() as ledger:
        before = len(ledger.store.checkpoints())
        _lose_next_write(ledger)
        ledger.checkpoint(now=corpus.now + 1)  # retried (or raises): it must not report a checkpoint not stored
        assert len(ledger.store.checkpoints()) == before + 1


def test_a_retried_admission_batch_does_not_refuse_its_own_landed_admissions(corpus: Corpus):
    """Adversary: a second writer that admits one contribution of a batch between the batch's lookup and its
    write, and then a connection lost mid-batch.

    Defect: `admit_many` retries its whole `flush` (`availability.retrying`). After the batch write meets the
    second writer's row (`Conflict`), flush writes the items one transaction each; if the connection is lost
    on the second of them, the rerun of flush looks every pending item up again, finds the first one, which
    this very call already committed, and overwrites its receipt with `replay`. The caller is told an
    admission was refused that is in the ledger (and, running it again, is refused again).
    Fix: retry the one write that was lost, not the flush: items already settled keep their outcome (or drop
    settled items from `pending` as they commit)."""
    items = []
    for name in ("c3", "c4", "c2"):
        data = corpus.data(f"{name}.jsonl")
        items.append((name, corpus.attestation(data, contribution_id=name), data))
    with corpus.open() as ledger:
        real, lookups = ledger.store.admission_conflicts, [0]

        def stale_lookup(*args):  # type: ignore[no-untyped-def]
            lookups[0] += 1
            if lookups[0] == 1:  # the first lookup (and the entries read before it) ran before c2 was committed
                _admitted(corpus, "c2")  # the second writer's admission
                return []
            return real(*args)

        ledger.store.admission_conflicts = stale_lookup
        # write 1: the batch (Conflict on c2); write 2: c3 alone, committed; write 3: c4 alone, lost
        calls = _lose_next_write(ledger, skip=2)
        outcomes = admit_many(ledger, items, now=corpus.now)
        assert calls[0] >= 3  # the scenario ran: the batch, c3, then c4 lost
    admitted = {row.contribution_id for row in _admissions(corpus)}
    assert admitted == {"c2", "c3", "c4"}
    assert outcomes[0].error is None, f"c3 is in the ledger but was reported {outcomes[0].error!r}"
    assert outcomes[1].error is None and outcomes[2].error is not None
    assert outcomes[2].error.code is Code.REPLAY


def _admissions(corpus: Corpus):  # type: ignore[no-untyped-def]
    with corpus.open() as ledger:
        return ledger.store.admissions()


# -- PostgreSQL: a lock holder, a read-only server ----------------------------------------------------------------


def test_a_postgresql_writer_behind_a_held_write_lock_gives_up_within_its_retry_time(pg_corpus: Corpus):
    """Adversary: a writer that hangs holding the write lock: a process stopped (SIGSTOP, a debugger, a
    swapped-out VM) mid-transaction, or the orphaned server backend of a connection partitioned away while
    committing, which keeps its transaction, and the advisory lock, until TCP keepalive notices (hours).

    Defect: PostgreSQL writers wait on `pg_advisory_xact_lock` with no lock_timeout, so a write, and the landed
    check that is meant to end in `write_unconfirmed`, waits for as long as the holder holds it:
    GOVTRAIN_LEDGER_RETRY_S bounds nothing. SQLite's busy_timeout makes the same situation `ledger_unavailable`.
    Fix: take the lock with a bound (SET LOCAL lock_timeout, or pg_try_advisory_xact_lock in a loop) and treat
    its expiry (LockNotAvailable) as `ledger_unavailable`, so `retrying` and `landed` end on time."""
    from sqlalchemy import create_engine

    _admitted(pg_corpus, "c1")
    before = snapshot(pg_corpus.url)
    holder = create_engine(pg_corpus.url).connect()
    holder.exec_driver_sql(f"SELECT pg_advisory_xact_lock({ADVISORY_LOCK})")  # in its transaction, held
    outcome: list = []
    with pg_corpus.open() as ledger:
        ledger.retry_s = 0.5

        def write() -> None:
            try:
                outcome.append(ledger.withdraw("c1", "asked", now=pg_corpus.now))
            except GovtrainError as e:
                outcome.append(e)

        writer = threading.Thread(target=write, daemon=True)
        started = time.monotonic()
        writer.start()
        writer.join(6)
        waited = time.monotonic() - started
        holder.rollback()  # release, so that the writer ends either way
        holder.close()
        writer.join(10)
    assert waited < 6, "the writer was still waiting for the lock 6 s in, with GOVTRAIN_LEDGER_RETRY_S=0.5"
    assert isinstance(outcome[0], GovtrainError) and outcome[0].code is Code.LEDGER_UNAVAILABLE
    assert snapshot(pg_corpus.url) == before


def test_a_read_only_postgresql_server_is_a_coded_error(pg_corpus: Corpus):
    """Adversary: the operations of a real deployment: a failover that leaves the URL pointing at a hot
    standby, or an administrator who sets the database read-only (`default_transaction_read_only`).

    Defect: the write fails with psycopg's ReadOnlySqlTransaction, an InternalError, which `guard` does not
    recognise (it codes only OperationalError and disconnects): the caller gets SQLAlchemy's exception, whose
    text holds the SQL statement and its parameters, and the CLI prints it as `error[internal]` (a bug).
    Fix: code every database error that reaches a ledger store: read-only / insufficient privilege / disk full
    as a stable code (ledger_unavailable, or a ledger_read_only of its own), one line, nothing written."""
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url

    _admitted(pg_corpus, "c1")
    before = snapshot(pg_corpus.url)
    admin = create_engine(pg_corpus.url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.exec_driver_sql(f"ALTER DATABASE {make_url(pg_corpus.url).database} "
                                   "SET default_transaction_read_only = on")
    admin.dispose()
    with pytest.raises(GovtrainError) as info:
        with pg_corpus.open() as ledger:
            ledger.retry_s = 0.2
            ledger.withdraw("c1", "asked", now=pg_corpus.now)
    assert "\n" not in info.value.line() and "INSERT" not in info.value.line()
    assert snapshot(pg_corpus.url) == before


def test_a_full_sqlite_disk_is_a_coded_error(corpus: Corpus):
    """Adversary: the disk the SQLite ledger lives on fills up (simulated with max_page_count on the writer's
    connection: SQLite answers exactly as it does on a full disk, SQLITE_FULL).

    Defect: `_transient` codes only SQLite's busy/locked messages; "database or disk is full" (an
    OperationalError too) passes through `guard` as SQLAlchemy's exception, the INSERT statement and its
    parameters in its text, `error[internal]` at the CLI.
    Fix: a coded, one-line error for every database failure a write can meet (ledger_unavailable: nothing was
    written; or a code of its own), never SQLAlchemy's exception."""
    from sqlalchemy import event

    _admitted(corpus, "c1")
    before = snapshot(corpus.url)
    with corpus.open() as ledger:
        ledger.retry_s = 0.2
        with ledger.store.engine.connect() as connection:
            pages = connection.exec_driver_sql("PRAGMA page_count").scalar_one()
        ledger.store.engine.dispose()

        @event.listens_for(ledger.store.engine, "connect")
        def _full(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
            dbapi_connection.execute(f"PRAGMA max_page_count = {pages}")  # not one page more

        items = []
        for i in range(40):  # 40 admit entries: more than the free space left in the pages there are
            data = corpus.data(f"d{i}.jsonl")
            items.append((f"d{i}", corpus.attestation(data, contribution_id=f"d{i}"), data))
        with pytest.raises(GovtrainError) as info:
            admit_many(ledger, items, now=corpus.now)
    assert snapshot(corpus.url) == before
    assert "\n" not in info.value.line() and "INSERT" not in info.value.line()


def test_a_wrong_postgresql_password_is_not_ledger_unavailable(pg_url: str):
    """Adversary: none but a misconfiguration (a rotated or mistyped password): the error must say what to do.

    Defect: `_transient` takes every psycopg OperationalError for a database that went away, and
    `LedgerStore.open` every connect failure, so a refused password is `ledger_unavailable`, "cannot reach ...
    try again once it is back", and a write meeting it mid-run (the password rotated) is retried for
    GOVTRAIN_LEDGER_RETRY_S seconds before saying so. Retrying cannot help; the line sends the operator to wait
    for a server that is up.
    Fix: tell authentication and authorisation failures (SQLSTATE 28xxx, 42501) from unreachability, and give
    them a configuration code of their own (exit 2, not retried), the password still redacted."""
    from sqlalchemy.engine import make_url

    from govtrain.ledger.ledger import Ledger

    wrong = make_url(pg_url).set(password="not-the-password").render_as_string(hide_password=False)
    with pytest.raises(GovtrainError) as info:
        Ledger.open(wrong)
    assert "not-the-password" not in info.value.line()
    assert info.value.code is not Code.LEDGER_UNAVAILABLE, info.value.line()
