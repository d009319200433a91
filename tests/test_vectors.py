"""govtrain's own attestation vector: regenerating it is byte-identical, and the gate accepts it."""

from __future__ import annotations

import json

from govtrain.attest.descriptor import Descriptor
from govtrain.attest.keys import raw_public_key
from govtrain.gate.gate import Gate
from govtrain.policy.trust import TrustStore
from tests.vectors.generate import CLOCK, HERE, build


def test_regenerating_vectors_is_byte_identical():
    for name, content in build().items():
        assert (HERE / name).read_bytes() == content, f"{name} drifted: rerun python -m tests.vectors.generate"


def test_vector_verifies(corpus):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    summary = json.loads((HERE / "attestation-v1.json").read_text())
    key = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(summary["secret_key"]))
    with corpus.open() as ledger:
        gate = Gate(ledger.policy, trust=TrustStore([("rfc8032-test-1", raw_public_key(key.public_key()),
                                                      ["public"])]))
    verified = gate.verify((HERE / "attestation-v1.cose").read_bytes(), now=CLOCK + 10)
    assert verified.descriptor_sha256.hex() == summary["descriptor_sha256"]
    assert verified.descriptor == Descriptor.from_bytes(bytes.fromhex(summary["descriptor_hex"]))
