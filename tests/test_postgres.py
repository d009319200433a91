"""The same ledger on PostgreSQL (psycopg 3): guarantees, concurrency, verification, retention."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine
from sqlalchemy.exc import DBAPIError

from govtrain.errors import IntegrityError
from govtrain.gate.admission import admit
from govtrain.ledger.ledger import Ledger
from govtrain.verify.verifier import verify_ledger
from tests.conftest import Corpus, snapshot
from tests.test_ledger_robustness import _concurrent_admissions


def _populate(c: Corpus) -> None:
    with c.open() as ledger:
        for i in range(4):
            data = c.data(f"pg{i}.jsonl")
            admit(ledger, c.attestation(data, contribution_id=f"pg{i}"), data, now=c.now)
        ledger.close_epoch(now=c.now)
        ledger.withdraw("pg1", "asked", now=c.now)
        ledger.close_epoch(now=c.now)
        data = c.data("pg-late.jsonl")
        admit(ledger, c.attestation(data, contribution_id="pg-late"), data, now=c.now)


def test_postgres_ledger_verifies_withdraws_and_compacts(pg_corpus: Corpus):
    _populate(pg_corpus)
    report = verify_ledger(pg_corpus.url)
    assert (report.entries, report.admissions, report.withdrawals, report.epochs) == (9, 5, 1, 2)
    with pg_corpus.open() as ledger:
        summarized = ledger.compact(1, now=pg_corpus.now)
    assert [s.seq for s in summarized] == [1, 3, 4]  # pg1 (entry 2) is withdrawn after the boundary: kept
    assert verify_ledger(pg_corpus.url).redacted == 3


@pytest.mark.parametrize("statement", [
    "UPDATE entries SET body = '\\x00'::bytea WHERE seq = 1",
    "UPDATE entries SET body = NULL WHERE seq = 1",  # not summarized
    "DELETE FROM entries WHERE seq = 8",
    "TRUNCATE entries CASCADE",
    "UPDATE admissions SET data_class = 'x'",
    "DELETE FROM checkpoints",
    "TRUNCATE tree_nodes",
])
def test_postgres_triggers_refuse_changes(pg_corpus: Corpus, statement: str):
    _populate(pg_corpus)
    before = snapshot(pg_corpus.url)
    engine = create_engine(pg_corpus.url)
    with pytest.raises(DBAPIError, match="append-only"):
        with engine.begin() as connection:
            connection.exec_driver_sql(statement)
    engine.dispose()
    assert snapshot(pg_corpus.url) == before


def test_postgres_tamper_is_detected(pg_corpus: Corpus):
    _populate(pg_corpus)
    engine = create_engine(pg_corpus.url)
    with engine.begin() as connection:
        connection.exec_driver_sql("DROP TRIGGER entries_guard ON entries")
        connection.exec_driver_sql("UPDATE entries SET body = overlay(body placing '\\x00'::bytea from 20) "
                                   "WHERE seq = 3")
    engine.dispose()
    with pytest.raises(IntegrityError) as info:
        verify_ledger(pg_corpus.url)
    assert info.value.code.value == "leaf_hash_mismatch" and info.value.seq == 3


def test_four_writers_append_500_each_on_postgresql(pg_corpus: Corpus):
    _concurrent_admissions(pg_corpus, pg_corpus.url)


def test_postgres_url_errors(pg_url: str):
    from govtrain.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        Ledger.open(pg_url)  # an empty database is not a ledger
    assert info.value.code.value == "ledger_missing"
