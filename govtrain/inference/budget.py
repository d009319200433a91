"""Session budgets in SQLite, for both sides of split inference (no torch).

A session is an id the client chooses. Its requests compose exactly (`govtrain.accounting.gaussian`): request i
with sensitivity Delta_i and noise sigma_i adds (Delta_i/sigma_i)^2 to the session's mu^2, and the session has
spent the epsilon of one Gaussian release with that mu, at the session's delta. A request is admitted only if
that epsilon *after* it stays within the budget; otherwise `session_budget_exhausted`, and nothing changes.

The check and the debit are one transaction (BEGIN IMMEDIATE takes SQLite's write lock before the read), so
concurrent requests on one session, from threads or processes, are admitted one at a time against the spend
the previous one left: never past the budget. The database is in WAL mode with synchronous = FULL, so a debit
that returned survives a crash or a restart; the tables refuse UPDATEs that lower a spend and every DELETE.

**Ownership.** The first request on a session id records its `owner` (the server passes the subject of the
caller's rights envelope; a client keeps its own store under one owner). A request that names another owner
is refused with `session_owner_mismatch` and changes nothing. So a caller who replays someone else's session id
can neither spend that session's budget (a denial of service on its owner) nor learn how much is left. It can
still open sessions of its own: a session budget bounds what one session reveals, not what one subject reveals
over many sessions; a server that wants a bound per subject uses the subject as the session id.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from govtrain import units
from govtrain.accounting import gaussian
from govtrain.errors import Code, ConfigError, InferenceError
from govtrain.inference.mechanism import GaussianRelease, SessionBudget, check_session_id

VERSION = 1
SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    budget_epsilon_u INTEGER NOT NULL CHECK (budget_epsilon_u > 0),
    delta_p INTEGER NOT NULL CHECK (delta_p > 0),
    mu_sq INTEGER NOT NULL DEFAULT 0 CHECK (mu_sq >= 0),
    spent_epsilon_u INTEGER NOT NULL DEFAULT 0 CHECK (spent_epsilon_u <= budget_epsilon_u),
    requests INTEGER NOT NULL DEFAULT 0,
    created_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS debits (
    session_id TEXT NOT NULL REFERENCES sessions (session_id),
    seq INTEGER NOT NULL,
    epsilon_u INTEGER NOT NULL,
    delta_p INTEGER NOT NULL,
    clip_norm_u INTEGER NOT NULL,
    sigma_u INTEGER NOT NULL,
    mu_sq INTEGER NOT NULL,
    spent_epsilon_u INTEGER NOT NULL,
    time INTEGER NOT NULL,
    PRIMARY KEY (session_id, seq)
);
CREATE TRIGGER IF NOT EXISTS sessions_no_refund BEFORE UPDATE ON sessions
    WHEN NEW.mu_sq < OLD.mu_sq OR NEW.spent_epsilon_u < OLD.spent_epsilon_u OR NEW.requests < OLD.requests
      OR NEW.owner IS NOT OLD.owner OR NEW.budget_epsilon_u IS NOT OLD.budget_epsilon_u
      OR NEW.delta_p IS NOT OLD.delta_p
    BEGIN SELECT RAISE(ABORT, 'a session''s spend never decreases, and its owner and budget never change'); END;
CREATE TRIGGER IF NOT EXISTS sessions_no_delete BEFORE DELETE ON sessions
    BEGIN SELECT RAISE(ABORT, 'sessions are never deleted'); END;
CREATE TRIGGER IF NOT EXISTS debits_no_update BEFORE UPDATE ON debits
    BEGIN SELECT RAISE(ABORT, 'debits are append-only'); END;
CREATE TRIGGER IF NOT EXISTS debits_no_delete BEFORE DELETE ON debits
    BEGIN SELECT RAISE(ABORT, 'debits are append-only'); END;
"""


@dataclass(frozen=True, kw_only=True, slots=True)
class SessionState:
    """A session as stored: its owner, its budget, mu^2 of its admitted requests (`gaussian.MU_SQ_SCALE` units) and
    the epsilon they spent at the session's delta (micro-units, rounded up)."""

    session_id: str
    owner: str
    budget: SessionBudget
    mu_sq: int
    spent_epsilon_u: int
    requests: int

    @property
    def spent_epsilon(self) -> float:
        return self.spent_epsilon_u / units.MICRO

    @property
    def remaining_epsilon(self) -> float:
        return (self.budget.epsilon_u - self.spent_epsilon_u) / units.MICRO


@dataclass(frozen=True, kw_only=True, slots=True)
class DebitRecord:
    """One admitted request, as the store keeps it (append-only)."""

    session_id: str
    seq: int
    release: GaussianRelease
    mu_sq: int  # what it added
    spent_epsilon_u: int  # the session's spend after it
    time: int


class SessionStore:
    """Session budgets in the SQLite file `path` (created on first use, 0600). Safe to share between threads (one
    connection per thread) and processes (SQLite's locks); `now` gives the time debits record."""

    def __init__(self, path: str | os.PathLike[str], *, now: Callable[[], float] = time.time,
                 busy_timeout_s: float = 60.0) -> None:
        self.path = Path(path)
        self._now = now
        self._timeout = busy_timeout_s
        self._local = threading.local()
        if not self.path.parent.is_dir():
            raise ConfigError(Code.BAD_ARGUMENT, f"{self.path.parent}: no such folder for the session store")
        if not self.path.exists():
            fd = os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o600)  # no one else reads which sessions exist
            os.close(fd)
        try:
            connection = self._connection()
            version = connection.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, VERSION):
                raise ConfigError(Code.BAD_ARGUMENT, f"{self.path}: a session store of version {version}; this "
                                                     f"govtrain reads version {VERSION}")
            if connection.execute("PRAGMA journal_mode").fetchone()[0] != "wal":  # persistent: set once, at creation
                connection.execute("PRAGMA journal_mode = WAL")
            connection.executescript(f"BEGIN IMMEDIATE;\n{SCHEMA}\nPRAGMA user_version = {VERSION};\nCOMMIT;")
        except sqlite3.DatabaseError as e:
            raise ConfigError(Code.BAD_ARGUMENT, f"{self.path}: not a session store ({e})") from None

    def _connection(self) -> sqlite3.Connection:
        held = getattr(self._local, "connection", None)
        if held is not None and self._local.pid == os.getpid():
            return held
        # autocommit mode: every transaction is opened here, explicitly, and IMMEDIATE where it writes
        connection = sqlite3.connect(self.path, timeout=self._timeout, isolation_level=None)
        connection.execute("PRAGMA synchronous = FULL")
        connection.execute("PRAGMA foreign_keys = ON")
        self._local.connection, self._local.pid = connection, os.getpid()
        return connection

    def close(self) -> None:
        """Close this thread's connection (others close with their threads)."""
        held = getattr(self._local, "connection", None)
        if held is not None:
            held.close()
            self._local.connection = None

    def __enter__(self) -> "SessionStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading ----------------------------------------------------------------------------------------------

    def session(self, session_id: str, *, owner: str) -> SessionState | None:
        """The session `session_id` as its `owner` sees it; None where there is none; `session_owner_mismatch`
        where another owner holds it."""
        row = self._connection().execute(_SELECT, (check_session_id(session_id),)).fetchone()
        if row is None:
            return None
        state = _state(row)
        _check_owner(state, owner)
        return state

    def debits(self, session_id: str, *, owner: str) -> list[DebitRecord]:
        """Every admitted request of the session, in order."""
        if self.session(session_id, owner=owner) is None:
            return []
        rows = self._connection().execute(
            "SELECT seq, epsilon_u, delta_p, clip_norm_u, sigma_u, mu_sq, spent_epsilon_u, time FROM debits "
            "WHERE session_id = ? ORDER BY seq", (session_id,)).fetchall()
        return [DebitRecord(session_id=session_id, seq=r[0], release=GaussianRelease(
            epsilon_u=r[1], delta_p=r[2], clip_norm_u=r[3], sigma_u=r[4]), mu_sq=r[5], spent_epsilon_u=r[6],
            time=r[7]) for r in rows]

    # -- writing ----------------------------------------------------------------------------------------------

    def open_session(self, session_id: str, *, owner: str, budget: SessionBudget) -> SessionState:
        """The session `session_id`, created for `owner` with `budget` where it does not exist. An existing one
        keeps the budget it was created with (a budget is never raised by asking again)."""
        return self._transaction(session_id, owner, budget, None)

    def debit(self, session_id: str, release: GaussianRelease, *, owner: str, budget: SessionBudget) -> SessionState:
        """Admit one request of mechanism `release` on the session and charge it, atomically; the session is
        created for `owner` with `budget` where it does not exist. Returns the session after the debit.
        Refusals change nothing: `session_budget_exhausted` (the session's epsilon after the request would pass
        its budget), `session_owner_mismatch` (the id is another owner's)."""
        return self._transaction(session_id, owner, budget, release)

    def _transaction(self, session_id: str, owner: str, budget: SessionBudget,
                     release: GaussianRelease | None) -> SessionState:
        check_session_id(session_id)
        if not isinstance(owner, str) or not owner:
            raise TypeError("owner is the non-empty name of whoever holds the session")
        connection = self._connection()
        connection.execute("BEGIN IMMEDIATE")  # the write lock before the read: check and debit see one state
        try:
            row = connection.execute(_SELECT, (session_id,)).fetchone()
            if row is None:
                state = SessionState(session_id=session_id, owner=owner, budget=budget, mu_sq=0, spent_epsilon_u=0,
                                     requests=0)
            else:
                state = _state(row)
                _check_owner(state, owner)
            now = int(self._now())
            if release is not None:
                state = _charged(state, release)
            if row is None:
                connection.execute(
                    "INSERT INTO sessions (session_id, owner, budget_epsilon_u, delta_p, created_at) "
                    "VALUES (?, ?, ?, ?, ?)", (session_id, owner, budget.epsilon_u, budget.delta_p, now))
            if release is not None:
                connection.execute("UPDATE sessions SET mu_sq = ?, spent_epsilon_u = ?, requests = ? WHERE "
                                   "session_id = ?", (state.mu_sq, state.spent_epsilon_u, state.requests, session_id))
                connection.execute(
                    "INSERT INTO debits (session_id, seq, epsilon_u, delta_p, clip_norm_u, sigma_u, mu_sq, "
                    "spent_epsilon_u, time) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (session_id, state.requests, release.epsilon_u, release.delta_p, release.clip_norm_u,
                     release.sigma_u, release.mu_sq, state.spent_epsilon_u, now))
            connection.execute("COMMIT")
        except BaseException:
            connection.execute("ROLLBACK")
            raise
        return state


_SELECT = ("SELECT session_id, owner, budget_epsilon_u, delta_p, mu_sq, spent_epsilon_u, requests FROM sessions "
           "WHERE session_id = ?")


def _state(row: tuple) -> SessionState:
    return SessionState(session_id=row[0], owner=row[1], budget=SessionBudget(epsilon_u=row[2], delta_p=row[3]),
                        mu_sq=row[4], spent_epsilon_u=row[5], requests=row[6])


def _check_owner(state: SessionState, owner: str) -> None:
    if state.owner != owner:
        raise InferenceError(Code.SESSION_OWNER_MISMATCH, f"session {state.session_id!r} belongs to another caller: "
                                                          "choose a session id of your own (a fresh random one)")


def _charged(state: SessionState, release: GaussianRelease) -> SessionState:
    """The session after `release`, or `session_budget_exhausted`: exact composition, mu^2 summed."""
    mu_sq = state.mu_sq + release.mu_sq
    spent = gaussian.gdp_epsilon_u(mu_sq, state.budget.delta_p)
    if spent > state.budget.epsilon_u:
        raise InferenceError(Code.SESSION_BUDGET_EXHAUSTED, (
            f"session {state.session_id!r} has spent epsilon {state.spent_epsilon:.6f} of "
            f"{state.budget.epsilon:g} (delta {state.budget.delta:g}) over {state.requests} request(s); this one "
            f"(epsilon {release.epsilon:g}, delta {release.delta:g}) would bring it to {spent / units.MICRO:.6f}: "
            "ask for a smaller epsilon, or open a new session where the policy allows"))
    return SessionState(session_id=state.session_id, owner=state.owner, budget=state.budget, mu_sq=mu_sq,
                        spent_epsilon_u=spent, requests=state.requests + 1)
