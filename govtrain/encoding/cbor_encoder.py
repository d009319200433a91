"""The deterministic CBOR encoder (RFC 8949 §4.2.1) and the `Tag` item: the one function that writes the
bytes govtrain signs or hashes. `cbor.py` documents the format and is the path callers import from.

`encode` writes the core deterministic encoding: shortest integer and length arguments, definite lengths
only, map keys sorted by the bytewise order of their encodings. Floats are refused (docs/design.md §2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_INPUT_BYTES = 64 * 1024
MAX_DEPTH = 16
_UINT64_MAX = 2**64 - 1


@dataclass(frozen=True, slots=True)
class Tag:
    """A CBOR tag (major type 6) wrapping one data item."""

    number: int
    value: Any


# ---------------------------------------------------------------------------------------
# Encoder
# ---------------------------------------------------------------------------------------


def _head(major: int, value: int) -> bytes:
    """The initial byte and shortest argument for `value` under `major` (§4.2.1)."""
    mt = major << 5
    if value < 24:
        return bytes((mt | value,))
    if value < 0x100:
        return bytes((mt | 24, value))
    if value < 0x10000:
        return bytes((mt | 25,)) + value.to_bytes(2, "big")
    if value < 0x100000000:
        return bytes((mt | 26,)) + value.to_bytes(4, "big")
    return bytes((mt | 27,)) + value.to_bytes(8, "big")


_CACHE_LIMIT = 4096
_key_bytes: dict[tuple[type, Any], bytes] = {}
_key_orders: dict[tuple[tuple, tuple], list[tuple[bytes, Any]]] = {}


def _sorted_keys(obj: dict) -> list[tuple[bytes, Any]]:
    """(encoded key, key) pairs in §4.2.1 order; memoised per key set, since entries repeat their keys."""
    # Keys and their types: 1, 1.0 and True are equal as dict keys but must not share an encoding.
    signature = (tuple(obj), tuple(map(type, obj)))
    order = _key_orders.get(signature)
    if order is not None:
        return order
    pairs = []
    for key in obj:
        if type(key) is not str and type(key) is not int:
            raise TypeError(f"map keys must be integers or text, not {type(key).__name__}")
        cache_key = (type(key), key)
        encoded = _key_bytes.get(cache_key)
        if encoded is None:
            out = bytearray()
            _encode_into(out, key)
            encoded = bytes(out)
            if len(_key_bytes) < _CACHE_LIMIT:
                _key_bytes[cache_key] = encoded
        pairs.append((encoded, key))
    pairs.sort(key=lambda pair: pair[0])
    if len(_key_orders) < _CACHE_LIMIT:
        _key_orders[signature] = pairs
    return pairs


def _encode_into(out: bytearray, obj: Any) -> None:
    kind = type(obj)
    if kind is int:
        if 0 <= obj < 24:
            out.append(obj)
        elif 0 <= obj <= _UINT64_MAX:
            out += _head(0, obj)
        elif -(2**64) <= obj < 0:
            out += _head(1, -1 - obj)
        else:
            raise TypeError(f"integer {obj} does not fit in 64 bits")
    elif kind is str:
        raw = obj.encode("utf-8")
        if len(raw) < 24:
            out.append(0x60 | len(raw))
        else:
            out += _head(3, len(raw))
        out += raw
    elif kind is bytes:
        out += _head(2, len(obj))
        out += obj
    elif kind is dict:
        out += _head(5, len(obj))
        for encoded, key in _sorted_keys(obj):
            out += encoded
            value = obj[key]
            # Inline the scalars that flat entries are made of; everything else recurses.
            value_kind = type(value)
            if value_kind is int and 0 <= value <= 0xFFFFFFFF:
                if value < 24:
                    out.append(value)
                elif value < 0x100:
                    out += b"\x18" + value.to_bytes(1, "big")
                elif value < 0x10000:
                    out += b"\x19" + value.to_bytes(2, "big")
                else:
                    out += b"\x1a" + value.to_bytes(4, "big")
            elif value_kind is bytes and len(value) < 0x100:
                out += (bytes((0x40 | len(value),)) if len(value) < 24 else b"\x58" + bytes((len(value),))) + value
            elif value_kind is str and value.isascii() and len(value) < 0x100:
                raw = value.encode("ascii")
                out += (bytes((0x60 | len(raw),)) if len(raw) < 24 else b"\x78" + bytes((len(raw),))) + raw
            else:
                _encode_into(out, value)
    elif kind is list or kind is tuple:
        out += _head(4, len(obj))
        for item in obj:
            _encode_into(out, item)
    elif obj is True:
        out.append(0xF5)
    elif obj is False:
        out.append(0xF4)
    elif obj is None:
        out.append(0xF6)
    elif kind is Tag:
        if not 0 <= obj.number <= _UINT64_MAX:
            raise TypeError(f"tag number {obj.number} out of range")
        out += _head(6, obj.number)
        _encode_into(out, obj.value)
    elif isinstance(obj, float):
        raise TypeError("floats are not allowed in signed or hashed structures; use micro-units")
    elif isinstance(obj, (bytearray, memoryview)):
        _encode_into(out, bytes(obj))
    elif isinstance(obj, bool):
        _encode_into(out, bool(obj))
    elif isinstance(obj, int):
        _encode_into(out, int(obj))
    elif isinstance(obj, str):
        _encode_into(out, str(obj))
    else:
        raise TypeError(f"cannot encode {type(obj).__name__} as deterministic CBOR")


def encode(obj: Any) -> bytes:
    """The RFC 8949 §4.2.1 core deterministic encoding of `obj`."""
    out = bytearray()
    _encode_into(out, obj)
    return bytes(out)


def encode_bstr_head(length: int) -> bytes:
    """Head of a byte string of `length` bytes (used to frame signed bytes without copying)."""
    return _head(2, length)
