"""Fuzzing the strict CBOR decoder, descriptors and COSE_Sign1 attestations (docs/fuzzing.md).

Targets: `cbor` (govtrain.encoding.cbor.decode, then the oracle: what decodes re-encodes to the same bytes),
`descriptor` (Descriptor.from_bytes: the regex fast path and the full decoder must agree), `attestation` (a `.cose`
file through Gate.verify: decoding, headers, kid, signature, descriptor, policy) and `signed_descriptor` (bytes an
authorised attester signed as its payload, through Gate.verify: what a trusted key can still send).
"""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from govtrain.attest.cose import CONTENT_TYPE, sign_sign1
from govtrain.attest.descriptor import Descriptor
from govtrain.encoding import cbor
from govtrain.encoding.cbor import Tag
from tests.fuzz.common import ContractViolation, Target, check, fuzz_settings, main, mutated
from tests.fuzz.world import NOW, descriptor_map, world
from tests.vectors import __file__ as _vectors

VECTORS = Path(_vectors).parent
TAGS = frozenset({18, 1})


def run_cbor(data: bytes) -> None:
    value = cbor.decode(data, tags=TAGS)
    if cbor.encode(value) != data:  # strict: only the bytes `encode` writes are accepted (RFC 8949 §4.2.1)
        raise ContractViolation(f"decode accepted non-canonical bytes {data.hex()}")


def run_descriptor(data: bytes) -> None:
    descriptor = Descriptor.from_bytes(data)
    if Descriptor.from_map(cbor.decode(data)) != descriptor or descriptor.signed_bytes() != data:
        raise ContractViolation(f"the fast and full descriptor paths disagree on {data.hex()}")


def run_attestation(data: bytes) -> None:
    world().gate().verify(data, now=NOW)


def run_signed_descriptor(data: bytes) -> None:
    w = world()
    w.gate().verify(sign_sign1(data, w.attester, content_type=CONTENT_TYPE), now=NOW)


def _descriptor_seeds() -> list[bytes]:
    return [Descriptor(**descriptor_map(b"x\n", f"seed-{i}", records=i + 1)).signed_bytes() for i in range(3)]


def _cose_seeds() -> list[bytes]:
    return [(VECTORS / "attestation-v1.cose").read_bytes(), *world().attestations]


def _cbor_seeds() -> list[bytes]:
    return [*_cose_seeds(), *_descriptor_seeds(), cbor.encode([1, -1, b"", "", {}, [], True, False, None]),
            cbor.encode({1: 2**64 - 1, -2**64: "x", "k": Tag(1, 0)})]


TARGETS = [
    Target("cbor", run_cbor, _cbor_seeds, ("govtrain/encoding/cbor_decoder.py", "govtrain/encoding/cbor_encoder.py")),
    Target("descriptor", run_descriptor, _descriptor_seeds,
           ("govtrain/attest/descriptor.py", "govtrain/encoding/cbor_decoder.py", "govtrain/encoding/cbor_templates.py",
            "govtrain/encoding/fields.py")),
    Target("attestation", run_attestation, _cose_seeds,
           ("govtrain/attest/cose.py", "govtrain/gate/gate.py", "govtrain/attest/descriptor.py"), setup=world),
    Target("signed_descriptor", run_signed_descriptor, _descriptor_seeds,
           ("govtrain/gate/gate.py", "govtrain/attest/descriptor.py", "govtrain/encoding/fields.py"), setup=world),
]

# -- hypothesis: structured inputs ---------------------------------------------------------------------------------

scalars = st.one_of(st.integers(-(2**64), 2**64 - 1), st.binary(max_size=40), st.text(max_size=20), st.booleans(),
                    st.none())
trees = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=5),
                            st.dictionaries(st.one_of(st.integers(-30, 30), st.text(max_size=8)), inner, max_size=5),
                            st.builds(Tag, st.sampled_from([1, 18, 2, 24, 55799]), inner)),
    max_leaves=20,
)


@fuzz_settings()
@given(trees)
def test_cbor_round_trip_or_coded_refusal(tree: object) -> None:
    """Any tree encodes to bytes that decode back to it, or are refused with a code (a tag outside the set)."""
    data = cbor.encode(tree)
    if check(lambda: run_cbor(data)) is None:
        assert cbor.decode(data, tags=TAGS) == tree


@fuzz_settings()
@given(mutated(_cbor_seeds()))
def test_cbor_mutations(data: bytes) -> None:
    check(lambda: run_cbor(data))


@fuzz_settings()
@given(st.fixed_dictionaries({}, optional={name: trees for name in descriptor_map(b"", "x")}).flatmap(
    lambda drop: st.builds(lambda extra: {**descriptor_map(b"x\n", "d"), **drop, **extra},
                           st.dictionaries(st.text(max_size=6), scalars, max_size=2))))
def test_descriptor_fields(fields: dict) -> None:
    """A descriptor whose fields are replaced by random values, plus random extra fields."""
    check(lambda: run_descriptor(cbor.encode(fields)))
    check(lambda: run_signed_descriptor(cbor.encode(fields)))


@fuzz_settings()
@given(mutated(_descriptor_seeds()))
def test_descriptor_mutations(data: bytes) -> None:
    check(lambda: run_descriptor(data))


@fuzz_settings()
@given(mutated(_cose_seeds()))
def test_attestation_mutations(data: bytes) -> None:
    check(lambda: run_attestation(data))


@fuzz_settings(0.5)
@given(protected=st.one_of(trees, st.dictionaries(st.sampled_from([1, 2, 3, 4, 5, -1]), trees, max_size=4)),
       unprotected=st.one_of(st.just({}), trees), tag=st.sampled_from([18, 16, 1, None]),
       signature=st.one_of(st.binary(min_size=64, max_size=64), st.binary(max_size=70), trees))
def test_cose_structures(protected: object, unprotected: object, tag: int | None, signature: object) -> None:
    """COSE_Sign1 envelopes with random header buckets, tags and signature fields around a valid payload."""
    payload = _descriptor_seeds()[0]
    body = [cbor.encode(protected), unprotected, payload, signature]
    check(lambda: run_attestation(cbor.encode(Tag(tag, body) if tag is not None else body)))


if __name__ == "__main__":
    main(TARGETS)
