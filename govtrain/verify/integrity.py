"""The structural half of verification, in bulk: sequence, leaf hashes, kinds, roots, checkpoint signatures.

Used by `verifier.inspect_ledger(..., integrity_only=True)` for millions of entries (no entry is
decoded: each body's kind is read from its canonical envelope), and for the tree arithmetic the full
pass shares. What it does not check is in `NOT_CHECKED`.
"""

from __future__ import annotations

import hashlib
import os
from operator import itemgetter
from typing import Sequence

import ledger_store
from govtrain.encoding import cbor
from govtrain.errors import Code, IntegrityError
from govtrain.ledger.checkpoint import NoteError, verify_checkpoint
from govtrain.ledger.entries import ENTRY_VERSION, SPECS, decode_entry
from govtrain.ledger.policy_chain import UnauthorisedPolicy, note_keys, policy_chain
from govtrain.ledger.merkle import fold_right
from govtrain.policy.model import Policy
from ledger_store.models import REDACTABLE_KINDS

from govtrain.verify.report import VerificationReport, _Failure, fork_detail, tampered


def _build_levels(leaves: list[bytes]) -> list[list[bytes]]:
    levels = [leaves]
    level = leaves
    sha256 = hashlib.sha256
    while len(level) > 1:
        level = [sha256(b"\x01" + level[i] + level[i + 1]).digest() for i in range(0, len(level) - 1, 2)]
        levels.append(level)
    return levels


NOT_CHECKED = ("content rules (fields, floors, budgets, withdrawals)", "attestations", "recorded spend",
               "that summaries cover exactly the redacted entries (a redacted entry's kind cannot be read)",
               "the admissions, withdrawals and summaries index tables")


# The kind column against the body, without decoding. An entry is a canonical CBOR map whose text keys
# sort length-first (docs/design.md §2): "v", then "kid" (admit entries only) and "seq", then "kind". So every
# entry of a kind starts with the same bytes up to its seq value (its lead), and its "kind" key and value
# follow the seq value, whose width depends on the sequence number alone. Matching the lead and that field
# reads the body's kind exactly; a body laid out otherwise is decoded instead (`_kind_failure`).
_V = cbor.encode("v") + cbor.encode(ENTRY_VERSION)
_KID = cbor.encode("kid") + b"\x58\x20"  # the attester's key id: a 32-byte string
_SEQ = cbor.encode("seq")


def _envelopes() -> dict[str, tuple[bytes, int, bytes]]:
    """Per kind: (its lead, where its seq value starts, its "kind" key and value)."""
    envelopes = {}
    for kind, spec in SPECS.items():
        before_kind = {key for key in spec if cbor.encode(key) < cbor.encode("kind")}
        if len(spec) >= 24 or before_kind - {"kid"} != {"v", "seq"}:
            continue  # not a one-byte map head, or other keys first: decoded entry by entry
        head = bytes([0xA0 + len(spec)]) + _V
        if "kid" in before_kind:
            lead, seq_at = head + _KID, len(head + _KID) + 32 + len(_SEQ)
        else:
            lead, seq_at = head + _SEQ, len(head + _SEQ)
        envelopes[kind] = (lead, seq_at, cbor.encode("kind") + cbor.encode(kind))
    return envelopes


_ENVELOPES = _envelopes()
_LEADS = {kind: lead for kind, (lead, _, _) in _ENVELOPES.items()}
_KIND_FIELDS = {kind: field for kind, (_, _, field) in _ENVELOPES.items()}
_UINT_WIDTHS = ((24, 1), (1 << 8, 2), (1 << 16, 3), (1 << 32, 5), (1 << 64, 9))  # RFC 8949 §3.1 heads


def _seq_widths(start: int, count: int):
    """(lo, hi, width): runs of the batch whose sequence numbers start + lo .. start + hi - 1 encode in
    `width` bytes."""
    lo = 0
    for limit, width in _UINT_WIDTHS:
        hi = min(count, limit - start)
        if hi > lo:
            yield lo, hi, width
            lo = hi


def _kind_failure(seq: int, kind: str, body: bytes | None, width: int) -> _Failure | None:
    """The exact check of one entry: a body only where its kind may be redacted, and the body's kind
    is the kind column."""
    if body is None:
        if kind in REDACTABLE_KINDS:
            return None
        return _Failure(Code.BAD_ENTRY, f"entry {seq} ({kind}) has no body; only "
                        f"{', '.join(REDACTABLE_KINDS[:-1])} and {REDACTABLE_KINDS[-1]} entries may be redacted",
                        seq=seq)
    envelope = _ENVELOPES.get(kind)
    if envelope is not None and body.startswith(envelope[0]) and body.startswith(envelope[2], envelope[1] + width):
        return None
    try:
        decode_entry(body, seq=seq, kind=kind)
    except IntegrityError as e:
        return _Failure(Code.BAD_ENTRY, f"entry {seq}: its kind column says {kind!r}, its body disagrees "
                        f"({e.detail})", seq=seq)
    return None


def _check_kinds(kinds: Sequence[str], bodies: Sequence[bytes | None], start: int) -> _Failure | None:
    """The first entry of the batch whose body is missing or of another kind than its row says. A run
    of entries is compared in bulk, in C (map over bytes.startswith: the lead, then the "kind" field);
    a run where that fails is checked again entry by entry, to name the first bad one."""
    for lo, hi, width in _seq_widths(start, len(bodies)):
        whole = hi - lo == len(bodies)
        run_bodies, run_kinds = (bodies, kinds) if whole else (bodies[lo:hi], kinds[lo:hi])
        offsets = {kind: seq_at + width for kind, (_, seq_at, _) in _ENVELOPES.items()}
        try:
            if all(map(bytes.startswith, run_bodies, map(_LEADS.__getitem__, run_kinds))) and all(
                    map(bytes.startswith, run_bodies, map(_KIND_FIELDS.__getitem__, run_kinds),
                        map(offsets.__getitem__, run_kinds))):
                continue
        except (KeyError, TypeError):  # a kind with no known envelope, or a missing body (None)
            pass
        for i in range(lo, hi):
            failure = _kind_failure(start + i, kinds[i], bodies[i], width)
            if failure is not None:
                return failure
    return None


def _check_rows(rows: list, start: int) -> list[bytes]:
    """Sequence numbers, leaf hashes and kinds of one batch of (seq, leaf hash, body, kind), as list
    comparisons; raises at the first bad entry. The comparisons take each cell's type on trust (no check per
    cell on the bulk path); a cell that breaks them is found and named afterwards."""
    try:
        return _compare_rows(rows, start)
    except TypeError:
        try:
            for row in rows:
                ledger_store.checked("entries", ("seq", "leaf_hash", "body", "kind"), tuple(row))
        except ledger_store.TamperedRow as e:
            raise tampered(e) from None
        raise


def _compare_rows(rows: list, start: int) -> list[bytes]:
    # Columns by itemgetter: twice as fast as zip(*rows), which pays for reading the kind column.
    seqs, stored, bodies, kinds = (list(map(itemgetter(column), rows)) for column in range(4))
    if seqs != list(range(start, start + len(rows))):
        missing = next(start + i for i, seq in enumerate(seqs) if seq != start + i)
        raise _Failure(Code.SEQUENCE_GAP, f"entry {missing} is missing", seq=missing)
    sha256 = hashlib.sha256
    computed = [leaf if body is None else sha256(b"\x00" + body).digest() for leaf, body in zip(stored, bodies)]
    failures = []
    if computed != stored:
        bad = next(start + i for i, (a, b) in enumerate(zip(computed, stored)) if a != b)
        failures.append(_Failure(Code.LEAF_HASH_MISMATCH, f"entry {bad}: stored leaf hash does not match its body",
                                 seq=bad))
    kind_failure = _check_kinds(kinds, bodies, start)
    if kind_failure is not None:
        failures.append(kind_failure)
    if failures:
        raise min(failures, key=lambda f: f.seq)  # the first bad entry; at a tie, its leaf hash
    return stored


def prefix_parts(size: int) -> list[tuple[int, int]]:
    """(height, index) of the perfect subtrees whose right fold is the root of the first `size` leaves."""
    parts, start = [], 0
    for height in range(size.bit_length() - 1, -1, -1):
        if size >> height & 1:
            parts.append((height, start >> height))
            start += 1 << height
    return parts


def _extract(levels: list[list[bytes]], offset: int, wanted: Sequence[tuple[int, int]]) -> dict:
    """The wanted nodes (global coordinates) that lie in a subtree starting at leaf `offset`."""
    found = {}
    for height, index in wanted:
        local = index - (offset >> height)
        if height < len(levels) and 0 <= local < len(levels[height]) and (index << height) >= offset:
            found[(height, index)] = levels[height][local]
    return found


def _sqlite_half(path: str, start: int, stop: int, wanted: list[tuple[int, int]]) -> tuple[str, object]:
    """Worker: check entries [start, stop) of a SQLite ledger; return the wanted subtree hashes."""
    import sqlite3

    connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        leaves: list[bytes] = []
        cursor = connection.execute("SELECT seq, leaf_hash, body, kind FROM entries WHERE seq >= ? AND seq < ? "
                                    "ORDER BY seq", (start, stop))
        while rows := cursor.fetchmany(100_000):
            leaves += _check_rows(rows, start + len(leaves))
        if len(leaves) != stop - start:
            missing = start + len(leaves)
            return "error", (Code.SEQUENCE_GAP.value, f"entry {missing} is missing", missing)
        return "ok", _extract(_build_levels(leaves), start, wanted)
    except _Failure as e:
        return "error", (e.code.value, e.detail, e.seq)
    finally:
        connection.close()


def _tree_nodes(store: ledger_store.LedgerStore, total: int, wanted: list[tuple[int, int]]) -> dict:
    """Check every leaf and return the wanted perfect-subtree hashes. A large SQLite ledger is split at
    a power of two between two processes; other ledgers are checked in this one."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from sqlalchemy.engine import make_url

    if store.backend != "sqlite" or total < 1 << 16 or (os.cpu_count() or 1) < 2:
        leaves: list[bytes] = []
        for rows in store.leaf_rows(with_kind=True):
            leaves += _check_rows(rows, len(leaves))
        if len(leaves) != total:
            raise _Failure(Code.SEQUENCE_GAP, f"entry {len(leaves)} is missing", seq=len(leaves))
        return _extract(_build_levels(leaves), 0, wanted)
    split = 1 << (total - 1).bit_length() - 1
    path = make_url(store.url).database
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork")) as pool:
        halves = list(pool.map(_sqlite_half, [path, path], [0, split], [split, total], [wanted, wanted]))
    nodes: dict = {}
    for status, value in halves:
        if status == "error":
            code, detail, seq = value
            raise _Failure(Code(code), detail, seq=seq)
        nodes.update(value)
    return nodes


def _integrity(store: ledger_store.LedgerStore, report: VerificationReport, trusted: Sequence[str]) -> None:
    """Steps 1, 2, 6, 7, 8 in bulk, and each body's kind against its row (no entry is decoded)."""
    total = report.entries = store.size()
    if total == 0:
        raise _Failure(Code.BAD_LEDGER_HEADER, "the ledger is empty: entry 0 (header) is missing", seq=0)
    first = store.entry(0)
    header = decode_entry(first.body, seq=0, kind="header") if first and first.body else None
    if header is None:
        raise _Failure(Code.BAD_LEDGER_HEADER, "entry 0 is not a header", seq=0)
    try:
        policies = policy_chain(store, header)  # each change authorised by the policy before it
    except UnauthorisedPolicy as e:
        raise _Failure(e.code, e.detail, seq=e.seq) from e
    keys = {id(p): note_keys(p) for _, p in policies}

    def policy_at(size: int) -> Policy:
        return [p for seq, p in policies if seq < max(min(size, total), 1)][-1]

    # 6. Signatures first (cheap), so that the sizes whose roots must be checked are known.
    checkpoints = store.checkpoints()
    report.checkpoints = len(checkpoints)
    signed = []
    previous = 0
    for stored in checkpoints:
        if stored.size < previous:
            raise _Failure(Code.BAD_CHECKPOINT, f"checkpoint {stored.id} is smaller than the one before it",
                           checkpoint=stored.id)
        previous = stored.size
        policy = policy_at(stored.size)
        try:
            checkpoint = verify_checkpoint(stored.note, origin=policy.origin, keys=keys[id(policy)])
        except NoteError as e:
            good = signed[-1][0].size if signed else 0
            raise _Failure(Code.BAD_CHECKPOINT, f"checkpoint {stored.id}: {e.detail}", checkpoint=stored.id,
                           seq=good) from e
        signed.append((stored, checkpoint))
    trusted_checkpoints = []
    for note in trusted:
        try:
            size = int(note.split("\n")[1])
        except (IndexError, ValueError):
            size = total
        policy = policy_at(size)
        try:
            trusted_checkpoints.append(verify_checkpoint(note, origin=policy.origin, keys=keys[id(policy)]))
        except NoteError as e:
            raise _Failure(Code.FORK, f"a trusted checkpoint is not signed by a ledger key in force at its size "
                                      f"({e.detail})") from e
    sizes = {c.size for _, c in signed if c.size <= total} | {c.size for c in trusted_checkpoints if c.size <= total}
    wanted = sorted({part for size in sizes if size for part in prefix_parts(size)})

    # 1-2. Every leaf, in bulk; the subtree hashes the checkpointed roots need come back.
    nodes = _tree_nodes(store, total, wanted)

    def root(size: int) -> bytes:
        return fold_right([nodes[part] for part in prefix_parts(size)])

    # 6-7. Roots, truncation, unsigned tail.
    good = 0
    for stored, checkpoint in signed:
        if stored.size > total:
            raise _Failure(Code.TRUNCATED, f"checkpoint {stored.id} signs {stored.size} entries but the ledger "
                           f"holds {total}", seq=total, checkpoint=stored.id)
        if checkpoint.size != stored.size or root(stored.size) != checkpoint.root:
            raise _Failure(Code.BAD_CHECKPOINT, f"checkpoint {stored.id}: the root of the first {stored.size} "
                           "entries is not the signed root", checkpoint=stored.id, seq=good)
        good = stored.size
    if good < total:
        raise _Failure(Code.UNSIGNED_TAIL, f"entries {good}..{total - 1} are covered by no signed checkpoint",
                       seq=good)
    # 8. Trusted checkpoints.
    agreed = 0
    for checkpoint in sorted(trusted_checkpoints, key=lambda c: c.size):
        if checkpoint.size > total:
            raise _Failure(Code.ROLLBACK, f"a trusted checkpoint signs {checkpoint.size} entries but this ledger "
                           f"holds {total}", seq=total)
        if root(checkpoint.size) != checkpoint.root:
            raise _Failure(Code.FORK, fork_detail(checkpoint.size, agreed), seq=agreed)
        agreed = checkpoint.size
    report.trusted_checkpoints = len(trusted_checkpoints)
