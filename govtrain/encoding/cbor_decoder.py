"""The strict deterministic-CBOR decoder: it accepts exactly the bytes `cbor_encoder.encode` would produce
for the decoded value, checking the canonical form while parsing (not by re-encoding), so that the admission
gate stays fast. Kept apart from the encoder because it is the part that reads untrusted input.
"""

from __future__ import annotations

from typing import AbstractSet, Any

from govtrain.encoding.cbor_encoder import MAX_DEPTH, MAX_INPUT_BYTES, Tag
from govtrain.errors import Code, EncodingError

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
