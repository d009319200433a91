"""A search's selection file (`govtrain tune`, `tune.py`): its rows read once as the task's examples
(`read_selection`), and refused (`selection_admitted`) where it is, or holds any row of, an admitted
contribution's data (`check_selection`): selecting on private data is not post-processing.

Kept apart from the search itself: this half only reads the ledger's admissions and the data, and writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from govtrain.errors import Code, ConfigError
from govtrain.train.config import RunConfig

@dataclass(frozen=True, kw_only=True)
class Selection:
    """The selection file, read once: its digest (a file's SHA-256 or a directory's tree hash) and its rows as
    the task's examples, each with where it is (file:line)."""

    path: Path
    sha256: bytes
    where: list[str]
    examples: list[Any]


def read_selection(path: Path, task, integer_columns: tuple[str, ...]) -> Selection:  # type: ignore[no-untyped-def]
    """Every row of the selection file (any format training reads) as the task's example; a row the task cannot
    use is refused (BAD_DATA, naming file and row), as `govtrain eval` refuses it."""
    from govtrain.data import read_data
    from govtrain.train.data import rows_of

    if not path.exists():
        raise ConfigError(Code.DATA_UNREADABLE, f"select.data {path}: no such file or directory")
    data = read_data(path)
    rows = rows_of(data, integer_columns)
    if not rows:
        raise ConfigError(Code.BAD_DATA, f"select.data {path}: no rows to score on")
    return Selection(path=path, sha256=data.sha256, where=[where for where, _ in rows],
                     examples=[task.example(row, where) for where, row in rows])


def check_selection(ledger, config: RunConfig, task, selection: Selection) -> None:  # type: ignore[no-untyped-def]
    """Refuse (SELECTION_ADMITTED) a selection file that is an admitted contribution's data (its digest, for
    every admitted contribution), or that holds any row of one (against the rows of every admitted contribution
    whose data is in training.data, withdrawn ones included), compared as inputs, the label left out: by input
    digest (`govtrain.data.rows`), then as the base model's tokenizer reads them: by input digest after its
    normaliser (a zero-width space, an uncased text's case), and by the token ids it gives them, cut at
    `model.max_length` as the trials are scored, without padding and structural special tokens (an admitted row
    with an unknown token by its digests only). For a causal task those token ids are also compared by prefix
    (`PrefixIndex`): a selection row that starts with an admitted row (its loss on those tokens is the admitted
    row's), or that is an admitted row's first `MIN_PREFIX` tokens or more. Selecting on private data is not
    post-processing."""
    from govtrain.data.rows import (AdmittedRows, PrefixIndex, admitted_summary, input_digest, normalised_digest,
                                    token_rows)
    from govtrain.train.data import load_examples
    from govtrain.train.model import load_tokenizer

    admissions = _admitted_data(ledger)
    for data_sha256, contribution_id in admissions.items():
        if data_sha256 == selection.sha256:
            raise ConfigError(Code.SELECTION_ADMITTED, f"select.data {selection.path} is the data of admitted "
                                                       f"contribution {contribution_id!r}: selecting on private "
                                                       "data is not post-processing; hold out a file that is not "
                                                       "admitted")
    loaded = load_examples(config.data_dir, admissions, task, integer_columns=(config.file.data.label_column,))
    admitted = AdmittedRows(tuple(loaded.items), tuple(loaded.owner))
    matched: list[tuple[str, ...]] = list(admitted.matches(zip(selection.where,
                                                               map(input_digest, selection.examples))))
    if not matched and admitted.examples:
        tokenizer, _ = load_tokenizer(config)
        length, normalised = config.file.model.max_length, admitted.normalised(tokenizer)
        tokens = admitted.tokens(task, tokenizer, length, keep_unknown=False)
        prefixes = PrefixIndex.of(tokens) if task.causal else None
        # A selection row as it is read, unknown tokens kept: no admitted row here holds one, so an unknown token
        # never makes a row match an admitted row it does not hold, and after an admitted opening it still counts
        # (an admitted row with an unknown word appended is refused).
        read = token_rows(task, selection.examples, tokenizer, length)
        for where, example, row in zip(selection.where, selection.examples, read):
            owner = normalised.get(normalised_digest(example, tokenizer)) or tokens.get(row)  # type: ignore[arg-type]
            if owner is not None:
                matched.append((where, owner))
            elif prefixes is not None and (found := prefixes.match(row)) is not None:
                matched.append((where, found[1], found[0]))
    if matched:
        raise ConfigError(Code.SELECTION_ADMITTED, f"select.data {selection.path}: "
                                                   f"{admitted_summary(matched, len(selection.examples))}: selecting "
                                                   "on private data is not post-processing; score on rows that no "
                                                   "contribution admitted")


def _admitted_data(ledger) -> dict[bytes, str]:  # type: ignore[no-untyped-def]
    """Data SHA-256 -> contribution id of every admission, retired ones too, from the verified entries (`verified`):
    never the admissions index, whose rows a database writer without keys can delete to pass admitted data off as
    a held-out selection file."""
    from govtrain.ledger.verified import verified_entries

    found: dict[bytes, str] = {}
    entries = verified_entries(ledger.store)
    for item in entries:
        if item.kind == "admit":
            admit = item.entry if item.entry is not None else entries.redacted.admits[item.seq]
            found.setdefault(admit["data_sha256"], admit["contribution_id"])
    return found
