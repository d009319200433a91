"""What the gate remembers of its ledger (`govtrain/serve/memory.py`, docs/serving.md "The gate"): the largest
verified tree per origin and every withdrawal seen per release, in its SQLite store, so that no rolled-back or
forked ledger, and no restart, unsees a withdrawal; and how often a caller without an envelope can make the gate
read its ledger (`TaintWatch`, `GET /v1/info`)."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import pytest

from govtrain.errors import Code, ConfigError, IntegrityError, ServeError
from govtrain.ledger.merkle import MerkleTree
from govtrain.serve.gate import TAINT_UNREADABLE, TaintReading, TaintWatch
from govtrain.serve.memory import LedgerMemory, SeenWithdrawal

ORIGIN = "test.invalid/memory"
RELEASE = hashlib.sha256(b"a release").digest()


def _leaves(count: int, salt: bytes = b"") -> list[bytes]:
    return [hashlib.sha256(salt + i.to_bytes(4, "big")).digest() for i in range(count)]


def _advance(memory: LedgerMemory, leaves: list[bytes], withdrawals=(),  # type: ignore[no-untyped-def]
             *, now: int = 100):
    tree = MerkleTree(leaves, len(leaves))
    return memory.advance(origin=ORIGIN, size=len(leaves), root=tree.root(),
                          consistency=lambda old: tree.consistency_proof(old, len(leaves)),
                          release_sha256=RELEASE, withdrawals=list(withdrawals), now=now)


def _withdrawal(seq: int, name: str = "restr") -> SeenWithdrawal:
    return SeenWithdrawal(contribution_id=name, seq=seq, leaf_hash=hashlib.sha256(name.encode()).digest(), time=seq)


def test_a_tree_that_extends_the_remembered_one_moves_it_and_keeps_every_withdrawal(tmp_path: Path):
    leaves = _leaves(12)
    memory = LedgerMemory(tmp_path / "gate.db")
    assert _advance(memory, leaves[:5]) == ()
    seen = _advance(memory, leaves[:9], [_withdrawal(7)])
    assert [w.seq for w in seen] == [7] and memory.tree(ORIGIN) == (9, MerkleTree(leaves, 9).root())
    # a later reading that no longer lists it (a body dropped, a reader's bug): still withdrawn
    assert [w.seq for w in _advance(memory, leaves, [_withdrawal(10, "other")])] == [7, 10]
    memory.close()
    again = LedgerMemory(tmp_path / "gate.db")  # a restart
    assert again.tree(ORIGIN) == (12, MerkleTree(leaves, 12).root())
    assert [w.seq for w in _advance(again, leaves)] == [7, 10]
    assert (tmp_path / "gate.db").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("reading, code", [
    (lambda leaves: leaves[:8], Code.ROLLBACK),  # behind the tree seen: an older copy put back
    (lambda leaves: leaves[:9] + _leaves(1, b"fork"), Code.FORK),  # the same size, another root
    (lambda leaves: leaves[:5] + _leaves(7, b"fork"), Code.FORK),  # larger, but not an extension
])
def test_a_ledger_behind_or_beside_the_tree_seen_is_refused_and_changes_nothing(tmp_path: Path, reading, code):
    leaves = _leaves(12)
    memory = LedgerMemory(tmp_path / "gate.db")
    _advance(memory, leaves[:10], [_withdrawal(9)])
    held = memory.tree(ORIGIN)
    with pytest.raises(IntegrityError) as refused:
        _advance(memory, reading(leaves), [_withdrawal(3, "forged")])
    assert refused.value.code is code
    assert memory.tree(ORIGIN) == held and [w.seq for w in _advance(memory, leaves[:10])] == [9]


def test_the_store_refuses_to_shrink_a_tree_or_forget_a_withdrawal(tmp_path: Path):
    memory = LedgerMemory(tmp_path / "gate.db")
    _advance(memory, _leaves(6), [_withdrawal(4), _withdrawal(7, "tail")])  # 4 signed, 7 sighted past the tree
    memory.close()
    with sqlite3.connect(tmp_path / "gate.db") as db:
        for statement in ("UPDATE gate_ledger_trees SET size = 2", "UPDATE gate_ledger_trees SET root = zeroblob(32)",
                          "DELETE FROM gate_ledger_trees", "DELETE FROM gate_signed_withdrawals",
                          "UPDATE gate_signed_withdrawals SET contribution_id = 'x'",
                          "UPDATE gate_signed_withdrawals SET time = 1", "DELETE FROM gate_tail_sightings",
                          "UPDATE gate_tail_sightings SET seen_at = 1",
                          "UPDATE gate_tail_sightings SET resolved = 'refuted'",  # a resolution needs its time
                          "UPDATE gate_tail_sightings SET resolved = 'refuted', resolved_at = 1, time = 1"):
            with pytest.raises(sqlite3.IntegrityError):
                db.execute(statement)


def test_a_caller_without_an_envelope_reads_the_ledger_at_most_once_per_max_age():
    clock, reads = [1000.0], []

    def read(now: int) -> TaintReading:
        reads.append(now)
        if fail[0]:
            raise IntegrityError(Code.ROLLBACK, "sqlite:///secret/place.db was rolled back")
        return TaintReading(withdrawn=(), since=None, checked_at=now)

    fail = [False]
    watch = TaintWatch(read, ttl_s=0, grace_s=0, clock=lambda: clock[0])
    for _ in range(5):
        watch.reading(max_age_s=10)
    assert len(reads) == 1
    watch.check()  # an enveloped request under ttl 0 reads every time (the policy says so)
    assert len(reads) == 2
    fail[0], clock[0] = True, 1011.0
    for _ in range(5):
        with pytest.raises(ServeError) as refused:
            watch.reading(max_age_s=10)
        assert refused.value.code is Code.TAINT_UNKNOWN and refused.value.detail == TAINT_UNREADABLE
    assert len(reads) == 3 and "rolled back" in watch.failure  # one read; the cause kept for the operator
    clock[0] = 1021.0
    with pytest.raises(ServeError):
        watch.reading(max_age_s=10)
    assert len(reads) == 4


# -- the gate: a restart remembers ------------------------------------------------------------------------------


def test_a_gate_restarted_on_a_ledger_rolled_back_behind_a_withdrawal_refuses_to_start(tmp_path_factory,
                                                                                      tmp_path: Path):
    pytest.importorskip("torch")
    pytest.importorskip("fastapi")
    from govtrain.serve.rights import HEADER
    from govtrain.serve.service import INFO_TAINT_AGE_S
    from tests.release_setup import trained_release
    from tests.serve_setup import TEXTS, deploy

    deployment = deploy(trained_release(tmp_path_factory).copy(tmp_path / "copy"),
                        release_extra="taint_check_seconds = 0")
    database = deployment.released.root / "ledger.db"
    with sqlite3.connect(database) as a, sqlite3.connect(tmp_path / "before.db") as b:
        a.backup(b)
    gate = deployment.start()
    try:
        with deployment.released.open() as ledger:
            ledger.withdraw("restr", "the contributor asked", now=ledger.store.head().time)
        # GET /v1/info, which needs no envelope, reuses the start-up reading: it made the gate read nothing
        deployment.clock[0] += INFO_TAINT_AGE_S - 1
        assert gate.info()["taint"]["withdrawn_since"] == []
        deployment.clock[0] += 1
        assert gate.info()["taint"]["withdrawn_since"] == ["restr"]
        with pytest.raises(ServeError) as tainted:
            gate.classify(deployment.rights()[HEADER], TEXTS)
        assert tainted.value.code is Code.RELEASE_TAINTED
    finally:
        gate.close()
    with sqlite3.connect(tmp_path / "before.db") as a, sqlite3.connect(database) as b:
        a.backup(b)  # the ledger, rolled back while the gate was down
    with pytest.raises(ConfigError) as refused:
        deployment.start()
    assert refused.value.code is Code.TAINT_UNKNOWN and "rolled back" in refused.value.detail
