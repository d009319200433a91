"""Fuzzing contributions' data: JSON Lines, CSV, Parquet and `datasets` save_to_disk directories.

Each target writes the input as the file (or directory) and reads it the two ways an attacker's data is read: the
gate's `inspect_data` (a digest, a count and the first problem, never an exception but a coded error) and training's
`rows_of(read_data(...))` with an integer label column (every row, or one `bad_data` line). `dataset_tree` varies
the directory's shape around a valid dataset: added files, links, FIFOs and directories, their names (any byte but
"/" and NUL: newlines, invalid UTF-8) and their depth (past the walk's bound).
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import shutil
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import given
from hypothesis import strategies as st

from govtrain.data import inspect_data, read_data
from govtrain.errors import ConfigError
from govtrain.train.data import rows_of
from tests.fuzz.common import Target, check, fuzz_settings, main, mutated

SEPARATOR = b"\n--shard--\n"  # a dataset_dir input: state.json, this separator, the shard's bytes
SHARD = "data-00000-of-00001.arrow"


@functools.cache
def _scratch() -> Path:
    return Path(tempfile.mkdtemp(prefix="govtrain-fuzz-data-"))


def _read(path: Path) -> None:
    inspect_data(path)
    rows_of(read_data(path, error=ConfigError), ("label",))


def _file(suffix: str):  # type: ignore[no-untyped-def]
    def run(data: bytes) -> None:
        path = _scratch() / f"contribution{suffix}"
        path.write_bytes(data)
        _read(path)
    return run


def run_dataset_dir(data: bytes) -> None:
    folder = _scratch() / "dataset"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    state, _, shard = data.partition(SEPARATOR)
    (folder / "state.json").write_bytes(state)
    if shard:
        (folder / SHARD).write_bytes(shard)
    _read(folder)


def run_dataset_tree(data: bytes) -> None:
    """A valid dataset directory (state.json and one shard) with entries added, NUL-separated: a kind byte
    (f file, l symbolic link, p FIFO, anything else a directory), an optional depth `N*` (N levels of `a/`, at
    most 200) and a path whose names may hold any byte but "/" and NUL: the tree's shape, names and depth."""
    folder = _scratch() / "tree"
    shutil.rmtree(folder, ignore_errors=True)
    state, _, shard = _dataset_seed().partition(SEPARATOR)
    folder.mkdir()
    (folder / "state.json").write_bytes(state)
    (folder / SHARD).write_bytes(shard)
    for record in data.split(b"\x00"):
        kind, spec = record[:1], record[1:]
        depth, star, rest = spec.partition(b"*")
        levels = min(int(depth), 200) if star and depth.isdigit() and len(depth) <= 3 else 0
        names = [n[:100] for n in (rest if levels else spec).split(b"/") if n not in (b"", b".", b"..")]
        if not names:
            continue
        path = os.path.join(os.fsencode(folder), *([b"a"] * levels), *names)
        with contextlib.suppress(OSError):  # a name taken, or too long: that entry is left out
            os.makedirs(os.path.dirname(path), exist_ok=True)
            if kind == b"f":
                Path(os.fsdecode(path)).write_bytes(b"x")
            elif kind == b"l":
                os.symlink(b"state.json", path)
            elif kind == b"p":
                os.mkfifo(path)
            else:
                os.mkdir(path)
    _read(folder)


TREE_SEEDS = (b"f.DS_Store", b"fcache-1.arrow\x00dempty", b"d70*deep\x00f3*x", b"lx\nerror[ok]: admitted",
              b"p\xff\xfe", b"fsub/\xe2\x80\xaeevil")


TABLE = pa.table({"text": ["a good film", "a bad film", "ok"], "label": [1, 0, 1]})


def _parquet_seed() -> bytes:
    out = io.BytesIO()
    pq.write_table(TABLE, out)
    return out.getvalue()


def _arrow_seed(table: pa.Table = TABLE) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def _dataset_seed() -> bytes:
    state = {"_data_files": [{"filename": SHARD}], "_fingerprint": "f", "_format_type": None}
    return json.dumps(state).encode() + SEPARATOR + _arrow_seed()


JSONL = b'{"text": "a good film", "label": 1}\n{"text": "bad", "label": 0}\n\n{"text": "x", "label": 1}\n'
CSV = b'text,label\n"a good film, really",1\nbad,0\n'

TARGETS = [
    Target("jsonl", _file(".jsonl"), lambda: [JSONL], ("govtrain/data/contribution.py", "govtrain/data/formats.py")),
    Target("csv", _file(".csv"), lambda: [CSV], ("govtrain/data/formats.py", "govtrain/data/contribution.py")),
    Target("parquet", _file(".parquet"), lambda: [_parquet_seed()], ("govtrain/data/formats.py",)),
    Target("dataset_dir", run_dataset_dir, lambda: [_dataset_seed()],
           ("govtrain/data/dataset.py", "govtrain/data/digest.py", "govtrain/data/formats.py")),
    Target("dataset_tree", run_dataset_tree, lambda: list(TREE_SEEDS), ("govtrain/data/digest.py",)),
]

json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                                     st.text(max_size=10)),
                           lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                   st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                           max_leaves=10)


@fuzz_settings()
@given(st.one_of(mutated([JSONL]), st.lists(json_values.map(lambda v: json.dumps(v).encode()), max_size=4)
                 .map(b"\n".join), st.just(b"[" * 5000 + b"]" * 5000 + b"\n")))
def test_jsonl(data: bytes) -> None:
    check(lambda: _file(".jsonl")(data))


@fuzz_settings()
@given(st.one_of(mutated([CSV]), st.lists(st.lists(st.text(max_size=8), max_size=3), max_size=4).map(
    lambda rows: "\n".join(",".join(json.dumps(cell) for cell in row) for row in [["text", "label"], *rows]).encode()),
    st.just(b"text,label\nx," + b"9" * 5000 + b"\n")))
def test_csv(data: bytes) -> None:
    check(lambda: _file(".csv")(data))


@fuzz_settings(0.5)
@given(mutated([_parquet_seed()]))
def test_parquet(data: bytes) -> None:
    check(lambda: _file(".parquet")(data))


@fuzz_settings(0.5)
@given(st.one_of(mutated([_dataset_seed()]),
                 st.builds(lambda state, rows: json.dumps(state).encode() + SEPARATOR + _arrow_seed(
                     pa.table({"text": [str(r) for r in rows], "label": list(range(len(rows)))})),
                           st.one_of(json_values, st.fixed_dictionaries(
                               {"_data_files": st.lists(st.one_of(json_values, st.fixed_dictionaries(
                                   {"filename": st.sampled_from([SHARD, "../x", "/etc/passwd", "state.json", ""])})),
                                   max_size=3)})),
                           st.lists(st.text(max_size=5), max_size=3))))
def test_dataset_dir(data: bytes) -> None:
    check(lambda: run_dataset_dir(data))


tree_names = st.one_of(st.text(st.characters(exclude_characters="/\x00"), min_size=1, max_size=8).map(
    lambda t: t.encode("utf-8", "surrogatepass")),  # a lone surrogate: a name that is not UTF-8
    st.binary(min_size=1, max_size=8).map(lambda b: b.replace(b"/", b"_").replace(b"\x00", b"_")),
    st.sampled_from([b"x\nerror[ok]: admitted", b"\x1b[2K", b"\xe2\x80\xae"]))


@fuzz_settings(0.5)
@given(st.one_of(mutated(list(TREE_SEEDS)),
                 st.lists(st.builds(lambda kind, depth, names: kind + (b"%d*" % depth if depth else b"") +
                                    b"/".join(names), st.sampled_from([b"f", b"l", b"p", b"d"]),
                                    st.one_of(st.just(0), st.integers(0, 120)), st.lists(tree_names, min_size=1,
                                                                                         max_size=3)),
                          max_size=4).map(b"\x00".join)))
def test_dataset_tree(data: bytes) -> None:
    check(lambda: run_dataset_tree(data))


if __name__ == "__main__":
    main(TARGETS)
