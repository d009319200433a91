"""The CDDL schemas describe exactly what govtrain writes, checked by an independent validator (pycddl)."""

from __future__ import annotations

import re

import pycddl
import pytest

from govtrain.encoding import cbor
from govtrain.ledger.ledger import Ledger
from tests.conftest import REPO, Corpus, sign_raw

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
