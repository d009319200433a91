"""Fuzzing checkpoints, inclusion proofs, Merkle proof verification, ledger entries and the verifier.

Targets: `checkpoint` (a note's bytes through verify_checkpoint), `signed_checkpoint` (text the ledger key signed:
what a key holder can still send; the tree head inside is parsed), `proof` (c2sp.org/tlog-proof text through
verify_proof, as `govtrain ledger verify-proof` reads it), `merkle` (RFC 9162 inclusion and consistency proofs against
a real tree: whatever verifies must be true), `entry` (decode_entry on a body), `verifier` (inspect_ledger on a real
ledger whose entry k holds the input, its leaf hash recomputed: what a database writer can put there),
`verifier_cell` (inspect_ledger on a real ledger with one cell rewritten as another SQLite type: a TEXT body, a
TEXT withdrawal seq) and `trusted_checkpoint` (inspect_ledger with the input as a checkpoint the auditor trusts).
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import sqlite3
import tempfile
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from govtrain.ledger.checkpoint import sign_note, verify_checkpoint
from govtrain.ledger.entries import decode_entry
from govtrain.ledger.merkle import MerkleTree, leaf_hash, node_hash, root_of, verify_consistency, verify_inclusion
from govtrain.ledger.proof import verify_proof
from govtrain.verify.verifier import inspect_ledger, recorded_accountant
from tests.fuzz.common import ContractViolation, Target, check, fuzz_settings, main, mutated
from tests.fuzz.world import ORIGIN, world

TREE = [leaf_hash(bytes((i,))) for i in range(23)]


def run_checkpoint(data: bytes) -> None:
    verify_checkpoint(data, origin=ORIGIN, keys=[world().note_key])


def run_signed_checkpoint(data: bytes) -> None:
    text = data.decode("utf-8", errors="replace")
    text = text if text.endswith("\n") else text + "\n"
    verify_checkpoint(sign_note(text, world().ledger_key, ORIGIN), origin=ORIGIN, keys=[world().note_key])


def run_proof(data: bytes) -> None:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return  # the CLI refuses it before the parser (bad_proof: not text)
    verify_proof(text, [world().note_key], origin=ORIGIN, attestation=world().attestations[0])


def run_merkle(data: bytes) -> None:
    """Bytes as (index, size, first, second, leaf, proof edits); the proof starts from the true one."""
    head, rest = data[:6].ljust(6, b"\0"), data[6:]
    index, size, first = head[0] % 30, head[1] % 30, head[2] % 30
    tree = MerkleTree(TREE, len(TREE))
    leaf = TREE[index] if head[3] & 1 and index < len(TREE) else leaf_hash(rest[:8])
    proof = tree.inclusion_proof(index, size) if 0 <= index < size <= len(TREE) else []
    proof = _edit(proof, rest, head[4])
    root = root_of(TREE[:size])
    if check(lambda: verify_inclusion(index, size, leaf, proof, root)) is None:
        if size > len(TREE) or index >= len(TREE) or leaf != TREE[index]:
            raise ContractViolation(f"a false inclusion verified: leaf {index} of {size}")
    consistency = tree.consistency_proof(first, size) if 0 < first <= size <= len(TREE) else []
    consistency = _edit(consistency, rest[::-1], head[5])
    first_root = root_of(TREE[:first]) if head[3] & 2 else leaf_hash(rest[:4])
    if check(lambda: verify_consistency(first, size, first_root, root, consistency)) is None:
        if first > size or (first and first_root != root_of(TREE[:first])):
            raise ContractViolation(f"a false consistency proof verified: {first} -> {size}")


def _edit(proof: list[bytes], rest: bytes, how: int) -> list[bytes]:
    proof = list(proof)
    if how & 1 and proof:
        proof[how % len(proof)] = hashlib.sha256(rest).digest()
    if how & 2 and proof:
        del proof[(how >> 2) % len(proof)]
    if how & 4:
        proof.insert((how >> 3) % (len(proof) + 1), rest[:32])
    if how & 8:
        proof.append(node_hash(rest[:32].ljust(32, b"\0"), TREE[0]))
    return proof


def run_entry(data: bytes) -> None:
    decode_entry(data, seq=data[0] % 8 if data else 0, kind=None)


_SCRATCH: list[Path] = []


def _ledger_copy() -> Path:
    if not _SCRATCH:
        _SCRATCH.append(Path(tempfile.mkdtemp(prefix="govtrain-fuzz-ledger-")) / "ledger.db")
    path = _SCRATCH[0]
    path.write_bytes(world().ledger_db)
    return path


def run_verifier(data: bytes) -> None:
    """Entry `data[0] % size` replaced by the rest of the input, its leaf hash recomputed (so the body is read)."""
    path = _ledger_copy()
    seq, body = (data[0] if data else 0) % world().entries, data[1:]
    with sqlite3.connect(path) as connection:
        connection.execute("UPDATE entries SET body = ?, leaf_hash = ? WHERE seq = ?", (body, leaf_hash(body), seq))
    connection.close()
    report = inspect_ledger(f"sqlite:///{path}", accountant=recorded_accountant)
    if report.error is None and body != _bodies()[seq]:
        raise ContractViolation(f"a ledger with entry {seq} replaced verified")


CELLS = (("entries", "body", "seq = 1"), ("entries", "body", "seq = 2"), ("entries", "leaf_hash", "seq = 1"),
         ("entries", "time", "seq = 2"), ("entries", "kind", "seq = 3"), ("withdrawals", "seq", "1"),
         ("withdrawals", "contribution_id", "1"), ("admissions", "seq", "seq = 1"),
         ("admissions", "data_sha256", "seq = 1"), ("checkpoints", "size", "id = 1"), ("checkpoints", "note", "id = 1"),
         ("checkpoints", "root", "id = 1"))
SQL_VALUES = ("?", "CAST(? AS TEXT)", "length(?)", "length(?) + 0.5", "NULL", "-length(?)")


def run_verifier_cell(data: bytes) -> None:
    """One cell of the world ledger (data[0] picks which) rewritten as another SQLite type (data[1]: BLOB, TEXT,
    INTEGER, REAL, NULL) from the rest of the input, the triggers dropped first: what a database writer can do
    that no ledger does. `inspect_ledger` must give a verdict, never a traceback; a verdict against the ledger is
    raised (the coded error the report carries)."""
    path = _ledger_copy()
    (table, column, where), value = CELLS[data[0] % len(CELLS)] if data else CELLS[0], data[2:]
    sql = SQL_VALUES[data[1] % len(SQL_VALUES)] if len(data) > 1 else "?"
    connection = sqlite3.connect(path)
    try:
        for (name,) in connection.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'").fetchall():
            connection.execute(f"DROP TRIGGER {name}")
        with contextlib.suppress(sqlite3.IntegrityError):  # a NULL or a duplicate a constraint still refuses
            connection.execute(f"UPDATE {table} SET {column} = {sql} WHERE {where}", (value,) * sql.count("?"))
        connection.commit()
    finally:
        connection.close()
    report = inspect_ledger(f"sqlite:///{path}", accountant=recorded_accountant)
    if report.error is not None:
        raise report.error


def run_trusted_checkpoint(data: bytes) -> None:
    report = inspect_ledger(f"sqlite:///{_ledger_copy()}", trusted_checkpoints=[data.decode("utf-8", "replace")],
                            accountant=None)
    if report.error is None and data.decode("utf-8", "replace") != world().checkpoint:
        raise ContractViolation("a trusted checkpoint other than the ledger's own was consistent")


@functools.cache
def _bodies() -> list[bytes]:
    """The world ledger's entry bodies, by seq."""
    import ledger_store

    store = ledger_store.LedgerStore.open(f"sqlite:///{_ledger_copy()}")
    try:
        return [e.body for e in store.entries()]
    finally:
        store.close()


def _entry_seeds() -> list[bytes]:
    return [bytes((seq,)) + body for seq, body in enumerate(_bodies())]


def _note_seeds() -> list[bytes]:
    return [world().checkpoint.encode()]


def _proof_seeds() -> list[bytes]:
    return [world().proof.encode()]


TARGETS = [
    Target("checkpoint", run_checkpoint, _note_seeds, ("govtrain/ledger/checkpoint.py",), setup=world),
    Target("signed_checkpoint", run_signed_checkpoint, _note_seeds, ("govtrain/ledger/checkpoint.py",), setup=world),
    Target("proof", run_proof, _proof_seeds,
           ("govtrain/ledger/proof.py", "govtrain/ledger/checkpoint.py", "govtrain/ledger/merkle.py"), setup=world),
    Target("merkle", run_merkle, lambda: [bytes(range(6)) + b"x" * 40, b"\x07\x10\x03\x03\x00\x00"],
           ("govtrain/ledger/merkle.py",)),
    Target("entry", run_entry, _entry_seeds, ("govtrain/ledger/entries.py", "govtrain/encoding/fields.py"),
           setup=world),
    Target("verifier", run_verifier, _entry_seeds,
           ("govtrain/verify/full_audit.py", "govtrain/verify/retention.py", "govtrain/ledger/entries.py"), setup=world),
    Target("verifier_cell", run_verifier_cell, lambda: [bytes((i, 1)) + b"x" for i in range(len(CELLS))],
           ("govtrain/verify/full_audit.py", "govtrain/verify/integrity.py", "ledger_store/store.py",
            "ledger_store/rows.py"), setup=world),
    Target("trusted_checkpoint", run_trusted_checkpoint, _note_seeds,
           ("govtrain/verify/checkpoint_audit.py", "govtrain/ledger/checkpoint.py"), setup=world),
]

# -- hypothesis ----------------------------------------------------------------------------------------------------


@fuzz_settings()
@given(mutated(_note_seeds()))
def test_checkpoint_mutations(data: bytes) -> None:
    check(lambda: run_checkpoint(data))


lines = st.text(st.characters(codec="utf-8", exclude_characters="\n"), max_size=30)


@fuzz_settings()
@given(st.lists(st.one_of(lines, st.just(ORIGIN), st.integers(-5, 10**6).map(str), st.text("0123456789", min_size=1),
                          st.binary(max_size=40).map(lambda b: base64.b64encode(b).decode()),
                          st.just("9" * 5000)), max_size=5))
def test_signed_checkpoint_bodies(body: list[str]) -> None:
    """Tree heads with random lines, signed by the ledger key: parsed without trusting what the key signed."""
    check(lambda: run_signed_checkpoint(("\n".join(body) + "\n").encode()))


@fuzz_settings()
@given(mutated(_proof_seeds()))
def test_proof_mutations(data: bytes) -> None:
    check(lambda: run_proof(data))


@fuzz_settings()
@given(index=st.one_of(st.integers(0, 40), st.just("9" * 5000), st.text("0123456789-+ ", max_size=8)),
       hashes=st.lists(st.binary(max_size=40), max_size=6), extra=st.binary(max_size=200))
def test_proof_lines(index: object, hashes: list[bytes], extra: bytes) -> None:
    """Proof files with random index lines, hashes and entries around the real checkpoint."""
    proof_lines = ["c2sp.org/tlog-proof@v1", f"extra {base64.b64encode(extra).decode()}", f"index {index}",
                   *(base64.b64encode(h).decode() for h in hashes)]
    check(lambda: run_proof(("\n".join(proof_lines) + "\n\n" + world().checkpoint).encode()))


@fuzz_settings()
@given(st.binary(min_size=6, max_size=80))
def test_merkle_soundness(data: bytes) -> None:
    check(lambda: run_merkle(data))


@fuzz_settings()
@given(mutated(_entry_seeds()))
def test_entry_mutations(data: bytes) -> None:
    check(lambda: run_entry(data))


@fuzz_settings(0.25)
@given(mutated(_entry_seeds()))
def test_verifier_entry_mutations(data: bytes) -> None:
    check(lambda: run_verifier(data))


@fuzz_settings(0.25)
@given(st.builds(lambda cell, kind, value: bytes((cell, kind)) + value, st.integers(0, len(CELLS) - 1),
                 st.integers(0, len(SQL_VALUES) - 1), st.binary(max_size=40)))
def test_verifier_cell_types(data: bytes) -> None:
    check(lambda: run_verifier_cell(data))


@fuzz_settings(0.25)
@given(mutated(_note_seeds()))
def test_verifier_trusted_checkpoints(data: bytes) -> None:
    check(lambda: run_trusted_checkpoint(data))


if __name__ == "__main__":
    main(TARGETS)
