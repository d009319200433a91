"""Proofs for contributors: c2sp.org/tlog-proof@v1 text, checkable offline with the ledger's public key.

    c2sp.org/tlog-proof@v1
    extra base64(the admit entry's canonical bytes)
    index 17
    base64(sibling hash)            one per line, from the leaf's sibling up to the root's child
    ...
                                    blank line
    the checkpoint note, verbatim

The leaf is the admit entry, which a contributor cannot rebuild (it records its sequence number
and admission time), so the proof carries it on the `extra` line. The verifier never trusts
that line: it hashes it into the leaf, checks the inclusion proof against the signed root, and
can check the entry against the contributor's own `.cose` file.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from dataclasses import dataclass

from govtrain.errors import Code, IntegrityError
from govtrain.ledger.checkpoint import Checkpoint, NoteError, NoteKey, verify_checkpoint
from govtrain.ledger.entries import decode_entry
from govtrain.ledger.merkle import ProofError, leaf_hash, verify_inclusion

HEADER = "c2sp.org/tlog-proof@v1"
_INDEX = re.compile(r"index (0|[1-9][0-9]{0,18})")  # a ledger seq fits in 63 bits: at most 19 digits


@dataclass(frozen=True, slots=True)
class InclusionProof:
    entry: bytes
    index: int
    hashes: list[bytes]
    checkpoint_note: str

    def text(self) -> str:
        lines = [HEADER, f"extra {base64.b64encode(self.entry).decode()}", f"index {self.index}"]
        lines += [base64.b64encode(h).decode() for h in self.hashes]
        return "\n".join(lines) + "\n\n" + self.checkpoint_note


@dataclass(frozen=True, slots=True)
class VerifiedProof:
    entry: dict
    index: int
    checkpoint: Checkpoint


def _bad(detail: str) -> IntegrityError:
    return IntegrityError(Code.BAD_PROOF, detail)


def parse_proof(text: str) -> InclusionProof:
    head, sep, note = text.partition("\n\n")
    if not sep:
        raise _bad("no blank line between the proof and its checkpoint")
    lines = head.split("\n")
    if lines[0] != HEADER:
        raise _bad(f"first line is not {HEADER}")
    rest = lines[1:]
    if not rest or not rest[0].startswith("extra "):
        raise _bad("no extra line carrying the admit entry")
    try:
        entry = base64.b64decode(rest[0][len("extra "):], validate=True)
        match = _INDEX.fullmatch(rest[1]) if len(rest) > 1 else None
        if match is None:
            raise _bad("no index line (index N, N a decimal of at most 19 digits)")
        hashes = [base64.b64decode(line, validate=True) for line in rest[2:]]
    except (binascii.Error, ValueError) as e:
        raise _bad("proof lines are not base64") from e
    return InclusionProof(entry, int(match.group(1)), hashes, note)


def verify_proof(text: str, keys: list[NoteKey], *, origin: str,
                 attestation: bytes | None = None) -> VerifiedProof:
    """Verify a proof offline: the checkpoint's signature, that it is a checkpoint of the ledger `origin`,
    the inclusion of the entry, and optionally that the entry records `attestation` (the contributor's own
    `.cose` bytes).

    `origin` is the ledger the caller expects, never read from the proof: one key may sign several
    ledgers, and a proof from another of them must not pass for this one.
    """
    proof = parse_proof(text)
    try:
        checkpoint = verify_checkpoint(proof.checkpoint_note, origin=origin, keys=keys)
    except NoteError as e:
        raise _bad(f"checkpoint: {e.detail}") from e
    try:
        verify_inclusion(proof.index, checkpoint.size, leaf_hash(proof.entry), proof.hashes, checkpoint.root)
    except ProofError as e:
        raise _bad(e.detail) from e
    entry = decode_entry(proof.entry, seq=proof.index, kind="admit")
    if attestation is not None and entry["attestation_sha256"] != hashlib.sha256(attestation).digest():
        raise _bad("the proven entry records a different attestation than the one given")
    return VerifiedProof(entry, proof.index, checkpoint)
