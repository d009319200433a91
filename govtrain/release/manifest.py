"""`govtrain release`: a signed release manifest of a run's adapter folder (docs/release-manifest.md).

    envelope = build_release(ledger, "run-1", "adapter", key=release_key)     # a DSSE envelope (dsse.Envelope)
    Path("release.dsse").write_bytes(envelope.to_json())

Built in order, refusing before anything is signed:
  1. the signing key is a release key of the ledger's current policy (`key_not_authorized`);
  2. the folder is one govtrain released (`govtrain.json`) for this ledger and this run, and its files, but the card,
     hash to the adapter hash the run entry records (`adapter_mismatch`: the run's adapter and no other);
  3. the base model found is the one the run entry records, by tree hash (`base_model_mismatch`);
  4. the ledger's facts of the run as of its latest checkpoint (`facts.py`), which must sign every entry stored
     (`unsigned_tail`, whatever `confirm` says: an entry past it is deleted checkpoints or forged, and a withdrawal
     there could neither be trusted nor left out): the run entry and its inclusion proof,
     ε per class (the tune's, for a trial), the privacy terms and the withdrawals of what it trained on. A run that
     trained on a contribution withdrawn since is refused unless the caller confirms (`withdrawn_at_release`;
     `confirm=True`, `--yes`): the release states the withdrawal, and an inference gate refuses it as tainted, as
     it refuses the run's earlier releases (seed 004: signing the same adapter again is no retraining);
  5. the groups the run trained, resolved again on the model it trained (`groups.py`) and checked against the noise
     groups its spend entries recorded;
  6. the statement: every file of the folder as a subject (card included), the predicate; signed over DSSE's PAE.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from govtrain.attest.keys import raw_public_key
from govtrain.errors import Code, ConfigError, IntegrityError, RejectedError
from govtrain.ledger.merkle import leaf_hash
from govtrain.release import dsse
from govtrain.release.artifact import ArtifactRecord, adapter_digest, folder_files, read_record
from govtrain.release.facts import LedgerFacts, ledger_facts, privacy_of, signed_log, tune_of, withdrawn_of
from govtrain.release.groups import TrainedGroup, adapter_layout, trained_groups
from govtrain.ledger.signed import SignedLog
from govtrain.release.predicate import (PREDICATE_TYPE, STATEMENT_TYPE, AdapterRef, BaseModelRef, ClassEps, ClassReach,
                                        Digest, Group, LayerIndices, LedgerRef, Predicate, RunEntry,
                                        Statement, Subject, own_adapter,
                                        statement_bytes)
from govtrain.resolver.profile import describe_profile

if TYPE_CHECKING:
    from govtrain.ledger.ledger import Ledger


def build_release(ledger: "Ledger", run_id: str, folder: str | os.PathLike[str], *, key: Ed25519PrivateKey,
                  base: str | os.PathLike[str] | None = None, now: int | None = None,
                  confirm: bool = False) -> dsse.Envelope:
    """The signed release manifest of run `run_id`'s adapter in `folder`. `base` is the base model (`minilm`, a
    Hugging Face id in the local cache, or a local directory), by default the one the folder's record names, as
    `govtrain.load` finds it. `confirm`: sign it even where the run trained on a contribution withdrawn since
    (step 4)."""
    statement = release_statement(ledger, run_id, folder, key=key, base=base, now=now, confirm=confirm)
    return dsse.sign(statement_bytes(statement), key)


def release_statement(ledger: "Ledger", run_id: str, folder: str | os.PathLike[str], *, key: Ed25519PrivateKey,
                      base: str | os.PathLike[str] | None = None, now: int | None = None,
                      confirm: bool = False) -> Statement:
    """The statement `build_release` signs (steps 1-6 of the module's docstring, the signature aside)."""
    folder = Path(folder)
    now = int(time.time()) if now is None else now
    # 1.
    policy = ledger.policy
    public = raw_public_key(key.public_key())
    if public not in {k.public_key for k in policy.release_keys}:
        names = ", ".join(k.name for k in policy.release_keys)
        hint = f"its release keys are {names}" if names else "it names no release key: add [[release_keys]] to it"
        raise RejectedError(Code.KEY_NOT_AUTHORIZED, f"the signing key {dsse.keyid(public)[:16]}… is not a release "
                                                     f"key of the ledger's current policy ({hint})")
    # 2.
    record = read_record(folder)
    if record.run.run_id != run_id or record.run.ledger_origin != policy.origin:
        raise IntegrityError(Code.ADAPTER_MISMATCH, f"{folder} holds run {record.run.run_id!r}'s adapter on the ledger "
                                                    f"{record.run.ledger_origin!r}, not run {run_id!r} on "
                                                    f"{policy.origin!r}")
    files = folder_files(folder)
    log = signed_log(ledger)  # the entries by their bodies, under the largest checkpoint that signs them
    if log.tail:
        raise unsigned_error(log)
    facts = ledger_facts(ledger, run_id, log.checkpoint, log=log)
    entry = facts.run
    recorded = entry["adapter_sha256"]
    if recorded is None or adapter_digest(files) != recorded:
        raise IntegrityError(Code.ADAPTER_MISMATCH, f"{folder}'s files (but README.md) hash to "
                                                    f"{adapter_digest(files).hex()}; run {run_id!r}'s entry "
                                                    f"{facts.proof.index} records {recorded.hex() if recorded else 'none'}")
    if record.base_model.sha256 != entry["base_model_sha256"].hex():
        raise IntegrityError(Code.ADAPTER_MISMATCH, f"{folder}'s govtrain.json names another base model than run "
                                                    f"{run_id!r}'s entry records")
    if facts.withdrawn and not confirm:
        raise withdrawn_error(run_id, facts)
    # 3.
    base_path = _base_path(folder, record, base)
    # 4. (above) and 5.
    groups = trained_groups(facts.policy.classes, adapter_layout(folder, record, base_path), facts.noise_signatures)
    # 6.
    subjects = [Subject(name=name, digest=Digest(sha256=digest.hex())) for name, digest in sorted(
        files.items(), key=lambda item: item[0].split("/"))]
    return Statement(**{"_type": STATEMENT_TYPE}, subject=subjects, predicateType=PREDICATE_TYPE,
                     predicate=_predicate(facts, record, groups, now))


def unsigned_error(log: SignedLog) -> IntegrityError:
    """The refusal to release from a ledger holding entries past the last checkpoint its keys sign: the ledger
    signs every state it writes, so they are deleted checkpoints or forged entries, and what they hold (a
    withdrawal among them) is no one's statement, nor can it be left out (step 4)."""
    count = f"{log.tail} {'entry' if log.tail == 1 else 'entries'}"
    return IntegrityError(Code.UNSIGNED_TAIL, (
        f"the ledger holds {count} past the last checkpoint its keys sign (from entry {log.size}): checkpoints were "
        "deleted or entries forged, so what the run trained on that was withdrawn is not known; nothing was "
        "written; run govtrain-verify and restore the ledger before releasing"))


def withdrawn_error(run_id: str, facts: LedgerFacts, *, flag: str = "--yes (confirm=True)") -> ConfigError:
    """The refusal of a release of a run that trained on contributions withdrawn since, unconfirmed."""
    names = ", ".join(f"{w.contribution_id} (entry {w.seq})" for w in facts.withdrawn[:5])
    more = f" and {len(facts.withdrawn) - 5} more" if len(facts.withdrawn) > 5 else ""
    return ConfigError(Code.WITHDRAWN_AT_RELEASE, (
        f"run {run_id!r} trained on {len(facts.withdrawn)} contribution(s) withdrawn since: {names}{more}; its "
        "adapter still carries them, so an inference gate refuses a release of it as tainted (a new signature is "
        f"no retraining); nothing was written; train a run without them, or pass {flag} to sign it all the same"))


def _base_path(folder: Path, record: ArtifactRecord, base: str | os.PathLike[str] | None) -> Path:
    """The base model's folder, its tree hash the record's (as `govtrain.load` checks it)."""
    from govtrain.release.load import _tree_hash
    from govtrain.resolver.load import SHORT_NAMES, hub_snapshot, model_path

    named = record.base_model
    if base is None and named.spec is None:
        raise ConfigError(Code.MODEL_UNREADABLE, f"{folder}: its base model is a local folder, {named.name!r}, which "
                                                 "only its owner can point to: pass --base PATH (base= in Python)")
    if base is not None:
        path = model_path(str(base))
    else:
        path = model_path(named.spec) if named.spec in SHORT_NAMES else hub_snapshot(named.spec, named.revision)
    if _tree_hash(path) != named.sha256:
        raise ConfigError(Code.BASE_MODEL_MISMATCH, f"{path} is not the base model {folder} was trained on (its tree "
                                                    f"hash is not {named.sha256}): give the base it was trained on")
    return path


def _predicate(facts: LedgerFacts, record: ArtifactRecord, trained: tuple[TrainedGroup, ...], now: int) -> Predicate:
    entry, policy = facts.run, facts.policy
    eps = {name: facts.eps_by_class.get(name, 0) for name in policy.classes}
    groups = [Group(classes=[ClassEps(data_class=c, eps_u=eps[c]) for c in g.classes], adapters=list(g.adapters),
                    layers=list(g.layers), heads=[LayerIndices(layer=n, indices=list(i)) for n, i in g.heads],
                    experts=[LayerIndices(layer=n, indices=list(i)) for n, i in g.experts], outside=list(g.outside),
                    tensors=g.tensors, scalars=g.scalars) for g in trained]
    classes = []
    for name in sorted(policy.classes):
        reached = [i for i, g in enumerate(trained) if name in g.classes]
        classes.append(ClassReach(data_class=name, eps_u=eps[name],
                                  contributions=facts.contributions_by_class.get(name, 0),
                                  profile=describe_profile(policy.classes[name].profile), groups=reached,
                                  adapter=own_adapter(name, [groups[i] for i in reached])))
    return Predicate(
        version=1, released_at=now,
        run=RunEntry(run_id=entry["run_id"], seq=facts.proof.index, leaf_hash=leaf_hash(facts.proof.entry).hex(),
                     mechanism=entry["mechanism"], config_sha256=entry["config_sha256"].hex(),
                     adapter_sha256=entry["adapter_sha256"].hex(), device=entry["device"],
                     precision=entry["precision"]),
        ledger=LedgerRef(origin=facts.origin, checkpoint_size=facts.checkpoint.size, proof=facts.proof.text()),
        base_model=BaseModelRef(name=record.base_model.name, revision=record.base_model.revision,
                                sha256=entry["base_model_sha256"].hex()),
        adapter=AdapterRef(sha256=entry["adapter_sha256"].hex(), task=record.task, adapters=list(record.adapters)),
        privacy=privacy_of(facts),
        tune=tune_of(facts),
        classes=classes, groups=groups, withdrawn=withdrawn_of(facts.withdrawn))
