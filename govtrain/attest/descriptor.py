"""The contribution descriptor (docs/design.md §3, `schemas/descriptor.cddl`).

A descriptor binds a contributor's data file (by SHA-256) to a class, a clipping
norm, a noise multiplier, a budget and a validity window. Its canonical CBOR bytes
are what the attester signs; `Descriptor.signed_bytes` is the one function that
produces them, and a received descriptor is always kept as the bytes that were
verified, never re-encoded.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import unicodedata
from dataclasses import dataclass

from govtrain.encoding import cbor
from govtrain.encoding.fields import check_shape
from govtrain.errors import AttestationError, Code

VERSION = 1
SALT_BYTES = 16
CONTRIBUTION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
CLASS_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
MAX_CONTRIBUTOR_CHARS = 256

_SPEC = {
    "v": int,
    "contribution_id": str,
    "contributor": str,
    "data_class": str,
    "data_sha256": bytes,
    "records": int,
    "clip_norm_u": int,
    "noise_multiplier_u": int,
    "eps_budget_u": int,
    "not_before": int,
    "not_after": int,
    "issued_at": int,
    "salt": bytes,
}


_set = object.__setattr__
_FAST = cbor.FixedMap({
    **{name: {int: "uint", bytes: "bstr", str: "tstr"}[kind] for name, kind in _SPEC.items()},
    "data_sha256": "bstr32",
    "salt": f"bstr{SALT_BYTES}",
})


@dataclass(frozen=True, slots=True, kw_only=True)
class Descriptor:
    contribution_id: str
    contributor: str
    data_class: str
    data_sha256: bytes
    records: int
    clip_norm_u: int
    noise_multiplier_u: int
    eps_budget_u: int
    not_before: int
    not_after: int
    issued_at: int
    salt: bytes
    v: int = VERSION

    def __post_init__(self) -> None:
        _check_values(self)

    def to_map(self) -> dict:
        return {name: getattr(self, name) for name in _SPEC}

    def signed_bytes(self) -> bytes:
        """The canonical CBOR bytes an attester signs (the COSE payload)."""
        return cbor.encode(self.to_map())

    def sha256(self) -> bytes:
        return hashlib.sha256(self.signed_bytes()).digest()

    @classmethod
    def from_map(cls, obj: object) -> "Descriptor":
        check_shape(obj, _SPEC, what="descriptor", error=AttestationError)
        return cls(**obj)  # type: ignore[arg-type]

    @classmethod
    def from_bytes(cls, payload: bytes) -> "Descriptor":
        """Strictly decode and validate a received payload."""
        fields = _FAST.decode(payload)  # exact canonical layout with the right types, or None
        if fields is None:
            return cls.from_map(cbor.decode(payload))
        # The fields are exactly this class's, with the right types: skip the generated __init__.
        descriptor = object.__new__(cls)
        for name, value in fields.items():
            _set(descriptor, name, value)
        _check_values(descriptor)
        return descriptor


def _check_values(d: Descriptor) -> None:
    def bad(detail: str) -> AttestationError:
        return AttestationError(Code.BAD_VALUE, f"descriptor.{detail}")

    if d.v != VERSION:
        raise AttestationError(Code.UNSUPPORTED_VERSION, f"descriptor version {d.v} is not supported (expected 1)")
    if not CONTRIBUTION_ID.fullmatch(d.contribution_id):
        raise bad("contribution_id must be 1-128 characters from [A-Za-z0-9._:-]")
    contributor = d.contributor
    # isprintable() is False for every Cc, Cf, Zl and Zp character, so it settles the common case.
    if not 1 <= len(contributor) <= MAX_CONTRIBUTOR_CHARS or not contributor.isprintable() and any(
        unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp") for ch in contributor
    ):
        raise bad(f"contributor must be 1-{MAX_CONTRIBUTOR_CHARS} printable characters")
    if not CLASS_NAME.fullmatch(d.data_class):
        raise bad("data_class must be 1-64 characters from [A-Za-z0-9._-]")
    if len(d.data_sha256) != 32:
        raise bad("data_sha256 must be 32 bytes")
    if len(d.salt) != SALT_BYTES:
        raise bad("salt must be 16 bytes")
    for key in ("records", "clip_norm_u", "noise_multiplier_u", "eps_budget_u"):
        if getattr(d, key) <= 0:
            raise bad(f"{key} must be greater than 0")


def new_descriptor(
    *,
    contribution_id: str,
    contributor: str,
    data_class: str,
    data_sha256: bytes,
    records: int,
    clip_norm_u: int,
    noise_multiplier_u: int,
    eps_budget_u: int,
    issued_at: int,
    valid_seconds: int,
    salt: bytes | None = None,
) -> Descriptor:
    """A descriptor valid from `issued_at` for `valid_seconds`, with a fresh random salt."""
    return Descriptor(
        contribution_id=contribution_id,
        contributor=contributor,
        data_class=data_class,
        data_sha256=data_sha256,
        records=records,
        clip_norm_u=clip_norm_u,
        noise_multiplier_u=noise_multiplier_u,
        eps_budget_u=eps_budget_u,
        not_before=issued_at,
        not_after=issued_at + valid_seconds,
        issued_at=issued_at,
        salt=secrets.token_bytes(SALT_BYTES) if salt is None else salt,
    )
