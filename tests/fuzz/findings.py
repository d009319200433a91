"""The minimal reproducer of every finding of the fuzzing (docs/fuzzing.md#findings): each input, the target that
reached it, and the coded error it now gets. tests/fuzz/test_findings.py replays them through their targets;
tests/test_attacks_fuzz.py sends them through the public entry points and checks that nothing changed."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path

from govtrain.errors import Code


@dataclass(frozen=True)
class Finding:
    number: int
    target: str
    data: bytes
    code: Code
    was: str  # what the parser raised (or did) before the fix


TOML_DEEP = b"a = " + b"[" * 3000 + b"]" * 3000 + b"\n"
TOML_LONG_INT = b"a = " + b"9" * 5000 + b"\n"
JSON_DEEP = b"[" * 100_000 + b"]" * 100_000
LONG_DIGITS = b"9" * 5000


def arrow_offsets_past_values() -> bytes:
    """An Arrow IPC stream of one string column whose last offset points far past its values."""
    import pyarrow as pa

    table = pa.table({"text": ["a good film", "a bad film", "ok"], "label": [1, 0, 1]})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    raw = sink.getvalue().to_pybytes()
    offsets = b"".join(n.to_bytes(4, "little") for n in (0, 11, 21, 23))
    assert raw.count(offsets) == 1
    return raw.replace(offsets, offsets[:12] + (0x6F6F6420).to_bytes(4, "little"))


def arrow_column_not_utf8() -> bytes:
    """An Arrow IPC stream whose schema names a column with bytes that are not UTF-8."""
    import pyarrow as pa

    table = pa.table({"text": ["a"], "qzqz": [1]})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    raw = sink.getvalue().to_pybytes()
    assert raw.count(b"qzqz") == 1
    return raw.replace(b"qzqz", b"qz\xf8z")  # the same length: the flatbuffer stays well formed


# Found by atheris (make fuzz, 2026-11-27): 3 rows of data whose row group declares 55,406,687,869 rows.
PARQUET_ROWS_DECLARED = (Path(__file__).parent / "inputs" / "parquet-55-billion-rows.parquet").read_bytes()

PARQUET_LEVEL_HISTOGRAM = (Path(__file__).parent / "inputs" / "parquet-level-histogram.parquet").read_bytes()

STATE = b'{"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}'
SHARD = b"\n--shard--\n"  # tests.fuzz.test_data.SEPARATOR


def proof_with_long_index(checkpoint: str) -> bytes:
    return (f"c2sp.org/tlog-proof@v1\nextra {base64.b64encode(b'x').decode()}\nindex {'9' * 5000}\n\n"
            f"{checkpoint}").encode()


def findings(checkpoint: str) -> list[Finding]:
    """Every finding; `checkpoint` is a checkpoint note the proof reproducer carries (the world ledger's)."""
    return [
        Finding(1, "proof", proof_with_long_index(checkpoint), Code.BAD_PROOF,
                "ValueError: an index of more than 4300 digits (Python's int() limit)"),
        Finding(2, "signed_checkpoint", b"test.invalid/govtrain/1\n" + LONG_DIGITS + b"\n" + base64.b64encode(bytes(32)) + b"\n", Code.BAD_CHECKPOINT,
                "ValueError: a signed tree size of more than 4300 digits"),
        Finding(3, "policy", TOML_DEEP, Code.POLICY_UNREADABLE, "RecursionError in tomllib: arrays nested 3000 deep"),
        Finding(4, "policy", TOML_LONG_INT, Code.POLICY_UNREADABLE, "ValueError: a TOML integer of 5000 digits"),
        Finding(5, "run_config", TOML_DEEP, Code.RUN_CONFIG_INVALID, "RecursionError in tomllib"),
        Finding(6, "inference_policy", b"a = " + b"{b = " * 2000, Code.INFERENCE_POLICY_UNREADABLE,
                "RecursionError in tomllib: inline tables nested 2000 deep"),
        Finding(7, "grid", b'[grid]\n"optimizer.lr" = [2000-01-01]\n[select]\ndata = "x.jsonl"\n', Code.GRID_INVALID,
                "TypeError: a TOML date in a grid has no JSON form (plan_trials hashes trials as JSON)"),
        Finding(8, "jsonl", JSON_DEEP + b"\n", Code.BAD_DATA, "RecursionError in json.loads: a line nested 100000 deep"),
        Finding(9, "csv", b"text,label\nx," + LONG_DIGITS + b"\n", Code.BAD_DATA,
                "ValueError: an integer label of 5000 digits"),
        Finding(10, "dataset_dir", JSON_DEEP, Code.BAD_DATA, "RecursionError: state.json nested 100000 deep"),
        Finding(11, "dataset_dir", STATE + SHARD + arrow_column_not_utf8(), Code.BAD_DATA,
                "UnicodeDecodeError: an Arrow column name that is not UTF-8"),
        Finding(12, "dataset_dir", STATE + SHARD + arrow_offsets_past_values(), Code.BAD_DATA,
                "segmentation fault: pyarrow's to_pylist read a string offset past its values"),
        Finding(13, "parquet", PARQUET_ROWS_DECLARED, Code.BAD_DATA,
                "out of memory (over 4 GB for a 736-byte file): the reader allocated for the rows a row group declared"),
        Finding(14, "policy", b'"\\n" = 0\n', Code.POLICY_INVALID,
                "an error of two lines: pydantic's path of a quoted key holding a newline, printed as it was"),
        Finding(15, "grid", b'[grid]\n"\\n" = [0]\n[select]\ndata = "x.jsonl"\n', Code.GRID_INVALID,
                "an error of two lines (the same, in a grid)"),
        Finding(16, "parquet", PARQUET_LEVEL_HISTOGRAM, Code.BAD_DATA,
                "process abort (an uncaught C++ exception) where a first fix for 13 read column-chunk metadata: kept "
                "as a regression of that fix; the reader itself refuses the file cleanly"),
        # 17-21: found by review (tests/test_attacks_fuzz_review.py), reached by the targets added for them.
        Finding(17, "serve_body", b"c" + b"[" * 2000 + b"]" * 2000, Code.BAD_REQUEST,
                "RecursionError in parse_body's json.loads: a 4 KB body of nested arrays (500 internal)"),
        Finding(18, "dataset_tree", b"f200*x", Code.BAD_DATA,
                "RecursionError past ~1,000 levels (the review's test builds 1,100; the harness stops at 200, past "
                "the bound of 64): the tree walk recursed once per directory level"),
        Finding(19, "dataset_tree", b"lx\nerror[ok]: contribution admitted", Code.BAD_DATA,
                "an error of two lines: a file name holding a newline, printed as it was"),
        Finding(20, "verifier_cell", bytes((0, 1)) + b"not bytes", Code.BAD_ENTRY,
                "TypeError: an entry body stored as TEXT, hashed as bytes"),
        Finding(21, "verifier_cell", bytes((5, 1)) + b"x", Code.INDEX_MISMATCH,
                "TypeError: a withdrawals seq stored as TEXT, sorted among integers"),
    ]
