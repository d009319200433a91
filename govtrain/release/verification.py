"""`verify_release`: a release manifest checked offline against keys the auditor pins, and optionally against an
adapter folder and a live ledger. Never imports torch (docs/release-manifest.md).

    report = verify_release(Path("release.dsse").read_bytes(), release_key=pinned, ledger_keys=[ledger_pub],
                            adapter="adapter", ledger="sqlite:///ledger.db")
    report.classes["restricted"].adapter      # "restricted": it reached its own LoRA adapter and nothing else
    report.tainted                            # a contribution it trained on was withdrawn, since or before it

Checked in order; each step raises `IntegrityError` with its code (exit 4):
  1. the envelope is DSSE JSON, read strictly (`bad_envelope`), and a signature over its PAE verifies under the
     pinned release key (`unknown_key`, `bad_signature`) (DSSE protocol v1.0.0);
  2. its payload, as received, is an in-toto Statement v1 of govtrain's predicate: the schema and the relations
     between its fields, its adapters among its subjects (`bad_statement`) (in-toto attestation spec v1,
     statement.md);
  3. the checkpoint the proof carries is a signed note by a ledger key the auditor pinned, for the predicate's
     origin, of the size it states (`bad_checkpoint`, `predicate_mismatch`) (c2sp.org/signed-note, tlog-checkpoint);
  4. the run entry is in that tree (`bad_proof`) (RFC 9162 §2.1.3.2), and it is a run entry stating exactly the run,
     base model, adapter hash and mechanism the predicate states (`predicate_mismatch`);
  5. the subjects, but the card, hash to the run entry's adapter hash (`adapter_mismatch`): a key holder cannot
     sign the run's privacy over other files;
  6. with `adapter`: the folder holds exactly the subjects' files and bytes (`subject_mismatch`);
  7. with `ledger`: it names the predicate's origin; its entries, read as its checkpoints signed them
     (`ledger/signed.py`: by their bodies, under the largest checkpoint that verifies, and past it), are the tree
     of the release's checkpoint (`rollback`, `fork`, or the ledger's own codes: run govtrain-verify); the pinned
     release key is a release key of the policy in force at the release (`key_not_authorized`); the ledger's own
     facts of the run as of the release (ε per class, contributions, the whole tune entry, privacy terms, classes,
     withdrawals, the groups' class sets against the recorded noise groups, an own-adapter class against its
     profile) are the predicate's (`predicate_mismatch`); and the withdrawals since the release of contributions
     the run trained on are listed: the release is then tainted, a result, not an error (as it is, with or
     without a ledger, when it states withdrawals at release: an inference gate refuses both).
Offline, ε per class, the tune, the withdrawals and the groups' classes are the release key holder's statement;
step 7 checks them. Where the groups lie comes from the model the run trained (`groups.py`), which the audit path
never loads.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping, Sequence

from govtrain.errors import Code, GovtrainError, IntegrityError
from govtrain.ledger.checkpoint import Checkpoint, NoteError, NoteKey, parse_note, verify_checkpoint
from govtrain.ledger.entries import decode_entry
from govtrain.ledger.merkle import ProofError, leaf_hash, verify_inclusion
from govtrain.ledger.proof import parse_proof
from govtrain.release import dsse
from govtrain.release.artifact import adapter_digest, folder_files
from govtrain.release.facts import (LedgerFacts, Withdrawal, ledger_facts, privacy_of, signed_log, tune_of, withdrawals,
                                    withdrawn_of)
from govtrain.release.predicate import Predicate, Statement, read_statement
from govtrain.resolver.profile import describe_profile

if TYPE_CHECKING:
    from govtrain.ledger.ledger import Ledger


@dataclass(frozen=True, kw_only=True)
class ClassRelease:
    """One class as the release states it: its largest ε (micro-units, at the release's δ), how many of its
    contributions the run (or its tune) trained on, the groups it reached (indices into `ReleaseReport.groups`),
    and `adapter`: its own LoRA adapter's name where it reached that adapter alone (None: shared parameters)."""

    data_class: str
    eps_u: int
    contributions: int
    profile: str
    groups: tuple[int, ...]
    adapter: str | None

    @property
    def adapter_only(self) -> bool:
        """Whether serving without this class means disabling one adapter (`adapter`) rather than refusing."""
        return self.adapter is not None


@dataclass(frozen=True, kw_only=True)
class GroupRelease:
    """Trained coordinates reached by the same classes: `eps_u` maps each to its ε; where they lie."""

    eps_u: Mapping[str, int]
    adapters: tuple[str, ...]
    layers: tuple[int, ...]
    heads: tuple[tuple[int, tuple[int, ...]], ...]
    experts: tuple[tuple[int, tuple[int, ...]], ...]
    outside: tuple[str, ...]
    tensors: int
    scalars: int

    @property
    def classes(self) -> tuple[str, ...]:
        return tuple(self.eps_u)


@dataclass(frozen=True, kw_only=True)
class ReleaseReport:
    """What a verified release states, and what was checked. `withdrawn_since` is None where no ledger was given."""

    release_sha256: bytes  # SHA-256 of the signed payload: names this release
    statement: Statement
    run_id: str
    origin: str
    run_seq: int
    checkpoint: Checkpoint  # the release's, verified under the pinned ledger keys
    subjects: Mapping[str, str]  # file (relative path) -> SHA-256 hex
    classes: Mapping[str, ClassRelease]
    groups: tuple[GroupRelease, ...]
    withdrawn_at_release: tuple[Withdrawal, ...]
    adapter_checked: str | None  # the folder checked against the subjects
    current_checkpoint: Checkpoint | None  # the live ledger's largest verified one, which extends the release's
    unsigned_entries: int | None  # entries the live ledger holds past it, read all the same (0: none)
    withdrawn_since: tuple[Withdrawal, ...] | None
    # the leaf hash of every entry the live ledger holds, as read (the first `current_checkpoint.size` fold into its
    # root; the rest, each its body's, are the unsigned tail): what an inference gate remembers a tail by
    leaves: tuple[bytes, ...] | None = None

    @property
    def tainted(self) -> bool:
        """Whether an inference gate refuses the release as tainted: a contribution its run trained on was withdrawn
        since it (known only against a ledger), or before it (the predicate states it; a ledger checks it). Signing
        the same adapter again is no retraining (seed 004), so both count, as they do at a gate."""
        return bool(self.withdrawn_since or self.withdrawn_at_release)

    @property
    def delta_p(self) -> int:
        return self.statement.predicate.privacy.delta_p

    def as_json(self) -> dict:
        p = self.statement.predicate
        return {
            "ok": True, "status": "tainted" if self.tainted else "ok", "tainted": self.tainted,
            "release_sha256": self.release_sha256.hex(), "run_id": self.run_id, "origin": self.origin,
            "run_seq": self.run_seq, "checkpoint_size": self.checkpoint.size,
            "current_size": None if self.current_checkpoint is None else self.current_checkpoint.size,
            "unsigned_entries": self.unsigned_entries,
            "adapter_checked": self.adapter_checked, "ledger_checked": self.withdrawn_since is not None,
            "subjects": dict(self.subjects), "privacy": p.privacy.model_dump(mode="json"),
            "classes": {n: {"eps_u": c.eps_u, "contributions": c.contributions, "groups": list(c.groups),
                            "adapter": c.adapter, "profile": c.profile} for n, c in self.classes.items()},
            "groups": [g.model_dump(mode="json") for g in p.groups],
            "withdrawn_at_release": [_withdrawal(w) for w in self.withdrawn_at_release],
            "withdrawn_since": None if self.withdrawn_since is None else [_withdrawal(w) for w in self.withdrawn_since],
        }

    def __str__(self) -> str:
        from govtrain.release.card import eps_text

        classes = "; ".join(f"{c.data_class} ε {eps_text(c.eps_u)}"
                            + (f" (only its own adapter {c.adapter!r})" if c.adapter else "")
                            for c in self.classes.values() if c.contributions)
        lines = [f"ok: run {self.run_id}'s release (entry {self.run_seq} of {self.origin}, checkpoint size "
                 f"{self.checkpoint.size}), {len(self.subjects)} files; {classes or 'no class trained'} at δ = "
                 f"{self.delta_p / 1e12:g}; {len(self.withdrawn_at_release)} withdrawn at release"]
        lines.append(f"adapter folder {self.adapter_checked}: every file matches" if self.adapter_checked else
                     "adapter folder: not checked (--adapter DIR)")
        if self.tainted:
            lines[0] = "tainted" + lines[0][2:]
        if self.withdrawn_since is None:
            lines.append("ledger: not checked (--ledger URL): withdrawals since the release are not known")
        elif self.withdrawn_since:
            names = ", ".join(f"{w.contribution_id} (entry {w.seq})" for w in self.withdrawn_since)
            lines.append(f"TAINTED: withdrawn since the release: {names}; release a new adapter without them")
        else:
            lines.append(f"ledger: extends the release's checkpoint to size {self.current_checkpoint.size}; nothing "
                         "it trained on was withdrawn since")
        if self.withdrawn_at_release:
            names = ", ".join(f"{w.contribution_id} (entry {w.seq})" for w in self.withdrawn_at_release)
            lines.append(f"TAINTED: its run trained on contributions withdrawn before this release: {names}; an "
                         "inference gate refuses it as tainted (a new signature is no retraining): release the "
                         "adapter of a run trained without them")
        if self.unsigned_entries:
            size = self.current_checkpoint.size
            count = f"{self.unsigned_entries} {'entry' if self.unsigned_entries == 1 else 'entries'}"
            lines.append(f"WARNING: the ledger holds {count} past the last checkpoint a trusted key signs (from entry "
                         f"{size}); read for withdrawals all the same; run govtrain-verify")
        return "\n".join(lines)


def _withdrawal(w: Withdrawal) -> dict:
    return {"contribution_id": w.contribution_id, "data_class": w.data_class, "seq": w.seq,
            "leaf_hash": w.leaf_hash.hex()}


def _mismatch(detail: str) -> IntegrityError:
    return IntegrityError(Code.PREDICATE_MISMATCH, detail)


def verify_release(envelope: bytes, *, release_key: bytes, ledger_keys: Sequence[NoteKey | bytes],
                   adapter: str | os.PathLike[str] | None = None,
                   ledger: "str | Ledger | None" = None) -> ReleaseReport:
    """Verify the release manifest `envelope` (the bytes of a .dsse file) under the pinned `release_key` (raw
    Ed25519) and the pinned `ledger_keys` (checkpoint verifier keys, or raw Ed25519 keys, named by the note's own
    signature lines); with `adapter`, against that folder; with `ledger` (a URL or an open `Ledger`), against the
    live ledger. Raises `IntegrityError`; returns what the release states."""
    # 1.
    body = dsse.verify(dsse.parse(envelope), release_key)
    # 2.
    statement = read_statement(dsse.strict_json(body, "the payload"))
    p = statement.predicate
    # 3.
    proof = parse_proof(p.ledger.proof)
    try:
        checkpoint = verify_checkpoint(proof.checkpoint_note, origin=p.ledger.origin,
                                       keys=_note_keys(proof.checkpoint_note, ledger_keys))
    except NoteError as e:
        raise IntegrityError(Code.BAD_CHECKPOINT, f"the release's checkpoint: {e.detail} (pinned ledger keys)") from e
    if checkpoint.size != p.ledger.checkpoint_size:
        raise _mismatch(f"the predicate states checkpoint size {p.ledger.checkpoint_size}, its checkpoint signs "
                        f"{checkpoint.size}")
    # 4.
    try:
        verify_inclusion(proof.index, checkpoint.size, leaf_hash(proof.entry), proof.hashes, checkpoint.root)
    except ProofError as e:
        raise IntegrityError(Code.BAD_PROOF, f"the run entry's inclusion proof: {e.detail}") from e
    try:
        entry = decode_entry(proof.entry, seq=proof.index, kind="run")
    except IntegrityError as e:
        raise _mismatch(f"the proven entry is not a run entry: {e.detail}") from e
    stated = {"run_id": p.run.run_id, "seq": p.run.seq, "leaf_hash": p.run.leaf_hash, "mechanism": p.run.mechanism,
              "config_sha256": p.run.config_sha256, "adapter_sha256": p.run.adapter_sha256, "device": p.run.device,
              "precision": p.run.precision, "base model": p.base_model.sha256, "adapter hash": p.adapter.sha256,
              "privacy mechanism": p.privacy.mechanism}
    proven = {"run_id": entry["run_id"], "seq": proof.index, "leaf_hash": leaf_hash(proof.entry).hex(),
              "mechanism": entry["mechanism"], "config_sha256": entry["config_sha256"].hex(),
              "adapter_sha256": entry["adapter_sha256"].hex() if entry["adapter_sha256"] else None,
              "device": entry["device"], "precision": entry["precision"],
              "base model": entry["base_model_sha256"].hex(),
              "adapter hash": entry["adapter_sha256"].hex() if entry["adapter_sha256"] else None,
              "privacy mechanism": entry["mechanism"]}
    _compare("the proven run entry", stated, proven)
    # 5.
    subjects = {s.name: s.digest.sha256 for s in statement.subject}
    if adapter_digest({n: bytes.fromhex(d) for n, d in subjects.items()}).hex() != p.run.adapter_sha256:
        raise IntegrityError(Code.ADAPTER_MISMATCH, f"the manifest's subjects are not run {p.run.run_id!r}'s adapter: "
                                                    "their files but README.md do not hash to the adapter hash its "
                                                    "run entry records")
    # 6.
    checked = None
    if adapter is not None:
        _check_folder(Path(adapter), subjects)
        checked = str(adapter)
    report = dict(
        release_sha256=hashlib.sha256(body).digest(), statement=statement, run_id=p.run.run_id,
        origin=p.ledger.origin, run_seq=proof.index, checkpoint=checkpoint, subjects=MappingProxyType(subjects),
        classes=MappingProxyType({c.data_class: ClassRelease(data_class=c.data_class, eps_u=c.eps_u, contributions=c.contributions,
                                            profile=c.profile, groups=tuple(c.groups), adapter=c.adapter)
                 for c in p.classes}),
        groups=tuple(GroupRelease(eps_u=MappingProxyType({c.data_class: c.eps_u for c in g.classes}), adapters=tuple(g.adapters),
                                  layers=tuple(g.layers), heads=tuple((h.layer, tuple(h.indices)) for h in g.heads),
                                  experts=tuple((x.layer, tuple(x.indices)) for x in g.experts),
                                  outside=tuple(g.outside), tensors=g.tensors, scalars=g.scalars) for g in p.groups),
        withdrawn_at_release=tuple(Withdrawal(contribution_id=w.contribution_id, data_class=w.data_class, seq=w.seq,
                                              leaf_hash=bytes.fromhex(w.leaf_hash)) for w in p.withdrawn),
        adapter_checked=checked, current_checkpoint=None, unsigned_entries=None, withdrawn_since=None)
    if ledger is None:
        return ReleaseReport(**report)
    # 7.
    if isinstance(ledger, str):
        from govtrain.ledger.ledger import Ledger

        with Ledger.open(ledger) as opened:
            current, leaves, at_release, since = _against_ledger(opened, statement, checkpoint, release_key,
                                                                 ledger_keys)
    else:
        current, leaves, at_release, since = _against_ledger(ledger, statement, checkpoint, release_key, ledger_keys)
    # the withdrawals at release as the ledger records them (the predicate's, compared): with their entries' times
    return ReleaseReport(**{**report, "current_checkpoint": current, "unsigned_entries": len(leaves) - current.size,
                            "withdrawn_at_release": at_release, "withdrawn_since": since, "leaves": leaves})


def _note_keys(note: str, ledger_keys: Sequence[NoteKey | bytes]) -> list[NoteKey]:
    """The pinned keys as note verifier keys: a raw key under each name the note's signature lines give it (a name
    is bound into the key ID; only the key decides what verifies)."""
    keys = [k for k in ledger_keys if isinstance(k, NoteKey)]
    raw = [k for k in ledger_keys if not isinstance(k, NoteKey)]
    if not keys and not raw:
        raise TypeError("verify_release needs at least one pinned ledger key")
    if raw:
        try:
            _, signatures = parse_note(note)
        except NoteError as e:
            raise IntegrityError(Code.BAD_CHECKPOINT, f"the release's checkpoint: {e.detail}") from e
        for public in raw:
            for signature in signatures:
                try:
                    candidate = NoteKey(signature.name, public)
                except ValueError:
                    continue
                if candidate.key_id == signature.key_id:
                    keys.append(candidate)
    return keys


def _compare(what: str, stated: Mapping[str, object], found: Mapping[str, object]) -> None:
    for name, value in stated.items():
        if found[name] != value:
            raise _mismatch(f"the predicate states {name} {value!r}, {what} {found[name]!r}")


def _check_folder(folder: Path, subjects: Mapping[str, str]) -> None:
    try:
        files = {n: d.hex() for n, d in folder_files(folder).items()}
    except GovtrainError as e:
        raise IntegrityError(Code.SUBJECT_MISMATCH, e.detail) from e
    changed = sorted(n for n in subjects.keys() & files.keys() if subjects[n] != files[n])
    missing, extra = sorted(subjects.keys() - files.keys()), sorted(files.keys() - subjects.keys())
    if changed or missing or extra:
        parts = [f"{label}: {', '.join(names[:5])}" for label, names in
                 (("changed", changed), ("missing", missing), ("not in the release", extra)) if names]
        raise IntegrityError(Code.SUBJECT_MISMATCH, f"{folder} is not the released adapter ({'; '.join(parts)})")


def _against_ledger(ledger: "Ledger", statement: Statement, checkpoint: Checkpoint, release_key: bytes,
                    ledger_keys: Sequence[NoteKey | bytes]
                    ) -> tuple[Checkpoint, tuple[bytes, ...], tuple[Withdrawal, ...], tuple[Withdrawal, ...]]:
    p = statement.predicate
    if ledger.policy.origin != p.ledger.origin:
        raise _mismatch(f"the release is of the ledger {p.ledger.origin!r}, this ledger is {ledger.policy.origin!r}")
    # Every entry by its body, its leaf in the tree of the release's checkpoint (`rollback`, `fork`) and of the
    # largest checkpoint the pinned keys, or the keys the policy chain authorised, sign (`ledger/signed.py`).
    log = signed_log(ledger, keys=lambda note: _note_keys(note, ledger_keys), trusted=[checkpoint])
    facts = ledger_facts(ledger, p.run.run_id, checkpoint, log=log)
    if release_key not in {k.public_key for k in facts.release_policy.release_keys}:
        raise IntegrityError(Code.KEY_NOT_AUTHORIZED, "the pinned release key is not a release key of the ledger's "
                                                      "policy at the release")
    stated = {"run entry": p.run.seq,
              "classes": {c.data_class: (c.eps_u, c.contributions, c.profile) for c in p.classes},
              "privacy": p.privacy, "tune": p.tune, "withdrawn": p.withdrawn}
    found = {"run entry": facts.proof.index,
             "classes": {name: (facts.eps_by_class.get(name, 0), facts.contributions_by_class.get(name, 0),
                                describe_profile(cls.profile)) for name, cls in facts.policy.classes.items()},
             "privacy": privacy_of(facts), "tune": tune_of(facts), "withdrawn": withdrawn_of(facts.withdrawn)}
    _compare("the ledger", stated, found)
    _check_reach(p, facts)
    since = withdrawals(log, facts.charged, facts.classes, start=checkpoint.size)  # to the last entry stored
    return log.checkpoint, tuple(e.leaf_hash for e in log.entries), facts.withdrawn, since


def _check_reach(p: Predicate, facts: LedgerFacts) -> None:
    """The groups, as the run's spend entries recorded them: the class sets of the groups that a class its noise
    reached reaches are exactly the noise groups it charged (`noise_groups`), and a class said to reach only its own
    adapter has the profile `adapter = NAME` of that adapter in the policy it trained under."""
    noised = frozenset().union(*facts.noise_signatures)
    reached = {frozenset(c.data_class for c in g.classes) for g in p.groups}
    stated = {s for s in reached if s & noised}
    if stated != facts.noise_signatures:
        names = lambda found: "; ".join(sorted(", ".join(sorted(s)) for s in found)) or "none"  # noqa: E731
        raise _mismatch(f"the predicate's groups are reached by the classes {names(stated)}; the run's spend entries "
                        f"charged noise on groups reached by {names(facts.noise_signatures)}")
    for c in p.classes:
        profile = facts.policy.classes[c.data_class].profile
        if c.adapter is not None and (profile.kind != "adapter" or profile.adapter != c.adapter):
            raise _mismatch(f"the predicate states that class {c.data_class!r} reached only its own adapter "
                            f"{c.adapter!r}; its profile in the policy it trained under is "
                            f"{describe_profile(profile)}")
