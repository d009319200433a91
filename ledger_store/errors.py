"""What the ledger store raises: one exception per failure a caller can act on (govtrain maps each to a code,
`govtrain.ledger.ledger.store_errors`), and how a driver error that refuses who connects is recognised."""

from __future__ import annotations

import re


class StoreError(Exception):
    """Base of ledger_store errors."""


class UnsupportedURL(StoreError):
    pass


class LedgerMissing(StoreError):
    pass


class LedgerExists(StoreError):
    pass


class NotADatabase(StoreError):
    """A file SQLite cannot read as a database (a data file, a key, a policy given as the ledger)."""


class Unavailable(StoreError):
    """The database server could not be reached (down, restarting, refusing connections) or stayed locked."""


class AccessDenied(StoreError):
    """The database refused these credentials or this role (a wrong or rotated password, no pg_hba entry, no
    privilege): waiting cannot help, the URL or the database's grants must change."""


class Conflict(StoreError):
    """A unique constraint refused the write (a replay, or a second withdrawal, that raced another writer)."""


class TamperedRow(StoreError):
    """A cell that does not hold its column's type (SQLite keeps whatever type is written: a TEXT body, a TEXT
    seq): no ledger writer wrote it. `table`, `column` and `key` (the row's seq, id or name) say where."""

    def __init__(self, table: str, column: str, key: object, value: object) -> None:
        where = repr(key) if len(repr(key)) <= 80 else repr(key)[:77] + "..."
        super().__init__(f"{table}.{column} of row {where} holds {type(value).__name__}, not the column's type")
        self.table, self.column, self.key = table, column, key


# PostgreSQL's refusals of a connection carry no SQLSTATE (libpq reports them as text); these are the server's.
_ACCESS_DENIED = re.compile(r"authentication failed|no pg_hba\.conf entry|permission denied|is not permitted to log in"
                            r"|role \"[^\"]*\" does not exist|no password supplied")


def access_denied(error: BaseException) -> bool:
    """Whether a driver error is PostgreSQL refusing who connects: SQLSTATE class 28 (invalid authorization,
    a wrong password) or 42501 (insufficient privilege), or a refused connection saying so."""
    sqlstate = getattr(error, "sqlstate", None)
    if sqlstate:
        return sqlstate.startswith("28") or sqlstate == "42501"
    return type(error).__module__.startswith("psycopg") and _ACCESS_DENIED.search(str(error)) is not None
