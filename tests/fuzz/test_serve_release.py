"""Fuzzing what reaches the inference gate and a release's auditor: rights envelopes, DSSE release manifests and
split-inference request bodies.

Targets: `rights` (a Govtrain-Rights header value through from_header and verify_rights), `signed_rights` (bytes the
issuer signed as a rights payload: what an issuer's key can still send), `release` (a .dsse file through
verify_release under the pinned release and ledger keys), `signed_release` (a payload the release key signed: the
statement, its predicate, its proof and checkpoint are read without trusting the key holder), `split_wire`
(parse_split_request on a request body) and `serve_body` (parse_body, the JSON reader of `govtrain serve`'s
/v1/classify and /v1/generate, on a request body: any client reaches it).
"""

from __future__ import annotations

import base64
import functools
import json
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given
from hypothesis import strategies as st

from govtrain.attest.cose import sign_sign1
from govtrain.attest.keys import raw_public_key
from govtrain.encoding import cbor
from govtrain.inference.wire import parse_split_request
from govtrain.ledger.merkle import MerkleTree
from govtrain.ledger.proof import InclusionProof
from govtrain.release import dsse
from govtrain.release.verification import verify_release
from govtrain.serve.app import ClassifyRequest, GenerateRequest, parse_body
from govtrain.serve.rights import CONTENT_TYPE, Issuer, from_header, verify_rights
from tests.fuzz.common import Target, check, fuzz_settings, main, mutated
from tests.fuzz.world import world
from tests.vectors import __file__ as _vectors

VECTORS = Path(_vectors).parent
RIGHTS = json.loads((VECTORS / "rights-v1.json").read_text())
RIGHTS_KEY = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(RIGHTS["secret_key"]))
AUDIENCE = "vectors.govtrain.invalid/gate"


@functools.cache
def _issuers() -> dict[bytes, Issuer]:
    issuer = Issuer(name="vectors", public_key=raw_public_key(RIGHTS_KEY.public_key()))
    return {issuer.kid: issuer}


def _verify_rights(envelope: bytes) -> None:
    verify_rights(envelope, issuers=_issuers(), audience=AUDIENCE, now=RIGHTS["clock"], clock_skew_s=60,
                  max_validity_s=30 * 86_400)


def run_rights(data: bytes) -> None:
    _verify_rights(from_header(data.decode("latin-1")))  # an HTTP header value is latin-1 text


def run_signed_rights(data: bytes) -> None:
    _verify_rights(sign_sign1(data, RIGHTS_KEY, content_type=CONTENT_TYPE))


def _release(envelope: bytes) -> None:
    w = world()
    verify_release(envelope, release_key=raw_public_key(w.release.public_key()), ledger_keys=[w.note_key])


def run_release(data: bytes) -> None:
    _release(data)


def run_signed_release(data: bytes) -> None:
    _release(dsse.sign(data, world().release).to_json())


def run_split_wire(data: bytes) -> None:
    parse_split_request(data)


def run_serve_body(data: bytes) -> None:
    """The first byte picks the route's body model (classify or generate); the rest is the body."""
    model = GenerateRequest if data[:1] == b"g" else ClassifyRequest
    parse_body(data[1:], model)


@functools.cache
def _statement() -> bytes:
    """A release statement of the world ledger's run r0 (entry 3), its proof against the latest checkpoint. The run
    entry records no adapter, so verification stops at step 4; what comes before it is what is fuzzed from here."""
    import ledger_store

    from tests.fuzz.test_ledger import _ledger_copy

    store = ledger_store.LedgerStore.open(f"sqlite:///{_ledger_copy()}")
    try:
        entries = list(store.entries())
    finally:
        store.close()
    leaves = [e.leaf_hash for e in entries]
    proof = InclusionProof(entries[3].body, 3, MerkleTree(leaves, len(leaves)).inclusion_proof(3, len(leaves)),
                           world().checkpoint).text()
    hex32 = "ab" * 32
    predicate = {
        "version": 1, "released_at": 1_700_000_000,
        "run": {"run_id": "r0", "seq": 3, "leaf_hash": entries[3].leaf_hash.hex(), "mechanism": "dpsgd",
                "config_sha256": "00" * 32, "adapter_sha256": hex32, "device": "cpu", "precision": "fp32"},
        "ledger": {"origin": "test.invalid/govtrain/1", "checkpoint_size": len(leaves), "proof": proof},
        "base_model": {"name": "tiny", "revision": None, "sha256": "00" * 32},
        "adapter": {"sha256": hex32, "task": "sequence-classification", "adapters": ["default"]},
        "privacy": {"unit": "example", "examples_per_contribution": None, "accountant": "prv", "delta_p": 10_000_000,
                    "mechanism": "dpsgd", "sampling_rates_u": [10_000], "steps": 10},
        "tune": None,
        "classes": [{"data_class": "public", "eps_u": 1_000_000, "contributions": 1, "profile": "fraction 0.5-1.0",
                     "groups": [0], "adapter": None}],
        "groups": [{"classes": [{"data_class": "public", "eps_u": 1_000_000}], "adapters": ["default"], "layers": [1],
                    "heads": [], "experts": [], "outside": ["classifier"], "tensors": 4, "scalars": 1024}],
        "withdrawn": [],
    }
    statement = {"_type": "https://in-toto.io/Statement/v1", "predicateType": "https://govtrain.invalid/release/v1",
                 "subject": [{"name": "adapter_model.safetensors", "digest": {"sha256": hex32}}],
                 "predicate": predicate}
    return json.dumps(statement, sort_keys=True).encode()


SERVE_SEEDS = (b"c" + json.dumps({"texts": ["a good film", "dull"]}).encode(),
               b"g" + json.dumps({"prompt": "once upon", "max_new_tokens": 4}).encode())


def _nested(route: bytes, depth: int, arrays: bool) -> bytes:
    """A body nested `depth` deep (arrays, or objects of one key): small bytes, deep for a recursive reader."""
    if arrays:
        return route + b"[" * depth + b"]" * depth
    return route + b'{"texts":' * depth + b"0" + b"}" * depth


def _split_seed() -> bytes:
    return json.dumps({"session_id": "s-1", "epsilon": 1.0, "delta": 1e-6, "clip_norm": 4.0, "sigma": 12.5,
                       "vector": [0.5, -1.25, 3.0]}).encode()


TARGETS = [
    Target("rights", run_rights, lambda: [(VECTORS / "rights-v1.token").read_bytes().strip()],
           ("govtrain/serve/rights.py", "govtrain/attest/cose.py")),
    Target("signed_rights", run_signed_rights, lambda: [bytes.fromhex(RIGHTS["claims_hex"])],
           ("govtrain/serve/rights.py", "govtrain/encoding/fields.py")),
    Target("release", run_release, lambda: [dsse.sign(_statement(), world().release).to_json()],
           ("govtrain/release/dsse.py", "govtrain/release/verification.py"), setup=world),
    Target("signed_release", run_signed_release, lambda: [_statement()],
           ("govtrain/release/verification.py", "govtrain/release/predicate.py", "govtrain/ledger/proof.py"),
           setup=world),
    Target("split_wire", run_split_wire, lambda: [_split_seed()], ("govtrain/inference/wire.py",)),
    Target("serve_body", run_serve_body, lambda: list(SERVE_SEEDS), ("govtrain/serve/app.py",)),
]

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=12)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=10)


def _set_path(document: object, path: list[int], value: object) -> object:
    """`document` (JSON) with the value at a path (indices into keys/items at each level) replaced by `value`."""
    if not path or not isinstance(document, (dict, list)) or not document:
        return value
    if isinstance(document, dict):
        key = sorted(document)[path[0] % len(document)]
        return {**document, key: _set_path(document[key], path[1:], value)}
    index = path[0] % len(document)
    return [*document[:index], _set_path(document[index], path[1:], value), *document[index + 1:]]


def edited_json(seed: bytes) -> st.SearchStrategy[bytes]:
    return st.builds(lambda path, value: json.dumps(_set_path(json.loads(seed), path, value)).encode(),
                     st.lists(st.integers(0, 50), min_size=1, max_size=6), json_values)


@fuzz_settings()
@given(mutated([(VECTORS / "rights-v1.token").read_bytes().strip()]))
def test_rights_header(data: bytes) -> None:
    check(lambda: run_rights(data))


@fuzz_settings()
@given(st.one_of(mutated([bytes.fromhex(RIGHTS["claims_hex"])]),
                 st.dictionaries(st.sampled_from(["v", "subject", "audience", "classes", "sessions", "not_before",
                                                  "not_after", "issued_at", "rights_id", "x"]),
                                 st.one_of(st.integers(-5, 2**64 - 1), st.text(max_size=10), st.binary(max_size=20),
                                           st.lists(st.one_of(st.text(max_size=8), st.integers(-(2**63), 2**63)), max_size=3)))
                 .map(cbor.encode)))
def test_signed_rights(data: bytes) -> None:
    check(lambda: run_signed_rights(data))


@fuzz_settings(0.5)
@given(st.one_of(mutated([dsse.sign(b"{}", RIGHTS_KEY).to_json()]),
                 st.builds(lambda doc: json.dumps(doc).encode(), json_values),
                 st.builds(lambda sigs: json.dumps({"payload": base64.b64encode(b"{}").decode(),
                                                    "payloadType": dsse.PAYLOAD_TYPE, "signatures": sigs}).encode(),
                           json_values)))
def test_release_envelope(data: bytes) -> None:
    check(lambda: run_release(data))


@fuzz_settings(0.5)
@given(st.one_of(edited_json(_statement()), mutated([_statement()])))
def test_signed_release(data: bytes) -> None:
    check(lambda: run_signed_release(data))


@fuzz_settings()
@given(st.one_of(edited_json(_split_seed()), mutated([_split_seed()]), st.just(b"[" * 5000 + b"]" * 5000),
                 st.just(b'{"epsilon": ' + b"9" * 5000 + b"}")))
def test_split_wire(data: bytes) -> None:
    check(lambda: run_split_wire(data))


@fuzz_settings()
@given(st.one_of(st.sampled_from(SERVE_SEEDS).flatmap(lambda seed: edited_json(seed[1:]).map(seed[:1].__add__)),
                 mutated(SERVE_SEEDS),
                 st.builds(_nested, st.sampled_from([b"c", b"g"]), st.integers(0, 5000), st.booleans())))
def test_serve_body(data: bytes) -> None:
    check(lambda: run_serve_body(data))


if __name__ == "__main__":
    main(TARGETS)
