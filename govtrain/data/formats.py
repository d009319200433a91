"""The rows of each data file format, parsed from bytes that were already hashed.

A row is a plain dict (column → Python value) with a `where` label that names it for error messages.
The format is picked by the file's suffix, the same way at `attest`, at the gate and in training:

| suffix | format | row | where |
|---|---|---|---|
| `.jsonl` `.ndjson` `.json` | JSON Lines: one JSON object per non-blank line; only `\\n` ends a record | the object | `name:LINE` |
| `.csv` | CSV (RFC 4180 quoting), UTF-8 (a leading BOM is dropped), a header row of unique non-empty names, then one record per row with exactly as many fields; empty lines are skipped; a cell holds at most `csv.field_size_limit()` characters | header → cell, a `str`; in `integer_columns` a cell that is a decimal integer literal (`-?[0-9]+`) becomes an `int` | `name:LINE` (where the record starts) |
| `.parquet` | Apache Parquet | column → value, as pyarrow converts it | `name:row N` |

CSV has no types, so a label column of digits would otherwise reach the task as text: the caller names the
columns that are integers (training passes RUN.toml's `label_column`); a cell there that is not an integer
literal stays a string, for the task to refuse or accept. pyarrow is imported only when a Parquet or Arrow
file is read.
"""

from __future__ import annotations

import csv
import io
import json
import re
from typing import Any, Callable, Collection, Iterable, Iterator

Row = tuple[str, dict[str, Any]]

JSON_LINES_SUFFIXES = (".jsonl", ".ndjson", ".json")
CSV_SUFFIX = ".csv"
PARQUET_SUFFIX = ".parquet"
_INTEGER = re.compile(r"-?[0-9]+", re.ASCII)


class BadData(Exception):
    """The first thing in a contribution's data that makes it unusable: `where` (file:line, file:row N) and why."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"{where}: {reason}")
        self.where = where
        self.reason = reason


def json_lines_rows(lines: Iterable[bytes], name: str) -> Iterator[Row]:
    """Rows of JSON Lines given as its lines (a file's iteration, or bytes split at `\\n`)."""
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{name}:{number}"
        try:
            record = json.loads(line)
        except (UnicodeDecodeError, ValueError) as e:
            raise BadData(where, f"not JSON ({e.__class__.__name__}){_ONE_PER_LINE}") from None
        except RecursionError:
            raise BadData(where, "JSON nested too deep to read") from None
        if not isinstance(record, dict):
            raise BadData(where, f"not a JSON object{_ONE_PER_LINE}")
        yield where, record


# A pretty-printed JSON array fails on its first line: say what the format is rather than only that it is wrong.
_ONE_PER_LINE = "; .jsonl, .ndjson and .json files are JSON Lines: one object per line"


def csv_rows(raw: bytes, name: str, integer_columns: Collection[str] = ()) -> Iterator[Row]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise BadData(f"{name}:{line}", "not UTF-8") from None
    reader = csv.reader(io.StringIO(text.removeprefix("\ufeff"), newline=""), strict=True)
    header: list[str] | None = None
    start = 1
    try:
        for fields in reader:
            where, start = f"{name}:{start}", reader.line_num + 1
            if not fields:
                continue
            if header is None:
                header = _csv_header(fields, where)
                continue
            if len(fields) != len(header):
                raise BadData(where, f"{len(fields)} fields, the header has {len(header)}")
            try:
                row = {column: _csv_cell(cell, column in integer_columns) for column, cell in zip(header, fields)}
            except ValueError:  # an integer past Python's digit limit (sys.get_int_max_str_digits)
                raise BadData(where, "a number too long to read") from None
            yield where, row
    except csv.Error as e:
        raise BadData(f"{name}:{reader.line_num}", f"not CSV ({e})") from None


def _csv_header(fields: list[str], where: str) -> list[str]:
    if any(not column for column in fields):
        raise BadData(where, "the header row has an empty column name")
    if len(set(fields)) != len(fields):
        raise BadData(where, "the header row names a column twice")
    return fields


def _csv_cell(cell: str, integer: bool) -> str | int:
    return int(cell) if integer and _INTEGER.fullmatch(cell) else cell


def parquet_rows(raw: bytes, name: str) -> Iterator[Row]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    file = _arrow(lambda: pq.ParquetFile(pa.BufferReader(raw)), name, "not a readable Parquet file")
    if not _arrow(lambda: _counts_agree(file.metadata), name, "not a readable Parquet file"):
        # The reader allocates for the rows a row group declares: 3 rows of data declared as 55 billion would
        # exhaust memory before any value is read.
        raise BadData(name, "not a readable Parquet file (its row groups, its columns and its footer declare "
                            "different numbers of rows)")
    table = _arrow(file.read, name, "not a readable Parquet file")
    return table_rows(table, name)


def _counts_agree(meta) -> bool:  # type: ignore[no-untyped-def]
    """The row groups' rows add up to the file's. (Column chunks' counts are left to the reader: pyarrow 26 aborts
    the process, uncatchably, reading some malformed column-chunk metadata that its reader refuses cleanly.)"""
    return sum(meta.row_group(i).num_rows for i in range(meta.num_row_groups)) == meta.num_rows


def arrow_stream_table(raw: bytes, name: str):  # type: ignore[no-untyped-def]
    """The table in an Arrow IPC *stream* (what `datasets` writes as `data-*.arrow`)."""
    import pyarrow as pa

    return _arrow(lambda: pa.ipc.open_stream(pa.py_buffer(raw)).read_all(), name, "not a readable Arrow stream")


def table_rows(table, name: str, first: int = 1) -> Iterator[Row]:  # type: ignore[no-untyped-def]
    """Rows of a pyarrow table, numbered from `first` (a dataset's shards continue one numbering)."""
    names = _arrow(lambda: table.schema.names, name, "column names that are not UTF-8")
    if len(set(names)) != len(names):
        raise BadData(name, "a column name appears twice")
    # Readers check an Arrow stream's metadata, not its buffers: an offset past its values would be read out of
    # bounds (a crash) by to_pylist. Full validation checks every offset and length first.
    _arrow(lambda: table.validate(full=True), name, "buffers that do not hold what the schema says")
    records = _arrow(table.to_pylist, name, "values pyarrow cannot convert")
    return ((f"{name}:row {first + i}", record) for i, record in enumerate(records))


def _arrow(read: Callable[[], Any], name: str, what: str) -> Any:
    import pyarrow as pa

    try:
        return read()
    except (pa.ArrowException, OSError, ValueError, TypeError) as e:
        raise BadData(name, f"{what} ({e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def file_rows(raw: bytes, name: str, suffix: str, integer_columns: Collection[str] = ()) -> Iterator[Row]:
    """Rows of a data file of any format, picked by `suffix`."""
    suffix = suffix.lower()
    if suffix in JSON_LINES_SUFFIXES:
        return json_lines_rows(raw.split(b"\n"), name)
    if suffix == CSV_SUFFIX:
        return csv_rows(raw, name, integer_columns)
    if suffix == PARQUET_SUFFIX:
        return parquet_rows(raw, name)
    raise BadData(name, f"unknown data format {suffix or '(no suffix)'!r}; name the file .jsonl, .ndjson, .json "
                        "(JSON Lines), .csv or .parquet, or give a datasets save_to_disk directory")
