"""When the database goes away under a writer: one coded error, bounded retries, and never a double append.

A connection lost mid-write, a PostgreSQL server restarting, SQLite's write lock held past its busy timeout:
SQLAlchemy raises its own `OperationalError`, with the driver's message. `guard` puts one line in its place,
`ledger_unavailable`, for every statement a ledger store runs (reads, writes, connects).

A write is retried (`retrying`, for `GOVTRAIN_LEDGER_RETRY_S` seconds, default 30) only where that cannot
append it twice. How a write transaction failed decides it (`Ledger.append`):

- before COMMIT was sent: the server rolled it back, nothing of it exists; the operation runs again, reading
  the ledger afresh.
- while committing: it may have committed with its acknowledgement lost. `landed` asks the database, under the
  write lock (so the lost transaction has ended one way or the other), whether the entries and the checkpoint
  this transaction wrote are there, leaf hash for leaf hash: if so the write succeeded and is reported so, and
  is not run again; if not, nothing of it exists and running it again appends it once. Where the database cannot
  be reached to tell, the writer stops with `write_unconfirmed` and retries nothing.
"""

from __future__ import annotations

import os
import sqlite3
import time
from typing import Callable, Sequence, TypeVar

from sqlalchemy import event

import ledger_store
from govtrain.errors import Code, ConfigError, GovtrainError

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


def _transient(context) -> bool:  # type: ignore[no-untyped-def]
    original = context.original_exception
    if isinstance(original, sqlite3.OperationalError):
        return any(text in str(original) for text in _SQLITE_BUSY)
    if context.is_disconnect:
        return True
    try:
        import psycopg
    except ImportError:  # no PostgreSQL driver: no PostgreSQL ledger
        return False
    return isinstance(original, psycopg.OperationalError)


def guard(store: ledger_store.LedgerStore) -> None:
    """Make every transient failure of `store`'s database raise `ledger_unavailable` (ConfigError, exit 2)."""
    where = ledger_store.redacted_url(store.url)

    @event.listens_for(store.engine, "handle_error")
    def _unavailable(context) -> None:  # type: ignore[no-untyped-def]
        # A pre-ping failure is SQLAlchemy's own cue to reconnect: leave it to the pool.
        if context.is_pre_ping or not _transient(context):
            return
        reason = str(context.original_exception).strip().splitlines()
        raise ConfigError(Code.LEDGER_UNAVAILABLE, f"the ledger database {where} cannot be reached or is busy "
                                                   f"({reason[0] if reason else type(context.original_exception).__name__}"
                                                   "): nothing was written; try again once it is back")


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


def landed(store: ledger_store.LedgerStore, first: int, leaves: Sequence[bytes], root: bytes, *,
           retry_s: float) -> bool:
    """Whether the write that appended `leaves` at `first` and signed the tree of `first + len(leaves)` entries
    with `root` committed, asked under the write lock. `write_unconfirmed` where the database stays unreachable."""
    size = first + len(leaves)

    def ask() -> bool:
        with store.append() as appender:
            return (appender.leaf_hashes(first, size) == list(leaves)
                    and appender.has_checkpoint(size, root))

    try:
        return retrying(ask, retry_s=retry_s)
    except GovtrainError as e:
        if e.code is not Code.LEDGER_UNAVAILABLE:
            raise
        raise ConfigError(Code.WRITE_UNCONFIRMED, f"the connection to {ledger_store.redacted_url(store.url)} was lost "
                                                  f"while committing entries {first}..{size - 1} and the database has "
                                                  f"not answered since: the write may or may not be in the ledger; "
                                                  "look (govtrain ledger status) before doing it again") from e
