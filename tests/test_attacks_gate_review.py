"""An adversarial review of the gate's memory of withdrawals and of the re-release taint (issue 34 items 4 and 5,
as merged). Each test is a proof: it fails on the code under review and passes once the defect it names is fixed.
The fixtures are those of tests/test_attacks_gate_memory.py: a trained release served with a grace period of
600 s, every enveloped request reading the ledger, and an injected clock."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from tests.test_attacks_gate_memory import Y2100, _copy_database, _forge_withdrawal, deployment  # noqa: F401

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

GRACE = 600


def _classify(client, deployment):  # type: ignore[no-untyped-def]
    from tests.serve_setup import TEXTS

    return client.post("/v1/classify", json={"texts": TEXTS}, headers=deployment.rights())


def _release_sha256(deployment) -> bytes:  # type: ignore[no-untyped-def]
    return deployment.released.verify(deployment.envelope).release_sha256


def _gate_rows(deployment) -> dict[str, list[tuple]]:  # type: ignore[no-untyped-def]
    with sqlite3.connect(deployment.policy().session_store) as db:
        return {table: db.execute(f"SELECT * FROM {table} ORDER BY 1, 2").fetchall()
                for table in ("gate_ledger_trees", "gate_signed_withdrawals", "gate_tail_sightings")}


# -- 1. the gate's state folder: a planted row outweighs the signed ledger ----------------------------------------


def test_a_row_planted_in_the_gate_store_cannot_stretch_the_grace_period_of_a_signed_withdrawal(deployment):
    """Adversary: someone who can write the gate's state folder (its SQLite store, `sessions.store`) while the gate
    is down; the ledger is honest and untouched. Attack: once `restr` is withdrawn (a signed entry), INSERT into
    `gate_signed_withdrawals` a row for that entry (its real leaf hash, which anyone reading the ledger knows) with
    `time` and `first_seen` in 2100. The triggers refuse UPDATE and DELETE only, and `LedgerMemory._sign` keeps a
    remembered row whose leaf matches without comparing its time, then counts grace from the row's
    min(time, first_seen). Impact: the gate serves the tainted release (200, `grace_until` in 2100) for ever, an
    hour past its real grace period, although every reading shows the signed time; with no memory at all it would
    refuse. Expected: a withdrawal's time is never later than the signed time read now (nor than when the store
    first saw it): 409 `release_tainted` once `time + grace` has passed."""
    with deployment.serving() as (client, _):
        assert _classify(client, deployment).status_code == 200  # the gate has seen the ledger: clean
    start = int(deployment.clock[0])
    with deployment.released.open() as ledger:
        real = ledger.withdraw("restr", "the contributor asked", now=start + 10)
    with sqlite3.connect(deployment.policy().session_store) as db:  # the state folder's writer, gate down
        db.execute("INSERT INTO gate_signed_withdrawals (release_sha256, seq, contribution_id, leaf_hash, time, "
                   "first_seen) VALUES (?, ?, ?, ?, ?, ?)",
                   (_release_sha256(deployment), real.seq, "restr", real.leaf_hash, Y2100, Y2100))
    deployment.clock[0] = real.time + GRACE + 3600  # an hour past the real grace period
    with deployment.serving() as (client, _):
        answer = _classify(client, deployment)
        assert answer.status_code == 409 and answer.json()["code"] == "release_tainted", answer.text


# -- 2. retention: a redacted withdrawal's time is the database's column -------------------------------------------


def test_a_compacted_withdrawal_does_not_take_its_grace_from_the_time_column(deployment):
    """Adversary: a database writer without keys. Once retention compacts `restr` (withdrawn long ago: its withdraw
    entry's body is dropped, its leaf stays), the gate reads that withdrawal's time from the `entries.time` column
    (`service._taint_reader`: `stored.time`, "unchecked; capped by memory"), which no signature covers and
    `read_log` never checks for a body-less row. Attack: drop the append-only trigger and set that column to 2100.
    The cap is when this store first saw the entry, so every gate store that first reads it now (a new deployment,
    or any release whose memory is fresh: the memory is keyed by release, so a re-signed one too) starts a new
    grace period. Impact: a release tainted for an hour past its grace period is served (200, `grace_until` = now +
    600); docs/serving.md promises "its entry's own time, never the database's column". Expected: a time only a
    signature covers (e.g. the last signed entry before it, a lower bound as entry times never decrease), or no
    grace: 409 `release_tainted`."""
    start = int(deployment.clock[0])
    with deployment.released.open() as ledger:
        real = ledger.withdraw("restr", "the contributor asked", now=start + 10)
        for i in range(3):  # retention_epochs = 1: the withdrawal falls behind the horizon
            ledger.close_epoch(now=start + 20 + i)
        redacted = ledger.compact(ledger.epoch() - 1, now=start + 30)
    assert real.seq in {row.seq for row in redacted}
    with sqlite3.connect(deployment.released.root / "ledger.db") as db:
        db.execute("DROP TRIGGER entries_no_update")
        db.execute("UPDATE entries SET time = ? WHERE seq = ?", (Y2100, real.seq))
    deployment.clock[0] = real.time + GRACE + 3600  # an hour past the real grace period
    with deployment.serving() as (client, _):
        answer = _classify(client, deployment)
        assert answer.status_code == 409 and answer.json()["code"] == "release_tainted", answer.text


# -- 3. an unsigned tail far ahead: 503 until the ledger grows that far ---------------------------------------------


def _forge_fillers(released, count: int, when: int) -> int:  # type: ignore[no-untyped-def]
    """Append `count` unsigned epoch entries at the next sequence numbers (bodies and leaves need no key). Returns
    the first one's seq."""
    from govtrain.ledger.entries import epoch_entry
    from govtrain.ledger.merkle import leaf_hash

    with released.open() as ledger:
        first = ledger.store.head().seq + 1
    with sqlite3.connect(released.root / "ledger.db") as db:
        for seq in range(first, first + count):
            body = epoch_entry(seq, when, 10_000 + seq)  # an epoch number the ledger will never write there
            db.execute("INSERT INTO entries (seq, kind, time, leaf_hash, body) VALUES (?, 'epoch', ?, ?, ?)",
                       (seq, when, leaf_hash(body), body))
    return first


def test_a_forged_tail_refuted_by_the_first_signed_entry_does_not_keep_the_gate_down(deployment, tmp_path: Path):
    """Adversary: a database writer without keys. Attack: append 40 unsigned filler entries and then a withdraw
    entry of `restr` (sequence numbers stay dense, so the tail reads); the gate reads it (a sighting at seq
    N + 40); the writer puts the database back. The honest ledger then signs its next entry at seq N, which is not
    the filler the tail had there: that tail, and so the sighting read on it, is proven not the ledger's. The
    memory keeps only (seq, leaf) of the sighting, so it stays unsettled (`unsigned_tail`, 503 `taint_unknown`,
    and a restart refuses to start) until the signed tree reaches N + 41: forty more honest entries here, and as
    many as the writer cared to insert (10^5 rows cost it seconds; the gate's only way out is to throw its memory,
    and its rollback protection, away). Impact: a denial of service that outlives the repair of the database by as
    long as the attacker likes, where docs/serving.md promises the signed entry settles it. Expected: a sighting is
    refuted as soon as a signed tree diverges from the tail it was read on (remember the tail's leaves, or a
    commitment to them, from the signed size up to the sighting): after the first signed entry the release is
    served clean (200, `"tainted": false`)."""
    database = deployment.released.root / "ledger.db"
    start = int(deployment.clock[0])
    _copy_database(database, tmp_path / "before.db")
    first = _forge_fillers(deployment.released, 40, start + 5)
    seq = _forge_withdrawal(deployment.released, "restr", start + 5)
    assert seq == first + 40
    with deployment.serving() as (client, _):
        seen = _classify(client, deployment)
        assert seen.status_code == 200 and seen.json()["tainted"] is True, seen.text
        _copy_database(tmp_path / "before.db", database)
        with deployment.released.open() as ledger:
            assert ledger.close_epoch(now=start + 60) is not None and ledger.size() == first + 1  # signed at seq N
        deployment.clock[0] = start + 70
        served = _classify(client, deployment)
        assert served.status_code == 200 and served.json()["tainted"] is False, served.text


# -- 4. a key holder: the first-sight cap is per release, so a re-signature resets it -------------------------------


def test_a_re_signed_release_does_not_restart_the_grace_of_a_future_dated_signed_withdrawal(deployment):
    """Adversary: a key-holding operator (ledger key and release key) against a gate that pins both. Entry times
    are the operator's clock, checked only for order (docs/threat-model.md), so it signs the real withdrawal of
    `restr` dated 2100. The gate caps that at when it first saw it, and refuses once that grace period is over
    (409). Attack: sign the same run's adapter again (`--yes`). Its memory of withdrawals is keyed by the release's
    SHA-256 (`gate_signed_withdrawals.release_sha256`), so for the new release the same signed entry (same origin,
    seq and leaf) is "first seen" now, and a fresh grace period starts; each re-signature buys another. Impact: the
    tainted adapter is served (200) past its grace period, although the store first saw that very entry long
    before; item 5's promise that a re-signature changes nothing does not hold for the grace period. Expected:
    a withdrawal entry's first sighting is a fact of the ledger, not of a release: 409 `release_tainted`."""
    start = int(deployment.clock[0])
    with deployment.released.open() as ledger:
        ledger.withdraw("restr", "the contributor asked", now=Y2100)  # signed, dated by the operator's clock
    deployment.clock[0] = start + 10
    with deployment.serving() as (client, _):
        seen = _classify(client, deployment)
        assert seen.status_code == 200 and seen.json()["grace_until"] == start + 10 + GRACE, seen.text
        deployment.clock[0] = start + 10 + GRACE + 3600
        refused = _classify(client, deployment)
        assert refused.status_code == 409, refused.text
    (deployment.root / "release.dsse").write_bytes(deployment.released.build(confirm=True))  # the same adapter
    with deployment.serving() as (client, _):
        answer = _classify(client, deployment)
        assert answer.status_code == 409 and answer.json()["code"] == "release_tainted", answer.text


# -- 5. govtrain release reads the signed prefix only -----------------------------------------------------------------


def test_govtrain_release_does_not_sign_a_withdrawn_run_unconfirmed_after_checkpoint_rows_are_deleted(deployment,
                                                                                                   tmp_path: Path):
    """Adversary: a database writer without keys. Attack: after `pub` is withdrawn (signed), delete the checkpoint
    row that signs the withdrawal, so that it sits in an unsigned tail. `release_statement` computes the
    withdrawals from the signed prefix only (`ledger_facts(..., log.checkpoint)`), and neither looks at the tail nor
    refuses it, so `govtrain release` signs the run without `--yes` and without a warning (exit 0), under the older
    checkpoint. Impact: the refusal item 5 added (`withdrawn_at_release` unless confirmed) is bypassed: an honest
    release manager publishes a release every gate refuses as tainted, with nothing said (`release verify` would
    at least warn about the unsigned entries). Expected: `govtrain release` refuses (exit 2 `withdrawn_at_release`,
    or an integrity error naming the unsigned tail), and writes nothing."""
    from click.testing import CliRunner

    from govtrain.cli.main import cli
    from tests.release_setup import RUN_ID

    released = deployment.released
    with released.open() as ledger:
        withdrawn = ledger.withdraw("pub", "the contributor asked", now=int(deployment.clock[0]) + 10)
        size = ledger.size()
    assert size == withdrawn.seq + 1
    with sqlite3.connect(released.root / "ledger.db") as db:
        db.execute("DROP TRIGGER checkpoints_no_delete")
        assert db.execute("DELETE FROM checkpoints WHERE size > ?", (withdrawn.seq,)).rowcount >= 1
    out = tmp_path / "again.dsse"
    answer = CliRunner().invoke(cli, ["release", "--run", RUN_ID, "--adapter", str(released.adapter), "--out",
                                      str(out), "--ledger", released.url, "--key", str(released.release_key_path),
                                      "--base", str(released.base)])
    assert answer.exit_code != 0 and not out.exists(), answer.output


# -- 6. the gate's state folder: a resolution the signed tree cannot have made ----------------------------------------


def test_a_sighting_marked_refuted_in_the_gate_store_before_any_signed_tree_covers_it_still_taints(deployment):
    """Adversaries: a database writer without keys and someone who can write the gate's state folder (together, or
    one person with both). The ledger signs the withdrawal of `pub`; the writer deletes the checkpoint row that
    signs it, so that the gate reads it in an unsigned tail (no rollback: the gate's remembered tree is the one
    before). Attack: INSERT into `gate_tail_sightings` the row that sighting will have, already `resolved =
    'refuted'` (the triggers refuse UPDATE and DELETE, not INSERT; the one UPDATE they allow is exactly this
    resolution). `advance` re-inserts what it reads with INSERT OR IGNORE, so the planted verdict stands, and only
    unresolved sightings are returned: a withdrawal standing in the very reading the gate just took is dropped,
    although no signed tree covers its sequence number, the only thing that may refute it. Impact: the release is
    served as clean (200, `"tainted": false`) for as long as the checkpoint row stays deleted. Expected: a
    resolution of a sequence number the remembered tree does not cover is no resolution (the sighting counts, or
    the memory is refused as corrupt: 503 `taint_unknown`); here the release reads tainted."""
    with deployment.serving() as (client, _):
        assert _classify(client, deployment).json()["tainted"] is False  # the gate remembers the tree before
    with deployment.released.open() as ledger:
        withdrawn = ledger.withdraw("pub", "the contributor asked", now=int(deployment.clock[0]) + 10)
    with sqlite3.connect(deployment.released.root / "ledger.db") as db:  # the database writer
        db.execute("DROP TRIGGER checkpoints_no_delete")
        db.execute("DELETE FROM checkpoints WHERE size > ?", (withdrawn.seq,))
    with sqlite3.connect(deployment.policy().session_store) as db:  # the state folder's writer
        db.execute("INSERT INTO gate_tail_sightings (release_sha256, seq, leaf_hash, contribution_id, time, seen_at, "
                   "resolved, resolved_at) VALUES (?, ?, ?, ?, ?, ?, 'refuted', ?)",
                   (_release_sha256(deployment), withdrawn.seq, withdrawn.leaf_hash, "pub", withdrawn.time,
                    withdrawn.time, withdrawn.time))
    deployment.clock[0] = withdrawn.time + 20
    with deployment.serving() as (client, _):
        answer = _classify(client, deployment)
        assert answer.status_code in (200, 503), answer.text
        assert answer.status_code == 503 or answer.json()["tainted"] is True, answer.text


# -- 7. a store the memory cannot read -----------------------------------------------------------------------------


def test_a_gate_store_whose_memory_tables_are_not_the_memory_s_is_a_one_line_refusal(deployment):
    """Adversary: someone who can write the gate's state folder (or an older or foreign file at `sessions.store`).
    Attack: a store holding a `gate_withdrawals` table of another shape (the name the memory migrates from).
    `LedgerMemory.__init__` runs its migration unguarded, so `Gate.start` raises sqlite3.OperationalError ("no such
    column"), which `govtrain serve` reports as `error[internal]` (a bug), leaving the session store open, where
    `SessionStore` answers a store it cannot read with a one-line `ConfigError` (`bad_argument`, exit 2). Expected:
    a `ConfigError` naming the store (exit 2), nothing changed."""
    from govtrain.errors import ConfigError

    store = deployment.policy().session_store
    store.parent.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(store) as db:
        db.execute("CREATE TABLE gate_withdrawals (release_sha256 BLOB, seq INTEGER)")
    with pytest.raises(ConfigError):
        deployment.start()
