"""The ledger under load (bench/ledger_load.py, shortened), and the fixes it needed: a lost or locked database is
`ledger_unavailable`, a write is retried only where that cannot append it twice, a verifier reads one snapshot."""

from __future__ import annotations

import os
import sqlite3
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from govtrain.errors import Code, ConfigError, GovtrainError
from govtrain.gate.admission import admit
from govtrain.verify.verifier import verify_ledger
from tests.conftest import Corpus, snapshot
from tests.pg_cluster import Cluster, binaries

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from ledger_load import UNAVAILABLE, passed, report_lines, run_load  # noqa: E402


def _check(result: dict) -> None:
    assert passed(result), "\n".join(report_lines(result, "test"))
    for op in ("admit", "withdraw", "spend"):
        assert result["operations"][op]["ok"] > 0, op
    verifier = result["verifier"]
    assert verifier["audits"] and verifier["consistency"] > 0 and verifier["inclusion"] > 0


@pytest.mark.slow
def test_four_writers_and_a_verifier_on_sqlite(tmp_path: Path):
    result = run_load(f"sqlite:///{tmp_path / 'ledger.db'}", tmp_path, seconds=10, writers=4)
    _check(result)
    assert not any(result["operations"][op]["failed"] for op in ("admit", "withdraw", "spend"))


@pytest.mark.slow
def test_four_writers_and_a_verifier_on_postgresql(tmp_path: Path, pg_url: str):
    result = run_load(pg_url, tmp_path, seconds=10, writers=4)
    _check(result)


@pytest.mark.slow
def test_postgresql_restarted_mid_load_loses_nothing(tmp_path: Path):
    if binaries() is None:
        reason = "no PostgreSQL binaries (initdb, pg_ctl) to start a cluster of the test's own"
        if os.environ.get("CI"):
            pytest.fail(f"PostgreSQL is required under CI: {reason}")
        pytest.skip(f"POSTGRESQL RESTART TEST SKIPPED: {reason}")
    cluster = Cluster().start()
    try:
        result = run_load(cluster.url, tmp_path, seconds=12, writers=4, restart=cluster.restart)
    finally:
        cluster.remove()
    assert result["restart_downtime_s"] is not None
    _check(result)  # contiguous, every checkpoint verifies, index rows, nothing lost or doubled, no traceback
    failed = {code for op in ("admit", "withdraw", "spend") for code in result["operations"][op]["failed"]}
    assert failed <= set(UNAVAILABLE)  # a writer either succeeded or failed with the database's coded error


# -- the fixes, one by one ------------------------------------------------------------------------------------------


def _flaky_commits(ledger, *, landed: bool, times: int = 1):
    """The store's next `times` write transactions fail as a dropped connection would: after committing (the
    acknowledgement lost) where `landed`, else before COMMIT (rolled back)."""
    original, left = ledger.store.append, [times]

    @contextmanager
    def append():
        lost = ConfigError(Code.LEDGER_UNAVAILABLE, "connection lost (simulated)")
        if landed:
            with original() as appender:
                yield appender
            if left[0] > 0:
                left[0] -= 1
                raise lost
            return
        with original() as appender:
            yield appender
            if left[0] > 0:
                left[0] -= 1
                raise lost

    ledger.store.append = append
    return left


def _admitted(corpus: Corpus, name: str) -> None:
    with corpus.open() as ledger:
        data = corpus.data(f"{name}.jsonl")
        admit(ledger, corpus.attestation(data, contribution_id=name), data, now=corpus.now)


@pytest.mark.parametrize("landed", [True, False])
def test_a_write_whose_connection_dropped_is_in_the_ledger_exactly_once(corpus: Corpus, landed: bool):
    _admitted(corpus, "c1")
    before = snapshot(corpus.url)
    with corpus.open() as ledger:
        left = _flaky_commits(ledger, landed=landed)
        stored = ledger.withdraw("c1", "asked", now=corpus.now)  # no error: committed, or retried once
        assert left == [0]
    size, head, admissions = snapshot(corpus.url)
    assert (size, admissions) == (before[0] + 1, before[2]) and head == stored.leaf_hash
    report = verify_ledger(corpus.url)
    assert report.withdrawals == 1 and report.by_kind["withdraw"] == 1


def test_a_commit_that_cannot_be_confirmed_is_not_retried(corpus: Corpus):
    _admitted(corpus, "c1")
    with corpus.open() as ledger:
        ledger.retry_s = 0.2
        calls = []
        original = ledger.store.append

        @contextmanager
        def append():
            calls.append(1)
            if len(calls) > 1:  # the database never answers again
                raise ConfigError(Code.LEDGER_UNAVAILABLE, "connection refused (simulated)")
            with original() as appender:
                yield appender
            raise ConfigError(Code.LEDGER_UNAVAILABLE, "connection lost while committing (simulated)")

        ledger.store.append = append
        with pytest.raises(ConfigError) as info:
            ledger.withdraw("c1", "asked", now=corpus.now)
    assert info.value.code is Code.WRITE_UNCONFIRMED and info.value.exit_code == 2
    assert verify_ledger(corpus.url).withdrawals == 1  # it had landed; the writer was told to look, not to redo


def test_a_locked_sqlite_database_is_ledger_unavailable_and_changes_nothing(corpus: Corpus):
    _admitted(corpus, "c1")
    before = snapshot(corpus.url)
    path = corpus.url.removeprefix("sqlite:///")
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with corpus.open() as ledger:
            ledger.retry_s = 0.3
            with ledger.store.engine.connect() as connection:  # the pool's one connection: stop waiting soon
                connection.exec_driver_sql("PRAGMA busy_timeout=20")
            with pytest.raises(GovtrainError) as info:
                ledger.withdraw("c1", "asked", now=corpus.now)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert info.value.code is Code.LEDGER_UNAVAILABLE and info.value.line().startswith("error[ledger_unavailable]: ")
    assert "\n" not in info.value.line()
    assert snapshot(corpus.url) == before
    verify_ledger(corpus.url)


def test_an_unreachable_postgresql_server_is_ledger_unavailable():
    from govtrain.ledger.ledger import Ledger

    with pytest.raises(ConfigError) as info:  # nothing listens on port 1
        Ledger.open("postgresql+psycopg://postgres:secret@127.0.0.1:1/postgres")
    assert info.value.code is Code.LEDGER_UNAVAILABLE and "secret" not in info.value.line()


def test_a_verifier_reads_one_snapshot_while_writers_append(corpus: Corpus):
    _admitted(corpus, "c1")
    with corpus.open() as reader, corpus.open() as writer:
        with reader.store.snapshot():
            size = reader.store.size()
            writer.withdraw("c1", "asked", now=corpus.now)
            _admitted(corpus, "c2")
            assert reader.store.size() == size == reader.store.latest_checkpoint().size
            assert [row.contribution_id for row in reader.store.admissions()] == ["c1"]
            assert reader.store.withdrawals() == {}
        assert reader.store.size() == size + 2


def test_a_lost_write_whose_positions_another_writer_took_runs_again(corpus: Corpus):
    """A write lost while committing that did not land, whose sequence numbers another writer's entries hold by
    the time it asks: those rows are not its own and do not pass for it, so it runs again (not `fork`)."""
    _admitted(corpus, "c1")
    before = snapshot(corpus.url)
    with corpus.open() as ledger:
        original, calls = ledger.store.append, [0]

        class Lost(Exception):
            pass

        @contextmanager
        def append():
            calls[0] += 1
            if calls[0] > 1:
                with original() as appender:
                    yield appender
                return
            try:
                with original() as appender:
                    yield appender
                    raise Lost  # rolled back, as a commit that never reached the server
            except Lost:
                pass
            _admitted(corpus, "c2")  # meanwhile, another writer appends at the same positions
            raise ConfigError(Code.LEDGER_UNAVAILABLE, "connection lost while committing (simulated)")

        ledger.store.append = append
        stored = ledger.withdraw("c1", "asked", now=corpus.now)
    assert calls[0] == 3  # the lost write, the landed check, the rerun
    size, head, admissions = snapshot(corpus.url)
    assert (size, head, admissions) == (before[0] + 2, stored.leaf_hash, before[2] + 1)
    assert verify_ledger(corpus.url).withdrawals == 1
