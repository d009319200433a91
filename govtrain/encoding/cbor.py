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

`cbor_encoder.py` holds the encoder, `cbor_decoder.py` the strict decoder and `cbor_templates.py` the
fixed-layout fast paths; this module is the one path callers import them from (`cbor.encode`, `cbor.decode`).
"""

from __future__ import annotations

from govtrain.encoding.cbor_decoder import decode
from govtrain.encoding.cbor_encoder import MAX_DEPTH, MAX_INPUT_BYTES, Tag, encode, encode_bstr_head
from govtrain.encoding.cbor_templates import FixedMap, MapTemplate, head_pattern, head_value

__all__ = ["MAX_DEPTH", "MAX_INPUT_BYTES", "FixedMap", "MapTemplate", "Tag", "decode", "encode", "encode_bstr_head",
           "head_pattern", "head_value"]
