"""Session budgets (`govtrain.inference.budget`): exact composition decides admission (checked against
dp-accounting's PLD accountant), a refusal changes nothing, a restart forgets nothing, the tables refuse refunds."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from govtrain.accounting import gaussian
from govtrain.errors import Code, ConfigError, InferenceError
from govtrain.inference.budget import SessionStore
from govtrain.inference.mechanism import release_for, session_budget

REPO = Path(__file__).resolve().parents[1]
BUDGET = session_budget(3.0, 1e-6)
REQUEST = release_for(1.0, 1e-6, 1.0)
ADMITTED = 7  # epsilon 1 per request at delta 1e-6: 7 compose to 2.89, 8 to 3.11 (the sum would stop at 3)


def pld_epsilon(releases, delta: float) -> float:
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant

    pld = pld_privacy_accountant.PLDAccountant()
    for release in dict.fromkeys(releases):  # each distinct mechanism self-composed: one convolution per count
        pld.compose(dp_event.GaussianDpEvent(release.sigma_u / release.sensitivity_u), releases.count(release))
    return pld.get_epsilon(delta)


def fill(store: SessionStore, session: str = "s1", owner: str = "alice") -> int:
    """Debit REQUEST until refused; the number admitted."""
    admitted = 0
    while True:
        try:
            store.debit(session, REQUEST, owner=owner, budget=BUDGET)
        except InferenceError as e:
            assert e.code is Code.SESSION_BUDGET_EXHAUSTED
            return admitted
        admitted += 1


def test_requests_are_admitted_while_their_exact_composition_fits_the_budget(tmp_path: Path):
    with SessionStore(tmp_path / "s.db", now=lambda: 1_700_000_000) as store:
        assert fill(store) == ADMITTED
        state = store.session("s1", owner="alice")
        assert state.requests == ADMITTED and state.mu_sq == ADMITTED * REQUEST.mu_sq
        composed = gaussian.gdp_epsilon_u(ADMITTED * REQUEST.mu_sq, BUDGET.delta_p)
        assert state.spent_epsilon_u == composed <= BUDGET.epsilon_u
        # A second library agrees: PLD composition of the admitted requests fits, one more does not.
        assert pld_epsilon([REQUEST] * ADMITTED, 1e-6) <= 3.0 < pld_epsilon([REQUEST] * (ADMITTED + 1), 1e-6)
        assert state.spent_epsilon == pytest.approx(pld_epsilon([REQUEST] * ADMITTED, 1e-6), rel=2e-3)
        debits = store.debits("s1", owner="alice")
        assert [d.seq for d in debits] == list(range(1, ADMITTED + 1)) and {d.time for d in debits} == {1_700_000_000}
        assert all(d.release == REQUEST for d in debits) and debits[-1].spent_epsilon_u == state.spent_epsilon_u


def test_a_refused_request_changes_nothing(tmp_path: Path):
    with SessionStore(tmp_path / "s.db") as store:
        fill(store)
        before = (store.session("s1", owner="alice"), store.debits("s1", owner="alice"))
        small = release_for(0.01, 1e-6, 1.0)  # even a small request no longer fits
        with pytest.raises(InferenceError) as info:
            store.debit("s1", release_for(5.0, 1e-6, 1.0), owner="alice", budget=BUDGET)
        assert info.value.code is Code.SESSION_BUDGET_EXHAUSTED and "2.889882 of 3" in info.value.detail
        assert (store.session("s1", owner="alice"), store.debits("s1", owner="alice")) == before
        # A first request that alone exceeds the budget does not even create its session.
        with pytest.raises(InferenceError):
            store.debit("s2", release_for(5.0, 1e-6, 1.0), owner="alice", budget=BUDGET)
        assert store.session("s2", owner="alice") is None
        state = store.debit("s1", small, owner="alice", budget=BUDGET)  # what still fits is still admitted
        assert state.requests == ADMITTED + 1


def test_mixed_requests_are_charged_their_composition(tmp_path: Path):
    releases = [release_for(0.5, 1e-5, 1.0), release_for(2.0, 1e-8, 4.0), release_for(1.0, 1e-6, 0.5)]
    with SessionStore(tmp_path / "s.db") as store:
        for release in releases:
            state = store.debit("mixed", release, owner="alice", budget=session_budget(10.0, 1e-6))
        assert state.spent_epsilon == pytest.approx(pld_epsilon(releases, 1e-6), rel=2e-3)
        assert [d.release for d in store.debits("mixed", owner="alice")] == releases


def test_budgets_survive_a_restart(tmp_path: Path):
    path = tmp_path / "s.db"
    with SessionStore(path) as store:
        for _ in range(4):
            store.debit("s1", REQUEST, owner="alice", budget=BUDGET)
        before = (store.session("s1", owner="alice"), store.debits("s1", owner="alice"))
    with SessionStore(path) as reopened:  # the same file, a new store
        assert (reopened.session("s1", owner="alice"), reopened.debits("s1", owner="alice")) == before
    child = ("import sys; import govtrain.inference; from govtrain.inference.budget import SessionStore\n"
             "from govtrain.inference.mechanism import release_for, session_budget\n"
             f"store = SessionStore({str(path)!r})\n"
             "print(store.session('s1', owner='alice').requests)\n"
             "store.debit('s1', release_for(1.0, 1e-6, 1.0), owner='alice', budget=session_budget(3.0, 1e-6))\n"
             "assert 'torch' not in sys.modules, 'the budgets imported torch'\n")
    result = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "4"  # another process read the spend, then added to it
    with SessionStore(path) as store:
        assert fill(store) == ADMITTED - 5  # the restarted spend, not a fresh budget


def test_asking_again_never_raises_a_sessions_budget(tmp_path: Path):
    with SessionStore(tmp_path / "s.db") as store:
        store.open_session("s1", owner="alice", budget=BUDGET)
        state = store.open_session("s1", owner="alice", budget=session_budget(100.0, 1e-3))
        assert state.budget == BUDGET
        assert fill(store) == ADMITTED


def test_the_tables_refuse_refunds_and_deletions(tmp_path: Path):
    path = tmp_path / "s.db"
    with SessionStore(path) as store:
        fill(store)
        before = store.session("s1", owner="alice")
    raw = sqlite3.connect(path)
    for statement in ("UPDATE sessions SET mu_sq = 0", "UPDATE sessions SET spent_epsilon_u = 0",
                      "UPDATE sessions SET budget_epsilon_u = budget_epsilon_u * 2", "UPDATE sessions SET owner = 'x'",
                      "DELETE FROM sessions", "DELETE FROM debits", "UPDATE debits SET mu_sq = 0"):
        with pytest.raises(sqlite3.DatabaseError):
            raw.execute(statement)
    with pytest.raises(sqlite3.IntegrityError):  # a spend past the budget cannot be written either
        raw.execute("UPDATE sessions SET spent_epsilon_u = budget_epsilon_u + 1")
    raw.close()
    with SessionStore(path) as store:
        assert store.session("s1", owner="alice") == before


def test_a_file_that_is_not_a_session_store_is_refused(tmp_path: Path):
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not sqlite at all" * 100)
    with pytest.raises(ConfigError) as info:
        SessionStore(junk)
    assert info.value.code is Code.BAD_ARGUMENT
    with pytest.raises(ConfigError):
        SessionStore(tmp_path / "no-such-folder" / "s.db")
    store = SessionStore(tmp_path / "new.db")
    assert (tmp_path / "new.db").stat().st_mode & 0o777 == 0o600
    store.close()


def test_session_ids_have_a_form(tmp_path: Path):
    with SessionStore(tmp_path / "s.db") as store:
        for bad in ("", "a b", "x" * 129, "../s", None, 7):
            with pytest.raises(InferenceError) as info:
                store.debit(bad, REQUEST, owner="alice", budget=BUDGET)
            assert info.value.code is Code.BAD_SPLIT_REQUEST
        with pytest.raises(TypeError):
            store.debit("s1", REQUEST, owner="", budget=BUDGET)
