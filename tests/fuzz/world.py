"""A fixed world the harnesses parse against: keys.example's keys, the test policy, a small ledger, a fixed clock.

Built once per process in a temporary folder (`world()`); nothing here downloads or reads the network.
"""

from __future__ import annotations

import functools
import hashlib
import sqlite3
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from govtrain.attest.cose import sign_attestation
from govtrain.attest.descriptor import Descriptor
from govtrain.attest.keys import load_private_key, raw_public_key
from govtrain.gate.admission import admit
from govtrain.gate.gate import Gate
from govtrain.ledger.checkpoint import NoteKey
from govtrain.ledger.ledger import Ledger
from govtrain.policy.config import load_policy
from govtrain.policy.model import Policy
from govtrain.policy.trust import TrustStore
from tests.conftest import KEYS_EXAMPLE, TEST_POLICY, append_runs, copy_demo_keys

NOW = 1_700_000_000
ORIGIN = "test.invalid/govtrain/1"


@dataclass(frozen=True)
class World:
    dir: Path
    policy: Policy
    policy_path: Path
    attester: Ed25519PrivateKey
    ledger_key: Ed25519PrivateKey
    issuer: Ed25519PrivateKey
    release: Ed25519PrivateKey
    ledger_db: bytes  # a ledger (header, two admits, two runs, a withdrawal), checkpointed, its triggers dropped
    entries: int
    attestations: tuple[bytes, ...]
    proof: str  # an inclusion proof of the first admit entry, in c2sp.org/tlog-proof@v1 text
    checkpoint: str  # the ledger's last checkpoint note

    def gate(self) -> Gate:
        """A gate with an empty attestation cache (each input verified afresh) and the policy's screened keys."""
        return Gate(self.policy, trust=_trust(self.policy))

    @property
    def note_key(self) -> NoteKey:
        return _note_key(raw_public_key(self.ledger_key.public_key()))


_TRUST: dict[int, TrustStore] = {}


def _trust(policy: Policy) -> TrustStore:
    """The policy's trust store, built once: screening its keys is what costs (policies do not hash)."""
    if id(policy) not in _TRUST:
        _TRUST[id(policy)] = TrustStore.from_policy(policy)
    return _TRUST[id(policy)]


@functools.cache
def _note_key(public_key: bytes) -> NoteKey:
    return NoteKey(ORIGIN, public_key)


def descriptor_map(data: bytes, name: str, **overrides: object) -> dict:
    fields = {
        "v": 1, "contribution_id": name, "contributor": "alice@example.org", "data_class": "public",
        "data_sha256": hashlib.sha256(data).digest(), "records": data.count(b"\n"), "clip_norm_u": 1_000_000,
        "noise_multiplier_u": 1_000_000, "eps_budget_u": 5_000_000, "not_before": NOW - 60,
        "not_after": NOW + 7 * 86_400, "issued_at": NOW - 60, "salt": hashlib.sha256(name.encode()).digest()[:16],
    }
    fields.update(overrides)
    return fields


@functools.cache
def world() -> World:
    root = Path(tempfile.mkdtemp(prefix="govtrain-fuzz-"))
    keys = copy_demo_keys(root / "keys")
    for name in ("issuer.key", "issuer.pub"):
        (keys / name).write_bytes((KEYS_EXAMPLE / name).read_bytes())
    (keys / "issuer.key").chmod(0o600)
    (keys / "limited.pub").write_bytes((KEYS_EXAMPLE / "issuer.pub").read_bytes())
    policy_path = keys / "test-policy.toml"
    policy_path.write_text(TEST_POLICY)
    policy, digest = load_policy(policy_path)
    attester = load_private_key(keys / "attester.key")
    url = f"sqlite:///{root / 'ledger.db'}"
    Ledger.init(url, policy, digest, key_path=keys / "ledger.key", now=NOW - 3600).close()
    attestations = []
    with Ledger.open(url) as ledger:
        for index in range(2):
            data = root / f"c{index}.jsonl"
            data.write_bytes(b"".join(b'{"text": "example %d %d", "label": %d}\n' % (index, i, i % 2) for i in range(3)))
            raw = sign_attestation(Descriptor(**descriptor_map(data.read_bytes(), f"c{index}")), attester)
            attestations.append(raw)
            admit(ledger, raw, data, now=NOW)
        append_runs(ledger, 2, NOW)
        ledger.withdraw("c1", "fuzz world", now=NOW)
        proof = ledger.prove("c0").text()
        entries = ledger.size()
    db = root / "ledger.db"
    with sqlite3.connect(db) as connection:
        connection.execute("DROP TRIGGER IF EXISTS entries_no_update")
        checkpoint = connection.execute("SELECT note FROM checkpoints ORDER BY id DESC LIMIT 1").fetchone()[0]
    connection.close()
    return World(dir=root, policy=policy, policy_path=policy_path, attester=attester,
                 ledger_key=load_private_key(keys / "ledger.key"), issuer=load_private_key(keys / "issuer.key"),
                 release=load_private_key(keys / "release.key"), ledger_db=db.read_bytes(), entries=entries,
                 attestations=tuple(attestations), proof=proof, checkpoint=checkpoint)

