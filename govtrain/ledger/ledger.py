"""A govtrain ledger: the store, the policy its header (or latest policy entry) records, and its key.

This is the boundary between `ledger_store` (storage, its own exceptions) and the rest of
govtrain (`GovtrainError` with stable codes). Every write goes through `Ledger.append`, which
signs a C2SP checkpoint of the resulting tree inside the same transaction: every state the
ledger is ever in is signed, so an entry beyond the last checkpoint can only be a forgery.
"""

from __future__ import annotations

import functools
import hashlib
import os
import time as _time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

import ledger_store
from govtrain.attest.keys import load_private_key, raw_public_key
from govtrain.errors import Code, ConfigError, IntegrityError, RejectedError
from govtrain.ledger import retention
from govtrain.ledger.checkpoint import Checkpoint, NoteKey, sign_checkpoint
from govtrain.ledger.entries import (
    decode_entry,
    epoch_entry,
    header_entry,
    policy_entry,
    run_entry,
    spend_entry,
    summary_entry,
    withdraw_entry,
)
from govtrain.ledger.merkle import MerkleTree
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


def note_keys(policy: Policy) -> list[NoteKey]:
    """The policy's ledger keys as checkpoint verifier keys."""
    return [NoteKey(k.name, k.public_key) for k in policy.ledger_keys]


class Ledger:
    def __init__(self, store: ledger_store.LedgerStore, policy: Policy, header: dict,
                 key_path: str | os.PathLike | None = None) -> None:
        self.store = store
        self.policy = policy
        self.header = header
        self._key_path = key_path
        self._key = None
        self._nodes = store.node_cache()  # subtree hashes, kept for the life of this Ledger

    @classmethod
    def open(cls, url: str, *, key: str | os.PathLike | None = None) -> "Ledger":
        """Open a ledger. `key` (else $GOVTRAIN_LEDGER_KEY, else the path `init` recorded) signs checkpoints."""
        with store_errors():
            store = ledger_store.LedgerStore.open(url)
        try:
            first = store.entry(0)
            if first is None or first.kind != "header" or first.body is None:
                raise IntegrityError(Code.BAD_LEDGER_HEADER, "entry 0 is not a header; the ledger is damaged")
            header = decode_entry(first.body, seq=0, kind="header")
            policy = Policy.from_record(header["policy"])
            for stored in store.entries(kinds=("policy",)):
                if stored.body is not None:
                    policy = Policy.from_record(decode_entry(stored.body, seq=stored.seq, kind="policy")["policy"])
        except Exception:
            store.close()
            raise
        return cls(store, policy, header, key)

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
                    raise ConfigError(Code.LEDGER_EXISTS, f"{store.url} already holds a ledger")
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
    def append(self, now: int | None = None) -> Iterator[ledger_store.Appender]:
        """A write transaction that ends by signing a checkpoint of the tree it leaves behind."""
        now = int(_time.time()) if now is None else now
        key = self.signing_key()
        cache = self._nodes
        try:
            with self.store.append() as appender:
                yield appender
                appender.flush()
                size = appender.next_seq
                cache.lookup = appender.node  # inside the transaction: sees only committed subtrees
                root = MerkleTree(appender.leaf_hashes, size, cache=cache,
                                  min_cached_height=ledger_store.PERSISTED_NODE_HEIGHT).root()
                cache.flush(appender.connection)
                checkpoint = sign_checkpoint(self.policy.origin, size, root, key, self._key_name(key))
                appender.add_checkpoint(size, root, checkpoint.note, now)
        except BaseException:
            cache.rollback()
            raise
        cache.commit()

    def _key_name(self, key) -> str:
        raw = raw_public_key(key.public_key())
        return next(k.name for k in self.policy.ledger_keys if k.public_key == raw)

    def checkpoint(self, now: int | None = None) -> Checkpoint:
        """Sign and store a checkpoint of the ledger as it is now."""
        with self.append(now):
            pass
        latest = self.store.latest_checkpoint()
        assert latest is not None
        return Checkpoint(self.policy.origin, latest.size, latest.root, latest.note)

    # -- queries -----------------------------------------------------------------------

    def epoch(self) -> int:
        """The current ledger epoch: how many `epoch` entries precede now."""
        return self.store.count_kind("epoch")

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
        """An inclusion proof of the contribution's admit entry against the latest (or a given) checkpoint."""
        from govtrain.ledger.checkpoint import verify_checkpoint
        from govtrain.ledger.proof import InclusionProof

        admission = self.store.admission(contribution_id)
        if admission is None:
            raise RejectedError(Code.UNKNOWN_CONTRIBUTION, f"no admitted contribution {contribution_id!r}")
        if checkpoint_note is None:
            latest = self.store.latest_checkpoint()
            if latest is None:
                raise RejectedError(Code.NO_CHECKPOINT, "the ledger has no checkpoint yet")
            checkpoint_note, size = latest.note, latest.size
        else:
            size = verify_checkpoint(checkpoint_note, origin=self.policy.origin, keys=note_keys(self.policy)).size
        if admission.seq >= size:
            raise RejectedError(Code.NO_CHECKPOINT, f"the checkpoint (size {size}) predates entry {admission.seq}")
        entry = self.store.entry(admission.seq)
        assert entry is not None
        if entry.body is None:
            raise RejectedError(Code.REDACTED, f"entry {admission.seq} was summarized and its body dropped by "
                                "retention; proofs exist only for entries still held")
        return InclusionProof(entry.body, admission.seq, self.tree(size).inclusion_proof(admission.seq, size),
                              checkpoint_note)

    # -- writes --------------------------------------------------------------------------

    def close_epoch(self, now: int | None = None) -> int:
        """Append the `epoch` entry that closes the current epoch (and sign the checkpoint)."""
        now = int(_time.time()) if now is None else now
        with self.append(now) as appender:
            epoch = appender.count_kind("epoch")  # under the write lock: racing closers cannot collide
            appender.add("epoch", now, lambda seq: epoch_entry(seq, now, epoch))
        return epoch

    def change_policy(self, policy: Policy, policy_source_sha256: bytes, reason: str, *, now: int | None = None,
                      key: str | os.PathLike | None = None) -> ledger_store.StoredEntry:
        """Append a `policy` entry: `policy` governs every entry after it. The checkpoint that records the
        change is signed by `key` (default: the current key), which must be one of the new policy's keys."""
        now = int(_time.time()) if now is None else now
        new_key = _load_ledger_key(key, policy) if key is not None else self.signing_key()
        if raw_public_key(new_key.public_key()) not in {k.public_key for k in policy.ledger_keys}:
            raise ConfigError(Code.KEY_MISMATCH, "the new policy does not list the key that would sign it")
        old_policy, old_key = self.policy, self._key
        self.policy, self._key = policy, new_key
        try:
            with self.append(now) as appender:
                stored = appender.add("policy", now, lambda seq: policy_entry(seq, now, policy, policy_source_sha256,
                                                                             reason))
        except Exception:
            self.policy, self._key = old_policy, old_key
            raise
        if key is not None:
            self.store.set_setting(LEDGER_KEY_SETTING, str(Path(key).resolve()))
        return stored

    def withdraw(self, contribution_id: str, reason: str, now: int | None = None) -> ledger_store.StoredEntry:
        """Append a `withdraw` entry. Never removes or edits earlier entries, never refunds spend."""
        now = int(_time.time()) if now is None else now
        admission = self.store.admission(contribution_id)
        if admission is None:
            raise RejectedError(Code.UNKNOWN_CONTRIBUTION, f"no admitted contribution {contribution_id!r}")
        if contribution_id in self.store.withdrawals():
            raise RejectedError(Code.ALREADY_WITHDRAWN, f"{contribution_id!r} is already withdrawn")
        admit = self.store.entry(admission.seq)
        assert admit is not None
        if admit.body is None or contribution_id in retention.RetiredKeys.read(self.store):
            raise RejectedError(Code.REDACTED, f"{contribution_id!r} was summarized by retention and is retired")
        if not reason.strip() or len(reason) > 1024:
            raise ConfigError(Code.BAD_ARGUMENT, "--reason must be 1-1024 characters")
        try:
            with self.append(now) as appender:
                stored = appender.add(
                    "withdraw", now, lambda seq: withdraw_entry(seq, now, contribution_id, admit.leaf_hash, reason),
                    withdrawal={"contribution_id": contribution_id})
        except ledger_store.Conflict as e:
            raise RejectedError(Code.ALREADY_WITHDRAWN, f"{contribution_id!r} is already withdrawn") from e
        return stored

    def record_spend(self, epoch: int, sampling_rate_u: int, spends: "Sequence[tuple[str, int, int, int]]",
                     now: int | None = None) -> list[ledger_store.StoredEntry]:
        """Write ahead one ledger epoch's spend (DESIGN §5): for each (contribution_id, steps, sigma_eff_u,
        eps_u), a `spend` entry, all in one transaction with the checkpoint that covers them, before any
        of the epoch's steps run. Refuses the whole batch (writing nothing) if any record breaks a rule the
        verifier applies: unknown, withdrawn or compacted contribution, a second spend in the epoch, a
        multiplier below the signed one, a cumulative epsilon that falls or exceeds the signed budget."""
        now = int(_time.time()) if now is None else now
        policy = self.policy
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
            entry = decode_entry(admit.body, seq=admit.seq, kind="admit")
            if steps < 1 or sigma_u < entry["noise_multiplier_u"] or eps_u > entry["eps_budget_u"]:
                raise RejectedError(Code.BUDGET_EXCEEDED,
                                    f"spend for {contribution_id!r} ({steps} steps, sigma {sigma_u}, epsilon {eps_u}) "
                                    f"breaks its signed bounds (sigma >= {entry['noise_multiplier_u']}, "
                                    f"epsilon <= {entry['eps_budget_u']})")
            signed[contribution_id] = (admit.leaf_hash, entry)
        if len(signed) != len(spends):
            raise ConfigError(Code.BAD_ARGUMENT, "a contribution appears twice in one epoch's spend")
        with self.append(now) as appender:
            if appender.count_kind("epoch") != epoch:
                raise ConfigError(Code.BAD_ARGUMENT, f"spend for epoch {epoch} while the ledger is in epoch "
                                                     f"{appender.count_kind('epoch')}")
            withdrawn = self.store.withdrawals()
            latest = self._latest_spend(set(signed))
            stored = []
            for contribution_id, steps, sigma_u, eps_u in spends:
                leaf, _ = signed[contribution_id]
                if contribution_id in withdrawn:
                    raise RejectedError(Code.ALREADY_WITHDRAWN, f"{contribution_id!r} was withdrawn: no more spend")
                last_epoch, last_eps = latest.get(contribution_id, (-1, 0))
                if last_epoch == epoch or eps_u < last_eps:
                    raise RejectedError(Code.BUDGET_EXCEEDED, f"{contribution_id!r}: spend already written for epoch "
                                                             f"{epoch}, or epsilon {eps_u} below the recorded {last_eps}")
                fields = dict(contribution_id=contribution_id, admit_leaf=leaf, epoch=epoch, steps=steps,
                              sampling_rate_u=sampling_rate_u, noise_multiplier_u=sigma_u,
                              accountant=policy.accountant, delta_p=policy.delta_p, eps_u=eps_u)
                stored.append(appender.add("spend", now, functools.partial(_spend_at, now=now, fields=fields)))
        return stored

    def record_run(self, run_id: str, mechanism: str, config_sha256: bytes, base_model_sha256: bytes,
                   adapter_sha256: bytes | None, now: int | None = None) -> ledger_store.StoredEntry:
        """Append a `run` entry: what a training run was (config, base model) and what it produced."""
        from govtrain.mechanisms import MECHANISMS

        if mechanism not in MECHANISMS:
            raise ValueError(f"unknown mechanism {mechanism!r}: one of {', '.join(MECHANISMS)}")
        now = int(_time.time()) if now is None else now
        with self.append(now) as appender:
            return appender.add("run", now, lambda seq: run_entry(
                seq, now, run_id=run_id, mechanism=mechanism, config_sha256=config_sha256,
                base_model_sha256=base_model_sha256, adapter_sha256=adapter_sha256))

    def _latest_spend(self, contributions: set[str]) -> dict[str, tuple[int, int]]:
        latest: dict[str, tuple[int, int]] = {}
        for stored in self.store.entries(start=1, kinds=("spend",)):
            if stored.body is not None:
                entry = decode_entry(stored.body, seq=stored.seq, kind="spend")
                if entry["contribution_id"] in contributions:
                    latest[entry["contribution_id"]] = (entry["epoch"], entry["eps_u"])
        return latest

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
                epoch = appender.count_kind("epoch")
                horizon = epoch - self.policy.retention_epochs
                if not 1 <= before_epoch <= horizon:
                    raise RejectedError(Code.RETENTION_HORIZON,
                                        f"can compact only epochs before {max(horizon, 0)} (retention is "
                                        f"{self.policy.retention_epochs} epochs, current epoch {epoch})")
                boundary = retention.epoch_boundary(self.store, before_epoch)
                contributions = retention.retirable(self.store, boundary, retention.RetiredKeys.read(self.store))
                if not contributions:
                    raise _NothingToRetire
                for fields in retention.summarize(before_epoch, contributions):
                    index = {"data_class": fields["data_class"], "first_seq": fields["first_seq"],
                             "last_seq": fields["last_seq"]}
                    appender.add("summary", now, functools.partial(_summary_at, now=now, fields=fields),
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


class _NothingToRetire(Exception):
    """Rolls back the summaries' transaction (and its checkpoint) when a compaction finds nothing new."""


def _summary_at(seq: int, *, now: int, fields: dict) -> bytes:
    return summary_entry(seq, now, **fields)


def _spend_at(seq: int, *, now: int, fields: dict) -> bytes:
    return spend_entry(seq, now, **fields)


def _load_ledger_key(path: str | os.PathLike, policy: Policy):
    key = load_private_key(path)
    if raw_public_key(key.public_key()) not in {k.public_key for k in policy.ledger_keys}:
        raise ConfigError(Code.KEY_MISMATCH,
                          f"{path} is not one of the policy's ledger_keys; sign with a listed key or list it")
    return key
