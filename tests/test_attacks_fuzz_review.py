"""Adversarial review of the fuzzing work (issue 23 item 4): untrusted inputs the harnesses in tests/fuzz do not
reach, each through its public entry point.

Each test asserts the contract (docs/fuzzing.md#the-contract: the entry point returns, or raises a `GovtrainError`
with a `Code` whose `line()` is one line) and fails on the code under review. Nothing here needs a model."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

from govtrain.data import inspect_data, read_data
from govtrain.errors import Code, GovtrainError
from govtrain.serve.app import STATUS, ClassifyRequest, parse_body
from govtrain.verify.verifier import inspect_ledger, recorded_accountant
from tests.fuzz.world import world

DEPTH = 1_100  # past Python's default recursion limit (1000), a path of 2,200 characters: far under PATH_MAX


def _raises(code: Code, call) -> GovtrainError:  # type: ignore[no-untyped-def]
    with pytest.raises(GovtrainError) as caught:
        call()
    assert caught.value.code is code, caught.value.line()
    assert "\n" not in caught.value.line(), caught.value.line()
    return caught.value


# -- a hostile client of the inference gate ------------------------------------------------------------------------


def test_serve_body_nested_json_is_bad_request() -> None:
    """Adversary: any client of `govtrain serve` (no rights needed to send a body). Defect: `parse_body`
    (govtrain/serve/app.py), which reads the JSON body of /v1/classify and /v1/generate, catches `ValueError` but
    not `RecursionError`: a 4 KB body of nested arrays (far under max_body_bytes) escapes as an uncoded exception,
    which the app answers 500 `internal` instead of 400 `bad_request`. (The fuzzed `split_wire` target is pydantic's
    own JSON reader; this `json.loads` is reached by no harness.)"""
    body = b"[" * 2_000 + b"]" * 2_000
    error = _raises(Code.BAD_REQUEST, lambda: parse_body(body, ClassifyRequest))
    assert STATUS[error.code] == 400


# -- a hostile contributor's dataset directory -------------------------------------------------------------------


def _nested_dataset(root: Path, depth: int) -> Path:
    """`root/ds/a/a/…/a/f` (depth levels of `a`), built with directory descriptors (os.makedirs recurses too)."""
    top = root / "ds"
    top.mkdir()
    current = os.open(top, os.O_RDONLY)
    for _ in range(depth):
        os.mkdir("a", dir_fd=current)
        inner = os.open("a", os.O_RDONLY, dir_fd=current)
        os.close(current)
        current = inner
    os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=current))
    os.close(current)
    return top


def _remove_nested(top: Path, depth: int) -> None:
    """Undo `_nested_dataset` without recursion (shutil.rmtree recurses once per level)."""
    path = top / "/".join(["a"] * depth)
    (path / "f").unlink()
    for _ in range(depth):
        path.rmdir()
        path = path.parent
    top.rmdir()


def test_dataset_directory_nested_past_the_recursion_limit(tmp_path: Path) -> None:
    """Adversary: a contributor handing over a `datasets` directory (admit, attest, training all read it).
    Defect: `read_tree`'s `_walk` (govtrain/data/digest.py) recurses once per directory level, and `read_data`
    catches only `OSError` and `BadData`: a directory 1,100 levels deep (one empty file at the bottom, a few KB on
    disk) raises `RecursionError` out of `inspect_data`, the gate's reader, instead of `bad_data`. The `dataset_dir`
    harness varies state.json and one shard, never the tree's shape. Fix: walk with an explicit stack (or refuse
    a depth past a bound) and report it as BadData."""
    top = _nested_dataset(tmp_path, DEPTH)
    try:
        _raises(Code.BAD_DATA, lambda: inspect_data(top))
        _raises(Code.BAD_DATA, lambda: read_data(top))  # training's and attest's reader
    finally:
        _remove_nested(top, DEPTH)


def test_dataset_file_name_cannot_add_a_line_to_the_error(tmp_path: Path) -> None:
    """Adversary: a contributor who names a file in their dataset directory. Defect: `_walk` and `_read_regular`
    (govtrain/data/digest.py) put the contributor's file name into the error as it is (`{relative} is a symbolic
    link`, `{relative} is not a regular file`), so a name holding a newline makes the gate's `bad_data` error two
    lines, the second one of the contributor's choosing (here a forged `error[ok]` line for a log reader). The fix
    of findings 14-15 escapes such keys in TOML errors only. Fix: show the name with `!r` or `ascii()`, as
    `dataset.py` already does for `_data_files` names."""
    top = tmp_path / "ds"
    top.mkdir()
    (top / "state.json").write_text("{}")
    os.symlink("state.json", top / "x\nerror[ok]: contribution admitted")
    _raises(Code.BAD_DATA, lambda: inspect_data(top))  # one line: the name escaped


# -- a hostile ledger database ----------------------------------------------------------------------------------


def _hostile_ledger(tmp_path: Path, statement: str) -> Path:
    """The fuzz world's ledger (triggers already dropped, as a database writer can) with one statement applied."""
    path = tmp_path / "ledger.db"
    path.write_bytes(world().ledger_db)
    connection = sqlite3.connect(path)
    try:
        for (name,) in connection.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'").fetchall():
            connection.execute(f"DROP TRIGGER {name}")
        connection.execute(statement)
        connection.commit()
    finally:
        connection.close()
    return path


def _audited(path: Path) -> GovtrainError:
    """What `govtrain-verify` reports: a coded one-line error, and the database left as it was."""
    before = path.read_bytes()
    report = inspect_ledger(f"sqlite:///{path}", accountant=recorded_accountant)
    assert path.read_bytes() == before
    assert report.error is not None, "a tampered ledger verified"
    assert "\n" not in report.error.line()
    return report.error


def test_verifier_entry_body_stored_as_text(tmp_path: Path) -> None:
    """Adversary: whoever can write the ledger database (the operator being audited). Defect: the verifier takes
    `entries.body` as bytes (govtrain/verify/verifier.py `_entry` -> `ledger_store.leaf_hash`), but SQLite keeps
    whatever type is written, and a TEXT body comes back a `str`: `TypeError: can't concat str to bytes` stops
    `govtrain-verify` with a traceback instead of a `bad_entry` verdict. The `verifier` harness only writes BLOB
    bodies. Fix: check each column's type as it is read from the store (a wrong type is a tampered row)."""
    path = _hostile_ledger(tmp_path, "UPDATE entries SET body = 'not bytes' WHERE seq = 1")
    _audited(path)


def test_verifier_withdrawal_seq_stored_as_text(tmp_path: Path) -> None:
    """Adversary: the same database writer. Defect: the verifier compares the `withdrawals` index with the
    entries (govtrain/verify/retention.py `indexes`) by sorting seqs; a `withdrawals.seq` stored as TEXT raises
    `TypeError: '<' not supported between instances of 'int' and 'str'` out of `inspect_ledger` instead of the
    index being reported as disagreeing with the log. Fix: as above, refuse a cell of the wrong type as tampering."""
    path = _hostile_ledger(tmp_path, "UPDATE withdrawals SET seq = 'x'")
    _audited(path)
