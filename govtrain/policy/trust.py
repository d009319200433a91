"""The trust store: which attester keys may attest which classes (docs/design.md §3, §4).

Built from a policy, it screens every key again (`check_public_key`) as it enters, so
a small-order key in a policy or a tampered ledger header can never verify anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from govtrain.attest.keys import check_public_key, key_id
from govtrain.errors import AttestationError, Code


@dataclass(frozen=True, slots=True)
class TrustedKey:
    name: str
    kid: bytes
    public_key: Ed25519PublicKey
    classes: frozenset[str]


class TrustStore:
    def __init__(self, keys: Iterable[tuple[str, bytes, Iterable[str]]]) -> None:
        """`keys`: (name, raw 32-byte public key, classes it may attest). Raises bad_public_key."""
        entries: dict[bytes, TrustedKey] = {}
        for name, raw, classes in keys:
            check_public_key(raw)
            kid = key_id(raw)
            if kid in entries:
                raise ValueError(f"attester key {name!r} is listed twice")
            entries[kid] = TrustedKey(name, kid, Ed25519PublicKey.from_public_bytes(raw), frozenset(classes))
        self._keys: Mapping[bytes, TrustedKey] = entries

    @classmethod
    def from_policy(cls, policy) -> "TrustStore":
        return cls((a.name, a.public_key, a.classes) for a in policy.attesters)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, kid: bytes) -> bool:
        return kid in self._keys

    def key(self, kid: bytes) -> TrustedKey:
        """The trusted key named by `kid`, or `unknown_key`."""
        try:
            return self._keys[kid]
        except KeyError:
            raise AttestationError(Code.UNKNOWN_KEY, f"kid {kid.hex()[:16]}… names no trusted attester key") from None

    def authorize(self, key: TrustedKey, data_class: str) -> None:
        if data_class not in key.classes:
            raise AttestationError(
                Code.KEY_NOT_AUTHORIZED, f"attester {key.name!r} is not trusted to attest class {data_class!r}"
            )
