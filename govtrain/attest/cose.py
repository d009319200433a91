"""Attestations: COSE_Sign1 (RFC 9052 §4.2) over a canonical descriptor (DESIGN §3).

    COSE_Sign1 = #6.18([protected: bstr .cbor {1: -8, ?3: content type, 4: kid}, unprotected: {},
                        payload: bstr (the descriptor's canonical bytes), signature: bstr .size 64])

The signature is Ed25519 over ``Sig_structure = ["Signature1", protected, h'', payload]``.
Parsing is split from signature verification so that the gate can find the key by
kid first; `parse_attestation` never trusts what it reads and raises on the first
deviation, each with its own `Code`.
"""

from __future__ import annotations

import hashlib
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
    header: dict = {H_ALG: ALG_EDDSA, H_KID: key_id(private_key.public_key())}
    if with_content_type:
        header[H_CONTENT_TYPE] = CONTENT_TYPE
    protected = cbor.encode(header)
    payload = descriptor.signed_bytes()
    signature = private_key.sign(sig_structure(protected, payload))
    return cbor.encode(Tag(COSE_SIGN1_TAG, [protected, {}, payload, signature]))


def parse_attestation(raw: bytes) -> ParsedAttestation:
    """Steps 1-4 of verification: strict decoding and header checks (no key, no signature yet)."""
    # 1. Deterministic CBOR, no tags but COSE's own (DESIGN §2).
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
    if H_CONTENT_TYPE in header and header[H_CONTENT_TYPE] != CONTENT_TYPE:
        raise AttestationError(Code.BAD_HEADER, f"content type must be {CONTENT_TYPE!r}")
    kid = header.get(H_KID)
    if kid is None:
        raise AttestationError(Code.MISSING_KID, "protected header has no kid (4) naming the attester key")
    if type(kid) is not bytes or len(kid) != KID_BYTES:
        raise AttestationError(Code.BAD_HEADER, "kid must be the 32-byte SHA-256 of the attester's public key")
    if len(signature) != SIGNATURE_BYTES:
        raise AttestationError(Code.BAD_SIGNATURE, f"signature is {len(signature)} bytes, not 64")
    return ParsedAttestation(
        raw=bytes(raw), protected=protected, payload=payload, signature=signature, kid=kid, alg=alg
    )


def verify_signature(parsed: ParsedAttestation, public_key: Ed25519PublicKey) -> None:
    """Step 6: Ed25519 over the Sig_structure; raises `bad_signature`."""
    try:
        public_key.verify(parsed.signature, sig_structure(parsed.protected, parsed.payload))
    except InvalidSignature as e:
        raise AttestationError(Code.BAD_SIGNATURE, "signature does not verify under the attester key") from e
