"""Deterministic CBOR (RFC 8949 §4.2.1) for everything govtrain signs or hashes.

`encode` writes the core deterministic encoding: shortest integer and length
arguments, definite lengths only, map keys sorted by the bytewise order of their
encodings. It accepts unsigned and negative integers that fit in 64 bits, byte
strings, text strings, arrays, maps with integer or text keys, booleans, null and
`Tag`. Floats are refused: docs/design.md §2 keeps them out of every signed structure.

`decode` is strict: it accepts exactly the bytes `encode` would produce for the
decoded value and rejects, with a distinct `Code`, input over the size limit,
trailing bytes, indefinite lengths, non-minimal arguments, unsorted or duplicate
map keys, floats and other simple values, tags outside the caller's allowed set,
nesting deeper than the limit, invalid UTF-8 and truncated input. Checking the
canonical form while parsing (rather than re-encoding) keeps the admission gate
fast; `tests/test_cbor.py` cross-checks both against a re-encoding oracle.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import AbstractSet, Any, Iterable

from govtrain.errors import Code, EncodingError

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


# ---------------------------------------------------------------------------------------
# Strict decoder
# ---------------------------------------------------------------------------------------

_MINIMUM = {24: 24, 25: 0x100, 26: 0x10000, 27: 0x100000000}
_WIDTH = {24: 1, 25: 2, 26: 4, 27: 8}


class _Reader:
    __slots__ = ("data", "pos", "end", "tags", "max_depth")

    def __init__(self, data: bytes, tags: AbstractSet[int], max_depth: int) -> None:
        self.data = data
        self.pos = 0
        self.end = len(data)
        self.tags = tags
        self.max_depth = max_depth

    def fail(self, code: Code, detail: str) -> EncodingError:
        return EncodingError(code, f"{detail} at byte {self.pos}")

    def argument(self, info: int, major: int) -> int:
        """Read the argument that follows an initial byte; enforce the shortest form."""
        if info < 24:
            return info
        width = _WIDTH.get(info)
        if width is None:
            if info == 31:
                if major in (2, 3, 4, 5):
                    raise self.fail(Code.INDEFINITE_LENGTH, "indefinite-length item")
                raise self.fail(Code.MALFORMED_CBOR, "break or indefinite marker where none is allowed")
            raise self.fail(Code.MALFORMED_CBOR, f"reserved additional information {info}")
        start = self.pos
        stop = start + width
        if stop > self.end:
            raise self.fail(Code.MALFORMED_CBOR, "truncated argument")
        value = int.from_bytes(self.data[start:stop], "big")
        if value < _MINIMUM[info]:
            raise self.fail(Code.NON_CANONICAL, f"argument {value} not in its shortest form")
        self.pos = stop
        return value

    def take(self, length: int) -> bytes:
        start = self.pos
        stop = start + length
        if stop > self.end:
            raise self.fail(Code.MALFORMED_CBOR, f"truncated: {length} bytes announced, {self.end - start} left")
        self.pos = stop
        return self.data[start:stop]

    def item(self, depth: int) -> Any:
        if self.pos >= self.end:
            raise self.fail(Code.MALFORMED_CBOR, "truncated: data item expected")
        initial = self.data[self.pos]
        self.pos += 1
        major = initial >> 5
        info = initial & 0x1F

        if major == 7:
            if info == 20:
                return False
            if info == 21:
                return True
            if info == 22:
                return None
            if info in (25, 26, 27):
                raise self.fail(Code.FLOAT_FORBIDDEN, "floating-point value")
            if info == 31:
                raise self.fail(Code.MALFORMED_CBOR, "unexpected break")
            raise self.fail(Code.MALFORMED_CBOR, f"simple value {info} is not allowed")

        value = self.argument(info, major)
        if major == 0:
            return value
        if major == 1:
            return -1 - value
        if major == 2:
            return self.take(value)
        if major == 3:
            raw = self.take(value)
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise self.fail(Code.INVALID_UTF8, f"text string is not valid UTF-8 ({e.reason})") from e

        depth += 1
        if depth > self.max_depth:
            raise self.fail(Code.TOO_DEEP, f"nesting deeper than {self.max_depth}")
        if major == 4:
            if value > self.end - self.pos:
                raise self.fail(Code.MALFORMED_CBOR, f"truncated: array of {value} items")
            return [self.item(depth) for _ in range(value)]
        if major == 5:
            if 2 * value > self.end - self.pos:
                raise self.fail(Code.MALFORMED_CBOR, f"truncated: map of {value} pairs")
            result: dict = {}
            previous = b""
            seen = set()
            data = self.data
            for _ in range(value):
                key_start = self.pos
                key = self.item(depth)
                key_bytes = data[key_start : self.pos]
                if type(key) is not str and type(key) is not int:
                    raise self.fail(Code.MALFORMED_CBOR, "map keys must be integers or text strings")
                if key_bytes in seen:
                    raise self.fail(Code.DUPLICATE_KEY, f"duplicate map key {key!r}")
                if key_bytes < previous:
                    raise self.fail(Code.NON_CANONICAL, f"map key {key!r} out of deterministic order")
                seen.add(key_bytes)
                previous = key_bytes
                result[key] = self.item(depth)
            return result
        # major == 6
        if value not in self.tags:
            raise self.fail(Code.FORBIDDEN_TAG, f"tag {value} is not allowed here")
        return Tag(value, self.item(depth))


def decode(
    data: bytes,
    *,
    tags: AbstractSet[int] = frozenset(),
    max_size: int = MAX_INPUT_BYTES,
    max_depth: int = MAX_DEPTH,
) -> Any:
    """Decode exactly one deterministic-CBOR data item, or raise `EncodingError`.

    `tags` lists the tag numbers the caller's format names; any other tag is rejected.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError("decode() takes bytes")
    data = bytes(data)
    if len(data) > max_size:
        raise EncodingError(Code.TOO_LARGE, f"input of {len(data)} bytes exceeds the {max_size}-byte limit")
    reader = _Reader(data, tags, max_depth)
    value = reader.item(0)
    if reader.pos != reader.end:
        raise EncodingError(
            Code.TRAILING_BYTES, f"{reader.end - reader.pos} bytes after the data item (at byte {reader.pos})"
        )
    return value


# ---------------------------------------------------------------------------------------
# Fast path for fixed layouts
# ---------------------------------------------------------------------------------------
#
# The formats govtrain verifies most (descriptors, COSE envelopes) have a fixed shape. These
# helpers accept only the exact canonical bytes of that shape and answer None for anything
# else, so the caller can fall back to `decode`, which then names the precise problem. They
# never accept what `decode` plus the caller's schema check would reject: tests/test_cbor.py
# checks that on random and mutated inputs.

_INT63_MAX = 2**63 - 1


def head_pattern(major: int, max_value_63: bool = False) -> bytes:
    """A regex for the shortest-form head of `major` (RFC 8949 §4.2.1), as one capture group."""
    mt = major << 5
    byte = lambda b: re.escape(bytes((b,)))  # noqa: E731
    one = b"[" + byte(mt) + b"-" + byte(mt | 23) + b"]"
    two = byte(mt | 24) + b"[\\x18-\\xff]"
    three = byte(mt | 25) + b"(?!\\x00)[\\x00-\\xff]{2}"
    five = byte(mt | 26) + b"(?!\\x00\\x00)[\\x00-\\xff]{4}"
    nine = byte(mt | 27) + (b"(?=[\\x00-\\x7f])" if max_value_63 else b"") + b"(?!\\x00{4})[\\x00-\\xff]{8}"
    return b"(" + b"|".join((one, two, three, five, nine)) + b")"


def head_value(head: bytes) -> int:
    """The argument of a head matched by `head_pattern`."""
    info = head[0] & 0x1F
    return info if info < 24 else int.from_bytes(head[1:], "big")


class FixedMap:
    """A map with exactly these text keys, each holding an unsigned integer below 2^63 ("uint"),
    a byte string ("bstr", or "bstr32" for exactly 32 bytes, and so on) or a text string ("tstr").

    One compiled regular expression checks the layout in C: every key literal in §4.2.1 order and
    every head in its shortest form. String contents are matched lazily up to the next key inside
    atomic groups (linear time on any input), then their lengths are checked against their heads, so
    a string that happens to contain the next key's bytes only sends the input to the slow path.
    """

    _MAJORS = {"uint": 0, "bstr": 2, "tstr": 3}

    def __init__(self, fields: dict[str, str]) -> None:
        if not fields or len(fields) >= 24:
            raise ValueError("a FixedMap has 1 to 23 fields")
        encoded = sorted((encode(name), name, kind) for name, kind in fields.items())
        pattern = re.escape(bytes((0xA0 | len(encoded),)))
        # Capture-group indices by kind: integers (their head), fixed-size byte strings (their
        # content), variable strings (head, then content).
        self._uints: list[tuple[str, int]] = []
        self._fixed: list[tuple[str, int]] = []
        self._strings: list[tuple[str, int, bool]] = []  # (name, head group, is text)
        group = 0
        for index, (key, name, kind) in enumerate(encoded):
            following = re.escape(encoded[index + 1][0]) if index + 1 < len(encoded) else b"\\Z"
            pattern += re.escape(key)
            if kind.startswith("bstr") and kind != "bstr":
                size = int(kind.removeprefix("bstr"))
                pattern += re.escape(encode_bstr_head(size)) + b"(.{%d})" % size
                self._fixed.append((name, group))
                group += 1
            elif kind == "uint":
                pattern += head_pattern(0, True)
                self._uints.append((name, group))
                group += 1
            else:
                major = self._MAJORS[kind]
                pattern += b"(?>" + head_pattern(major, False) + b"(.*?)(?=" + following + b"))"
                self._strings.append((name, group, major == 3))
                group += 2
        self._regex = re.compile(pattern + b"\\Z", re.DOTALL)

    def decode(self, data: bytes) -> dict | None:
        """The map, if `data` is exactly its canonical encoding; otherwise None."""
        if len(data) > MAX_INPUT_BYTES:
            return None
        match = self._regex.match(data)
        if match is None:
            return None
        groups = match.groups()
        result = {
            name: head[0] & 0x1F if len(head := groups[index]) == 1 else int.from_bytes(head[1:], "big")
            for name, index in self._uints
        }
        for name, index in self._fixed:
            result[name] = groups[index]
        for name, index, is_text in self._strings:
            head, content = groups[index], groups[index + 1]
            if len(content) != (head[0] & 0x1F if len(head) == 1 else int.from_bytes(head[1:], "big")):
                return None
            if is_text:
                try:
                    content = content.decode("utf-8")
                except UnicodeDecodeError:
                    return None
            result[name] = content
        return result


_SMALL_UINTS = [bytes((i,)) for i in range(24)]
_UINT8 = [b"\x18" + bytes((i,)) for i in range(256)]
_BSTR_HEADS = [_head(2, n) for n in range(256)]
_TSTR_HEADS = [_head(3, n) for n in range(256)]


def _uint_bytes(value: int) -> bytes:
    if value < 24:
        return _SMALL_UINTS[value]
    if value < 0x100:
        return _UINT8[value]
    if value < 0x10000:
        return b"\x19" + value.to_bytes(2, "big")
    if value < 0x100000000:
        return b"\x1a" + value.to_bytes(4, "big")
    return _head(0, value)


class MapTemplate:
    """Encoder for maps with a fixed set of text keys (ledger entries): the key order and key bytes are
    computed once. Output is byte-identical to `encode` (tests/test_cbor.py checks it)."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._fields = sorted((encode(key), key) for key in keys)
        self._names = frozenset(key for _, key in self._fields)
        self._head = _head(5, len(self._fields))

    def encode(self, values: dict) -> bytes:
        if values.keys() != self._names:
            raise TypeError(f"fields {sorted(values)} do not match the template {sorted(self._names)}")
        parts = [self._head]
        append = parts.append
        for key_bytes, name in self._fields:
            append(key_bytes)
            value = values[name]
            kind = type(value)
            if kind is int and 0 <= value <= _UINT64_MAX:
                append(_SMALL_UINTS[value] if value < 24 else _uint_bytes(value))
            elif kind is bytes:
                length = len(value)
                append(_BSTR_HEADS[length] if length < 256 else _head(2, length))
                append(value)
            elif kind is str:
                raw = value.encode("utf-8")
                length = len(raw)
                append(_TSTR_HEADS[length] if length < 256 else _head(3, length))
                append(raw)
            else:
                append(encode(value))
        return b"".join(parts)
