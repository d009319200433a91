"""Deterministic CBOR: RFC 8949 Appendix A vectors, round trips, and every strict-decoder rejection."""

from __future__ import annotations

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from govtrain.encoding import cbor
from govtrain.encoding.cbor import Tag
from govtrain.errors import Code, EncodingError

# RFC 8949 Appendix A, the rows in the subset govtrain encodes (no floats, no bignums, no
# indefinite lengths, no simple values other than false/true/null).
APPENDIX_A = [
    (0, "00"), (1, "01"), (10, "0a"), (23, "17"), (24, "1818"), (25, "1819"), (100, "1864"),
    (1000, "1903e8"), (1000000, "1a000f4240"), (1000000000000, "1b000000e8d4a51000"),
    (18446744073709551615, "1bffffffffffffffff"), (-18446744073709551616, "3bffffffffffffffff"),
    (-1, "20"), (-10, "29"), (-100, "3863"), (-1000, "3903e7"),
    (False, "f4"), (True, "f5"), (None, "f6"),
    (Tag(1, 1363896240), "c11a514b67b0"), (Tag(23, b"\x01\x02\x03\x04"), "d74401020304"),
    (Tag(32, "http://www.example.com"), "d82076687474703a2f2f7777772e6578616d706c652e636f6d"),
    (b"", "40"), (b"\x01\x02\x03\x04", "4401020304"),
    ("", "60"), ("a", "6161"), ("IETF", "6449455446"), ("\"\\", "62225c"), ("\u00fc", "62c3bc"),
    ("\u6c34", "63e6b0b4"), ("\U00010151", "64f0908591"),
    ([], "80"), ([1, 2, 3], "83010203"), ([1, [2, 3], [4, 5]], "8301820203820405"),
    (list(range(1, 26)), "98190102030405060708090a0b0c0d0e0f101112131415161718181819"),
    ({}, "a0"), ({1: 2, 3: 4}, "a201020304"), ({"a": 1, "b": [2, 3]}, "a26161016162820203"),
    (["a", {"b": "c"}], "826161a161626163"),
    ({"a": "A", "b": "B", "c": "C", "d": "D", "e": "E"}, "a56161614161626142616361436164614461656145"),
]


@pytest.mark.parametrize("value,hex_bytes", APPENDIX_A, ids=[h for _, h in APPENDIX_A])
def test_appendix_a_encode_and_decode(value, hex_bytes):
    expected = bytes.fromhex(hex_bytes)
    assert cbor.encode(value) == expected
    tags = {value.number} if isinstance(value, Tag) else frozenset()
    assert cbor.decode(expected, tags=tags) == value


def test_map_keys_sorted_bytewise_not_length_first():
    # §4.2.1: 24 (0x1818) sorts before -1 (0x20) bytewise; length-first would put -1 first.
    assert cbor.encode({-1: 0, 24: 0}) == bytes.fromhex("a2181800" "2000")
    assert list(cbor.decode(bytes.fromhex("a21818002000"))) == [24, -1]


def test_encoder_refuses_what_signed_structures_must_not_hold():
    for bad in (1.5, float("nan"), 2**64, -(2**64) - 1, {b"k": 1}, {True: 1}, object(), {1, 2}):
        with pytest.raises(TypeError):
            cbor.encode(bad)


values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64 - 1) | st.binary(max_size=40) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=8) | st.integers(-1000, 1000), children, max_size=5),
    max_leaves=25,
)


@settings(max_examples=300, deadline=None)
@given(values)
def test_round_trip_and_agreement_with_cbor2(value):
    encoded = cbor.encode(value)
    assert cbor.decode(encoded) == value
    # Oracle: cbor2 reads the same value, and any canonical input re-encodes to itself.
    assert cbor2.loads(encoded) == value
    assert cbor.encode(cbor.decode(encoded)) == encoded


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_decoder_accepts_only_what_it_would_encode(data):
    """Re-encoding oracle: whatever the strict decoder accepts re-encodes to the very same bytes."""
    try:
        value = cbor.decode(data)
    except EncodingError:
        return
    assert cbor.encode(value) == data


REJECTIONS = [
    # (input hex or bytes, code, what)
    ("0000", Code.TRAILING_BYTES, "trailing bytes"),
    ("9f0102ff", Code.INDEFINITE_LENGTH, "indefinite array"),
    ("bf6161 01ff", Code.INDEFINITE_LENGTH, "indefinite map"),
    ("5f4101ff", Code.INDEFINITE_LENGTH, "indefinite byte string"),
    ("7f6161ff", Code.INDEFINITE_LENGTH, "indefinite text string"),
    ("1817", Code.NON_CANONICAL, "integer 23 in two bytes"),
    ("190017", Code.NON_CANONICAL, "integer 23 in three bytes"),
    ("1a0000ffff", Code.NON_CANONICAL, "integer 65535 in five bytes"),
    ("1b00000000ffffffff", Code.NON_CANONICAL, "integer 2^32-1 in nine bytes"),
    ("3817", Code.NON_CANONICAL, "negative integer not minimal"),
    ("5801ff", Code.NON_CANONICAL, "byte-string length not minimal"),
    ("980101", Code.NON_CANONICAL, "array length not minimal"),
    ("a2616201616101", Code.NON_CANONICAL, "map keys out of order"),
    ("a2182000 0100", Code.NON_CANONICAL, "integer keys out of bytewise order"),
    ("a2616101616102", Code.DUPLICATE_KEY, "duplicate text key"),
    ("a3616101616202616103", Code.DUPLICATE_KEY, "duplicate key, not adjacent"),
    ("f93c00", Code.FLOAT_FORBIDDEN, "half float"),
    ("fa3fc00000", Code.FLOAT_FORBIDDEN, "single float"),
    ("fb3ff8000000000000", Code.FLOAT_FORBIDDEN, "double float"),
    ("c11a514b67b0", Code.FORBIDDEN_TAG, "epoch-time tag"),
    ("c249010000000000000000", Code.FORBIDDEN_TAG, "bignum"),
    ("d9d9f700", Code.FORBIDDEN_TAG, "self-describe tag"),
    ("62c328", Code.INVALID_UTF8, "invalid UTF-8"),
    ("63eda080", Code.INVALID_UTF8, "UTF-8-encoded surrogate"),
    ("", Code.MALFORMED_CBOR, "empty input"),
    ("83 0102", Code.MALFORMED_CBOR, "truncated array"),
    ("4501", Code.MALFORMED_CBOR, "truncated byte string"),
    ("19 01", Code.MALFORMED_CBOR, "truncated argument"),
    ("1c", Code.MALFORMED_CBOR, "reserved additional information"),
    ("ff", Code.MALFORMED_CBOR, "lone break"),
    ("f7", Code.MALFORMED_CBOR, "undefined"),
    ("f820", Code.MALFORMED_CBOR, "simple value 32"),
    ("a1f601", Code.MALFORMED_CBOR, "null as a map key"),
    ("a14100 01", Code.MALFORMED_CBOR, "byte string as a map key"),
    ("9bffffffffffffffff", Code.MALFORMED_CBOR, "array length beyond the input"),
]


@pytest.mark.parametrize("data,code,what", REJECTIONS, ids=[r[2] for r in REJECTIONS])
def test_strict_decoder_rejects(data, code, what):
    raw = bytes.fromhex(data.replace(" ", "")) if isinstance(data, str) else data
    with pytest.raises(EncodingError) as info:
        cbor.decode(raw)
    assert info.value.code == code, info.value.detail


def test_nesting_limit():
    ok = b"\x81" * 16 + b"\x00"
    assert cbor.decode(ok) is not None
    with pytest.raises(EncodingError) as info:
        cbor.decode(b"\x81" * 17 + b"\x00")
    assert info.value.code == Code.TOO_DEEP
    with pytest.raises(EncodingError) as info:
        cbor.decode(b"\xa1\x61a" * 17 + b"\x00")
    assert info.value.code == Code.TOO_DEEP


def test_size_limit():
    payload = b"\x00" * (64 * 1024 - 3)
    fits = b"\x59" + len(payload).to_bytes(2, "big") + payload
    assert len(fits) == 64 * 1024 and cbor.decode(fits) == payload
    too_big = b"\x59" + (len(payload) + 1).to_bytes(2, "big") + payload + b"\x00"
    with pytest.raises(EncodingError) as info:
        cbor.decode(too_big)
    assert info.value.code == Code.TOO_LARGE


def test_allowed_tags_are_per_call():
    encoded = cbor.encode(Tag(18, [1]))
    assert cbor.decode(encoded, tags={18}) == Tag(18, [1])
    with pytest.raises(EncodingError) as info:
        cbor.decode(encoded)
    assert info.value.code == Code.FORBIDDEN_TAG


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.text(max_size=25), values, min_size=1, max_size=15))
def test_map_template_equals_the_encoder(value):
    assert cbor.MapTemplate(value.keys()).encode(value) == cbor.encode(value)


def test_map_template_refuses_other_fields_and_floats():
    template = cbor.MapTemplate(["a", "b"])
    with pytest.raises(TypeError):
        template.encode({"a": 1})
    with pytest.raises(TypeError):
        template.encode({"a": 1, "b": 2.5})
