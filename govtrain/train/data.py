"""Contribution data for a run: the files and dataset directories of the data folder whose digest matches an
admit entry.

Only admitted bytes are trained on: an entry is matched to its contribution by the digest the attestation
signed (a file's SHA-256, a directory's tree hash: `govtrain.data`), never by its name, and its rows are
parsed from the very bytes that were digested. Entries that match nothing are listed and skipped, as are
directories the tree hash refuses (a link inside): those bytes were never admitted. An admitted contribution
with no entry is not eligible (and is reported). Each row becomes an example of the run's task
(`govtrain.tasks`), which refuses a row it cannot use.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Iterator, Mapping

from govtrain.data import BadData, DataBytes, data_rows, read_data
from govtrain.errors import Code, ConfigError


@dataclass(frozen=True)
class Examples:
    items: list[Any]  # the task's examples
    owner: list[str]  # contribution id of each example
    unmatched_files: list[str]  # data folder entries that match no contribution (a directory ends in "/")
    missing: list[str]  # admitted contributions without a file

    def __len__(self) -> int:
        return len(self.items)


def load_examples(folder: Path, digests: Mapping[bytes, str], task, *,  # type: ignore[no-untyped-def]
                  records: Mapping[str, int] | None = None, integer_columns: Collection[str] = ()) -> Examples:
    """`digests` maps each admitted contribution's data digest to its id; `task` makes each row an example.

    `records` (contribution id → the record count its attestation declares), when given, must equal the rows
    read: the suffix picks the parser, so bytes renamed to another format would be read as other rows than
    the gate counted. `integer_columns` are the CSV columns whose integer cells become `int` (the label)."""
    if not folder.is_dir():
        raise ConfigError(Code.RUN_CONFIG_INVALID, f"training.data: {folder} is not a folder")
    items: list[Any] = []
    owner: list[str] = []
    unmatched: list[str] = []
    found: set[str] = set()
    for data in _entries(folder, unmatched):
        contribution = digests.get(data.sha256)
        if contribution is None or contribution in found:
            unmatched.append(_label(data.path))
            continue
        found.add(contribution)
        rows = rows_of(data, integer_columns)
        if records is not None and len(rows) != records[contribution]:
            raise ConfigError(Code.BAD_DATA, f"{data.name}: {len(rows)} records read, the attestation of "
                                             f"{contribution} declares {records[contribution]}; keep the name "
                                             "(and suffix) the data was attested with")
        for where, row in rows:
            items.append(task.example(row, where))
            owner.append(contribution)
    missing = sorted(set(digests.values()) - found)
    return Examples(items, owner, sorted(unmatched), missing)


def _entries(folder: Path, unmatched: list[str]) -> Iterator[DataBytes]:
    """Every data file and directory of the folder, read and digested once. An attestation kept beside its
    data (`admit --batch` reads X.cose with X) is never data itself."""
    for path in sorted(folder.iterdir()):
        if path.suffix == ".cose" or not (path.is_file() or path.is_dir()):
            continue
        try:
            data = read_data(path, error=ConfigError)
        except ConfigError as e:
            if e.code is not Code.BAD_DATA:
                raise
            unmatched.append(_label(path))  # the tree hash refuses it, so no admitted digest can name it
            continue
        yield data


def rows_of(data: DataBytes, integer_columns: Collection[str]) -> list[tuple[str, dict]]:
    """Every (where, row) of data `read_data` read; the first unreadable record is one BAD_DATA error."""
    try:
        return list(data_rows(data, integer_columns=integer_columns))
    except BadData as e:
        raise ConfigError(Code.BAD_DATA, str(e)) from None


def _label(path: Path) -> str:
    return path.name + "/" if path.is_dir() else path.name
