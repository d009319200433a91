"""DSSE envelopes (github.com/secure-systems-lab/dsse, protocol v1.0.0) signed with Ed25519. Never imports torch.

    {"payload": base64(body), "payloadType": "application/vnd.in-toto+json",
     "signatures": [{"keyid": hex(SHA-256 of the raw public key), "sig": base64(Ed25519 over PAE)}]}

The signature covers the pre-authentication encoding `pae(type, body)` (protocol.md):

    "DSSEv1" SP LEN(type) SP type SP LEN(body) SP body       LEN: the byte length in ASCII decimal, no leading zeros

The body is verified and returned as the bytes the envelope carries, never re-encoded (docs/design.md §3's rule).
`keyid` is a hint, as DSSE says: a signature verifies under the pinned key or not at all, whatever it names.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from govtrain.attest.keys import check_public_key, key_id, raw_public_key
from govtrain.errors import Code, IntegrityError

PAYLOAD_TYPE = "application/vnd.in-toto+json"
MAX_ENVELOPE_BYTES = 16 * 1024 * 1024
MAX_SIGNATURES = 16
_HEX = re.compile(r"[0-9a-f]+")


def pae(payload_type: str, body: bytes) -> bytes:
    """DSSE's pre-authentication encoding of (type, body): the bytes a signature covers."""
    kind = payload_type.encode("utf-8")
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(body), body)


def keyid(public_key: bytes | Ed25519PublicKey) -> str:
    """The `keyid` a govtrain signature carries: hex SHA-256 of the raw 32-byte Ed25519 public key (the `kid` of
    an attestation, docs/design.md §3)."""
    return key_id(raw_public_key(public_key)).hex()


@dataclass(frozen=True, kw_only=True)
class Signature:
    keyid: str
    sig: bytes


@dataclass(frozen=True, kw_only=True)
class Envelope:
    payload: bytes  # as carried, base64-decoded: the bytes signed and verified
    payload_type: str
    signatures: tuple[Signature, ...]

    def to_json(self) -> bytes:
        return (json.dumps({
            "payload": base64.b64encode(self.payload).decode(),
            "payloadType": self.payload_type,
            "signatures": [{"keyid": s.keyid, "sig": base64.b64encode(s.sig).decode()} for s in self.signatures],
        }, indent=2) + "\n").encode()


def sign(body: bytes, key: Ed25519PrivateKey, payload_type: str = PAYLOAD_TYPE) -> Envelope:
    """An envelope of `body`, signed by `key`."""
    signature = Signature(keyid=keyid(key.public_key()), sig=key.sign(pae(payload_type, body)))
    return Envelope(payload=body, payload_type=payload_type, signatures=(signature,))


def _bad(detail: str) -> IntegrityError:
    return IntegrityError(Code.BAD_ENVELOPE, detail)


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    keys = [k for k, _ in pairs]
    if len(keys) != len(set(keys)):
        raise _bad("a JSON object repeats a key")
    return dict(pairs)


def strict_json(raw: bytes, what: str) -> object:
    """`raw` as JSON, refusing what two readers could read differently: invalid UTF-8, a repeated key, NaN or
    Infinity, an integer too long to convert."""
    def constant(name: str) -> None:
        raise _bad(f"{what} holds {name}, which JSON does not have")

    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys, parse_constant=constant)
    except UnicodeDecodeError as e:
        raise _bad(f"{what} is not UTF-8") from e
    except json.JSONDecodeError as e:
        raise _bad(f"{what} is not JSON ({e.msg} at {e.pos})") from e
    except ValueError as e:  # an integer past Python's digit limit (sys.get_int_max_str_digits)
        raise _bad(f"{what} holds a number too long to read") from e
    except RecursionError as e:
        raise _bad(f"{what} nests too deep") from e


def _b64(value: object, what: str) -> bytes:
    if type(value) is not str:
        raise _bad(f"{what} must be a base64 string")
    try:  # DSSE accepts the standard and the URL-safe alphabet, padded
        return base64.b64decode(value.replace("-", "+").replace("_", "/"), validate=True)
    except (binascii.Error, ValueError) as e:
        raise _bad(f"{what} is not base64") from e


def parse(raw: bytes) -> Envelope:
    """An envelope read strictly from its JSON bytes; nothing is verified yet."""
    if len(raw) > MAX_ENVELOPE_BYTES:
        raise _bad(f"the envelope is over {MAX_ENVELOPE_BYTES} bytes")
    document = strict_json(raw, "the envelope")
    if type(document) is not dict or set(document) != {"payload", "payloadType", "signatures"}:
        raise _bad("an envelope is a JSON object of exactly payload, payloadType and signatures")
    if type(document["payloadType"]) is not str:
        raise _bad("payloadType must be a string")
    items = document["signatures"]
    if type(items) is not list or not 1 <= len(items) <= MAX_SIGNATURES:
        raise _bad(f"signatures must be a list of 1 to {MAX_SIGNATURES}")
    signatures = []
    for index, item in enumerate(items):
        if type(item) is not dict or not {"sig"} <= set(item) <= {"sig", "keyid"}:
            raise _bad(f"signatures[{index}] is an object of sig and an optional keyid")
        name = item.get("keyid", "")
        if type(name) is not str:
            raise _bad(f"signatures[{index}].keyid must be a string")
        signatures.append(Signature(keyid=name, sig=_b64(item["sig"], f"signatures[{index}].sig")))
    return Envelope(payload=_b64(document["payload"], "payload"), payload_type=document["payloadType"],
                    signatures=tuple(signatures))


def _printable(name: str) -> str:
    """A keyid as the error line may show it: hex as it is, anything else escaped (`ascii`), never a terminal
    control character from the file."""
    if not name:
        return "(none)"
    return name if _HEX.fullmatch(name) else ascii(name)


def verify(envelope: Envelope, public_key: bytes, payload_type: str = PAYLOAD_TYPE) -> bytes:
    """The envelope's body, once a signature over its PAE verifies under `public_key` (raw Ed25519, pinned by the
    caller). Raises `unknown_key` where no signature names that key and none verifies under it, `bad_signature`
    where one names it and none verifies."""
    if envelope.payload_type != payload_type:
        raise _bad(f"payloadType is {envelope.payload_type!r}, not {payload_type!r}")
    check_public_key(public_key)  # a small-order key verifies forgeries (docs/design.md §3)
    verifier = Ed25519PublicKey.from_public_bytes(public_key)
    message = pae(envelope.payload_type, envelope.payload)
    for signature in envelope.signatures:
        try:
            verifier.verify(signature.sig, message)
        except InvalidSignature:
            continue
        return envelope.payload
    pinned = keyid(public_key)
    if any(s.keyid == pinned for s in envelope.signatures):
        raise IntegrityError(Code.BAD_SIGNATURE, "the signature by the pinned release key does not verify: the "
                                                 "manifest was altered after it was signed")
    named = ", ".join(_printable(s.keyid[:16]) for s in envelope.signatures)
    raise IntegrityError(Code.UNKNOWN_KEY, f"no signature verifies under the pinned release key {pinned[:16]}…; the "
                                           f"envelope's signatures name key(s) {named}: another key signed it")
