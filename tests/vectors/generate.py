"""Regenerate govtrain's own test vectors from fixed keys, a fixed clock and a fixed salt.

    python -m tests.vectors.generate        # rewrites tests/vectors/attestation-v1.* and rights-v1.*

Ed25519 is deterministic, so the output is byte-identical every time; tests/test_vectors.py
checks that it is.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from govtrain.attest.cose import sign_attestation
from govtrain.attest.descriptor import Descriptor
from govtrain.serve.rights import issue_rights, to_header

HERE = Path(__file__).resolve().parent
# RFC 8032 §7.1 TEST 1 secret key: public, so these vectors prove nothing about real keys.
SECRET = bytes.fromhex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")
DATA = b'{"text": "a fixed example", "label": 1}\n{"text": "another", "label": 0}\n'
CLOCK = 1_767_225_600  # 2026-01-01T00:00:00Z


def build() -> dict[str, bytes]:
    key = Ed25519PrivateKey.from_private_bytes(SECRET)
    descriptor = Descriptor(
        contribution_id="vector-1", contributor="vectors@govtrain.invalid", data_class="public",
        data_sha256=hashlib.sha256(DATA).digest(), records=2, clip_norm_u=1_000_000,
        noise_multiplier_u=1_100_000, eps_budget_u=3_000_000, not_before=CLOCK, not_after=CLOCK + 30 * 86_400,
        issued_at=CLOCK, salt=bytes(range(16)),
    )
    cose = sign_attestation(descriptor, key)
    summary = {
        "secret_key": SECRET.hex(),
        "clock": CLOCK,
        "descriptor_hex": descriptor.signed_bytes().hex(),
        "descriptor_sha256": hashlib.sha256(descriptor.signed_bytes()).hexdigest(),
        "attestation_sha256": hashlib.sha256(cose).hexdigest(),
    }
    rights, claims = issue_rights(key, subject="caller@govtrain.invalid", audience="vectors.govtrain.invalid/gate",
                                  classes=["public", "sensitive"], sessions=["session-1"], valid_seconds=3600,
                                  now=CLOCK, rights_id=bytes(range(16, 32)))
    rights_summary = {"secret_key": SECRET.hex(), "clock": CLOCK, "claims_hex": claims.signed_bytes().hex(),
                      "envelope_sha256": hashlib.sha256(rights).hexdigest()}
    return {
        "rights-v1.token": (to_header(rights) + "\n").encode(),
        "rights-v1.json": (json.dumps(rights_summary, indent=2, sort_keys=True) + "\n").encode(),
        "attestation-v1.jsonl": DATA,
        "attestation-v1.cose": cose,
        "attestation-v1.json": (json.dumps(summary, indent=2, sort_keys=True) + "\n").encode(),
    }


if __name__ == "__main__":
    for name, content in build().items():
        (HERE / name).write_bytes(content)
        print(f"wrote tests/vectors/{name}")
