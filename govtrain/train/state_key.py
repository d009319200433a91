"""The run state's authentication: a MAC under a key only the ledger's signer holds (issue 34, review of item 3).

The run state (`state_file`) holds what a resumed run trusts: its place in the run (`step`), its epoch's plan, its
sampling key, its consent, its weights. Whoever can write the output folder as the run's user can write any file
govtrain's own writer would write, so "exactly what govtrain writes" proves nothing about who wrote it. What the
folder's writer does not hold is the ledger's private signing key: the process that writes a run state (the run's
lead) always holds it, since it signs every spend. So the state carries HMAC-SHA256 under a key derived from it:

- **the key**: HKDF-SHA256 over the raw bytes of the ledger's Ed25519 private key, with info naming this format and
  the ledger (`Ledger.identity`: the policy's origin and the leaf hash of its header), so that no other use of the
  ledger key, and no other ledger, shares it. It is never written, logged or shown (`repr` leaves it out).
- **the input**: the ledger identity again (of the ledger opened, never of the file), then each part of the file the
  reader decodes, length-prefixed (`state_file`: the format, the state's JSON text, which names the run's id and
  lease, the tensor table, the tensor bytes). Verified in constant time before any field is decoded.

So a state written by another key, for another ledger, or edited after it was written is refused
(`run_state_invalid`); a state cannot be moved to another ledger. An older state of the same run, written by the
same key, still verifies: a rollback brings its own older weights and step, and can only redo steps the ledger
already charged (docs/threat-model.md). A ledger whose key was rotated (`govtrain ledger policy` with a new key)
no longer verifies the states written under the old one: finish a run before rotating its ledger's key.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from typing import Iterable

INFO = b"govtrain-run-state/1"
MAC_BYTES = 32


def _framed(parts: Iterable[bytes]) -> bytes:
    return b"".join(len(part).to_bytes(8, "big") + part for part in parts)


@dataclass(frozen=True, kw_only=True)
class StateKey:
    """The run state's MAC key for one ledger: `StateKey.of(ledger)` (the lead's) or `StateKey.derive`."""

    identity: tuple[str, bytes]  # the ledger's (origin, header leaf hash)
    secret: bytes = field(repr=False)

    @classmethod
    def derive(cls, private_key, identity: tuple[str, bytes]) -> "StateKey":  # type: ignore[no-untyped-def]
        """The key for the ledger `identity` from its Ed25519 `private_key` (cryptography's)."""
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF

        raw = private_key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                        serialization.NoEncryption())
        origin, header = identity
        info = INFO + _framed([origin.encode(), header])
        secret = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(raw)
        return cls(identity=(origin, header), secret=secret)

    @classmethod
    def of(cls, ledger) -> "StateKey":  # type: ignore[no-untyped-def]
        """The key of the open `ledger` (its signing key: `key_missing` without one)."""
        return cls.derive(ledger.signing_key(), ledger.identity)

    def mac(self, parts: Iterable[bytes]) -> bytes:
        """HMAC-SHA256 over this ledger's identity and `parts`, each length-prefixed."""
        origin, header = self.identity
        return hmac.new(self.secret, _framed([INFO, origin.encode(), header, *parts]), hashlib.sha256).digest()


__all__ = ["StateKey", "MAC_BYTES"]
