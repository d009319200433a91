"""The CDDL schemas describe exactly what govtrain writes, checked by an independent validator (pycddl)."""

from __future__ import annotations

import re

import pycddl
import pytest

from govtrain.encoding import cbor
from govtrain.ledger.ledger import Ledger
from govtrain.verify.verifier import verify_ledger
from tests.conftest import REPO, Corpus, lease, noise_groups_for, sign_raw

DESCRIPTOR = (REPO / "schemas" / "descriptor.cddl").read_text()
ATTESTATION = (REPO / "schemas" / "attestation.cddl").read_text() + "\n" + DESCRIPTOR
LEDGER = (REPO / "schemas" / "ledger.cddl").read_text()


def _invalid(schema: pycddl.Schema, data: bytes) -> None:
    with pytest.raises(Exception):
        schema.validate_cbor(data)


def _rooted(text: str, rule: str) -> pycddl.Schema:
    """pycddl validates against the first rule; put `rule` first."""
    return pycddl.Schema(f"root-rule = {rule}\n{text}")


def _validate_attestation(cose: bytes) -> None:
    """pycddl 0.6 misapplies `.cbor` inside arrays to the items after it, so validate in two layers:
    the envelope with `.cbor` controls read as plain `bstr`, then each embedded item against its rule."""
    envelope = re.sub(r"bstr \.cbor [a-z-]+", "bstr", ATTESTATION)
    pycddl.Schema(envelope).validate_cbor(cose)
    protected, _, payload, _ = cbor.decode(cose, tags={18}).value
    _rooted(ATTESTATION, "protected-header").validate_cbor(protected)
    _rooted(ATTESTATION, "descriptor").validate_cbor(payload)


def test_descriptor_and_attestation_match_their_cddl(corpus: Corpus):
    data = corpus.data("s.jsonl")
    cose = corpus.attestation(data)
    descriptor = cbor.encode(corpus.descriptor_map(data))
    pycddl.Schema(DESCRIPTOR).validate_cbor(descriptor)
    _validate_attestation(cose)

    _invalid(pycddl.Schema(DESCRIPTOR), cbor.encode({**corpus.descriptor_map(data), "extra": 1}))
    _invalid(pycddl.Schema(DESCRIPTOR), cbor.encode({**corpus.descriptor_map(data), "salt": b"short"}))
    with pytest.raises(Exception):
        _validate_attestation(sign_raw(descriptor, corpus.attester, tag=17))
    with pytest.raises(Exception):
        _validate_attestation(sign_raw(descriptor, corpus.attester, protected=cbor.encode({1: -7, 4: bytes(32)})))


def test_ledger_entries_match_their_cddl(corpus: Corpus):
    from govtrain.gate.admission import admit

    data = corpus.data("l.jsonl")
    with corpus.open() as ledger:
        admit(ledger, corpus.attestation(data), data, now=corpus.now)
    with Ledger.open(corpus.url) as ledger:
        entries = list(ledger.store.entries())
    schema = pycddl.Schema(LEDGER)
    assert [e.kind for e in entries] == ["header", "admit"]
    for entry in entries:
        schema.validate_cbor(entry.body)
    broken = cbor.decode(entries[1].body)
    broken["kind"] = "admitted"
    _invalid(schema, cbor.encode(broken))


def test_every_entry_kind_matches_its_cddl(corpus: Corpus):
    from govtrain.gate.admission import admit
    from govtrain.accounting.spend import spend_epsilon_u
    from govtrain.ledger.entries import SPECS, run_entry, spend_entry

    data = corpus.data("k.jsonl")
    with corpus.open() as ledger:
        admit(ledger, corpus.attestation(data, contribution_id="k"), data, now=corpus.now)
        leaf = ledger.store.entry(1).leaf_hash
        groups = noise_groups_for(ledger, ["k"])
        eps_u = spend_epsilon_u("prv", 10_000_000, [(10_000, 1_000_000, 5)])  # what the verifier recomputes
        with ledger.append(corpus.now) as appender:
            appender.add("spend", corpus.now, lambda seq: spend_entry(
                seq, corpus.now, contribution_id="k", admit_leaf=leaf, run_id="t-trial-0", run_nonce=lease("t-trial-0"),
                epoch=0, epoch_steps=5, steps=5, sampling_rate_u=10_000, noise_multiplier_u=1_000_000, accountant="prv",
                delta_p=10_000_000, privacy_unit="example", eps_u=eps_u, noise_groups=groups))
            appender.add("run", corpus.now, lambda seq: run_entry(
                seq, corpus.now, run_id="t-trial-0", run_nonce=lease("t-trial-0"), mechanism="dpsgd", device="cpu", precision="fp32", config_sha256=bytes(32), base_model_sha256=bytes(32),
                adapter_sha256=None))
        ledger.record_tune(tune_id="t", config_sha256=bytes(32), grid_sha256=bytes(32),
                           trials=[("t-trial-0", bytes(32))], selection_sha256=bytes(32), metric="accuracy",
                           selected_run_id=None, now=corpus.now)
        ledger.withdraw("k", "test", now=corpus.now)
        ledger.change_policy(ledger.policy, bytes(32), "same policy, restated", now=corpus.now)
        ledger.close_epoch(now=corpus.now)
        ledger.close_epoch(now=corpus.now)
        before = list(ledger.store.entries())  # validated before compaction drops some bodies
        ledger.compact(1, now=corpus.now)
        after = list(ledger.store.entries())
    schema = pycddl.Schema(LEDGER)
    for entry in before + after[len(before):]:
        schema.validate_cbor(entry.body)
    assert {e.kind for e in before + after} == set(SPECS)
    assert verify_ledger(corpus.url).redacted == 3
