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
from typing import TYPE_CHECKING, Any, Collection, ContextManager, Iterator, Mapping, Sequence

import ledger_store
from govtrain.attest.keys import load_private_key, raw_public_key
from govtrain.errors import Code, ConfigError, IntegrityError, RejectedError
from govtrain.ledger import availability, compaction, run_writes, withdrawal
from govtrain.ledger.checkpoint import Checkpoint, verify_checkpoint
from govtrain.ledger.entries import decode_entry, epoch_entry, header_entry, policy_entry
from govtrain.ledger.merkle import MerkleTree
from govtrain.ledger.policy_chain import fixed_terms_changed, note_keys, policy_chain  # note_keys: benches read it here
from govtrain.ledger.signed_append import signed_append
from govtrain.ledger.spend_rules import SpendBook, read_spend_state
from govtrain.ledger.tuning import TuneBook
from govtrain.ledger.verified import verified_entries
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

    def append(self, now: int | None = None, *, cosigners: Sequence[tuple[object, str]] = (),
               signed_under: Policy | None = None) -> ContextManager[ledger_store.Appender]:
        """A write transaction that ends by signing a checkpoint of the tree it leaves behind.

        Before signing, the signer proves that tree extends the one it signed last (`signed_prefix`),
        computes the new root from that head and the new leaf hashes alone, refuses entries whose times
        run backwards, and checks the stored subtree hashes against the root before storing more.
        `signed_under` is the policy whose keys signed the tree so far (default: the current one).
        (`signed_append.py`.)"""
        return signed_append(self, now, cosigners=cosigners, signed_under=signed_under)

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
        return withdrawal.withdraw(self, contribution_id, reason, now)

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
        return run_writes.record_spend(self, epoch, sampling_rate_u, spends, run_id=run_id, run_nonce=run_nonce,
                                       epoch_steps=epoch_steps, noise_groups=noise_groups, now=now,
                                       consent=consent, privatizer=privatizer)

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
        return run_writes.record_run(self, run_id, mechanism, config_sha256, base_model_sha256, adapter_sha256, now,
                                     run_nonce=run_nonce, device=device, precision=precision,
                                     privatizer=privatizer)

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
        return run_writes.record_tune(self, tune_id=tune_id, config_sha256=config_sha256, grid_sha256=grid_sha256,
                                      trials=trials, selection_sha256=selection_sha256, metric=metric,
                                      selected_run_id=selected_run_id, now=now)

    def compact(self, before_epoch: int, now: int | None = None) -> list[ledger_store.StoredEntry]:
        """Retention: retire every contribution admitted before epoch `before_epoch - 1` closed and named by
        no entry since, with one `summary` entry per class that commits to what it retires, then drop the
        retired entries' bodies (leaf hashes stay, so every root, checkpoint and proof still verifies).
        Returns the entries whose bodies were dropped.

        Two transactions: first the summaries, computed from the entry bodies and signed by their checkpoint;
        then, once they are re-checked against those bodies with the verifier's own checks, the redaction.
        A compaction interrupted between the two is finished by the next one."""
        return compaction.compact(self, before_epoch, now)


class _Unchanged(Exception):
    """Raised inside `Ledger.append` to write nothing (the transaction rolls back)."""


def _load_ledger_key(path: str | os.PathLike, policy: Policy):
    key = load_private_key(path)
    if raw_public_key(key.public_key()) not in {k.public_key for k in policy.ledger_keys}:
        raise ConfigError(Code.KEY_MISMATCH,
                          f"{path} is not one of the policy's ledger_keys; sign with a listed key or list it")
    return key
