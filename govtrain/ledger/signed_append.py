"""The ledger's one write path: a store transaction that ends by signing a checkpoint of the tree it leaves.

`Ledger.append` returns `signed_append(ledger, ...)`. Before signing, the signer proves the tree extends the
one it signed last (`signed_prefix`, from its own record of its heads, `signer.SignedHead`), computes the new
root from that head and the new leaf hashes alone, refuses entries whose times run backwards (`check_times`),
and checks the stored subtree hashes against the root before storing more.
"""

from __future__ import annotations

import time as _time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ContextManager, Iterator, Protocol, Sequence

import ledger_store
from govtrain.errors import Code, GovtrainError, IntegrityError, RejectedError
from govtrain.ledger import availability
from govtrain.ledger.checkpoint import NoteError, sign_checkpoint, verify_checkpoint
from govtrain.ledger.merkle import CompactRange, MerkleTree
from govtrain.ledger.policy_chain import note_keys
from govtrain.ledger.signer import SignedHead
from govtrain.policy.model import Policy

if TYPE_CHECKING:
    from govtrain.ledger.spend_rules import SpendBook
    from govtrain.ledger.tuning import TuneBook


class SigningLedger(Protocol):
    """What the signed append reads and keeps on its `Ledger`, which passes itself (typed by protocols here, so
    that the modules the ledger calls for its writes never import `ledger.py` back)."""

    store: ledger_store.LedgerStore
    policy: Policy
    retry_s: float
    _nodes: Any  # the subtree hashes the ledger keeps for its life (`LedgerStore.node_cache`)
    _header_leaf: bytes | None

    def signing_key(self) -> Any: ...

    def _key_name(self, key: Any) -> str: ...

    def _signing_key_path(self) -> str: ...


class WritingLedger(Protocol):
    """What the ledger's write operations (`withdrawal.py`, `run_writes.py`, `compaction.py`) use of a `Ledger`."""

    store: ledger_store.LedgerStore
    policy: Policy

    def append(self, now: int | None = None, *, cosigners: Sequence[tuple[object, str]] = (),
               signed_under: Policy | None = None) -> ContextManager[ledger_store.Appender]: ...

    def dated(self, appender: ledger_store.Appender, now: int) -> int: ...

    def epoch(self) -> int: ...

    def spend_book(self) -> "SpendBook": ...

    def tune_book(self) -> "TuneBook": ...


@contextmanager
def signed_append(ledger: SigningLedger, now: int | None = None, *, cosigners: Sequence[tuple[object, str]] = (),
                  signed_under: Policy | None = None) -> Iterator[ledger_store.Appender]:
    """A write transaction that ends by signing a checkpoint of the tree it leaves behind.

    Before signing, the signer proves that tree extends the one it signed last (`signed_prefix`),
    computes the new root from that head and the new leaf hashes alone, refuses entries whose times
    run backwards, and checks the stored subtree hashes against the root before storing more.
    `signed_under` is the policy whose keys signed the tree so far (default: the current one)."""
    now = int(_time.time()) if now is None else now
    key = ledger.signing_key()
    signers = [(key, ledger._key_name(key)), *cosigners]
    cache = ledger._nodes
    head = None
    committing = False
    try:
        with ledger.store.append() as appender:
            yield appender
            appender.flush()
            first, size = appender.first_seq, appender.next_seq
            check_times(appender)
            header_leaf = ledger._header_leaf or (appender.added[0].leaf_hash if first == 0 and appender.added
                                                else None)
            if header_leaf is None:
                raise IntegrityError(Code.BAD_LEDGER_HEADER, "the ledger has no header entry")
            head = SignedHead.of(ledger._signing_key_path(), header_leaf)
            head.prepare()
            latest = appender.latest_checkpoint()
            tree = signed_prefix(appender, head, signed_under or ledger.policy, latest)
            for leaf in appender.leaf_hashes(first, size):
                tree.append(leaf)
            root = tree.root()
            cache.lookup = appender.node  # inside the transaction: sees only committed subtrees
            if MerkleTree(appender.leaf_hashes, size, cache=cache,
                          min_cached_height=ledger_store.PERSISTED_NODE_HEIGHT).root() != root:
                raise IntegrityError(Code.FORK, "the database's leaf hashes or stored subtree hashes (tree_nodes) "
                                                "disagree with the tree this key signed: it was altered; "
                                                "run govtrain-verify")
            cache.flush(appender.connection)
            checkpoint = sign_checkpoint(ledger.policy.origin, size, root, signers)
            appender.add_checkpoint(size, root, checkpoint.note, now)
            committing = True
    except GovtrainError as e:
        # Lost while committing: it may have committed unacknowledged. Ask, and report what is so
        # (availability.py); an operation is run again only where nothing of it landed.
        try:
            stored = committing and e.code is Code.LEDGER_UNAVAILABLE and availability.landed(
                ledger.store, appender.added, checkpoint.note, size=size,
                after=latest.id if latest is not None else -1, retry_s=ledger.retry_s)
        except BaseException:
            cache.rollback()
            raise
        if not stored:
            cache.rollback()
            raise
    except BaseException:
        cache.rollback()
        raise
    cache.commit()
    ledger._header_leaf = header_leaf
    head.save(tree, new_ledger=first == 0)


def signed_prefix(appender: ledger_store.Appender, head: SignedHead, policy: Policy,
                  latest: ledger_store.StoredCheckpoint | None) -> CompactRange:
    """The tree of the entries before this write, as this signer knows it was signed.

    From the head this key last signed here (kept outside the database), extended by any entries that
    other writers holding a ledger key appended and signed since; the database's latest checkpoint must
    be exactly that tree head. A key with no record for this ledger (its first write here) takes the
    database as it is, once, after checking it against its latest signed checkpoint."""
    first = appender.first_seq
    tree = head.load() if first else None  # a new ledger starts from nothing, whatever was recorded
    if tree is None:
        tree = CompactRange()
        for leaf in appender.leaf_hashes(0, first):
            tree.append(leaf)
    elif tree.size > first:
        raise IntegrityError(Code.ROLLBACK, f"this key signed {tree.size} entries of this ledger but the database "
                                            f"holds {first}: it was rolled back or truncated; restore it")
    else:
        for leaf in appender.leaf_hashes(tree.size, first):
            tree.append(leaf)
    if first == 0:
        return tree
    if latest is None or latest.size != first or latest.root != tree.root():
        raise IntegrityError(Code.FORK, f"the database's entries or checkpoints differ from the {first} entries "
                                        "signed so far (an entry was altered or a checkpoint removed): this key "
                                        "will not sign them; run govtrain-verify")
    try:
        verify_checkpoint(latest.note, origin=policy.origin, keys=note_keys(policy))
    except NoteError as e:
        raise IntegrityError(Code.FORK, f"the database's latest checkpoint does not verify ({e.detail}): this "
                                        "key will not sign on top of it; run govtrain-verify") from e
    return tree


def check_times(appender: ledger_store.Appender) -> None:
    """Entry times never decrease along the ledger (the verifier checks it too): an operator cannot
    backdate an entry to before one already written, such as an admission to before its attestation
    expired. A clock that reads earlier than the last entry is refused, not silently corrected."""
    previous = appender.last_time()
    for stored in appender.added:
        if previous is not None and stored.time < previous:
            raise RejectedError(Code.CLOCK_BEHIND, f"entry {stored.seq} would be dated {stored.time}, before the "
                                                   f"entry ahead of it ({previous}): entry times never decrease; "
                                                   "check this machine's clock")
        previous = stored.time

