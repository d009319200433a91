"""Retention's compaction (`Ledger.compact`): which contributions a compaction retires, the summaries that commit
to them, and the redaction of their bodies once the summaries are re-checked against those bodies.

What a summary holds and how it is checked is `retention.py`; this module reads the ledger to find what to
retire, always through the verified entries (`verified.py`: every row, never selected by its kind column).
"""

from __future__ import annotations

import functools
import time as _time
from typing import Mapping

import ledger_store
from govtrain.errors import Code, IntegrityError, RejectedError
from govtrain.ledger.entries import decode_entry, summary_entry
from govtrain.ledger.retention import (
    REDACTABLE,
    RetiredKeys,
    Summarized,
    _bad,
    check_compaction,
    check_leaves,
    check_structure,
    check_summary,
    read_summaries,
    summarize,
)
from govtrain.ledger.signed_append import WritingLedger
from govtrain.ledger.verified import verified_entries


def compact(ledger: WritingLedger, before_epoch: int, now: int | None = None) -> list[ledger_store.StoredEntry]:
    """`Ledger.compact`: the summaries' transaction, then the redaction (`redact_retired`)."""
    now = int(_time.time()) if now is None else now
    try:
        with ledger.append(now) as appender:  # under the write lock: nothing is appended meanwhile
            epoch = ledger.epoch()  # the verified entries' count, under the write lock
            horizon = epoch - ledger.policy.retention_epochs
            if not 1 <= before_epoch <= horizon:
                raise RejectedError(Code.RETENTION_HORIZON,
                                    f"can compact only epochs before {max(horizon, 0)} (retention is "
                                    f"{ledger.policy.retention_epochs} epochs, current epoch {epoch})")
            boundary = epoch_boundary(ledger.store, before_epoch)
            contributions = retirable(ledger.store, boundary, RetiredKeys.read(ledger.store))
            if not contributions:
                raise _NothingToRetire
            t = ledger.dated(appender, now)
            for fields in summarize(before_epoch, contributions):
                index = {"data_class": fields["data_class"], "first_seq": fields["first_seq"],
                         "last_seq": fields["last_seq"]}
                appender.add("summary", t, functools.partial(_summary_at, now=t, fields=fields),
                             summary=index)
    except _NothingToRetire:
        pass
    redacted = redact_retired(ledger)
    if not redacted:
        raise RejectedError(Code.RETENTION_HORIZON, f"nothing left to compact before epoch {before_epoch}")
    return redacted


def redact_retired(ledger: WritingLedger) -> list[ledger_store.StoredEntry]:
    """Drop the bodies of every entry a summary retired, after re-checking each such summary against them."""
    # The write lock again, so that nothing can name a retired contribution between the check and the
    # redaction; no checkpoint, since every leaf hash stays as it was.
    with ledger.store.append() as appender:
        summaries, rows = unfinished(ledger.store)
        if not summaries:
            return []
        check_unfinished(ledger.store, summaries, rows)
        appender.redact(sorted(rows))
    return [rows[seq] for seq in sorted(rows)]


class _NothingToRetire(Exception):
    """Rolls back the summaries' transaction (and its checkpoint) when a compaction finds nothing new."""


def _summary_at(seq: int, *, now: int, fields: dict) -> bytes:
    return summary_entry(seq, now, **fields)


def epoch_boundary(store: ledger_store.LedgerStore, before_epoch: int) -> int:
    """The seq of the `epoch` entry that closes epoch `before_epoch - 1`: what a compaction retires is before it."""
    for item in verified_entries(store):
        if item.kind == "epoch" and item.entry["epoch"] == before_epoch - 1:
            return item.seq
    raise IntegrityError(Code.BAD_EPOCH, f"no epoch entry closes epoch {before_epoch - 1}")


def retirable(store: ledger_store.LedgerStore, boundary: int, retired: RetiredKeys) -> list[list[Summarized]]:
    """The contributions a compaction may retire, each as its entries (admit first): admitted before entry
    `boundary`, not retired already, and named by no entry after it."""
    by_id: dict[str, list[Summarized]] = {}
    keep: set[str] = set()  # still active after the boundary, or not retirable whole
    for item in verified_entries(store):
        if item.entry is None or item.kind not in REDACTABLE:
            continue
        entry = item.entry
        contribution_id = entry["contribution_id"]
        if item.seq > boundary or (item.kind == "admit" and contribution_id in by_id):
            keep.add(contribution_id)
        elif item.kind == "admit":
            by_id[contribution_id] = [Summarized(item.seq, item.leaf_hash, entry)]
        elif contribution_id in by_id:
            by_id[contribution_id].append(Summarized(item.seq, item.leaf_hash, entry))
    return [items for contribution_id, items in by_id.items()
            if contribution_id not in keep and contribution_id not in retired]


def unfinished(store: ledger_store.LedgerStore) -> tuple[list[tuple[int, dict]], dict[int, ledger_store.StoredEntry]]:
    """The summaries whose retired entries still have their bodies (a compaction not yet redacted, or
    interrupted between its two transactions), with those entries."""
    summaries = read_summaries(store)
    wanted = sorted({s for _, summary in summaries for r in summary["retired"] for s in r["entry_seqs"]})
    rows = {row.seq: row for row in store.entries_at(wanted)}
    pending, held = [], {}
    for seq, summary in summaries:
        mine = [s for r in summary["retired"] for s in r["entry_seqs"]]
        present = [s for s in mine if s in rows and rows[s].body is not None]
        if present and len(present) != len(mine):
            raise _bad(f"summary entry {seq}: some of the entries it retires were redacted and some were not")
        if present:
            pending.append((seq, summary))
            held.update((s, rows[s]) for s in present)
    return pending, held


def check_unfinished(store: ledger_store.LedgerStore, summaries: list[tuple[int, dict]],
                     rows: Mapping[int, ledger_store.StoredEntry]) -> None:
    """Every check of the summaries `unfinished` returned, against their bodies, before they are dropped."""
    for seq, row in rows.items():
        if ledger_store.leaf_hash(row.body) != row.leaf_hash:
            raise IntegrityError(Code.LEAF_HASH_MISMATCH, f"entry {seq}: stored leaf hash does not match its body")
    bodies = {seq: Summarized(seq, row.leaf_hash, decode_entry(row.body, seq=seq, kind=row.kind))
              for seq, row in rows.items()}
    leaves = {seq: row.leaf_hash for seq, row in rows.items()}
    ids = {r["contribution_id"] for _, summary in summaries for r in summary["retired"]}
    named = appearances(store, ids, start=min(rows))
    groups: dict[tuple[int, int], list[dict]] = {}
    for seq, summary in summaries:
        try:
            check_structure(summary)
            check_leaves(summary, leaves)
            check_summary(summary, bodies, named)
        except IntegrityError as e:
            raise _bad(f"summary entry {seq}: {e.detail}") from e
        groups.setdefault((summary["first_seq"], summary["last_seq"]), []).append(summary)
    for (first, last), group in groups.items():
        try:
            check_compaction(group, leaves)
        except IntegrityError as e:
            raise _bad(f"the summaries of {first}..{last}: {e.detail}") from e


def appearances(store: ledger_store.LedgerStore, contribution_ids: set[str], *,
                start: int) -> dict[str, tuple[int, int]]:
    """For each of `contribution_ids`: (how many entries from `start` on name it, the last of them)."""
    named: dict[str, tuple[int, int]] = {}
    for item in verified_entries(store, start=start):
        if item.entry is None or item.kind not in REDACTABLE:
            continue
        contribution_id = item.entry["contribution_id"]
        if contribution_id in contribution_ids:
            named[contribution_id] = (named.get(contribution_id, (0, -1))[0] + 1, item.seq)
    return named
