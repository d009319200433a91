"""Row digests: one SHA-256 per example, so that the same rows are recognised in whatever file holds them.

    digest = row_digest(task.example(row, where))         # 32 bytes
    admitted = AdmittedRows(examples, owners)              # the rows no selection may score on
    matched = admitted.matches((where, input_digest(e)) for ...)  # [(where, contribution id)] of admitted rows
    admitted.tokens(task, tokenizer, max_length)           # {token ids as the model reads them: contribution id}
    PrefixIndex.of(tokens).match(row)                      # a causal task: ("starts with", contribution id) | None
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

For a causal task (`task.causal`) equality is not enough: the logit at a position reads only the tokens before
it, so a row that is an admitted row followed by more tokens scores the admitted row's tokens exactly as the
admitted row does (one token appended, its label -100, gives the admitted row's loss), and a row that is an
admitted row's first k tokens scores those k tokens as the admitted row does (review 3, F7). `PrefixIndex`
finds both over the same token rows (structural special tokens and padding left out), each once the shared
opening has `MIN_PREFIX` tokens or more: a row an admitted row of that length is a prefix of (the admitted row's
whole loss is in it, as in an exact copy), and a row of that length that is a prefix of an admitted row. A
shorter opening is one many texts share (see the constant): an admitted row of two words refused every held-out
row starting with them (review 4), while all either way scores of an admitted row is the loss of 7 tokens or
fewer. Equal token rows are refused at any length, as before.
"""

from __future__ import annotations

import bisect
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
# The fewest tokens (special tokens left out) a row needs before being an admitted row's opening refuses it (a
# causal task). A shorter row is an opening that independent texts share (a greeting, "what is the capital of",
# a chat role header that survives as ordinary tokens), so refusing it would refuse honest held-out rows, while
# all it scores of the admitted row is the loss of its first 7 tokens or fewer. 8 is the low end of the 8- to
# 13-token runs that contamination studies take as copied rather than coincidental (PaLM's 8-grams, GPT-3's
# 13-grams). The same bound holds for a short admitted row found as a row's opening; equal rows, at any length.
MIN_PREFIX = 8
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


@dataclass(frozen=True)
class PrefixIndex:
    """Admitted token rows in lexicographic order, for the prefix rule of a causal task (module docstring).

    Sorted tuples put every row that starts with `r` in one run right after `r`'s place, so "`r` is the
    opening of an admitted row" is one binary search. "An admitted row is an opening of `r`" is a few: the
    greatest admitted row not above `r` either is an opening of it, or differs from `r` at a position k where
    every admitted opening of `r` has ended (any longer one would sort after it), so the search goes on with
    `r`'s first k tokens, a strictly shorter probe. No per-token table is built: memory is the rows themselves.
    """

    rows: tuple[tuple[int, ...], ...]  # sorted, none empty
    owners: Mapping[tuple[int, ...], str]  # row -> contribution id

    @classmethod
    def of(cls, tokens: Mapping[tuple[int, ...], str]) -> PrefixIndex:
        """From `AdmittedRows.tokens` (one or more of them merged)."""
        return cls(rows=tuple(sorted(row for row in tokens if row)), owners=tokens)

    def match(self, row: Sequence[int]) -> tuple[str, str] | None:
        """(how `row` holds an admitted row, its contribution id), or None: "is" (the same tokens), "starts with"
        (an admitted row followed by more tokens) or "is the start of" (an admitted row's first `MIN_PREFIX` or
        more tokens). `row` is compared as given: leave out padding and structural special tokens first."""
        row, rows = tuple(row), self.rows
        if not row:
            return None
        probe = row
        while probe:
            at = bisect.bisect_right(rows, probe)
            if at == 0:
                break
            below = rows[at - 1]
            if probe[:len(below)] == below:  # the longest admitted opening of `row`: any longer one sorts above
                if below == row:
                    return "is", self.owners[below]
                if len(below) >= MIN_PREFIX:
                    return "starts with", self.owners[below]
                break
            probe = probe[:_common(below, probe)]
        if len(row) >= MIN_PREFIX:
            at = bisect.bisect_left(rows, row)
            if at < len(rows) and rows[at][:len(row)] == row:
                return ("is" if rows[at] == row else "is the start of"), self.owners[rows[at]]
        return None


    def longest_opening(self, row: Sequence[int]) -> int:
        """The most tokens `row` opens with that some admitted row opens with too (the longest common opening
        with any admitted row is with one of `row`'s two neighbours in sorted order)."""
        row = tuple(row)
        at = bisect.bisect_left(self.rows, row)
        return max((_common(self.rows[k], row) for k in (at - 1, at) if 0 <= k < len(self.rows)), default=0)


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """The length of the longest common opening of `a` and `b`."""
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def admitted_summary(matched: Sequence[tuple[str, ...]], total: int) -> str:
    """"3 of 40 rows are admitted rows (e.g. valid.csv:7 is a row of contribution 'pub')". Each match is (where,
    contribution id) or (where, contribution id, how) with how from `PrefixIndex.match`; once one is a prefix
    match, the summary says what a causal LM scores as an admitted row."""
    where, owner, *how = matched[0]
    relation = how[0] if how else "is"
    if all(len(m) < 3 or m[2] == "is" for m in matched):
        return f"{len(matched)} of {total} rows are admitted rows (e.g. {where} is a row of contribution {owner!r})"
    return (f"{len(matched)} of {total} rows are admitted rows, or score as one to a causal LM (an admitted row "
            f"with tokens appended, or its first {MIN_PREFIX}+ tokens: e.g. {where} {relation} a row of contribution "
            f"{owner!r})")


__all__ = ["DOMAIN", "LABELS", "MIN_PREFIX", "STRUCTURAL", "AdmittedRows", "PrefixIndex", "admitted_summary",
           "input_digest", "normal_form", "normalised_digest", "row_digest", "special_ids", "token_rows"]
