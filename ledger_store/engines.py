"""Ledger URLs and database engines: which URLs name a ledger (SQLite files, PostgreSQL through psycopg 3), how one
is shown without its password, and the engine each backend opens (SQLite: WAL, full sync, writers lock at BEGIN).
What a failure to open a ledger means to its user is decided here too."""

from __future__ import annotations

import os
import re
from pathlib import Path

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, DatabaseError, OperationalError

from ledger_store.errors import AccessDenied, LedgerMissing, NotADatabase, StoreError, Unavailable, UnsupportedURL, \
    access_denied

def normalize_url(url: str) -> str:
    """A SQLAlchemy URL; a bare path means a SQLite file (a relative one with a folder gets its explicit `./`)."""
    if "://" not in url:
        path = str(Path(url).expanduser())
        return f"sqlite:///{path}" if os.path.isabs(path) or "/" not in path else f"sqlite:///./{path}"
    return url


def redacted_url(url: str) -> str:
    """`url` with its password replaced by `***`: the only form of a URL a message, a log line or an answer holds
    (the password can write the ledger). Everything between the user name and the last `@` goes, and any
    `password=` query parameter: a password holding characters a URL should have escaped is hidden whole, at
    worst with part of what follows it."""
    scheme, sep, rest = url.partition("://")
    if sep:
        userinfo, at, host = rest.rpartition("@")
        if at and ":" in userinfo:
            rest = f"{userinfo.split(':', 1)[0]}:***@{host}"
    return re.sub(r"(?i)([?&]password=)[^&]*", r"\1***", f"{scheme}{sep}{rest}")


def _check_sqlite_path(url: str, database: str) -> None:
    """Refuse `sqlite:///tmp/x.db`: three slashes make `tmp/x.db` relative to the working directory, which is
    rarely what was meant. A relative path with a folder must say so (`./`, `../`); a bare file name need not."""
    if os.path.isabs(database) or "/" not in database or database.startswith(("./", "../")):
        return
    raise UnsupportedURL(f"{redacted_url(url)} names the relative path {database} (three slashes before a relative "
                         f"path, four before an absolute one): write sqlite:////{database} for /{database}, or "
                         f"sqlite:///./{database} for ./{database}")


ADVISORY_LOCK = 0x67766E74  # "gvnt": PostgreSQL writers serialize on this transaction-scoped lock


def _backend(url: str) -> str:
    """'sqlite' or 'postgresql'; anything else is refused with what to use instead."""
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError) as e:  # ValueError: a port that is not a number
        raise UnsupportedURL(f"{redacted_url(url)!r} is not a database URL (try sqlite:///ledger.db)") from None
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        if not parsed.database or parsed.database == ":memory:":
            raise UnsupportedURL("a ledger needs a SQLite file, not an in-memory database")
        _check_sqlite_path(url, parsed.database)
        return backend
    if backend == "postgresql":
        if parsed.get_driver_name() != "psycopg":
            raise UnsupportedURL("PostgreSQL ledgers use psycopg 3: postgresql+psycopg://USER:PASS@HOST/DB")
        return backend
    raise UnsupportedURL(f"{backend!r} ledgers are not supported; use sqlite:///PATH or postgresql+psycopg://…")


def _sqlite_path(url: str) -> Path:
    return Path(make_url(url).database)


def _unopenable(url: str, error: DatabaseError) -> StoreError:
    """What a failure to open or create the ledger at `url` means to its user."""
    if access_denied(error.orig):
        return AccessDenied(f"{redacted_url(url)} refused this connection ({str(error.orig).splitlines()[0]}): "
                            "check the user and password in the URL and the database's grants")
    if isinstance(error, OperationalError):
        return Unavailable(f"cannot reach {redacted_url(url)}: {str(error.orig).splitlines()[0]}")
    return _not_a_database(url, error)


def _not_a_database(url: str, error: DatabaseError) -> StoreError:
    where = make_url(url)
    if where.get_backend_name() != "sqlite":
        return LedgerMissing(f"cannot read {redacted_url(url)}: "
                             f"{str(error.orig).splitlines()[0]}")
    return NotADatabase(f"{where.database} is not a SQLite database ({str(error.orig).splitlines()[0]}): --ledger "
                        "names the ledger file `govtrain init` created")


def _engine(url: str, backend: str) -> Engine:
    if backend == "postgresql":
        return create_engine(url, pool_pre_ping=True)
    engine = create_engine(url)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record) -> None:
        dbapi_connection.isolation_level = None  # SQLAlchemy's "begin" event below issues BEGIN itself
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=60000")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection) -> None:
        # Writers take the write lock before reading the next sequence number; readers do not wait.
        connection.exec_driver_sql("BEGIN IMMEDIATE" if connection.info.get("writer") else "BEGIN")

    return engine
