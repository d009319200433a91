"""Signed checkpoints: C2SP tlog-checkpoint text in a C2SP signed note, Ed25519 (signature type 0x01).

    example.org/govtrain/demo          origin
    31                                 tree size
    base64(root)                       RFC 9162 root of the first 31 entries
                                       blank line
    — example.org/govtrain/demo base64(key ID ‖ Ed25519 signature over the three lines above)

key ID = SHA-256(key name ‖ 0x0A ‖ 0x01 ‖ 32-byte public key)[:4] (c2sp.org/signed-note).
Notes are stored and hashed verbatim; verification parses without trusting and raises.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from govtrain.attest.keys import check_public_key, raw_public_key
from govtrain.errors import Code, IntegrityError

SIGNATURE_TYPE_ED25519 = b"\x01"
MAX_NOTE_BYTES = 64 * 1024
MAX_SIGNATURES = 64
_EM_DASH = "\u2014"
_KEY_NAME = re.compile(r"[^\s+]+")
_SIZE = re.compile(r"0|[1-9][0-9]{0,18}")  # a tree size fits in 63 bits: at most 19 digits


class NoteError(IntegrityError):
    """A signed note or checkpoint that does not verify."""

    def __init__(self, detail: str) -> None:
        super().__init__(Code.BAD_CHECKPOINT, detail)


def note_key_id(name: str, public_key: bytes) -> bytes:
    """The 4-byte key ID of an Ed25519 note key."""
    return hashlib.sha256(name.encode("utf-8") + b"\n" + SIGNATURE_TYPE_ED25519 + public_key).digest()[:4]


@dataclass(frozen=True, slots=True)
class NoteKey:
    """A note verifier key: a name and an Ed25519 public key (screened for small order)."""

    name: str
    public_key: bytes

    def __post_init__(self) -> None:
        if not _KEY_NAME.fullmatch(self.name):
            raise ValueError("a note key name is non-empty, with no spaces and no '+'")
        check_public_key(self.public_key)

    @property
    def key_id(self) -> bytes:
        return note_key_id(self.name, self.public_key)

    def vkey(self) -> str:
        """The verifier-key string ``name+hex(key ID)+base64(0x01 ‖ public key)``."""
        return f"{self.name}+{self.key_id.hex()}+{base64.b64encode(SIGNATURE_TYPE_ED25519 + self.public_key).decode()}"

    @classmethod
    def from_vkey(cls, vkey: str) -> "NoteKey":
        parts = vkey.strip().split("+")
        if len(parts) != 3:
            raise NoteError("a verifier key is name+keyid+key")
        name, key_id_hex, material = parts
        try:
            raw = base64.b64decode(material, validate=True)
            key_id = bytes.fromhex(key_id_hex)
        except (binascii.Error, ValueError) as e:
            raise NoteError("verifier key is not valid hex and base64") from e
        if len(raw) != 33 or raw[:1] != SIGNATURE_TYPE_ED25519:
            raise NoteError("verifier key is not an Ed25519 (type 0x01) key")
        key = cls(name, raw[1:])
        if key.key_id != key_id:
            raise NoteError("verifier key's key ID does not match its name and key")
        return key


@dataclass(frozen=True, slots=True)
class NoteSignature:
    name: str
    key_id: bytes
    signature: bytes


def sign_note(text: str, private_key: Ed25519PrivateKey | Sequence[tuple[Ed25519PrivateKey, str]],
              name: str | None = None) -> str:
    """`text` (ending in a newline) signed as a note by `private_key` under key name `name`, or by each
    (key, name) of a sequence, one signature line each (a note may carry several, c2sp.org/signed-note)."""
    if not text.endswith("\n"):
        raise ValueError("note text ends with a newline")
    signers = [(private_key, name)] if isinstance(private_key, Ed25519PrivateKey) else list(private_key)
    lines = []
    for key, key_name in dict.fromkeys(signers):  # the same key under the same name signs once
        if key_name is None:
            raise ValueError("every note signature needs a key name")
        note_key = NoteKey(key_name, raw_public_key(key.public_key()))
        signature = key.sign(text.encode("utf-8"))
        lines.append(f"{_EM_DASH} {key_name} {base64.b64encode(note_key.key_id + signature).decode()}\n")
    return f"{text}\n{''.join(lines)}"


def parse_note(note: str | bytes) -> tuple[str, list[NoteSignature]]:
    """Split a signed note into its text and signature lines (c2sp.org/signed-note §Format)."""
    if isinstance(note, bytes):
        if len(note) > MAX_NOTE_BYTES:
            raise NoteError("note is too large")
        try:
            note = note.decode("utf-8")
        except UnicodeDecodeError as e:
            raise NoteError("note is not valid UTF-8") from e
    if len(note.encode("utf-8")) > MAX_NOTE_BYTES:
        raise NoteError("note is too large")
    if any(ch < " " and ch != "\n" for ch in note):
        raise NoteError("note contains a control character")
    split = note.rfind("\n\n")
    if split < 0 or not note.endswith("\n"):
        raise NoteError("note has no blank line before its signatures")
    text, lines = note[: split + 1], note[split + 2 :].split("\n")[:-1]
    if not lines or len(lines) > MAX_SIGNATURES:
        raise NoteError("note has no signature lines, or too many")
    signatures = []
    for line in lines:
        parts = line.split(" ")
        if len(parts) != 3 or parts[0] != _EM_DASH or not _KEY_NAME.fullmatch(parts[1]):
            raise NoteError(f"malformed signature line {line[:40]!r}")
        try:
            raw = base64.b64decode(parts[2], validate=True)
        except (binascii.Error, ValueError) as e:
            raise NoteError("signature is not base64") from e
        if len(raw) < 5:
            raise NoteError("signature is too short to hold a key ID")
        signatures.append(NoteSignature(parts[1], raw[:4], raw[4:]))
    return text, signatures


def verify_note(note: str | bytes, keys: Iterable[NoteKey]) -> tuple[str, list[NoteKey]]:
    """The note's text and the known keys whose signatures verified.

    Unknown signatures are ignored; a known key whose signature fails rejects the note; a note
    with no verified known signature is rejected (c2sp.org/signed-note §Signatures).
    """
    text, signatures = parse_note(note)
    known = {(k.name, k.key_id): k for k in keys}
    verified: list[NoteKey] = []
    for sig in signatures:
        key = known.get((sig.name, sig.key_id))
        if key is None:
            continue
        try:
            Ed25519PublicKey.from_public_bytes(key.public_key).verify(sig.signature, text.encode("utf-8"))
        except InvalidSignature as e:
            raise NoteError(f"signature by {key.name} does not verify") from e
        verified.append(key)
    if not verified:
        raise NoteError("no signature by a trusted key")
    return text, verified


@dataclass(frozen=True, slots=True)
class Checkpoint:
    origin: str
    size: int
    root: bytes
    note: str  # verbatim, as signed

    @staticmethod
    def text(origin: str, size: int, root: bytes) -> str:
        return f"{origin}\n{size}\n{base64.b64encode(root).decode()}\n"


def sign_checkpoint(origin: str, size: int, root: bytes,
                    private_key: Ed25519PrivateKey | Sequence[tuple[Ed25519PrivateKey, str]],
                    name: str | None = None) -> Checkpoint:
    """A checkpoint for the tree of `size` entries with `root`, signed under key name `name` (the origin),
    or by every (key, name) of a sequence."""
    if isinstance(private_key, Ed25519PrivateKey):
        private_key = [(private_key, name or origin)]
    note = sign_note(Checkpoint.text(origin, size, root), private_key)
    return Checkpoint(origin, size, root, note)


def verify_checkpoint(note: str | bytes, *, origin: str, keys: Iterable[NoteKey],
                      also_signed_by: Sequence[Iterable[NoteKey]] = ()) -> Checkpoint:
    """Verify a checkpoint note for `origin` under `keys` and parse its tree head (c2sp.org/tlog-checkpoint).

    Each set in `also_signed_by` must have a key whose signature is on the note too: a checkpoint that
    first covers a policy change carries a signature by a ledger key of the policy before it."""
    keys = list(keys)
    required = [list(group) for group in also_signed_by]
    text, verified = verify_note(note, keys + [k for group in required for k in group])
    if not any(k in verified for k in keys):
        raise NoteError("no signature by a ledger key of the policy in force")
    for group in required:
        if not any(k in verified for k in group):
            raise NoteError("no signature by a ledger key of the policy before the change it covers: "
                            "the change is not authorised")
    lines = text.split("\n")[:-1]
    if len(lines) < 3 or any(not line for line in lines):
        raise NoteError("checkpoint text needs origin, size and root lines, none empty")
    if lines[0] != origin:
        raise NoteError(f"checkpoint is for origin {lines[0]!r}, not {origin!r}")
    if not _SIZE.fullmatch(lines[1]):
        raise NoteError("checkpoint size is not a decimal of at most 19 digits without leading zeros")
    try:
        root = base64.b64decode(lines[2], validate=True)
    except (binascii.Error, ValueError) as e:
        raise NoteError("checkpoint root is not base64") from e
    if len(root) != 32:
        raise NoteError("checkpoint root is not 32 bytes")
    return Checkpoint(origin, int(lines[1]), root, note if isinstance(note, str) else note.decode("utf-8"))
