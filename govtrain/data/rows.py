"""Row digests: one SHA-256 per example, so that the same rows are recognised in whatever file holds them.

    digest = row_digest(task.example(row, where))         # 32 bytes
    admitted = AdmittedRows(examples, owners)              # the rows no selection may score on
    matched = admitted.matches((where, input_digest(e)) for ...)  # [(where, contribution id)] of admitted rows
    admitted.tokens(task, tokenizer, max_length)           # {token ids as the model reads them: contribution id}
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
digest. A selection compares inputs, though: `input_digest` is the digest without the example's label
(`LABELS`), since scoring the admitted text under a flipped label is scoring the admitted row (review 2, P2, P3).

And it is not the model's view: a tokenizer's own normaliser drops what rule 2 keeps (a zero-width space, the
case of an uncased model's text), and a user can tokenize without special tokens. Two forms follow the model:
`normalised_digest`, the input digest after the tokenizer's normaliser, and `token_rows`, each example encoded
by the run's task and tokenizer without its padding and the tokenizer's structural special tokens
(`STRUCTURAL`: BOS, EOS, CLS, SEP, pad; not UNK, which stands for content). Where the tokenizer turned part of
a text into UNK, its token ids no longer tell two texts apart: such a row's text is compared by its digests only
(`keep_unknown=False`, as `govtrain tune` does), while a tokenized row, which has no text, is compared as it
is. `govtrain tune` (its selection file) and the Trainer integration (evaluation that chooses what is
released) refuse selection on admitted rows with these (`selection_admitted`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import unicodedata
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Iterable, Mapping, Sequence

DOMAIN = b"govtrain row digest v1\n"
INPUT_DOMAIN = b"govtrain input digest v1\n"
LABELS = frozenset({"label"})  # an example's fields that are its target, not its input
STRUCTURAL = ("bos_token_id", "eos_token_id", "cls_token_id", "sep_token_id", "pad_token_id")
_CHUNK = 64  # examples encoded at once


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


def input_digest(example: Any) -> bytes:
    """SHA-256 of the normal form of the example's input: every field it compares by but its label (`LABELS`)."""
    kind, fields = normal_form(example) if dataclasses.is_dataclass(example) else ("", normal_form(example))
    inputs = {name: value for name, value in fields.items() if name not in LABELS}
    text = json.dumps([kind, inputs], sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(INPUT_DOMAIN + text.encode("utf-8")).digest()


def normalised_digest(example: Any, tokenizer: Any) -> bytes | None:
    """The input digest of the example with every string as the tokenizer's normaliser leaves it (an uncased
    model's lower case, the control and zero-width characters BERT's drops), or None: it has no normaliser."""
    normalizer = getattr(getattr(tokenizer, "backend_tokenizer", None), "normalizer", None)
    if normalizer is None:
        return None
    return input_digest(_strings(example, normalizer.normalize_str))


def _strings(value: Any, change: Any) -> Any:
    if isinstance(value, str):
        return change(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_strings(item, change) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _strings(getattr(value, f.name), change)
                                             for f in dataclasses.fields(value) if f.compare and f.init})
    return value


def special_ids(tokenizer: Any) -> frozenset[int]:
    """The tokenizer's structural special token ids (`STRUCTURAL`)."""
    return frozenset(i for i in (getattr(tokenizer, name, None) for name in STRUCTURAL) if isinstance(i, int))


def token_rows(task: Any, examples: Sequence[Any], tokenizer: Any, max_length: int, *,
               keep_unknown: bool = True) -> list[tuple[int, ...]]:
    """Each example's token ids as the model reads them: encoded by `task` with `tokenizer`, cut at `max_length`,
    without its padding (attention mask off) and without the structural special tokens; `()` for one holding
    the unknown token unless `keep_unknown`."""
    import torch

    special, rows = special_ids(tokenizer), []
    unknown = getattr(tokenizer, "unk_token_id", None) if not keep_unknown else None
    for start in range(0, len(examples), _CHUNK):
        batch = task.encode(list(examples[start:start + _CHUNK]), tokenizer, max_length, torch.device("cpu"))
        ids, mask = batch.inputs["input_ids"].tolist(), batch.inputs.get("attention_mask")
        mask = mask.tolist() if mask is not None else [[1] * len(row) for row in ids]
        rows += [tuple(t for t, on in zip(row, keep) if on and t not in special) for row, keep in zip(ids, mask)]
    return [() if unknown is not None and unknown in row else row for row in rows]


@dataclass(frozen=True)
class AdmittedRows:
    """Admitted examples, each with the contribution it came from: the rows a selection may not score on."""

    examples: tuple[Any, ...]
    owners: tuple[str, ...]  # contribution id of each example

    @cached_property
    def digests(self) -> dict[bytes, str]:
        """Input digest (the label left out) -> the contribution of the first example with it."""
        digests: dict[bytes, str] = {}
        for example, owner in zip(self.examples, self.owners):
            digests.setdefault(input_digest(example), owner)
        return digests

    def matches(self, digested: Iterable[tuple[str, bytes]]) -> list[tuple[str, str]]:
        """(where, contribution id) of every (where, input digest) that is an admitted row's."""
        digests = self.digests
        return [(where, digests[digest]) for where, digest in digested if digest in digests]

    def tokens(self, task: Any, tokenizer: Any, max_length: int, *,
               keep_unknown: bool = True) -> dict[tuple[int, ...], str]:
        """`token_rows` of every example (empty ones left out) -> the contribution of the first with them."""
        found: dict[tuple[int, ...], str] = {}
        for row, owner in zip(token_rows(task, self.examples, tokenizer, max_length, keep_unknown=keep_unknown),
                              self.owners):
            if row:
                found.setdefault(row, owner)
        return found

    def normalised(self, tokenizer: Any) -> dict[bytes, str]:
        """`normalised_digest` of every example -> the contribution of the first with it (empty: no normaliser)."""
        found: dict[bytes, str] = {}
        for example, owner in zip(self.examples, self.owners):
            digest = normalised_digest(example, tokenizer)
            if digest is not None:
                found.setdefault(digest, owner)
        return found


def admitted_summary(matched: list[tuple[str, str]], total: int) -> str:
    """"3 of 40 rows are admitted rows (e.g. valid.csv:7 is a row of contribution 'pub')"."""
    where, owner = matched[0]
    return f"{len(matched)} of {total} rows are admitted rows (e.g. {where} is a row of contribution {owner!r})"


__all__ = ["DOMAIN", "LABELS", "STRUCTURAL", "AdmittedRows", "admitted_summary", "input_digest", "normal_form",
           "normalised_digest", "row_digest", "special_ids", "token_rows"]
