"""The fixed-layout fast paths accept nothing the full strict path rejects, and agree on what they accept.

`FixedMap.decode` (descriptors) and `_parse_fast` (COSE envelopes) answer None for anything but the
exact canonical layout; the full path then names the problem. Oracle: for valid inputs and for every
kind of mutation, whenever a fast path accepts, the full path accepts too and returns the same value.
"""

from __future__ import annotations

import hashlib

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from govtrain.attest.cose import _parse_fast, _parse_full, sign_attestation
from govtrain.attest.descriptor import _FAST, _SPEC, Descriptor
from govtrain.encoding import cbor
from govtrain.encoding.fields import check_shape
from govtrain.errors import AttestationError, GovtrainError

KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))

ids = st.from_regex(r"[A-Za-z0-9._:-]{1,40}", fullmatch=True)
u63 = st.integers(min_value=1, max_value=2**63 - 1)
times = st.integers(min_value=0, max_value=2**40)


@st.composite
def descriptors(draw) -> Descriptor:
    return Descriptor(
        contribution_id=draw(ids), contributor=draw(st.from_regex(r"[a-zé水 .@-]{1,60}", fullmatch=True)),
        data_class=draw(st.from_regex(r"[a-z._-]{1,20}", fullmatch=True)), data_sha256=draw(st.binary(min_size=32, max_size=32)),
        records=draw(u63), clip_norm_u=draw(u63), noise_multiplier_u=draw(u63), eps_budget_u=draw(u63),
        not_before=draw(times), not_after=draw(times), issued_at=draw(times), salt=draw(st.binary(min_size=16, max_size=16)),
    )


def _full_descriptor(data: bytes) -> dict | None:
    try:
        value = cbor.decode(data)
        check_shape(value, _SPEC, what="descriptor", error=AttestationError)
        return value
    except GovtrainError:
        return None


def _mutations(data: bytes, position: int, byte: int) -> list[bytes]:
    position %= len(data)
    replaced = data[:position] + bytes([byte]) + data[position + 1 :]
    return [replaced, data[:position], data + bytes([byte]), data[:position] + bytes([byte]) + data[position:]]


@settings(max_examples=300, deadline=None)
@given(descriptors(), st.integers(min_value=0), st.integers(min_value=0, max_value=255))
def test_fixed_map_agrees_with_the_full_decoder(descriptor, position, byte):
    encoded = descriptor.signed_bytes()
    assert _FAST.decode(encoded) == descriptor.to_map() == _full_descriptor(encoded)
    for mutated in _mutations(encoded, position, byte):
        fast = _FAST.decode(mutated)
        if fast is not None:
            assert fast == _full_descriptor(mutated)


def test_fixed_map_declines_a_string_that_contains_the_next_key():
    # "data_sha256" follows "data_class" in canonical order; a class name containing its bytes
    # must still decode correctly (through whichever path).
    d = Descriptor(contribution_id="x", contributor="k", data_class="a", data_sha256=bytes(32), records=1,
                   clip_norm_u=1, noise_multiplier_u=1, eps_budget_u=1, not_before=0, not_after=1, issued_at=0,
                   salt=bytes(16))
    tricky = cbor.encode({**d.to_map(), "contributor": "x" + cbor.encode("data_class").decode() + "y"})
    assert Descriptor.from_bytes(tricky).contributor.startswith("x")
    fast = _FAST.decode(tricky)
    assert fast is None or fast == cbor.decode(tricky)


def test_fixed_map_runs_in_linear_time_on_adversarial_input():
    import time

    evil = b"\xad" + cbor.encode("v") + b"\x01" + cbor.encode("salt") + b"\x50" + (cbor.encode("records") * 3000)
    start = time.perf_counter()
    assert _FAST.decode(evil[: 60_000]) is None
    assert time.perf_counter() - start < 1.0


@settings(max_examples=200, deadline=None)
@given(descriptors(), st.booleans(), st.integers(min_value=0), st.integers(min_value=0, max_value=255))
def test_envelope_fast_path_agrees_with_the_full_parser(descriptor, content_type, position, byte):
    raw = sign_attestation(descriptor, KEY, with_content_type=content_type)
    assert _parse_fast(raw) == _parse_full(raw)
    for mutated in _mutations(raw, position, byte):
        fast = _parse_fast(mutated)
        if fast is not None:
            assert fast == _parse_full(mutated)


@pytest.mark.parametrize("alg", [-8, -19])
def test_envelope_fast_path_takes_both_algorithms(alg):
    descriptor = Descriptor(contribution_id="a", contributor="b", data_class="c", data_sha256=bytes(32), records=1,
                            clip_norm_u=1, noise_multiplier_u=1, eps_budget_u=1, not_before=0, not_after=1,
                            issued_at=0, salt=bytes(16))
    from govtrain.attest.cose import sig_structure
    from govtrain.attest.keys import key_id
    from govtrain.encoding.cbor import Tag

    protected = cbor.encode({1: alg, 4: key_id(KEY.public_key())})
    payload = descriptor.signed_bytes()
    raw = cbor.encode(Tag(18, [protected, {}, payload, KEY.sign(sig_structure(protected, payload))]))
    fast = _parse_fast(raw)
    assert fast is not None and fast == _parse_full(raw) and fast.alg == alg
    assert hashlib.sha256(fast.payload).digest() == descriptor.sha256()
