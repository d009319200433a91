"""Row digests: one SHA-256 per example, so that the same rows are recognised in whatever file holds them.

    digest = row_digest(task.example(row, where))         # 32 bytes
    admitted = AdmittedRows(examples, owners)              # the rows no selection may score on
    matched = admitted.matches((where, digest) for ...)    # [(where, contribution id)] of the rows admitted
    admitted_summary(matched, total)                       # "3 of 40 rows are admitted rows (e.g. ...)"

A file's SHA-256 (`govtrain.data.digest`) binds bytes; a row digest names an example. Two data sets share a row
when they share a row digest, whatever the format (JSON Lines, CSV, Parquet, a dataset directory), blank lines,
CSV quoting, JSON key order and spacing, or files concatenated. The normal form a digest is taken over:

1. the row is the task's example (`task.example(row, where)`): only the columns the task reads, a CSV label
   cell of digits already the int training reads (`integer_columns`);
2. every string is Unicode NFC with each run of whitespace (what `str.split()` splits on: spaces, tabs, line
   breaks, no-break spaces) one space and none at either end; tuples are lists;
3. the digest is SHA-256 over `DOMAIN` and the canonical JSON (UTF-8, sorted keys, no spaces) of
   `[type name, {field: value}]` over the fields the example compares by (`where` is not one).

It is no fuzzy match: a row with a word, a label or a character outside that normal form changed has another
digest. `govtrain tune` (its selection file) and the Trainer integration (evaluation that chooses what is
released) refuse selection on admitted rows with it (`selection_admitted`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import unicodedata
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Iterable, Mapping

DOMAIN = b"govtrain row digest v1\n"


def normal_form(value: Any) -> Any:
    """The value as the digest sees it (module docstring, rule 2); an example is [type name, {field: value}]."""
    if isinstance(value, str):
        return " ".join(unicodedata.normalize("NFC", value).split())
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, (list, tuple)):
        return [normal_form(item) for item in value]
    if isinstance(value, Mapping):
        return {str(key): normal_form(item) for key, item in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [type(value).__name__, {f.name: normal_form(getattr(value, f.name))
                                       for f in dataclasses.fields(value) if f.compare}]
    raise TypeError(f"a row digest has no normal form for a {type(value).__name__}")


def row_digest(example: Any) -> bytes:
    """SHA-256 of the example's normal form (module docstring)."""
    text = json.dumps(normal_form(example), sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)
    return hashlib.sha256(DOMAIN + text.encode("utf-8")).digest()


@dataclass(frozen=True)
class AdmittedRows:
    """Admitted examples, each with the contribution it came from: the rows a selection may not score on."""

    examples: tuple[Any, ...]
    owners: tuple[str, ...]  # contribution id of each example

    @cached_property
    def digests(self) -> dict[bytes, str]:
        """Row digest -> the contribution of the first example with it."""
        digests: dict[bytes, str] = {}
        for example, owner in zip(self.examples, self.owners):
            digests.setdefault(row_digest(example), owner)
        return digests

    def matches(self, digested: Iterable[tuple[str, bytes]]) -> list[tuple[str, str]]:
        """(where, contribution id) of every (where, row digest) that is an admitted row's."""
        digests = self.digests
        return [(where, digests[digest]) for where, digest in digested if digest in digests]


def admitted_summary(matched: list[tuple[str, str]], total: int) -> str:
    """"3 of 40 rows are admitted rows (e.g. valid.csv:7 is a row of contribution 'pub')"."""
    where, owner = matched[0]
    return f"{len(matched)} of {total} rows are admitted rows (e.g. {where} is a row of contribution {owner!r})"


__all__ = ["DOMAIN", "AdmittedRows", "admitted_summary", "normal_form", "row_digest"]
