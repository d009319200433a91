"""A govtrain ledger: the store, the policy its header (or latest policy entry) records, and its key.

This is the boundary between `ledger_store` (storage, its own exceptions) and the rest of
govtrain (`GovtrainError` with stable codes). Every write goes through `Ledger.append`, which
signs a C2SP checkpoint of the resulting tree inside the same transaction: every state the
ledger is ever in is signed, so an entry beyond the last checkpoint can only be a forgery.
"""

from __future__ import annotations

import functools
import os
import time as _time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Collection, Iterator, Mapping, Sequence

import ledger_store
from govtrain.attest.keys import load_private_key, raw_public_key
from govtrain.errors import Code, ConfigError, GovtrainError, IntegrityError, RejectedError
from govtrain.ledger import availability, retention
from govtrain.ledger.checkpoint import Checkpoint, NoteError, sign_checkpoint, verify_checkpoint
from govtrain.ledger.entries import (
    DEVICE,
    PRECISIONS,
    decode_entry,
    decode_stored,
    epoch_entry,
    header_entry,
    policy_entry,
    run_entry,
    spend_entry,
    summary_entry,
    tune_entry,
    withdraw_entry,
)
from govtrain.ledger.merkle import CompactRange, MerkleTree
from govtrain.ledger.policy_chain import (  # noqa: F401  (re-exported: the verifier and tests read them here)
    UnauthorisedPolicy,
    authorise_policy_change,
    fixed_terms_changed,
    note_keys,
    policy_chain,
)
from govtrain.ledger.signer import SignedHead
from govtrain.ledger.spend_rules import SpendBook, SpendRuleError, SpendState, min_sampling_rate_u, read_spend_state
from govtrain.ledger.tuning import TuneBook, TuneRuleError
from govtrain.ledger.verified import feed, verified_entries
from govtrain.policy.model import Policy

if TYPE_CHECKING:
    from govtrain.ledger.proof import InclusionProof

LEDGER_KEY_SETTING = "ledger_key_path"
KEY_ENV = "GOVTRAIN_LEDGER_KEY"


@contextmanager
def store_errors() -> Iterator[None]:
    try:
        yield
    except ledger_store.UnsupportedURL as e:
        raise ConfigError(Code.LEDGER_URL, str(e)) from e
    except ledger_store.LedgerMissing as e:
        raise ConfigError(Code.LEDGER_MISSING, str(e)) from e
    except ledger_store.LedgerExists as e:
        raise ConfigError(Code.LEDGER_EXISTS, f"{e}; a ledger is initialised once") from e
    except ledger_store.NotADatabase as e:
        raise ConfigError(Code.LEDGER_NOT_DATABASE, str(e)) from e
    except ledger_store.Unavailable as e:
        raise ConfigError(Code.LEDGER_UNAVAILABLE, f"{e}; try again once it is back") from e
    except ledger_store.AccessDenied as e:
        raise ConfigError(Code.LEDGER_ACCESS_DENIED, str(e)) from e


def _retried(method):  # type: ignore[no-untyped-def]
    """A write that runs again while the database is unavailable (`availability.retrying`: never twice)."""

    @functools.wraps(method)
    def run(self: "Ledger", *args, **kwargs):  # type: ignore[no-untyped-def]
        return availability.retrying(lambda: method(self, *args, **kwargs), retry_s=self.retry_s)

    return run


class Ledger:
    def __init__(self, store: ledger_store.LedgerStore, policy: Policy, header: dict,
                 key_path: str | os.PathLike | None = None) -> None:
        self.store = store
        self.policy = policy
        self.header = header
        self._key_path = key_path
        self._key = None
        self._nodes = store.node_cache()  # subtree hashes, kept for the life of this Ledger
        self._header_leaf: bytes | None = None  # names this ledger in the signer's record of its heads
        self.retry_s = availability.retry_seconds()
        availability.guard(store)

    @property
    def retry_s(self) -> float:
        """How long a write retries a database that went away, and the longest a PostgreSQL writer waits for
        the write lock."""
        return self._retry_s

    @retry_s.setter
    def retry_s(self, seconds: float) -> None:
        self._retry_s = seconds
        self.store.lock_wait_s = seconds

    @classmethod
    def open(cls, url: str, *, key: str | os.PathLike | None = None) -> "Ledger":
        """Open a ledger. `key` (else $GOVTRAIN_LEDGER_KEY, else the path `init` recorded) signs checkpoints."""
        with store_errors():
            store = ledger_store.LedgerStore.open(url)
        try:
            first = store.entry(0)
            if first is None or first.kind != "header" or first.body is None:
                raise IntegrityError(Code.BAD_LEDGER_HEADER, "entry 0 is not a header; the ledger is damaged")
            if ledger_store.leaf_hash(first.body) != first.leaf_hash:  # the policy the checkpoints signed, unedited
                raise IntegrityError(Code.LEAF_HASH_MISMATCH, "entry 0 (the header) does not hash to its signed leaf: "
                                                              "the database was edited; run govtrain-verify")
            header = decode_entry(first.body, seq=0, kind="header")
            policy = policy_chain(store, header)[-1][1]
        except Exception:
            store.close()
            raise
        ledger = cls(store, policy, header, key)
        ledger._header_leaf = first.leaf_hash
        return ledger

    @classmethod
    def init(cls, url: str, policy: Policy, policy_source_sha256: bytes, *, key_path: str | os.PathLike,
             now: int | None = None) -> "Ledger":
        """Create a ledger whose first entry is the header recording `policy`, signed by `key_path`."""
        now = int(_time.time()) if now is None else now
        key = _load_ledger_key(key_path, policy)
        with store_errors():
            store = ledger_store.LedgerStore.create(url)
        try:
            store.set_setting(LEDGER_KEY_SETTING, str(Path(key_path).resolve()))
            ledger = cls(store, policy, {}, key_path)
            ledger._key = key
            with ledger.append(now) as appender:
                if appender.first_seq != 0:
                    raise ConfigError(Code.LEDGER_EXISTS,
                                      f"{ledger_store.redacted_url(store.url)} already holds a ledger")
                appender.add("header", now, lambda seq: header_entry(seq, now, policy, policy_source_sha256))
        finally:
            store.close()
        return cls.open(url, key=key_path)

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- signing -----------------------------------------------------------------------

    def signing_key(self):
        """The ledger's private key; it must be one the policy lists."""
        if self._key is None:
            path = self._key_path or os.environ.get(KEY_ENV) or self.store.setting(LEDGER_KEY_SETTING)
            if not path:
                raise ConfigError(Code.KEY_MISSING, "no ledger key: pass --key or set GOVTRAIN_LEDGER_KEY")
            self._key = _load_ledger_key(path, self.policy)
        return self._key

    @contextmanager
    def append(self, now: int | None = None, *, cosigners: Sequence[tuple[object, str]] = (),
               signed_under: Policy | None = None) -> Iterator[ledger_store.Appender]:
        """A write transaction that ends by signing a checkpoint of the tree it leaves behind.

        Before signing, the signer proves that tree extends the one it signed last (`_signed_prefix`),
        computes the new root from that head and the new leaf hashes alone, refuses entries whose times
        run backwards, and checks the stored subtree hashes against the root before storing more.
        `signed_under` is the policy whose keys signed the tree so far (default: the current one)."""
        now = int(_time.time()) if now is None else now
        key = self.signing_key()
        signers = [(key, self._key_name(key)), *cosigners]
        cache = self._nodes
        head = None
        committing = False
        try:
            with self.store.append() as appender:
                yield appender
                appender.flush()
                first, size = appender.first_seq, appender.next_seq
                _check_times(appender)
                header_leaf = self._header_leaf or (appender.added[0].leaf_hash if first == 0 and appender.added
                                                    else None)
                if header_leaf is None:
                    raise IntegrityError(Code.BAD_LEDGER_HEADER, "the ledger has no header entry")
                head = SignedHead.of(self._signing_key_path(), header_leaf)
                head.prepare()
                latest = appender.latest_checkpoint()
                tree = self._signed_prefix(appender, head, signed_under or self.policy, latest)
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
                checkpoint = sign_checkpoint(self.policy.origin, size, root, signers)
                appender.add_checkpoint(size, root, checkpoint.note, now)
                committing = True
        except GovtrainError as e:
            # Lost while committing: it may have committed unacknowledged. Ask, and report what is so
            # (availability.py); an operation is run again only where nothing of it landed.
            try:
                stored = committing and e.code is Code.LEDGER_UNAVAILABLE and availability.landed(
                    self.store, appender.added, checkpoint.note, size=size,
                    after=latest.id if latest is not None else -1, retry_s=self.retry_s)
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
        self._header_leaf = header_leaf
        head.save(tree, new_ledger=first == 0)

    def _signed_prefix(self, appender: ledger_store.Appender, head: SignedHead, policy: Policy,
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

    def dated(self, appender: ledger_store.Appender, now: int) -> int:
        """The time to give entries written in `appender`'s transaction: `now`, or the last entry's time
        where `now` is behind it by no more than the policy's clock skew (a writer that waited for the lock
        behind a later-dated one). Entry times never decrease; a clock further behind is refused."""
        last = appender.last_time()
        if last is None or now >= last:
            return now
        if last - now <= self.policy.clock_skew_s:
            return last
        raise RejectedError(Code.CLOCK_BEHIND, f"this machine's clock ({now}) is {last - now} s behind the ledger's "
                                               f"last entry ({last}), more than the policy's clock skew "
                                               f"({self.policy.clock_skew_s} s): entry times never decrease; fix the clock")

    def _signing_key_path(self) -> str:
        return str(self._key_path or os.environ.get(KEY_ENV) or self.store.setting(LEDGER_KEY_SETTING))

    def _key_name(self, key) -> str:
        raw = raw_public_key(key.public_key())
        return next(k.name for k in self.policy.ledger_keys if k.public_key == raw)

    @_retried
    def checkpoint(self, now: int | None = None) -> Checkpoint:
        """Sign and store a checkpoint of the ledger as it is now."""
        with self.append(now):
            pass
        latest = self.store.latest_checkpoint()
        assert latest is not None
        return Checkpoint(self.policy.origin, latest.size, latest.root, latest.note)

    # -- queries -----------------------------------------------------------------------

    @property
    def identity(self) -> tuple[str, bytes]:
        """(the policy's origin, the leaf hash of entry 0, the header): what names this ledger among ledgers of
        one policy. A run state records it, so that a run is resumed on the ledger that charged its steps."""
        if self._header_leaf is None:
            first = self.store.entry(0)
            if first is None:
                raise IntegrityError(Code.BAD_LEDGER_HEADER, "the ledger has no header entry")
            self._header_leaf = first.leaf_hash
        return self.policy.origin, self._header_leaf

    def epoch(self) -> int:
        """The current ledger epoch: how many `epoch` entries precede now, by their bodies in one verified pass
        (`verified.py`), never the kind column: a row relabelled `epoch`, or one inserted below entry 0, would move
        an epoch count that closes epochs, bounds retention and resumes a run's written-ahead epoch."""
        entries = verified_entries(self.store, policy=self.policy)
        for _ in entries:
            pass
        return entries.epochs

    def size(self) -> int:
        return self.store.size()

    def head_leaf_hash(self) -> bytes | None:
        head = self.store.head()
        return head.leaf_hash if head is not None else None

    def ledger_key_path(self) -> str | None:
        return self.store.setting(LEDGER_KEY_SETTING)

    def tree(self, size: int | None = None) -> MerkleTree:
        """The Merkle tree over the first `size` entries (default: all of them)."""
        reader = self.store.node_cache()
        self._nodes.lookup, self._nodes.lookup_many = reader.lookup, reader.lookup_many
        return MerkleTree(self.store.leaf_hashes, self.store.next_seq() if size is None else size,
                          cache=self._nodes, min_cached_height=ledger_store.PERSISTED_NODE_HEIGHT)

    def prove(self, contribution_id: str, checkpoint_note: str | None = None) -> "InclusionProof":
        """An inclusion proof of the contribution's admit entry against the latest (or a given) checkpoint.

        The proof is built from stored leaf and subtree hashes, which the database could have altered, so it
        is verified against the signed checkpoint before it is handed out: a bad proof is never given."""
        from govtrain.ledger.merkle import ProofError, verify_inclusion
        from govtrain.ledger.proof import InclusionProof

        admission = self.store.admission(contribution_id)
        if admission is None:
            raise RejectedError(Code.UNKNOWN_CONTRIBUTION, f"no admitted contribution {contribution_id!r}")
        if checkpoint_note is None:
            latest = self.store.latest_checkpoint()
            if latest is None:
                raise RejectedError(Code.NO_CHECKPOINT, "the ledger has no checkpoint yet")
            checkpoint_note = latest.note
        checkpoint = verify_checkpoint(checkpoint_note, origin=self.policy.origin, keys=note_keys(self.policy))
        size = checkpoint.size
        if admission.seq >= size:
            raise RejectedError(Code.NO_CHECKPOINT, f"the checkpoint (size {size}) predates entry {admission.seq}")
        entry = self.store.entry(admission.seq)
        assert entry is not None
        if entry.body is None:
            raise RejectedError(Code.REDACTED, f"entry {admission.seq} was summarized and its body dropped by "
                                "retention; proofs exist only for entries still held")
        if decode_entry(entry.body, seq=entry.seq, kind="admit")["contribution_id"] != contribution_id:
            raise IntegrityError(Code.INDEX_MISMATCH, f"the admissions index points {contribution_id!r} at entry "
                                                      f"{admission.seq}, which admits another contribution")
        hashes = self.tree(size).inclusion_proof(admission.seq, size)
        try:
            verify_inclusion(admission.seq, size, ledger_store.leaf_hash(entry.body), hashes, checkpoint.root)
        except ProofError as e:
            raise IntegrityError(Code.FORK, f"the stored entries or subtree hashes do not prove entry {admission.seq} "
                                            f"under the signed checkpoint ({e.detail}); run govtrain-verify") from e
        return InclusionProof(entry.body, admission.seq, hashes, checkpoint_note)

    # -- writes --------------------------------------------------------------------------

    @_retried
    def close_epoch(self, now: int | None = None, *, epoch: int | None = None) -> int | None:
        """Append the `epoch` entry that closes the current epoch (and sign the checkpoint). With `epoch`,
        close it only if it is still the current one (another run may have closed it): returns the epoch
        closed, or None when there was nothing to close."""
        now = int(_time.time()) if now is None else now
        try:
            with self.append(now) as appender:
                current = self.epoch()  # under the write lock: racing closers cannot collide
                if epoch is not None and current != epoch:
                    raise _Unchanged
                t = self.dated(appender, now)
                appender.add("epoch", t, lambda seq: epoch_entry(seq, t, current))
        except _Unchanged:
            return None
        return current

    def change_policy(self, policy: Policy, policy_source_sha256: bytes, reason: str, *, now: int | None = None,
                      key: str | os.PathLike | None = None) -> ledger_store.StoredEntry:
        """Append a `policy` entry: `policy` governs every entry after it. The checkpoint that records the
        change is signed by `key` (default: the current key), which must be one of the new policy's keys,
        and by the current key, which must be one of the current policy's: a change is authorised by the
        policy it replaces (the verifier and `Ledger.open` require both signatures)."""
        now = int(_time.time()) if now is None else now
        old_policy, old_key, old_path = self.policy, self.signing_key(), self._key_path
        if policy.origin != old_policy.origin:
            raise ConfigError(Code.POLICY_INVALID, f"a policy change keeps the ledger's origin ({old_policy.origin!r})")
        fixed = fixed_terms_changed(old_policy, policy)
        if fixed is not None:
            raise ConfigError(Code.POLICY_INVALID, f"a policy change may not change {fixed}; start a new ledger "
                                                   "for other terms")
        authority = (old_key, self._key_name(old_key))
        new_key = _load_ledger_key(key, policy) if key is not None else old_key
        if raw_public_key(new_key.public_key()) not in {k.public_key for k in policy.ledger_keys}:
            raise ConfigError(Code.KEY_MISMATCH, "the new policy does not list the key that would sign it")
        self.policy, self._key = policy, new_key
        if key is not None:
            self._key_path = key
        try:
            with self.append(now, cosigners=[authority], signed_under=old_policy) as appender:
                t = self.dated(appender, now)
                stored = appender.add("policy", t, lambda seq: policy_entry(seq, t, policy, policy_source_sha256,
                                                                           reason))
        except Exception:
            self.policy, self._key, self._key_path = old_policy, old_key, old_path
            raise
        if key is not None:
            self.store.set_setting(LEDGER_KEY_SETTING, str(Path(key).resolve()))
        return stored

    @_retried
    def withdraw(self, contribution_id: str, reason: str, now: int | None = None) -> ledger_store.StoredEntry:
        """Append a `withdraw` entry. Never removes or edits earlier entries, never refunds spend."""
        now = int(_time.time()) if now is None else now
        admit = _indexed_admit(self.store, contribution_id)
        if admit is not None and _withdrawal_of(self.store, contribution_id, admit.leaf_hash) is not None:
            admit = None  # the index lost the withdrawal's row: the entries decide (already_withdrawn)
        indexed = admit is not None
        if admit is None:  # the index says unknown or withdrawn, or points elsewhere: the entries decide
            admit = _admit_of(self.store, contribution_id)
        if admit.body is None or contribution_id in retention.RetiredKeys.read(self.store):
            raise RejectedError(Code.REDACTED, f"{contribution_id!r} was summarized by retention and is retired")
        if not reason.strip() or len(reason) > 1024:
            raise ConfigError(Code.BAD_ARGUMENT, "--reason must be 1-1024 characters")
        try:
            with self.append(now) as appender:
                t = self.dated(appender, now)
                stored = appender.add(
                    "withdraw", t, lambda seq: withdraw_entry(seq, t, contribution_id, admit.leaf_hash, reason),
                    # an index that hid the admission or forged a withdrawal gets no row: the entry is what counts
                    withdrawal={"contribution_id": contribution_id} if indexed else None)
        except ledger_store.Conflict as e:
            raise RejectedError(Code.ALREADY_WITHDRAWN, f"{contribution_id!r} is already withdrawn") from e
        return stored

    @_retried
    def record_spend(self, epoch: int, sampling_rate_u: int, spends: "Sequence[tuple[str, int, int, int]]", *,
                     run_id: str, run_nonce: bytes, epoch_steps: int, noise_groups: "Sequence[dict]",
                     now: int | None = None, consent: Collection[str] | None = None,
                     privatizer: "Mapping[str, Any] | None" = None) -> list[ledger_store.StoredEntry]:
        """Write ahead one ledger epoch's spend for run `run_id` (holding the lease `run_nonce`), which takes
        `epoch_steps` steps in it (docs/design.md §5): for each (contribution_id, steps, sigma_eff_u, eps_u), a `spend`
        entry recording the epoch's schedule `noise_groups` (`spend_rules.noise_groups_record`), all in one
        transaction with the checkpoint that covers them, before any of the epoch's steps run. Refuses the
        whole batch (writing nothing) if any record breaks a rule the verifier applies: unknown, withdrawn or
        compacted contribution, a multiplier below the signed one or above what the schedule implies, a
        cumulative epsilon that falls or exceeds the signed budget, or a rule of `spend_rules` (another run
        holds the epoch: `epoch_held`; another run holds the id: `run_id_taken`). With `consent` (the run ids whose
        charges need no consent: the run's own, a search's trials), a record of a contribution that any other run
        charged is refused (`charged_before`), read under the write lock: a run that never confirmed charging
        again is refused even where another run charged its contributions after it opened. `privatizer`: the
        record of the privatizer the run adds its noise with (`Privatizer.record`; None: the i.i.d. Gaussian's),
        which every spend entry records and the charge follows from (`privatizers`, docs/privatizers.md)."""
        now = int(_time.time()) if now is None else now
        policy = self.policy
        record = _privatizer_record(privatizer)
        if policy.sampling_rate_u is not None and sampling_rate_u != policy.sampling_rate_u:
            raise ConfigError(Code.BAD_ARGUMENT, f"sampling rate {sampling_rate_u} differs from the policy's "
                                                 f"{policy.sampling_rate_u}")
        if not 0 < sampling_rate_u <= 1_000_000:
            raise ConfigError(Code.BAD_ARGUMENT, "the sampling rate must be in (0, 1]")
        signed: dict[str, tuple[bytes, dict]] = {}
        for contribution_id, steps, sigma_u, eps_u in spends:
            admission = self.store.admission(contribution_id)
            if admission is None:
                raise RejectedError(Code.UNKNOWN_CONTRIBUTION, f"no admitted contribution {contribution_id!r}")
            admit = self.store.entry(admission.seq)
            if admit is None or admit.body is None:
                raise RejectedError(Code.REDACTED, f"{contribution_id!r} was summarized by retention and is retired")
            entry = decode_stored(admit)
            if entry["contribution_id"] != contribution_id:
                raise IntegrityError(Code.INDEX_MISMATCH, f"the admissions index points {contribution_id!r} at entry "
                                                          f"{admit.seq}, which admits {entry['contribution_id']!r}")
            if sigma_u < entry["noise_multiplier_u"] or eps_u > entry["eps_budget_u"]:
                raise RejectedError(Code.BUDGET_EXCEEDED,
                                    f"spend for {contribution_id!r} ({steps} steps, sigma {sigma_u}, ε {eps_u}) "
                                    f"breaks its signed bounds (sigma >= {entry['noise_multiplier_u']}, "
                                    f"ε <= {entry['eps_budget_u']})")
            signed[contribution_id] = (admit.leaf_hash, entry)
        if len(signed) != len(spends):
            raise ConfigError(Code.BAD_ARGUMENT, "a contribution appears twice in one epoch's spend")
        with self.append(now) as appender:
            t = self.dated(appender, now)
            entries = verified_entries(self.store, policy=policy)  # one pass, every row, none selected by kind
            state, tunes, classes = SpendState(policy, lambda: entries.redacted), TuneBook(), {}
            feed(entries, state.take, lambda item: tunes.take(item, classes, lambda: entries.redacted))
            book, live_records, withdrawn = state.book, state.live_units(), state.withdrawn
            retired = retention.RetiredKeys.read(self.store)
            floor = (min_sampling_rate_u(policy.expected_batch_size, live_records)
                     if policy.expected_batch_size is not None else None)
            ledger_epoch = book.ledger_epoch  # the epoch entries by their bodies, never by the kind column
            if consent is not None:
                _check_consent(book, [record[0] for record in spends], {run_id, *consent}, run_id, epoch)
            stored = []
            for contribution_id, steps, sigma_u, eps_u in spends:
                leaf, _ = signed[contribution_id]
                if contribution_id in withdrawn:
                    raise RejectedError(Code.ALREADY_WITHDRAWN, f"{contribution_id!r} was withdrawn: no more spend")
                if contribution_id in retired:
                    raise RejectedError(Code.REDACTED, f"{contribution_id!r} was retired by a retention summary")
                fields = dict(contribution_id=contribution_id, admit_leaf=leaf, run_id=run_id, run_nonce=run_nonce,
                              epoch=epoch, epoch_steps=epoch_steps, steps=steps, sampling_rate_u=sampling_rate_u,
                              noise_multiplier_u=sigma_u, accountant=policy.accountant, delta_p=policy.delta_p,
                              privacy_unit=policy.privacy_unit, eps_u=eps_u, noise_groups=list(noise_groups),
                              privatizer=dict(record))
                try:
                    book.check(fields, ledger_epoch=ledger_epoch, steps_per_epoch=policy.steps_per_epoch,
                               min_rate_u=floor, classes=policy.classes)
                except SpendRuleError as e:
                    error = RejectedError if e.code in _REJECTED else ConfigError
                    raise error(e.code, e.detail) from e
                try:  # the run is no trial of a recorded tune: that tune's total would no longer hold
                    tunes.check_spend(fields)
                except TuneRuleError as e:
                    raise RejectedError(Code.RUN_ID_TAKEN, f"{e.detail}; give the run another id") from e
                book.add(fields)
                stored.append(appender.add("spend", t, functools.partial(_spend_at, now=t, fields=fields)))
            try:  # rule 7's bound on s_g reads the whole epoch's spend: the transaction rolls back if it fails
                book.check_schedule(ledger_epoch)
            except SpendRuleError as e:
                raise ConfigError(e.code, e.detail) from e
        return stored

    def spend_book(self) -> SpendBook:
        """The recorded spend, as the rules a new spend must meet read it."""
        return self.spend_state()[0]

    def spend_state(self) -> tuple[SpendBook, int, set[str]]:
        """(the spend book, sampling units of the contributions admitted and not withdrawn, the withdrawn ids),
        from the entries (never the index tables, which a database writer without keys can edit)."""
        return read_spend_state(self.store, self.policy)

    @_retried
    def record_run(self, run_id: str, mechanism: str, config_sha256: bytes, base_model_sha256: bytes,
                   adapter_sha256: bytes | None, now: int | None = None, *, run_nonce: bytes, device: str = "cpu",
                   precision: str = "fp32", privatizer: "Mapping[str, Any] | None" = None
                   ) -> ledger_store.StoredEntry:
        """Append a `run` entry: what a training run was (config, base model, the device and precision that
        computed it) and what it produced. It ends the run's lease on its id: refused (`run_id_taken`, nothing
        written) where the id already has a run entry or its spend carries another nonce than `run_nonce`."""
        from govtrain.mechanisms import MECHANISMS

        if mechanism not in MECHANISMS:
            raise ValueError(f"unknown mechanism {mechanism!r}: one of {', '.join(MECHANISMS)}")
        if precision not in PRECISIONS or not DEVICE.fullmatch(device):
            raise ValueError(f"a run's precision is one of {', '.join(PRECISIONS)} and its device cpu or cuda:N")
        now = int(_time.time()) if now is None else now
        record = _privatizer_record(privatizer)
        with self.append(now) as appender:
            t = self.dated(appender, now)
            try:
                self.spend_book().check_run({"run_id": run_id, "run_nonce": run_nonce, "privatizer": record})
            except SpendRuleError as e:
                raise (RejectedError if e.code in _REJECTED else ConfigError)(e.code, e.detail) from e
            return appender.add("run", t, lambda seq: run_entry(
                seq, t, run_id=run_id, run_nonce=run_nonce, mechanism=mechanism, config_sha256=config_sha256,
                base_model_sha256=base_model_sha256, adapter_sha256=adapter_sha256, device=device,
                precision=precision, privatizer=dict(record)))

    def tune_book(self) -> TuneBook:
        """The runs, their spend and the tunes recorded so far, as the rules a new tune must meet read them."""
        return TuneBook.read(self.store)

    @_retried
    def record_tune(self, *, tune_id: str, config_sha256: bytes, grid_sha256: bytes, trials: "Sequence[tuple[str, bytes]]",
                    selection_sha256: bytes, metric: str, selected_run_id: str | None,
                    now: int | None = None) -> tuple[ledger_store.StoredEntry, dict]:
        """Append a `tune` entry binding the runs `trials` ((run id, config SHA-256), in order) into one
        hyperparameter search, with the selected run's adapter hash and the epsilon the trials' spend entries
        charged (`tuning.TuneBook.totals`), computed under the write lock. Refuses (writing nothing) an entry
        the verifier would fail. Returns the stored entry and its fields."""
        now = int(_time.time()) if now is None else now
        with self.append(now) as appender:
            t = self.dated(appender, now)
            book = self.tune_book()
            run_ids = [run_id for run_id, _ in trials]
            eps_u, by_class = book.totals(run_ids)
            selected = book.runs.get(selected_run_id) if selected_run_id is not None else None
            fields = dict(tune_id=tune_id, config_sha256=config_sha256, grid_sha256=grid_sha256,
                          trials=[{"run_id": run_id, "config_sha256": sha} for run_id, sha in trials],
                          selection_sha256=selection_sha256, metric=metric, selected_run_id=selected_run_id,
                          adapter_sha256=selected[-1][1] if selected else None, accounting="composition",
                          eps_u=eps_u, eps_by_class=by_class)
            try:
                book.check(fields)
            except TuneRuleError as e:
                error = ConfigError if e.code in (Code.TUNE_EXISTS, Code.SELECTION_ADMITTED) else RejectedError
                raise error(e.code, e.detail) from e
            stored = appender.add("tune", t, functools.partial(_tune_at, now=t, fields=fields))
        return stored, fields

    def compact(self, before_epoch: int, now: int | None = None) -> list[ledger_store.StoredEntry]:
        """Retention: retire every contribution admitted before epoch `before_epoch - 1` closed and named by
        no entry since, with one `summary` entry per class that commits to what it retires, then drop the
        retired entries' bodies (leaf hashes stay, so every root, checkpoint and proof still verifies).
        Returns the entries whose bodies were dropped.

        Two transactions: first the summaries, computed from the entry bodies and signed by their checkpoint;
        then, once they are re-checked against those bodies with the verifier's own checks, the redaction.
        A compaction interrupted between the two is finished by the next one."""
        now = int(_time.time()) if now is None else now
        try:
            with self.append(now) as appender:  # under the write lock: nothing is appended meanwhile
                epoch = self.epoch()  # the verified entries' count, under the write lock
                horizon = epoch - self.policy.retention_epochs
                if not 1 <= before_epoch <= horizon:
                    raise RejectedError(Code.RETENTION_HORIZON,
                                        f"can compact only epochs before {max(horizon, 0)} (retention is "
                                        f"{self.policy.retention_epochs} epochs, current epoch {epoch})")
                boundary = retention.epoch_boundary(self.store, before_epoch)
                contributions = retention.retirable(self.store, boundary, retention.RetiredKeys.read(self.store))
                if not contributions:
                    raise _NothingToRetire
                t = self.dated(appender, now)
                for fields in retention.summarize(before_epoch, contributions):
                    index = {"data_class": fields["data_class"], "first_seq": fields["first_seq"],
                             "last_seq": fields["last_seq"]}
                    appender.add("summary", t, functools.partial(_summary_at, now=t, fields=fields),
                                 summary=index)
        except _NothingToRetire:
            pass
        redacted = self._redact_retired()
        if not redacted:
            raise RejectedError(Code.RETENTION_HORIZON, f"nothing left to compact before epoch {before_epoch}")
        return redacted

    def _redact_retired(self) -> list[ledger_store.StoredEntry]:
        """Drop the bodies of every entry a summary retired, after re-checking each such summary against them."""
        # The write lock again, so that nothing can name a retired contribution between the check and the
        # redaction; no checkpoint, since every leaf hash stays as it was.
        with self.store.append() as appender:
            summaries, rows = retention.unfinished(self.store)
            if not summaries:
                return []
            retention.check_unfinished(self.store, summaries, rows)
            appender.redact(sorted(rows))
        return [rows[seq] for seq in sorted(rows)]


def _indexed_admit(store: ledger_store.LedgerStore, contribution_id: str) -> ledger_store.StoredEntry | None:
    """The admit entry of `contribution_id` where the index finds it (admitted, no withdrawal row) and it is that
    contribution's signed admit entry (its body hashes to its leaf and admits it, or retention dropped the body);
    else None: the index is not trusted to refuse a withdrawal."""
    admission = store.admission(contribution_id)
    if admission is None or contribution_id in store.withdrawals():
        return None
    admit = store.entry(admission.seq)
    if admit is None or admit.kind != "admit":
        return None
    if admit.body is not None and (ledger_store.leaf_hash(admit.body) != admit.leaf_hash or decode_entry(
            admit.body, seq=admit.seq, kind=None).get("contribution_id") != contribution_id):
        return None
    return admit


def _withdrawal_of(store: ledger_store.LedgerStore, contribution_id: str, admit_leaf: bytes) -> int | None:
    """The seq of a withdraw entry of `contribution_id`, found by its body (it holds its admit entry's leaf hash:
    one search of every body, as `policy_chain` finds policy entries), each body found checked against its leaf and
    its kind column (`decode_stored`); None where there is none. The `withdrawals` index is not trusted to say "not
    yet withdrawn": a deleted row would have the key sign a second withdrawal, which the verifier fails for good."""
    try:
        for stored in store.entries_holding(admit_leaf):
            if stored.seq < 0 or stored.body is None:  # a row below entry 0 is no entry
                continue
            entry = decode_stored(stored)
            if entry["kind"] == "withdraw" and entry["contribution_id"] == contribution_id:
                return stored.seq
    except ledger_store.TamperedRow as e:
        raise IntegrityError(Code.BAD_ENTRY, f"{e}: no ledger writes such a cell; run govtrain-verify") from e
    return None


def _admit_of(store: ledger_store.LedgerStore, contribution_id: str) -> ledger_store.StoredEntry:
    """The admit entry of `contribution_id`, from the verified entries (`verified`), where the index would refuse its
    withdrawal: a writer without keys can delete an admissions row, or forge a withdrawals row, to keep a
    contribution from withdrawing. `unknown_contribution` or `already_withdrawn` only where the entries say so."""
    admit = None
    entries = verified_entries(store)
    for item in entries:
        if item.kind in ("admit", "withdraw"):
            redacted = entries.redacted.admits if item.kind == "admit" else entries.redacted.withdrawals
            if (item.entry or redacted.get(item.seq, {})).get("contribution_id") == contribution_id:
                if item.kind == "withdraw":
                    raise RejectedError(Code.ALREADY_WITHDRAWN, f"{contribution_id!r} is already withdrawn")
                admit = item.seq
    if admit is None:
        raise RejectedError(Code.UNKNOWN_CONTRIBUTION, f"no admitted contribution {contribution_id!r}")
    stored = store.entry(admit)
    assert stored is not None
    return stored


_REJECTED = (Code.EPOCH_HELD, Code.BUDGET_EXCEEDED, Code.RUN_ID_TAKEN)  # a request refused, not a bad argument


def _check_consent(book: SpendBook, contributions: Sequence[str], mine: set[str], run_id: str, epoch: int) -> None:
    """Refuse (`charged_before`) a spend of contributions that runs outside `mine` charged, unconfirmed."""
    others = {cid: sorted(book.charged_by.get(cid, set()) - mine) for cid in contributions}
    others = {cid: runs for cid, runs in others.items() if runs}
    if others:
        runs = sorted({run for found in others.values() for run in found})
        raise ConfigError(Code.CHARGED_BEFORE, f"{len(others)} contribution(s) run {run_id!r} would charge in ledger "
                                               f"epoch {epoch} were charged by other runs since it opened "
                                               f"({', '.join(runs[:3])}{', ...' if len(runs) > 3 else ''}): "
                                               "charging them again spends more of their budgets and needs "
                                               "consent; nothing was written; open the run again with --yes "
                                               "(confirm=True) to charge them")


class _NothingToRetire(Exception):
    """Rolls back the summaries' transaction (and its checkpoint) when a compaction finds nothing new."""


def _summary_at(seq: int, *, now: int, fields: dict) -> bytes:
    return summary_entry(seq, now, **fields)


class _Unchanged(Exception):
    """Raised inside `Ledger.append` to write nothing (the transaction rolls back)."""


def _check_times(appender: ledger_store.Appender) -> None:
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


def _privatizer_record(privatizer: "Mapping[str, Any] | None") -> dict:
    """A privatizer record to write (None: the i.i.d. Gaussian's), refused (`privatizer_unknown`/`_invalid`, nothing
    written) where its privatizer could not be rebuilt from it: the verifier could not recompute the charge."""
    from govtrain.ledger.entries import check_privatizer_record
    from govtrain.privatizers import GAUSSIAN_RECORD, from_record

    record = dict(GAUSSIAN_RECORD if privatizer is None else privatizer)
    try:
        check_privatizer_record(record, what="the privatizer record")
    except IntegrityError as e:
        raise ConfigError(Code.PRIVATIZER_INVALID, e.detail) from e
    from_record(record)
    return record


def _spend_at(seq: int, *, now: int, fields: dict) -> bytes:
    return spend_entry(seq, now, **fields)


def _tune_at(seq: int, *, now: int, fields: dict) -> bytes:
    return tune_entry(seq, now, **fields)


def _load_ledger_key(path: str | os.PathLike, policy: Policy):
    key = load_private_key(path)
    if raw_public_key(key.public_key()) not in {k.public_key for k in policy.ledger_keys}:
        raise ConfigError(Code.KEY_MISMATCH,
                          f"{path} is not one of the policy's ledger_keys; sign with a listed key or list it")
    return key
