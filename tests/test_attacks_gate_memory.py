"""The gate's memory against a database writer without keys (issue 34 item 4): a forged, unsigned withdraw entry
appended past the signed tree, then the database restored, then the real withdrawal signed at the same sequence
number. The memory kept the first version it saw (`INSERT OR IGNORE`), so the forged time (2100) held the grace
period open for ever, and the forged entry tainted the release for good once the ledger was restored. Now a
sighting in an unsigned tail is settled by the signed entry at its sequence number, answered `taint_unknown` while
unsettled, and no withdrawal's time is later than when the gate first saw it (`govtrain/serve/memory.py`).

The state machine, each edge a test: sighted -> signed (same leaf); sighted -> refuted (another signed entry);
sighted -> vanished or contradicted (unsettled: 503) -> signed or refuted; signed -> another signed version (a
fork: refused, nothing remembered); and every state across a restart. Then the issue's three steps end to end,
with a real uvicorn and an injected clock."""

from __future__ import annotations

import hashlib
import sqlite3
import time
from pathlib import Path

import pytest

from govtrain.errors import Code, IntegrityError
from govtrain.ledger.merkle import MerkleTree
from govtrain.serve.memory import LedgerMemory, SeenWithdrawal

ORIGIN = "test.invalid/memory"
RELEASE = hashlib.sha256(b"a release").digest()
Y2100 = 4_102_444_800  # 2100-01-01T00:00:00Z


def _leaves(count: int, salt: bytes = b"") -> list[bytes]:
    return [hashlib.sha256(salt + i.to_bytes(4, "big")).digest() for i in range(count)]


def _withdrawal(seq: int, name: str = "restr", *, time: int = 50, version: bytes = b"") -> SeenWithdrawal:
    return SeenWithdrawal(contribution_id=name, seq=seq, leaf_hash=hashlib.sha256(name.encode() + version).digest(),
                          time=time)


def _advance(memory: LedgerMemory, leaves: list[bytes], withdrawals=(), *, now: int):  # type: ignore[no-untyped-def]
    """A reading of the signed tree `leaves`, with `withdrawals` past it read in an unsigned tail that holds them
    (at the next sequence numbers)."""
    tree = MerkleTree(leaves, len(leaves))
    tail = [w.leaf_hash for w in sorted(withdrawals, key=lambda w: w.seq) if w.seq >= len(leaves)]
    return memory.advance(origin=ORIGIN, size=len(leaves), root=tree.root(),
                          consistency=lambda old: tree.consistency_proof(old, len(leaves)),
                          release_sha256=RELEASE, withdrawals=list(withdrawals), now=now, leaves=[*leaves, *tail])


def _rows(path: Path) -> dict[str, list[tuple]]:
    with sqlite3.connect(path) as db:
        return {table: db.execute(f"SELECT * FROM {table} ORDER BY 1, 2").fetchall()
                for table in ("gate_ledger_trees", "gate_signed_withdrawals", "gate_tail_sightings")}


def _unsettled(memory: LedgerMemory, leaves: list[bytes], withdrawals=(), *, now: int) -> None:  # type: ignore
    with pytest.raises(IntegrityError) as refused:
        _advance(memory, leaves, withdrawals, now=now)
    assert refused.value.code is Code.UNSIGNED_TAIL and "govtrain-verify" in refused.value.detail


# -- the memory's state machine ----------------------------------------------------------------------------------


def test_a_forged_tail_withdrawal_timed_2100_counts_from_when_the_gate_first_saw_it(tmp_path: Path):
    leaves = _leaves(10)
    memory = LedgerMemory(tmp_path / "gate.db")
    seen = _advance(memory, leaves, [_withdrawal(10, time=Y2100, version=b"forged")], now=1000)
    assert [(w.seq, w.time) for w in seen] == [(10, 1000)]  # a sighting: its stated time is nobody's statement
    assert [(w.seq, w.time) for w in _advance(memory, leaves, [_withdrawal(10, time=Y2100, version=b"forged")],
                                              now=5000)] == [(10, 1000)]  # first seen, not last


def test_a_forged_tail_replaced_by_the_real_signed_withdrawal_counts_grace_from_the_signed_time(tmp_path: Path):
    """The issue's steps 1-3 against the memory: the forged entry at seq 10 is seen, the database restored (the
    tail is gone: unsettled), the real withdrawal signed at seq 10. The signed one decides, with its own time."""
    leaves = _leaves(10)
    memory = LedgerMemory(tmp_path / "gate.db")
    forged = _withdrawal(10, time=Y2100, version=b"forged")
    _advance(memory, leaves, [forged], now=1000)
    _unsettled(memory, leaves, now=1100)  # restored: the sighting is gone and nothing signs seq 10 yet
    real = _withdrawal(10, time=1200, version=b"real")
    later = leaves + [real.leaf_hash]
    seen = _advance(memory, later, [real], now=1300)
    assert [(w.seq, w.leaf_hash, w.time) for w in seen] == [(10, real.leaf_hash, 1200)]
    memory.close()
    again = LedgerMemory(tmp_path / "gate.db")  # a restart remembers the resolution
    assert [(w.leaf_hash, w.time) for w in _advance(again, later, [real], now=1400)] == [(real.leaf_hash, 1200)]
    assert [row[6] for row in _rows(tmp_path / "gate.db")["gate_tail_sightings"]] == ["refuted"]


def test_a_forged_tail_that_vanishes_is_unsettled_until_the_signed_tree_passes_it_then_taints_no_more(
        tmp_path: Path):
    leaves = _leaves(10)
    memory = LedgerMemory(tmp_path / "gate.db")
    _advance(memory, leaves, [_withdrawal(10, time=Y2100, version=b"forged")], now=1000)
    _unsettled(memory, leaves, now=1100)
    memory.close()
    memory = LedgerMemory(tmp_path / "gate.db")  # a restart does not forget it either
    _unsettled(memory, leaves, now=1200)
    # the ledger signs an honest entry (an epoch, an admission) at seq 10: the sighting was not the ledger's
    assert _advance(memory, _leaves(12), now=1300) == ()
    assert _advance(memory, _leaves(12), now=1400) == ()  # and stays settled


def test_a_tail_withdrawal_later_signed_as_it_was_read_keeps_the_time_first_seen(tmp_path: Path):
    """Checkpoint rows deleted (a real withdrawal reads as a tail), then signed again: the same leaf, now signed;
    grace counts from the earlier of its signed time and when the gate first saw it."""
    leaves = _leaves(10)
    real = _withdrawal(10, time=2000)
    memory = LedgerMemory(tmp_path / "gate.db")
    assert [w.time for w in _advance(memory, leaves, [real], now=1500)] == [1500]
    assert [w.time for w in _advance(memory, leaves + [real.leaf_hash], [real], now=2500)] == [1500]
    assert [row[6] for row in _rows(tmp_path / "gate.db")["gate_tail_sightings"]] == ["signed"]
    assert [w.time for w in _advance(memory, leaves + [real.leaf_hash], [], now=3000)] == [1500]  # never dropped


def test_two_versions_of_a_tail_entry_are_unsettled_and_the_signed_one_decides(tmp_path: Path):
    leaves = _leaves(10)
    memory = LedgerMemory(tmp_path / "gate.db")
    one, other = _withdrawal(10, time=Y2100, version=b"one"), _withdrawal(10, "pub", time=Y2100, version=b"two")
    _advance(memory, leaves, [one], now=1000)
    _unsettled(memory, leaves, [other], now=1100)  # the tail rewritten: neither is known to be the ledger's
    signed = _withdrawal(10, time=1150, version=b"two")  # "restr" at seq 10, as the ledger signs it
    seen = _advance(memory, leaves + [signed.leaf_hash], [signed], now=1200)
    assert [(w.contribution_id, w.time) for w in seen] == [("restr", 1150)]


def test_another_version_of_a_signed_withdrawal_is_a_fork_and_changes_nothing(tmp_path: Path):
    leaves = _leaves(12)
    memory = LedgerMemory(tmp_path / "gate.db")
    _advance(memory, leaves[:10], [_withdrawal(8, time=900)], now=1000)
    before = _rows(tmp_path / "gate.db")
    with pytest.raises(IntegrityError) as refused:
        _advance(memory, leaves, [_withdrawal(8, time=Y2100, version=b"other")], now=1100)
    assert refused.value.code is Code.FORK
    assert _rows(tmp_path / "gate.db") == before


def test_a_store_written_before_sightings_existed_is_read_conservatively(tmp_path: Path):
    """The previous layout kept one table of withdrawals, first version kept: its rows become sightings, which the
    next reading settles against the signed tree (the forged one it held is refuted, the real one signed)."""
    path = tmp_path / "gate.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE gate_withdrawals (release_sha256 BLOB NOT NULL, seq INTEGER NOT NULL, "
                   "contribution_id TEXT NOT NULL, leaf_hash BLOB NOT NULL, time INTEGER NOT NULL, "
                   "seen_at INTEGER NOT NULL, PRIMARY KEY (release_sha256, seq))")
        forged = _withdrawal(10, time=Y2100, version=b"forged")
        db.execute("INSERT INTO gate_withdrawals VALUES (?, ?, ?, ?, ?, ?)",
                   (RELEASE, 10, forged.contribution_id, forged.leaf_hash, forged.time, 1000))
    memory = LedgerMemory(path)
    real = _withdrawal(10, time=1200, version=b"real")
    seen = _advance(memory, _leaves(10) + [real.leaf_hash], [real], now=1300)
    assert [(w.leaf_hash, w.time) for w in seen] == [(real.leaf_hash, 1200)]


# -- the gate, end to end ----------------------------------------------------------------------------------------


def _forge_withdrawal(released, contribution_id: str, when: int) -> int:  # type: ignore[no-untyped-def]
    """Append a withdraw entry of `contribution_id` timed `when` at the next sequence number, with no checkpoint:
    what a database writer without keys can do (an entry's body and leaf hash need no key). Returns its seq."""
    from govtrain.ledger.entries import withdraw_entry
    from govtrain.ledger.ledger import Ledger
    from govtrain.ledger.merkle import leaf_hash

    with Ledger.open(released.url) as ledger:
        seq = ledger.store.head().seq + 1
        admit = ledger.store.entry(ledger.store.admission(contribution_id).seq)
    body = withdraw_entry(seq, when, contribution_id, admit.leaf_hash, "forged")
    with sqlite3.connect(released.root / "ledger.db") as db:
        db.execute("INSERT INTO entries (seq, kind, time, leaf_hash, body) VALUES (?, 'withdraw', ?, ?, ?)",
                   (seq, when, leaf_hash(body), body))
    return seq


def _copy_database(source: Path, target: Path) -> None:
    with sqlite3.connect(source) as a, sqlite3.connect(target) as b:
        a.backup(b)


@pytest.fixture
def deployment(tmp_path_factory, tmp_path: Path):  # type: ignore[no-untyped-def]
    pytest.importorskip("torch")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from tests.release_setup import trained_release
    from tests.serve_setup import deploy

    deployment = deploy(trained_release(tmp_path_factory).copy(tmp_path / "copy"),
                        release_extra="grace_period_seconds = 600\ntaint_check_seconds = 0")
    with deployment.released.open() as ledger:
        deployment.clock[0] = max(ledger.store.head().time, int(time.time()))
    return deployment


def test_the_real_withdrawal_signed_over_a_forged_tail_ends_the_grace_period_on_time(deployment, tmp_path: Path):
    """Adversary: a database writer without keys, against a policy with a grace period of 600 s. Attack (issue 34
    item 4): append an unsigned withdraw entry at the next seq timed 2100-01-01; the gate reads it; put the database
    back; the contributor's real withdrawal is then signed at the same seq. Before: the gate kept the forged
    version, `grace_until` stayed in 2100, and an hour past the real grace period /v1/classify still answered 200.
    Now: 503 while the tail is unsettled, then the signed entry's time: 409 once its grace period ends."""
    from tests.serve_setup import TEXTS

    database = deployment.released.root / "ledger.db"
    start = int(deployment.clock[0])
    with deployment.serving() as (client, gate):
        classify = lambda: client.post("/v1/classify", json={"texts": TEXTS},  # noqa: E731
                                       headers=deployment.rights())  # an envelope valid by the gate's clock
        clean = classify()
        assert clean.status_code == 200 and clean.json()["tainted"] is False, clean.text
        _copy_database(database, tmp_path / "before.db")
        # 1. the forged tail, seen
        seq = _forge_withdrawal(deployment.released, "restr", Y2100)
        deployment.clock[0] = start + 10
        forged = classify()
        assert forged.status_code == 200 and forged.json()["tainted"] is True, forged.text
        assert forged.json()["grace_until"] == start + 10 + 600  # from when the gate saw it, not 2100
        # 2. the database restored: the tail is gone, and nothing signs its seq: unknown, not served
        _copy_database(tmp_path / "before.db", database)
        deployment.clock[0] = start + 20
        gone = classify()
        assert gone.status_code == 503 and gone.json()["code"] == "taint_unknown", gone.text
        assert "unsigned" in gate.taint.failure or "signed tree" in gate.taint.failure
        # 3. the real withdrawal, signed at the same seq
        with deployment.released.open() as ledger:
            real = ledger.withdraw("restr", "the contributor asked", now=start + 30)
        assert real.seq == seq and real.time == start + 30
        deployment.clock[0] = start + 40
        served = classify()
        assert served.status_code == 200 and served.json()["grace_until"] == real.time + 600, served.text
        info = client.get("/v1/info").json()["taint"]
        assert info["withdrawn_since"] == ["restr"] and info["since"] == real.time
        deployment.clock[0] = real.time + 600 + 3600  # an hour past the real grace period
        refused = classify()
        assert refused.status_code == 409 and refused.json()["code"] == "release_tainted", refused.text


def test_a_forged_tail_then_a_restore_does_not_taint_the_release_for_good(deployment, tmp_path: Path):
    """The same forged tail, the database restored and no real withdrawal: before, the release stayed tainted for
    good (409 once the forged grace ran out, and across restarts). Now the gate refuses to serve on an unsettled
    reading (503, and a restart refuses to start: the memory is the store's), and once the ledger signs another
    entry at that seq the sighting is refuted and the release is served clean."""
    from govtrain.errors import ConfigError
    from tests.serve_setup import TEXTS

    database = deployment.released.root / "ledger.db"
    start = int(deployment.clock[0])
    _copy_database(database, tmp_path / "before.db")
    seq = _forge_withdrawal(deployment.released, "restr", Y2100)
    with deployment.serving() as (client, _):
        seen = client.post("/v1/classify", json={"texts": TEXTS}, headers=deployment.rights())
        assert seen.status_code == 200 and seen.json()["tainted"] is True, seen.text
    _copy_database(tmp_path / "before.db", database)
    deployment.clock[0] = start + 3600  # past the sighting's grace period
    with pytest.raises(ConfigError) as refused:
        deployment.start()
    assert refused.value.code is Code.TAINT_UNKNOWN and "govtrain-verify" in refused.value.detail
    with deployment.released.open() as ledger:
        assert ledger.close_epoch(now=start + 3600) is not None and ledger.size() == seq + 1  # an honest entry at seq
    with deployment.serving() as (client, _):
        served = client.post("/v1/classify", json={"texts": TEXTS}, headers=deployment.rights())
        assert served.status_code == 200 and served.json()["tainted"] is False, served.text
        assert client.get("/v1/info").json()["taint"]["withdrawn_since"] == []


# -- the memory against its own store and long tails (the gate review's proofs, at the memory) -----------------------


def _read(memory: LedgerMemory, signed: list[bytes], tail: list[bytes], withdrawals=(), *, now: int,
          release: bytes = RELEASE):  # type: ignore[no-untyped-def]
    tree = MerkleTree(signed, len(signed))
    return memory.advance(origin=ORIGIN, size=len(signed), root=tree.root(),
                          consistency=lambda old: tree.consistency_proof(old, len(signed)),
                          release_sha256=release, withdrawals=list(withdrawals), now=now, leaves=[*signed, *tail])


def test_a_long_forged_tail_is_refuted_by_the_first_signed_entry_that_is_not_the_tails(tmp_path: Path):
    """A sighting commits to the tail it was read on: 40 forged fillers and a forged withdrawal at seq 50. Once the
    database is put back, a signed entry at seq 10 that is the tail's own leaves it open (503); the first signed
    entry that differs from the tail refutes it, 40 entries before the ledger reaches its seq."""
    signed = _leaves(10)
    fillers = _leaves(40, b"forged filler")
    forged = _withdrawal(50, time=Y2100, version=b"forged")
    memory = LedgerMemory(tmp_path / "gate.db")
    assert [w.seq for w in _read(memory, signed, [*fillers, forged.leaf_hash], [forged], now=1000)] == [50]
    _unsettled(memory, signed, now=1100)
    with pytest.raises(IntegrityError) as still:  # the ledger signs the tail's own entry at 10: nothing refuted
        _read(memory, [*signed, fillers[0]], [], now=1200)
    assert still.value.code is Code.UNSIGNED_TAIL
    honest = [*signed, fillers[0], hashlib.sha256(b"an honest entry").digest()]
    assert _read(memory, honest, [], now=1300) == ()  # seq 11 is not the tail's: refuted
    assert _read(memory, honest, [], now=1400) == ()
    assert [row[6] for row in _rows(tmp_path / "gate.db")["gate_tail_sightings"]] == ["refuted"]


def test_an_entrys_first_sighting_is_the_stores_whatever_release_reads_it(tmp_path: Path):
    """A future-dated signed withdrawal counts from when the store first saw it, for a release signed later too."""
    signed = _leaves(10)
    entry = _withdrawal(9, time=Y2100)
    signed[9] = entry.leaf_hash
    memory = LedgerMemory(tmp_path / "gate.db")
    assert [w.time for w in _read(memory, signed, [], [entry], now=1000)] == [1000]
    other = hashlib.sha256(b"the same adapter, signed again").digest()
    assert [w.time for w in _read(memory, signed, [], [entry], now=5000, release=other)] == [1000]


def test_rows_planted_in_the_store_never_make_the_gate_more_lenient(tmp_path: Path):
    """Rows INSERTed by whoever writes the gate's state folder: a signed withdrawal's later time, a first sighting
    in 2100, a sighting of the very tail entry marked refuted with a commitment of its own. The signed time and
    the reading decide: the time is the signed one, and the tail withdrawal still counts."""
    from govtrain.serve.memory import tail_commitment

    path = tmp_path / "gate.db"
    signed = _leaves(10)
    entry = _withdrawal(9, time=500)
    signed[9] = entry.leaf_hash
    tail = _withdrawal(10, time=600, version=b"tail")
    memory = LedgerMemory(path)
    assert _read(memory, _leaves(9), [], now=400) == ()
    with sqlite3.connect(path) as db:
        db.execute("INSERT INTO gate_signed_withdrawals VALUES (?, 9, 'restr', ?, ?, ?)",
                   (RELEASE, entry.leaf_hash, Y2100, Y2100))
        db.execute("INSERT INTO gate_first_seen VALUES (?, 9, ?, ?)", (ORIGIN, entry.leaf_hash, Y2100))
        chunks = [b"x" * 32] * 7 + [tail.leaf_hash]  # a tail from seq 3 the signed tree refutes at once
        db.execute("INSERT INTO gate_tail_sightings VALUES (?, 10, ?, 'restr', 600, 600, 'refuted', 600, 3, ?, ?)",
                   (RELEASE, tail.leaf_hash, b"".join(chunks), tail_commitment(3, chunks)))
    seen = _read(memory, signed, [tail.leaf_hash], [entry, tail], now=700)
    assert [(w.seq, w.time) for w in seen] == [(9, 500), (10, 600)]


def test_a_store_of_the_previous_sightings_layout_is_migrated_and_settles_as_before(tmp_path: Path):
    path = tmp_path / "gate.db"
    forged = _withdrawal(10, time=Y2100, version=b"forged")
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE gate_tail_sightings (release_sha256 BLOB NOT NULL, seq INTEGER NOT NULL, leaf_hash "
                   "BLOB NOT NULL, contribution_id TEXT NOT NULL, time INTEGER NOT NULL, seen_at INTEGER NOT NULL, "
                   "resolved TEXT, resolved_at INTEGER, PRIMARY KEY (release_sha256, seq, leaf_hash))")
        db.execute("INSERT INTO gate_tail_sightings VALUES (?, 10, ?, 'restr', ?, 1000, NULL, NULL)",
                   (RELEASE, forged.leaf_hash, Y2100))
    memory = LedgerMemory(path)
    _unsettled(memory, _leaves(10), now=1100)  # its commitment is its own entry: open until seq 10 is signed
    real = _withdrawal(10, time=1200, version=b"real")
    seen = _advance(memory, _leaves(10) + [real.leaf_hash], [real], now=1300)
    assert [(w.leaf_hash, w.time) for w in seen] == [(real.leaf_hash, 1200)]
    assert [row[6] for row in _rows(path)["gate_tail_sightings"]] == ["refuted"]


@pytest.mark.parametrize("content", ["CREATE TABLE gate_first_seen (origin TEXT)", "not a database"])
def test_a_store_the_memory_cannot_read_is_a_config_error_and_changes_nothing(tmp_path: Path, content: str):
    from govtrain.errors import ConfigError

    path = tmp_path / "gate.db"
    if content.startswith("CREATE"):
        with sqlite3.connect(path) as db:
            db.execute(content)
    else:
        path.write_bytes(content.encode() * 200)
    before = path.read_bytes()
    with pytest.raises(ConfigError) as refused:
        LedgerMemory(path)
    assert refused.value.code is Code.BAD_ARGUMENT and str(path) in refused.value.detail
    assert "\n" not in refused.value.line() and path.read_bytes() == before
