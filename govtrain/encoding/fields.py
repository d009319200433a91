"""Exact-shape checks for decoded CBOR maps: no unknown, missing or mistyped fields (docs/design.md §2)."""

from __future__ import annotations

from typing import Any, Mapping

from govtrain.errors import Code, GovtrainError

INT63_MAX = 2**63 - 1  # what SQL integer columns can hold; larger values are refused everywhere

_TYPE_NAMES = {int: "unsigned integer", str: "text string", bytes: "byte string", list: "array",
               dict: "map", bool: "boolean"}


def check_shape(
    obj: Any,
    spec: Mapping[str, type | tuple[type, ...]],
    *,
    what: str,
    error: type[GovtrainError],
    optional: frozenset[str] = frozenset(),
) -> dict:
    """Check that `obj` is a map with exactly the keys of `spec` (less any absent `optional` ones),
    each of exactly the given type. Integers must be non-negative and fit in 63 bits.
    `type(None)` in a spec tuple admits null."""
    if type(obj) is not dict:
        raise error(Code.WRONG_TYPE, f"{what} must be a map, not {_describe(obj)}")
    for key in obj:
        if key not in spec:
            raise error(Code.UNKNOWN_FIELD, f"{what} has an unknown field {key!r}")
    for key, expected in spec.items():
        if key not in obj:
            if key in optional:
                continue
            raise error(Code.MISSING_FIELD, f"{what} is missing the field {key!r}")
        value = obj[key]
        kinds = expected if isinstance(expected, tuple) else (expected,)
        if type(value) not in kinds:
            names = " or ".join("null" if k is type(None) else _TYPE_NAMES.get(k, k.__name__) for k in kinds)
            raise error(Code.WRONG_TYPE, f"{what}.{key} must be a {names}, not {_describe(value)}")
        if type(value) is int and value < 0:
            raise error(Code.WRONG_TYPE, f"{what}.{key} must be an unsigned integer, not a negative integer")
        if type(value) is int and value > INT63_MAX:
            raise error(Code.BAD_VALUE, f"{what}.{key} must be at most 2^63-1")
    return obj


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if type(value) is int and value < 0:
        return "a negative integer"
    return "a " + _TYPE_NAMES.get(type(value), type(value).__name__)
