"""Attestations: COSE_Sign1 (RFC 9052 §4.2) over a canonical descriptor (docs/design.md §3).

    COSE_Sign1 = #6.18([protected: bstr .cbor {1: -8, ?3: content type, 4: kid}, unprotected: {},
                        payload: bstr (the descriptor's canonical bytes), signature: bstr .size 64])

The signature is Ed25519 over ``Sig_structure = ["Signature1", protected, h'', payload]``.
Parsing is split from signature verification so that the gate can find the key by
kid first; `parse_attestation` never trusts what it reads and raises on the first
deviation, each with its own `Code`.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from govtrain.attest.descriptor import Descriptor
from govtrain.attest.keys import key_id
from govtrain.encoding import cbor
from govtrain.encoding.cbor import Tag
from govtrain.errors import AttestationError, Code

COSE_SIGN1_TAG = 18
_OTHER_COSE_TAGS = frozenset({16, 17, 96, 97, 98})  # Encrypt0, Mac0, Encrypt, Mac, Sign: named, then refused
ALG_EDDSA = -8
ALG_ED25519 = -19  # RFC 9864's fully specified Ed25519; accepted, not produced
ACCEPTED_ALGS = frozenset({ALG_EDDSA, ALG_ED25519})
CONTENT_TYPE = "application/govtrain.descriptor+cbor"
H_ALG, H_CRIT, H_CONTENT_TYPE, H_KID = 1, 2, 3, 4
KNOWN_HEADERS = frozenset({H_ALG, H_CRIT, H_CONTENT_TYPE, H_KID})
SIGNATURE_BYTES = 64
KID_BYTES = 32

_SIG1_PREFIX = cbor.encode("Signature1")
_EMPTY_BSTR = b"\x40"


@dataclass(frozen=True, slots=True)
class ParsedAttestation:
    """A structurally valid COSE_Sign1 whose signature has NOT been checked yet."""

    raw: bytes
    protected: bytes
    payload: bytes
    signature: bytes
    kid: bytes
    alg: int

    def attestation_sha256(self) -> bytes:
        return hashlib.sha256(self.raw).digest()


def sig_structure(protected: bytes, payload: bytes) -> bytes:
    """The bytes the signature covers: canonical ``["Signature1", protected, h'', payload]``."""
    return b"".join(
        (
            b"\x84",
            _SIG1_PREFIX,
            cbor.encode_bstr_head(len(protected)),
            protected,
            _EMPTY_BSTR,
            cbor.encode_bstr_head(len(payload)),
            payload,
        )
    )


def sign_attestation(
    descriptor: Descriptor, private_key: Ed25519PrivateKey, *, with_content_type: bool = True
) -> bytes:
    """The `.cose` bytes of `descriptor` signed by `private_key`."""
    return sign_sign1(descriptor.signed_bytes(), private_key,
                      content_type=CONTENT_TYPE if with_content_type else None)


def sign_sign1(payload: bytes, private_key: Ed25519PrivateKey, *, content_type: str | None) -> bytes:
    """A COSE_Sign1 over `payload` (attached), protected header ``{1: -8, ?3: content_type, 4: kid}``: the one
    layout govtrain signs, for attestations and for rights envelopes (`govtrain/serve/rights.py`)."""
    header: dict = {H_ALG: ALG_EDDSA, H_KID: key_id(private_key.public_key())}
    if content_type is not None:
        header[H_CONTENT_TYPE] = content_type
    protected = cbor.encode(header)
    signature = private_key.sign(sig_structure(protected, payload))
    return cbor.encode(Tag(COSE_SIGN1_TAG, [protected, {}, payload, signature]))


def _protected_templates() -> dict[bytes, int]:
    """Canonical protected headers govtrain accepts, as byte prefixes before the 32-byte kid."""
    templates = {}
    for alg in ACCEPTED_ALGS:
        for header in ({H_ALG: alg}, {H_ALG: alg, H_CONTENT_TYPE: CONTENT_TYPE}):
            encoded = cbor.encode({**header, H_KID: bytes(KID_BYTES)})
            templates[encoded[:-KID_BYTES]] = alg
    return templates


_PROTECTED = _protected_templates()
# Every accepted protected header is 24-255 bytes long, so its bstr head is two bytes.
assert all(len(cbor.encode_bstr_head(len(p) + KID_BYTES)) == 2 for p in _PROTECTED)
# 18([bstr protected, {}, bstr payload, bstr .size 64]) with a known protected header, in one match:
# group 1 = protected with its head, 2 = its kid, 3 = payload head, 4 = payload, 5 = signature.
_ENVELOPE = re.compile(
    re.escape(bytes((0xC0 | COSE_SIGN1_TAG, 0x84)))
    + b"((?:" + b"|".join(re.escape(cbor.encode_bstr_head(len(p) + KID_BYTES) + p) for p in _PROTECTED) + b")"
    + b"(.{32}))\\xa0" + cbor.head_pattern(2) + b"(.*)\\x58\\x40(.{64})\\Z",
    re.DOTALL,
)


def _parse_fast(raw: bytes) -> ParsedAttestation | None:
    """The common case in one regular expression: exactly ``18([protected, {}, payload, sig64])`` in
    canonical form with one of the known protected headers. Anything else: None (use the full path)."""
    if len(raw) > cbor.MAX_INPUT_BYTES:
        return None
    match = _ENVELOPE.match(raw)
    if match is None:
        return None
    framed, kid, payload_head, payload, signature = match.groups()
    if len(payload) != cbor.head_value(payload_head):
        return None
    protected = framed[2:]
    return ParsedAttestation(raw=raw, protected=protected, payload=payload, signature=signature, kid=kid,
                             alg=_PROTECTED[protected[:-KID_BYTES]])


def parse_attestation(raw: bytes) -> ParsedAttestation:
    """Steps 1-4 of verification: strict decoding and header checks (no key, no signature yet)."""
    fast = _parse_fast(raw)
    return fast if fast is not None else _parse_full(raw)


def _preview(raw: bytes) -> str:
    """The first bytes, as text where they are printable (a JSON line, a CSV header, a PEM), else in hex."""
    head = raw[:24].split(b"\n")[0]
    text = head.decode("ascii", errors="replace")
    if text.strip() and text.isprintable():
        return f"with the text {text + ('…' if len(raw) > len(head) else '')!r}"
    return f"with the bytes {head[:8].hex(' ')}"


def _parse_full(raw: bytes) -> ParsedAttestation:
    """The general path: decode everything, then check each rule and name the first broken one."""
    return parse_sign1(raw, content_type=CONTENT_TYPE, what="an attestation", signer="attester",
                       hint="give the .cose file `govtrain attest` wrote, and its data as --data")


def parse_sign1(raw: bytes, *, content_type: str, what: str, signer: str, hint: str) -> ParsedAttestation:
    """Steps 0-4 for any COSE_Sign1 govtrain reads: `content_type` is the one content type (3) allowed; `what`,
    `signer` and `hint` name the message, whose key the kid names, and where a right one comes from."""
    # 0. A COSE_Sign1 begins with a CBOR tag (major type 6) or, untagged, an array (4): anything else is some other
    #    file (a data file, a key) given as the attestation, and decoding it would only report nonsense lengths.
    if raw and raw[0] >> 5 not in (4, 6):
        raise AttestationError(Code.NOT_COSE_SIGN1, f"not {what} (COSE_Sign1): it begins {_preview(raw)}; {hint}")

    # 1. Deterministic CBOR, no tags but COSE's own (docs/design.md §2).
    top = cbor.decode(raw, tags=_OTHER_COSE_TAGS | {COSE_SIGN1_TAG})

    # 2. Tag 18 around a four-element array (RFC 9052 §4.2).
    if not isinstance(top, Tag):
        raise AttestationError(Code.NOT_COSE_SIGN1, "attestation is not tagged as COSE_Sign1 (CBOR tag 18)")
    if top.number != COSE_SIGN1_TAG:
        raise AttestationError(Code.NOT_COSE_SIGN1, f"CBOR tag {top.number} is not COSE_Sign1 (18)")
    body = top.value
    if type(body) is not list or len(body) != 4:
        raise AttestationError(Code.BAD_COSE_STRUCTURE, "COSE_Sign1 must be an array of four elements")
    protected, unprotected, payload, signature = body
    if type(protected) is not bytes:
        raise AttestationError(Code.BAD_COSE_STRUCTURE, "protected header must be a byte string")
    if type(unprotected) is not dict:
        raise AttestationError(Code.BAD_COSE_STRUCTURE, "unprotected header must be a map")
    if payload is None:
        raise AttestationError(Code.BAD_COSE_STRUCTURE, "payload is detached; the descriptor must be attached")
    if type(payload) is not bytes:
        raise AttestationError(Code.BAD_COSE_STRUCTURE, "payload must be a byte string")
    if type(signature) is not bytes:
        raise AttestationError(Code.BAD_COSE_STRUCTURE, "signature must be a byte string")

    # 3. Header buckets (RFC 9052 §3): a decodable protected map, an empty unprotected map.
    if not protected:
        raise AttestationError(Code.BAD_ALGORITHM, "protected header is empty: alg is missing")
    header = cbor.decode(protected)
    if type(header) is not dict:
        raise AttestationError(Code.BAD_HEADER, "protected header must encode a map")
    for label in unprotected:
        if label in header:
            raise AttestationError(Code.DUPLICATE_HEADER, f"header label {label!r} is in both header buckets")
    if unprotected:
        raise AttestationError(Code.BAD_HEADER, "unprotected header must be empty; put every label in protected")
    # RFC 9052 §3.1: a critical label we do not understand makes the whole message unprocessable.
    if H_CRIT in header:
        crit = header[H_CRIT]
        if type(crit) is not list or not crit:
            raise AttestationError(Code.BAD_HEADER, "crit (2) must be a non-empty array of labels")
        for label in crit:
            if label not in (H_ALG, H_CONTENT_TYPE, H_KID) or label not in header:
                raise AttestationError(Code.UNKNOWN_CRITICAL, f"crit names label {label!r}, which is not understood")
    for label in header:
        if label not in KNOWN_HEADERS:
            raise AttestationError(Code.BAD_HEADER, f"unknown protected header label {label!r}")

    # 4. Each label's value (RFC 9052 §3.1, RFC 9864 for -19).
    alg = header.get(H_ALG)
    if alg is None:
        raise AttestationError(Code.BAD_ALGORITHM, "protected header has no alg (1)")
    if type(alg) is not int or alg not in ACCEPTED_ALGS:
        raise AttestationError(Code.BAD_ALGORITHM, f"alg {alg!r} is not EdDSA (-8) or Ed25519 (-19)")
    if H_CONTENT_TYPE in header and header[H_CONTENT_TYPE] != content_type:
        raise AttestationError(Code.BAD_HEADER, f"content type must be {content_type!r}")
    kid = header.get(H_KID)
    if kid is None:
        raise AttestationError(Code.MISSING_KID, f"protected header has no kid (4) naming the {signer} key")
    if type(kid) is not bytes or len(kid) != KID_BYTES:
        raise AttestationError(Code.BAD_HEADER, f"kid must be the 32-byte SHA-256 of the {signer}'s public key")
    if len(signature) != SIGNATURE_BYTES:
        raise AttestationError(Code.BAD_SIGNATURE, f"signature is {len(signature)} bytes, not 64")
    return ParsedAttestation(
        raw=bytes(raw), protected=protected, payload=payload, signature=signature, kid=kid, alg=alg
    )


def verify_signature(parsed: ParsedAttestation, public_key: Ed25519PublicKey, *,
                     message: bytes | None = None) -> None:
    """Step 6: Ed25519 over the Sig_structure (`message`, when the caller built it already); raises
    `bad_signature`."""
    if message is None:
        message = sig_structure(parsed.protected, parsed.payload)
    try:
        public_key.verify(parsed.signature, message)
    except InvalidSignature as e:
        raise AttestationError(Code.BAD_SIGNATURE, "signature does not verify under the key its kid names") from e
