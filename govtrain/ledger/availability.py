"""When the database goes away under a writer: one coded error, bounded retries, and never a double append.

A connection lost mid-write, a PostgreSQL server restarting, SQLite's write lock held past its busy timeout, a
standby that refuses writes, a full disk: SQLAlchemy raises its own exception, with the statement and its
parameters in its text. `guard` puts one line in its place, `ledger_unavailable` (or `ledger_access_denied`
where the database refuses who connects), for every statement a ledger store runs (reads, writes, connects).

A write is retried (`retrying`, for `GOVTRAIN_LEDGER_RETRY_S` seconds, default 30; a PostgreSQL writer waits
for the write lock no longer) only where that cannot append it twice. How a write transaction failed decides it
(`Ledger.append`):

- before COMMIT was sent: the server rolled it back, nothing of it exists; the operation runs again, reading
  the ledger afresh.
- while committing: it may have committed with its acknowledgement lost. `landed` asks the database, under the
  write lock (so the lost transaction has ended one way or the other), whether the entries and the checkpoint
  this transaction wrote are there, byte for byte and note for note: if so the write succeeded and is reported
  so, and is not run again; if none of it is, running it again appends it once; rows that pass for it but are
  not it are `fork`. Where the database cannot be reached to tell, the writer stops with `write_unconfirmed`
  and retries nothing.
"""

from __future__ import annotations

import os
import sqlite3
import time
from typing import Callable, Sequence, TypeVar

from sqlalchemy import event
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import IntegrityError as SQLIntegrityError

import ledger_store
from govtrain.errors import Code, ConfigError, GovtrainError, IntegrityError

RETRY_ENV = "GOVTRAIN_LEDGER_RETRY_S"
DEFAULT_RETRY_S = 30.0
_SQLITE_BUSY = ("database is locked", "database is busy", "database table is locked")

T = TypeVar("T")


def retry_seconds() -> float:
    """How long a write keeps retrying a ledger that cannot be reached: $GOVTRAIN_LEDGER_RETRY_S, else 30 s."""
    raw = os.environ.get(RETRY_ENV)
    if raw is None:
        return DEFAULT_RETRY_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= 86_400:
        raise ConfigError(Code.BAD_ARGUMENT, f"{RETRY_ENV}={raw!r}: give the seconds a write retries, 0 to 86400")
    return seconds


def _transient(original: BaseException) -> bool:
    if isinstance(original, sqlite3.OperationalError):
        return any(text in str(original) for text in _SQLITE_BUSY)
    try:
        import psycopg
    except ImportError:  # no PostgreSQL driver: no PostgreSQL ledger
        return False
    return isinstance(original, psycopg.OperationalError)


def guard(store: ledger_store.LedgerStore) -> None:
    """Give every database error `store`'s statements meet (reads, writes, connects) one coded line, without the
    statement or its parameters: `ledger_access_denied` where the database refuses who connects (not retried);
    `ledger_unavailable` (ConfigError, exit 2; retried) for the rest. A unique constraint's refusal is left to
    the store (`Conflict`), a failed pre-ping to the pool (it reconnects)."""
    where = ledger_store.redacted_url(store.url)

    @event.listens_for(store.engine, "handle_error")
    def _coded(context) -> None:  # type: ignore[no-untyped-def]
        error, original = context.sqlalchemy_exception, context.original_exception
        if context.is_pre_ping or not isinstance(error, DBAPIError) or isinstance(error, SQLIntegrityError):
            return
        lines = str(original).strip().splitlines()
        reason = lines[0] if lines else type(original).__name__
        if ledger_store.access_denied(original):
            raise ConfigError(Code.LEDGER_ACCESS_DENIED, f"the ledger database {where} refused this connection "
                                                         f"({reason}): nothing was written; check the user and "
                                                         "password in the URL and the database's grants")
        if context.is_disconnect or _transient(original):
            raise ConfigError(Code.LEDGER_UNAVAILABLE, f"the ledger database {where} cannot be reached or is busy "
                                                       f"({reason}): nothing was written; try again once it is back")
        # Read-only (a standby after failover), a full disk, a statement refused: nothing of it was written.
        # PostgreSQL's text may quote the statement or a value: its condition's name and SQLSTATE say enough.
        sqlstate = getattr(original, "sqlstate", None)
        if sqlstate:
            reason = f"{type(original).__name__}, SQLSTATE {sqlstate}"
        raise ConfigError(Code.LEDGER_UNAVAILABLE, f"the ledger database {where} refused the statement ({reason}): "
                                                   "nothing was written; try again once it accepts writes")


def retrying(operation: Callable[[], T], *, retry_s: float, sleep: Callable[[float], None] = time.sleep,
             clock: Callable[[], float] = time.monotonic) -> T:
    """`operation()`, run again after `ledger_unavailable` (with backoff) until it has retried for `retry_s`
    seconds; then that error goes to the caller. Only for operations that wrote nothing when they raised it:
    every ledger write (`Ledger.append` turns an unknown commit into a success, or into `write_unconfirmed`)."""
    deadline = clock() + retry_s
    pause = 0.05
    while True:
        try:
            return operation()
        except GovtrainError as e:
            if e.code is not Code.LEDGER_UNAVAILABLE or clock() + pause > deadline:
                raise
        sleep(pause)
        pause = min(pause * 2, 1.0)


def landed(store: ledger_store.LedgerStore, added: Sequence[ledger_store.StoredEntry], note: str, *,
           size: int, after: int, retry_s: float) -> bool:
    """Whether the write that appended `added` (none: a checkpoint alone) and stored the checkpoint `note` of the
    tree of `size` entries committed, asked under the write lock: its entries, byte for byte, and its note,
    verbatim, among the checkpoints stored after the one with id `after` (the latest before the write).
    `fork` where rows there pass for it but are not it; `write_unconfirmed` where the database stays unreachable."""
    first = size - len(added)
    what = f"entries {first}..{size - 1}" if added else f"a checkpoint of {size} entries"

    def ask() -> bool:
        with store.append() as appender:
            return _found(appender.entries(first, size), added, appender.checkpoints_after(after), size, note)

    try:
        return retrying(ask, retry_s=retry_s)
    except GovtrainError as e:
        if e.code is not Code.LEDGER_UNAVAILABLE:
            raise
        raise ConfigError(Code.WRITE_UNCONFIRMED, f"the connection to {ledger_store.redacted_url(store.url)} was lost "
                                                  f"while committing {what} and the database has "
                                                  f"not answered since: the write may or may not be in the ledger; "
                                                  "look (govtrain ledger status) before doing it again") from e


def _found(stored: list[ledger_store.StoredEntry], added: Sequence[ledger_store.StoredEntry],
           checkpoints: list[ledger_store.StoredCheckpoint], size: int, note: str) -> bool:
    """All of the write is there (True), or none of it and nothing that passes for it (False: another writer's
    entries may hold its positions); anything in between is a ledger that disagrees with what was committed."""
    ours = {entry.seq: entry for entry in added}
    exact = sum(row == ours[row.seq] for row in stored)  # every column: seq, kind, time, leaf hash, body
    posing = [row.seq for row in stored if row != ours[row.seq]
              and (row.leaf_hash == ours[row.seq].leaf_hash or row.body == ours[row.seq].body)]
    signed = any(c.size == size and c.note == note for c in checkpoints)
    if not posing and exact == len(added) == len(stored) and signed:
        return True
    if not posing and exact == 0 and not signed:
        return False
    first = size - len(added)
    found = (f"rows that carry its leaf hash or its bytes but not both (entries {', '.join(map(str, posing))})"
             if posing
             else "part of it: its entries without its checkpoint, or the reverse")
    raise IntegrityError(Code.FORK, f"the write of entries {first}..{size - 1} lost its connection while committing "
                                    f"and the database now holds {found}: it was altered; run govtrain-verify")
