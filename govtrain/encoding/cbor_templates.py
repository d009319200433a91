"""Fixed-layout CBOR: `FixedMap` (a fast path that accepts only the exact canonical bytes of one map shape)
and `MapTemplate` (an encoder for maps with fixed keys, byte-identical to `encode`). Both serve the formats
govtrain reads and writes most (descriptors, COSE envelopes, ledger entries).
"""

from __future__ import annotations

import re
from typing import Iterable

from govtrain.encoding.cbor_encoder import _UINT64_MAX, MAX_INPUT_BYTES, _head, encode, encode_bstr_head

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
