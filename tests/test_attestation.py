"""Attestations interoperate with independent COSE code, and no single-byte change survives the gate."""

from __future__ import annotations

import hashlib
import os

import cbor2
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from govtrain.attest.attest import attest
from govtrain.attest.cose import parse_attestation
from govtrain.errors import GovtrainError
from govtrain.gate.admission import admit
from govtrain.gate.gate import Gate
from tests.conftest import Corpus, snapshot


def _independent_sign(corpus: Corpus, data_path, *, alg: int = -8) -> bytes:
    """COSE_Sign1 assembled with cbor2 and cryptography only: no govtrain encoder involved."""
    raw_data = data_path.read_bytes()
    descriptor = {
        "v": 1, "contribution_id": "independent-1", "contributor": "bob", "data_class": "sensitive",
        "data_sha256": hashlib.sha256(raw_data).digest(), "records": 3, "clip_norm_u": 400_000,
        "noise_multiplier_u": 1_200_000, "eps_budget_u": 2_500_000, "not_before": corpus.now - 10,
        "not_after": corpus.now + 86_400, "issued_at": corpus.now - 10, "salt": os.urandom(16),
    }
    public = corpus.attester.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    payload = cbor2.dumps(descriptor, canonical=True)  # text keys only: canonical order is §4.2.1 order
    protected = cbor2.dumps({1: alg, 4: hashlib.sha256(public).digest()}, canonical=True)
    to_sign = cbor2.dumps(["Signature1", protected, b"", payload])
    signature = corpus.attester.sign(to_sign)
    return cbor2.dumps(cbor2.CBORTag(18, [protected, {}, payload, signature]))


@pytest.mark.parametrize("alg", [-8, -19])
def test_independently_built_attestation_is_admitted(corpus: Corpus, alg: int):
    data = corpus.data("independent.jsonl")
    cose = _independent_sign(corpus, data, alg=alg)
    with corpus.open() as ledger:
        receipt = admit(ledger, cose, data, now=corpus.now)
    assert receipt.contribution_id == "independent-1" and receipt.data_class == "sensitive"
    assert receipt.attestation_sha256 == hashlib.sha256(cose).digest()


def test_govtrain_attestation_verifies_with_independent_code(corpus: Corpus, tmp_path):
    data = corpus.data("mine.jsonl", records=4)
    cose, descriptor = attest(data, key=corpus.attester_key, contributor="carol", data_class="public",
                              clip_norm="0.75", noise_multiplier="1.1", eps_budget="6", now=corpus.now)
    top = cbor2.loads(cose)
    assert isinstance(top, cbor2.CBORTag) and top.tag == 18
    protected, unprotected, payload, signature = top.value
    header = cbor2.loads(protected)
    assert header[1] == -8 and unprotected == {}
    public = corpus.attester.public_key()
    raw_public = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert header[4] == hashlib.sha256(raw_public).digest()
    assert header[3] == "application/govtrain.descriptor+cbor"
    Ed25519PublicKey.from_public_bytes(raw_public).verify(
        signature, cbor2.dumps(["Signature1", protected, b"", payload]))
    fields = cbor2.loads(payload)
    assert cbor2.dumps(fields, canonical=True) == payload
    assert fields["data_sha256"] == hashlib.sha256(data.read_bytes()).digest()
    assert (fields["clip_norm_u"], fields["noise_multiplier_u"], fields["eps_budget_u"]) == (750_000, 1_100_000, 6_000_000)
    assert fields["records"] == 4 and fields["contributor"] == "carol"
    assert fields == descriptor.to_map()


def test_attest_rounds_toward_privacy(corpus: Corpus):
    data = corpus.data("round.jsonl")
    _, d = attest(data, key=corpus.attester_key, contributor="x", data_class="public",
                  clip_norm="0.99999999", noise_multiplier="1.0000001", eps_budget="2.9999999", now=corpus.now)
    assert d.clip_norm_u == 999_999  # down
    assert d.noise_multiplier_u == 1_000_001  # up
    assert d.eps_budget_u == 2_999_999  # down


@pytest.fixture(scope="module")
def signed_once(tmp_path_factory):
    """One valid attestation and a gate, shared by the mutation property below."""
    import time

    from govtrain.attest.keys import generate_key_pair, load_private_key
    from govtrain.policy.config import load_policy
    from tests.conftest import TEST_POLICY, copy_demo_keys

    keys = copy_demo_keys(tmp_path_factory.mktemp("mutation"))
    generate_key_pair(keys, "limited")
    (keys / "p.toml").write_text(TEST_POLICY)
    policy, _ = load_policy(keys / "p.toml")
    now = int(time.time())
    corpus = Corpus(dir=keys, policy_path=keys / "p.toml", url="", attester=load_private_key(keys / "attester.key"),
                    limited=load_private_key(keys / "limited.key"), now=now)
    data = corpus.data("m.jsonl")
    cose = corpus.attestation(data)
    gate = Gate(policy)
    gate.verify(cose, now=now)  # the unmodified attestation is valid
    return gate, cose, now


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(position=st.integers(min_value=0), new_byte=st.integers(min_value=0, max_value=255))
def test_any_single_byte_change_is_rejected(signed_once, position, new_byte):
    gate, cose, now = signed_once
    position %= len(cose)
    if cose[position] == new_byte:
        new_byte ^= 0xFF
    mutated = cose[:position] + bytes([new_byte]) + cose[position + 1:]
    gate.cache = type(gate.cache)()  # never let a cached verdict answer for other bytes
    with pytest.raises(GovtrainError):
        gate.verify(mutated, now=now)


def test_every_single_byte_change_is_rejected_exhaustively_for_one_value(signed_once):
    gate, cose, now = signed_once
    for position in range(len(cose)):
        mutated = cose[:position] + bytes([cose[position] ^ 0x01]) + cose[position + 1:]
        with pytest.raises(GovtrainError):
            gate.verify(mutated, now=now)


def test_cache_is_per_epoch_and_keyed_by_bytes(corpus: Corpus):
    data = corpus.data("cached.jsonl")
    cose = corpus.attestation(data)
    with corpus.open() as ledger:
        gate = Gate(ledger.policy)
    first = gate.verify(cose, now=corpus.now, epoch=0)
    assert gate.verify(cose, now=corpus.now, epoch=0) is first and gate.cache.hits == 1
    # Time-dependent checks still run on a cached attestation.
    with pytest.raises(GovtrainError) as info:
        gate.verify(cose, now=corpus.now + 30 * 86_400, epoch=0)
    assert info.value.code.value == "expired"
    # A new epoch starts a fresh cache: the attestation is verified again.
    assert gate.verify(cose, now=corpus.now, epoch=1) is not first


def test_parse_attestation_exposes_kid_and_hash(corpus: Corpus):
    data = corpus.data("parse.jsonl")
    cose = corpus.attestation(data)
    parsed = parse_attestation(cose)
    assert parsed.attestation_sha256() == hashlib.sha256(cose).digest()
    assert len(parsed.kid) == 32 and parsed.alg == -8


def test_admitted_ledger_grows_by_one(corpus: Corpus):
    data = corpus.data("grow.jsonl")
    before = snapshot(corpus.url)
    with corpus.open() as ledger:
        admit(ledger, corpus.attestation(data), data, now=corpus.now)
    after = snapshot(corpus.url)
    assert after[0] == before[0] + 1 and after[2] == before[2] + 1


def test_verify_many_agrees_with_verify(corpus: Corpus):
    good = [corpus.attestation(corpus.data(f"many{i}.jsonl")) for i in range(6)]
    bad_sig = good[1][:-1] + bytes([good[1][-1] ^ 1])
    expired = corpus.attestation(corpus.data("old.jsonl"), not_before=corpus.now - 90 * 86_400,
                                 issued_at=corpus.now - 90 * 86_400, not_after=corpus.now - 80 * 86_400)
    raws = [good[0], bad_sig, b"\x00", good[2], expired, good[0], good[3]]
    with corpus.open() as ledger:
        batch = Gate(ledger.policy).verify_many(raws, now=corpus.now)
        single = Gate(ledger.policy)
    for raw, result in zip(raws, batch):
        try:
            expected = single.verify(raw, now=corpus.now)
        except GovtrainError as error:
            assert isinstance(result, GovtrainError) and result.code == error.code
        else:
            assert not isinstance(result, GovtrainError) and result.descriptor == expected.descriptor
    assert [getattr(r, "code", None) and r.code.value for r in batch] == \
        [None, "bad_signature", "not_cose_sign1", None, "expired", None, None]


def test_verify_many_threaded_matches_single_threaded(corpus: Corpus):
    from govtrain.gate.gate import GatePerformance

    raws = [corpus.attestation(corpus.data(f"t{i}.jsonl")) for i in range(40)]
    raws[7] = raws[7][:-1] + bytes([raws[7][-1] ^ 1])
    raws[23] = raws[23][:-2] + bytes([raws[23][-2] ^ 4]) + raws[23][-1:]
    with corpus.open() as ledger:
        policy = ledger.policy
    one = Gate(policy, performance=GatePerformance(verify_threads=1)).verify_many(raws, now=corpus.now)
    many = Gate(policy, performance=GatePerformance(verify_threads=3, min_parallel_batch=2)).verify_many(
        raws, now=corpus.now)
    codes = lambda results: [getattr(r, "code", None) for r in results]  # noqa: E731
    assert codes(one) == codes(many)
    assert [i for i, r in enumerate(many) if isinstance(r, GovtrainError)] == [7, 23]
