"""Rights envelopes: what a caller may draw on at inference, signed by an issuer (schemas/rights.cddl).

    envelope = #6.18([protected: bstr .cbor {1: -8, 3: "application/govtrain.rights+cbor", 4: kid},
                      unprotected: {}, payload: bstr .cbor rights, signature: bstr .size 64])
    rights   = {"v": 1, "subject": tstr, "audience": tstr, "classes": [* tstr], "sessions": [* tstr],
                "not_before": uint, "not_after": uint, "issued_at": uint, "rights_id": bstr .size 16}

The COSE_Sign1 layout is the attestation's (`govtrain.attest.cose`: canonical CBOR, trailing bytes refused, the
signature over ``["Signature1", protected, h'', payload]``); the content type is required, so that no other
message an issuer's key signed can pass for rights. A request carries the envelope's bytes in the HTTP header
``Govtrain-Rights`` as unpadded base64url (RFC 4648 §5). `subject` is the caller (sessions are bound to it),
`audience` the deployment (inference.toml's `audience`), `classes` the admissibility classes whose training the
caller may draw on, `sessions` the split-inference session ids it covers.

Issuer keys are screened for prime order when the inference policy names them (`govtrain.attest.keys`), so no
small-order key, under which OpenSSL accepts forged signatures, ever verifies an envelope.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import secrets
from dataclasses import dataclass
from typing import Iterable, Mapping

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from govtrain.attest.cose import H_CONTENT_TYPE, parse_sign1, sign_sign1, verify_signature
from govtrain.attest.descriptor import CLASS_NAME
from govtrain.encoding import cbor
from govtrain.encoding.fields import check_shape
from govtrain.errors import Code, ConfigError, ServeError

VERSION = 1
CONTENT_TYPE = "application/govtrain.rights+cbor"
HEADER = "Govtrain-Rights"
RIGHTS_ID_BYTES = 16
MAX_ENVELOPE_BYTES = 4096  # a header, not a body: 64 classes and 64 sessions fit with room to spare
MAX_ITEMS = 64
SUBJECT = re.compile(r"[A-Za-z0-9._:@+-]{1,128}")
AUDIENCE = re.compile(r"[A-Za-z0-9._~:/@+-]{1,255}")
SESSION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")  # as split inference names sessions
_BASE64URL = re.compile(r"[A-Za-z0-9_-]+")

_SPEC = {"v": int, "subject": str, "audience": str, "classes": list, "sessions": list, "not_before": int,
         "not_after": int, "issued_at": int, "rights_id": bytes}


@dataclass(frozen=True, slots=True, kw_only=True)
class Rights:
    """The claims of a rights envelope. `signed_bytes` is the one function that gives the bytes an issuer signs."""

    subject: str
    audience: str
    classes: tuple[str, ...]
    sessions: tuple[str, ...]
    not_before: int
    not_after: int
    issued_at: int
    rights_id: bytes
    v: int = VERSION

    def __post_init__(self) -> None:
        _check_values(self)

    def signed_bytes(self) -> bytes:
        return cbor.encode({name: list(value) if isinstance(value, tuple) else value
                            for name in _SPEC for value in (getattr(self, name),)})

    @classmethod
    def from_bytes(cls, payload: bytes) -> "Rights":
        """Strictly decode a received payload: canonical CBOR, exactly the fields of schemas/rights.cddl."""
        fields = check_shape(cbor.decode(payload), _SPEC, what="rights", error=ServeError)
        for name in ("classes", "sessions"):
            if any(type(item) is not str for item in fields[name]):
                raise ServeError(Code.WRONG_TYPE, f"rights.{name} must be an array of text strings")
        return cls(**{**fields, "classes": tuple(fields["classes"]), "sessions": tuple(fields["sessions"])})


def _check_values(r: Rights) -> None:
    def bad(detail: str) -> ServeError:
        return ServeError(Code.BAD_VALUE, f"rights.{detail}")

    if r.v != VERSION:
        raise ServeError(Code.UNSUPPORTED_VERSION, f"rights version {r.v} is not supported (expected {VERSION})")
    if not SUBJECT.fullmatch(r.subject):
        raise bad("subject must be 1-128 characters from [A-Za-z0-9._:@+-]")
    if not AUDIENCE.fullmatch(r.audience):
        raise bad("audience must be 1-255 characters from [A-Za-z0-9._~:/@+-]")
    for name, pattern in (("classes", CLASS_NAME), ("sessions", SESSION_ID)):
        items = getattr(r, name)
        if len(items) > MAX_ITEMS:
            raise bad(f"{name} holds {len(items)} items; at most {MAX_ITEMS}")
        if any(not pattern.fullmatch(item) for item in items):
            raise bad(f"{name}: every item must match {pattern.pattern}")
        if list(items) != sorted(set(items)):  # one order, so that one set of rights has one encoding
            raise bad(f"{name} must be sorted and hold each item once")
    if len(r.rights_id) != RIGHTS_ID_BYTES:
        raise bad(f"rights_id must be {RIGHTS_ID_BYTES} bytes")


@dataclass(frozen=True, slots=True, kw_only=True)
class Issuer:
    """A key the inference policy trusts to issue rights: its name, raw public key (screened) and, where the policy
    limits it, the classes it may grant (None: any)."""

    name: str
    public_key: bytes
    classes: frozenset[str] | None = None

    @property
    def kid(self) -> bytes:
        from govtrain.attest.keys import key_id

        return key_id(self.public_key)


@dataclass(frozen=True, slots=True, kw_only=True)
class VerifiedRights:
    """An envelope that verified: its claims, the issuer that signed it (its policy name and key id), and the
    SHA-256 of its bytes as received."""

    rights: Rights
    issuer: str
    issuer_kid: bytes
    envelope_sha256: bytes

    @property
    def subject(self) -> str:
        return self.rights.subject

    @property
    def owner(self) -> str:
        """Who holds the split sessions this envelope opens: the subject *as named by this issuer's key*,
        `KID_HEX/subject`. Each issuer names its own subjects, so another issuer's "alice" is someone else (a
        subject holds no "/", so the two parts never run together)."""
        return session_owner(self.issuer_kid, self.rights.subject)

    @property
    def classes(self) -> frozenset[str]:
        return frozenset(self.rights.classes)


def session_owner(issuer_kid: bytes, subject: str) -> str:
    """The owner a split session is bound to: (the issuer's key id, the subject it named), as one string."""
    return f"{issuer_kid.hex()}/{subject}"


# -- issuing ----------------------------------------------------------------------------------------------------


def issue_rights(private_key: Ed25519PrivateKey, *, subject: str, audience: str, classes: Iterable[str],
                 sessions: Iterable[str] = (), valid_seconds: int, now: int,
                 rights_id: bytes | None = None) -> tuple[bytes, Rights]:
    """A signed rights envelope (its COSE_Sign1 bytes) for `subject` at `audience`, valid from `now` for
    `valid_seconds`, and the claims it carries. `rights_id` is random unless given (test vectors fix it)."""
    if not isinstance(valid_seconds, int) or valid_seconds < 1:
        raise ConfigError(Code.BAD_ARGUMENT, "a rights envelope is valid for at least one second")
    try:
        rights = Rights(subject=subject, audience=audience, classes=tuple(sorted(set(classes))),
                        sessions=tuple(sorted(set(sessions))), not_before=now, not_after=now + valid_seconds,
                        issued_at=now, rights_id=secrets.token_bytes(RIGHTS_ID_BYTES) if rights_id is None
                        else rights_id)
    except ServeError as e:
        raise ConfigError(Code.BAD_ARGUMENT, e.detail) from e
    return sign_sign1(rights.signed_bytes(), private_key, content_type=CONTENT_TYPE), rights


def to_header(envelope: bytes) -> str:
    """The `Govtrain-Rights` header value: the envelope in unpadded base64url."""
    return base64.urlsafe_b64encode(envelope).rstrip(b"=").decode("ascii")


def from_header(value: str | None) -> bytes:
    """The envelope's bytes from a `Govtrain-Rights` header value; `rights_missing` or `rights_unreadable`."""
    if value is None or not value.strip():
        raise ServeError(Code.RIGHTS_MISSING, f"no {HEADER} header: send the rights envelope your issuer signed "
                                              "(`govtrain rights issue`), base64url, in that header")
    value = value.strip()
    if len(value) > (MAX_ENVELOPE_BYTES * 4 + 2) // 3 or not _BASE64URL.fullmatch(value) or len(value) % 4 == 1:
        raise ServeError(Code.RIGHTS_UNREADABLE, f"the {HEADER} header is not one unpadded base64url token of at most "
                                                 f"{MAX_ENVELOPE_BYTES} bytes")
    try:
        raw = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))
    except (binascii.Error, ValueError) as e:
        raise ServeError(Code.RIGHTS_UNREADABLE, f"the {HEADER} header is not base64url ({e})") from None
    if to_header(raw) != value:  # non-zero padding bits: one envelope, one header
        raise ServeError(Code.RIGHTS_UNREADABLE, f"the {HEADER} header is not the canonical base64url of its bytes")
    return raw


# -- verifying --------------------------------------------------------------------------------------------------


def verify_rights(envelope: bytes, *, issuers: Mapping[bytes, Issuer], audience: str, now: int,
                  clock_skew_s: int, max_validity_s: int) -> VerifiedRights:
    """Verify a rights envelope (its bytes, as received) against the issuers by kid, the deployment's `audience`
    and the injected clock; return its claims or raise with the first broken rule's code."""
    # 1-4. Strict CBOR, COSE_Sign1 structure and headers (RFC 9052 §4.2; docs/design.md §2-3).
    parsed = parse_sign1(envelope, content_type=CONTENT_TYPE, what="a rights envelope", signer="issuer",
                         hint=f"send the envelope `govtrain rights issue` wrote, base64url, in the {HEADER} header")
    if H_CONTENT_TYPE not in cbor.decode(parsed.protected):
        raise ServeError(Code.BAD_HEADER, f"a rights envelope's protected header names its content type "
                                          f"(3: {CONTENT_TYPE!r})")
    # 5. The kid names an issuer of this deployment (a key from elsewhere is the wrong issuer).
    issuer = issuers.get(parsed.kid)
    if issuer is None:
        raise ServeError(Code.UNKNOWN_KEY, f"the envelope's issuer key (kid {parsed.kid.hex()[:16]}…) is not one "
                                           "this deployment's inference policy names")
    # 6. Ed25519 over the Sig_structure (RFC 9052 §4.4), before the payload is read.
    verify_signature(parsed, Ed25519PublicKey.from_public_bytes(issuer.public_key))
    # 7. The payload: canonical CBOR with exactly the claims of schemas/rights.cddl.
    rights = Rights.from_bytes(parsed.payload)
    # 8. Issued for this deployment.
    if rights.audience != audience:
        raise ServeError(Code.WRONG_AUDIENCE, f"the envelope is for {rights.audience!r}, this deployment is "
                                              f"{audience!r}")
    # 9. Validity window against the injected clock, with the policy's skew.
    if rights.not_after < rights.not_before or rights.issued_at > rights.not_after:
        raise ServeError(Code.BAD_WINDOW, "the envelope's not_after is before its not_before or its issued_at")
    if rights.issued_at > now + clock_skew_s:
        raise ServeError(Code.ISSUED_IN_FUTURE, f"the envelope was issued {rights.issued_at - now} s in the future")
    if now + clock_skew_s < rights.not_before:
        raise ServeError(Code.NOT_YET_VALID, f"the envelope is valid only from {rights.not_before} (now {now})")
    if now - clock_skew_s > rights.not_after:
        raise ServeError(Code.EXPIRED, f"the envelope expired at {rights.not_after} (now {now}): ask its issuer for "
                                       "a new one")
    if rights.not_after - rights.not_before > max_validity_s:
        raise ServeError(Code.WINDOW_TOO_LONG, f"the envelope's window of {rights.not_after - rights.not_before} s "
                                               f"exceeds the policy's {max_validity_s} s")
    # 10. The issuer may grant every class it granted.
    if issuer.classes is not None and not set(rights.classes) <= issuer.classes:
        extra = sorted(set(rights.classes) - issuer.classes)
        raise ServeError(Code.KEY_NOT_AUTHORIZED, f"issuer {issuer.name!r} may not grant class(es) {', '.join(extra)}")
    return VerifiedRights(rights=rights, issuer=issuer.name, issuer_kid=issuer.kid,
                          envelope_sha256=hashlib.sha256(envelope).digest())
