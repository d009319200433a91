"""A negative test per rejection: the exact code, exit 3 from the CLI, and nothing written.

Each case builds a `.cose` file and a data file, runs `govtrain admit --json` and checks the
JSON code, the one-line stderr report, and that the ledger's entry count, last leaf hash
and admissions index are unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest
from click.testing import CliRunner
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from govtrain.attest.keys import key_id
from govtrain.cli.main import cli
from govtrain.encoding import cbor
from govtrain.encoding.cbor import Tag
from govtrain.gate.admission import admit
from tests.conftest import Corpus, sign_raw, snapshot

DAY = 86_400


def _descriptor_bytes(c: Corpus, data: Path, **overrides: object) -> bytes:
    return cbor.encode(c.descriptor_map(data, **overrides))


def _kid(c: Corpus) -> bytes:
    return key_id(c.attester.public_key())


def _protected(c: Corpus, **labels: object) -> bytes:
    header: dict = {1: -8, 4: _kid(c)}
    for name, value in labels.items():
        label = int(name.removeprefix("l").replace("m", "-"))
        if value is None:
            header.pop(label, None)
        else:
            header[label] = value
    return cbor.encode(header)


def _raw_map(pairs: list[tuple[bytes, bytes]]) -> bytes:
    """A CBOR map from already-encoded key/value bytes, in the order given (may be non-canonical)."""
    return bytes([0xA0 + len(pairs)]) + b"".join(k + v for k, v in pairs)


def _descriptor_pairs(c: Corpus, data: Path) -> list[tuple[bytes, bytes]]:
    fields = c.descriptor_map(data)
    return sorted((cbor.encode(k), cbor.encode(v)) for k, v in fields.items())


def _with_field(c: Corpus, data: Path, key: str, value_bytes: bytes) -> bytes:
    pairs = [(k, value_bytes if k == cbor.encode(key) else v) for k, v in _descriptor_pairs(c, data)]
    return _raw_map(pairs)


# Each case: (code, build(corpus, data) -> (cose bytes, data path))
Case = Callable[[Corpus, Path], tuple[bytes, Path]]


def _signed(payload: Callable[[Corpus, Path], bytes]) -> Case:
    return lambda c, d: (sign_raw(payload(c, d), c.attester), d)


def _plain(**overrides: object) -> Case:
    return lambda c, d: (c.attestation(d, **overrides), d)


def _relative(**offsets: int) -> Case:
    def build(c: Corpus, d: Path) -> tuple[bytes, Path]:
        return c.attestation(d, **{k: c.now + v for k, v in offsets.items()}), d

    return build


def _mutate(fn: Callable[[bytes], bytes]) -> Case:
    return lambda c, d: (fn(c.attestation(d)), d)


def _other_data(c: Corpus, d: Path) -> tuple[bytes, Path]:
    cose = c.attestation(d)
    other = c.data("other.jsonl", records=3, salt="different")
    return cose, other


def _missing_data(c: Corpus, d: Path) -> tuple[bytes, Path]:
    return c.attestation(d), d.with_name("missing.jsonl")


def _record_mismatch(c: Corpus, d: Path) -> tuple[bytes, Path]:
    return c.attestation(d, records=4), d


def _bad_json(c: Corpus, d: Path) -> tuple[bytes, Path]:
    d.write_text('{"text": "fine", "label": 1}\nnot json at all\n')
    return c.attestation(d, records=2), d


def _forged_small_order(c: Corpus, d: Path) -> tuple[bytes, Path]:
    # A forgery that OpenSSL accepts under the identity public key (R = identity, S = 0).
    identity = bytes.fromhex("01" + "00" * 31)
    protected = cbor.encode({1: -8, 4: key_id(identity)})
    return sign_raw(_descriptor_bytes(c, d), c.attester, protected=protected, signature=identity + bytes(32)), d


def _wrong_key_right_kid(c: Corpus, d: Path) -> tuple[bytes, Path]:
    rogue = Ed25519PrivateKey.generate()
    return sign_raw(_descriptor_bytes(c, d), rogue, protected=_protected(c)), d


def _unknown_key(c: Corpus, d: Path) -> tuple[bytes, Path]:
    return c.attestation(d, key=Ed25519PrivateKey.generate()), d


def _flip_signature_bit(raw: bytes) -> bytes:
    return raw[:-1] + bytes([raw[-1] ^ 0x01])


def _indefinite_top_array(raw: bytes) -> bytes:
    assert raw[:2] == b"\xd2\x84"
    return b"\xd2\x9f" + raw[2:] + b"\xff"


def _non_minimal_payload_length(c: Corpus, d: Path) -> tuple[bytes, Path]:
    raw = c.attestation(d)
    body = cbor.decode(raw, tags={18}).value
    protected, _, payload, signature = body
    assert 256 <= len(payload) < 65536  # minimal form: 0x59 and a 2-byte length; this uses 4 bytes
    encoded = (b"\xd2\x84" + cbor.encode(protected) + b"\xa0" + b"\x5a" + len(payload).to_bytes(4, "big")
               + payload + cbor.encode(signature))
    return encoded, d


CASES: dict[str, tuple[str, Case]] = {
    # encoding
    "too_large": ("too_large", lambda c, d: (c.attestation(d) + b"\x00" * 70_000, d)),
    "truncated": ("malformed_cbor", _mutate(lambda raw: raw[:-10])),
    "trailing_bytes": ("trailing_bytes", _mutate(lambda raw: raw + b"\x00")),
    "indefinite_length": ("indefinite_length", _mutate(_indefinite_top_array)),
    "non_minimal_length": ("non_canonical", _non_minimal_payload_length),
    "unsorted_descriptor": ("non_canonical", _signed(lambda c, d: _raw_map(_descriptor_pairs(c, d)[::-1]))),
    "duplicate_key": ("duplicate_key", _signed(
        lambda c, d: _raw_map(_descriptor_pairs(c, d)[:12] + [_descriptor_pairs(c, d)[11]]))),
    "float_value": ("float_forbidden", _signed(
        lambda c, d: _with_field(c, d, "records", bytes.fromhex("fb4008000000000000")))),
    "tagged_value": ("forbidden_tag", _signed(
        lambda c, d: _with_field(c, d, "issued_at", b"\xc1" + cbor.encode(c.now)))),
    "too_deep": ("too_deep", _signed(lambda c, d: cbor.encode({"v": [[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]}))),
    "invalid_utf8": ("invalid_utf8", _signed(lambda c, d: _with_field(c, d, "contributor", b"\x62\xc3\x28"))),
    # schema
    "unknown_field": ("unknown_field", _signed(
        lambda c, d: cbor.encode({**c.descriptor_map(d), "extra": 1}))),
    "missing_field": ("missing_field", _signed(
        lambda c, d: cbor.encode({k: v for k, v in c.descriptor_map(d).items() if k != "salt"}))),
    "wrong_type": ("wrong_type", _signed(lambda c, d: cbor.encode({**c.descriptor_map(d), "records": "3"}))),
    "negative_integer": ("wrong_type", _signed(lambda c, d: cbor.encode({**c.descriptor_map(d), "records": -3}))),
    "bad_contribution_id": ("bad_value", _signed(
        lambda c, d: cbor.encode({**c.descriptor_map(d), "contribution_id": "has spaces"}))),
    "short_salt": ("bad_value", _signed(lambda c, d: cbor.encode({**c.descriptor_map(d), "salt": b"x"}))),
    "zero_clip_norm": ("bad_value", _signed(lambda c, d: cbor.encode({**c.descriptor_map(d), "clip_norm_u": 0}))),
    "version_2": ("unsupported_version", _signed(lambda c, d: cbor.encode({**c.descriptor_map(d), "v": 2}))),
    "payload_not_a_map": ("wrong_type", _signed(lambda c, d: cbor.encode([1, 2, 3]))),
    # COSE envelope
    "untagged": ("not_cose_sign1", lambda c, d: (sign_raw(_descriptor_bytes(c, d), c.attester, tag=None), d)),
    "cose_mac0_tag": ("not_cose_sign1", lambda c, d: (sign_raw(_descriptor_bytes(c, d), c.attester, tag=17), d)),
    "three_elements": ("bad_cose_structure", lambda c, d: (cbor.encode(Tag(18, [b"", {}, b""])), d)),
    "detached_payload": ("bad_cose_structure", lambda c, d: (
        cbor.encode(Tag(18, [_protected(c), {}, None, bytes(64)])), d)),
    "alg_missing": ("bad_algorithm", lambda c, d: (
        sign_raw(_descriptor_bytes(c, d), c.attester, protected=_protected(c, l1=None)), d)),
    "alg_es256": ("bad_algorithm", lambda c, d: (
        sign_raw(_descriptor_bytes(c, d), c.attester, protected=_protected(c, l1=-7)), d)),
    "label_in_both_buckets": ("duplicate_header", lambda c, d: (
        sign_raw(_descriptor_bytes(c, d), c.attester, unprotected={1: -8}), d)),
    "unprotected_not_empty": ("bad_header", lambda c, d: (
        sign_raw(_descriptor_bytes(c, d), c.attester, unprotected={5: b"iv"}), d)),
    "unknown_critical": ("unknown_critical", lambda c, d: (
        sign_raw(_descriptor_bytes(c, d), c.attester, protected=_protected(c, l2=[99], l99=1)), d)),
    "unknown_header_label": ("bad_header", lambda c, d: (
        sign_raw(_descriptor_bytes(c, d), c.attester, protected=_protected(c, l99=1)), d)),
    "wrong_content_type": ("bad_header", lambda c, d: (
        sign_raw(_descriptor_bytes(c, d), c.attester, protected=_protected(c, l3="application/json")), d)),
    "kid_missing": ("missing_kid", lambda c, d: (
        sign_raw(_descriptor_bytes(c, d), c.attester, protected=_protected(c, l4=None)), d)),
    "signature_short": ("bad_signature", lambda c, d: (
        sign_raw(_descriptor_bytes(c, d), c.attester, signature=bytes(63)), d)),
    "signature_bit_flip": ("bad_signature", _mutate(_flip_signature_bit)),
    "signed_by_other_key_with_trusted_kid": ("bad_signature", _wrong_key_right_kid),
    "unknown_key": ("unknown_key", _unknown_key),
    "forged_under_small_order_key": ("unknown_key", _forged_small_order),
    "key_not_authorized": ("key_not_authorized", lambda c, d: (
        c.attestation(d, key=c.limited, data_class="sensitive", clip_norm_u=500_000), d)),
    "unknown_class": ("unknown_class", _plain(data_class="secret")),
    # validity window (clock skew 60 s, longest window 30 days)
    "not_yet_valid": ("not_yet_valid", _relative(not_before=3600, issued_at=0, not_after=2 * DAY)),
    "expired": ("expired", _relative(not_before=-10 * DAY, issued_at=-10 * DAY, not_after=-DAY)),
    "window_too_long": ("window_too_long", _relative(not_before=-DAY, issued_at=-DAY, not_after=40 * DAY)),
    "window_inverted": ("bad_window", _relative(not_before=DAY, issued_at=DAY, not_after=-DAY)),
    "issued_in_future": ("issued_in_future", _relative(not_before=-DAY, issued_at=3600, not_after=DAY)),
    # bounds
    "noise_below_class": ("below_floor", _plain(noise_multiplier_u=700_000)),
    "clip_above_class": ("below_floor", _plain(clip_norm_u=1_000_001)),
    "noise_below_corpus": ("below_corpus_floor", _plain(noise_multiplier_u=400_000)),
    "clip_above_corpus": ("below_corpus_floor", _plain(clip_norm_u=5_000_000)),
    "budget_above_max": ("budget_above_max", _plain(eps_budget_u=10_000_001)),
    # data
    "digest_mismatch": ("digest_mismatch", _other_data),
    "data_unreadable": ("data_unreadable", _missing_data),
    "record_count_mismatch": ("record_count_mismatch", _record_mismatch),
    "bad_data": ("bad_data", _bad_json),
}


def _run_admit(c: Corpus, cose_path: Path, data: Path) -> tuple[int, dict, str]:
    result = CliRunner().invoke(cli, ["admit", str(cose_path), "--data", str(data), "--ledger", c.url, "--json"])
    return result.exit_code, json.loads(result.stdout), result.stderr


@pytest.mark.parametrize("name", sorted(CASES))
def test_rejection(corpus: Corpus, name: str):
    code, build = CASES[name]
    data = corpus.data("contribution.jsonl")
    cose, data_path = build(corpus, data)
    cose_path = corpus.dir / "contribution.cose"
    cose_path.write_bytes(cose)
    before = snapshot(corpus.url)

    exit_code, report, stderr = _run_admit(corpus, cose_path, data_path)

    assert exit_code == 3, stderr
    assert report["ok"] is False and report["code"] == code, report
    assert stderr.startswith(f"error[{code}]: ") and stderr.count("\n") == 1
    assert snapshot(corpus.url) == before


def test_there_are_at_least_thirty_distinct_inputs_and_every_gate_code_is_covered():
    assert len(CASES) >= 30
    gate_codes = {
        "too_large", "malformed_cbor", "trailing_bytes", "indefinite_length", "non_canonical", "duplicate_key",
        "float_forbidden", "forbidden_tag", "too_deep", "invalid_utf8", "unknown_field", "missing_field",
        "wrong_type", "bad_value", "unsupported_version", "not_cose_sign1", "bad_cose_structure", "bad_algorithm",
        "bad_header", "duplicate_header", "unknown_critical", "missing_kid", "bad_signature", "unknown_key",
        "key_not_authorized", "unknown_class", "bad_window", "not_yet_valid", "expired", "window_too_long",
        "issued_in_future", "below_floor", "below_corpus_floor", "budget_above_max", "data_unreadable",
        "digest_mismatch", "bad_data", "record_count_mismatch",
    }
    assert gate_codes <= {code for code, _ in CASES.values()}


# -- replay: the first admission succeeds, every replay leaves the ledger as it was --------


def _admit_ok(c: Corpus, cose: bytes, data: Path) -> None:
    path = c.dir / f"{data.name}.cose"
    path.write_bytes(cose)
    result = CliRunner().invoke(cli, ["admit", str(path), "--data", str(data), "--ledger", c.url])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("code", ["replay", "id_reused", "duplicate_data"])
def test_replay(corpus: Corpus, code: str):
    data = corpus.data("first.jsonl")
    first = corpus.attestation(data)
    _admit_ok(corpus, first, data)
    before = snapshot(corpus.url)
    assert before[0] == 2 and before[2] == 1

    if code == "replay":
        again, again_data = first, data
    elif code == "id_reused":
        again_data = corpus.data("second.jsonl", salt="other")
        again = corpus.attestation(again_data, contribution_id="first")
    else:
        again, again_data = corpus.attestation(data, contribution_id="first-again"), data
    path = corpus.dir / "again.cose"
    path.write_bytes(again)
    exit_code, report, _ = _run_admit(corpus, path, again_data)
    assert (exit_code, report["code"]) == (3, code)
    assert snapshot(corpus.url) == before


def test_attestation_file_unreadable(corpus: Corpus):
    before = snapshot(corpus.url)
    data = corpus.data("x.jsonl")
    exit_code, report, _ = _run_admit(corpus, corpus.dir / "nope.cose", data)
    assert (exit_code, report["code"]) == (3, "attestation_unreadable")
    assert snapshot(corpus.url) == before


def test_admission_succeeds_and_is_recorded(corpus: Corpus):
    data = corpus.data("good.jsonl", records=5)
    path = corpus.dir / "good.cose"
    path.write_bytes(corpus.attestation(data))
    exit_code, report, _ = _run_admit(corpus, path, data)
    assert exit_code == 0 and report["ok"] and report["seq"] == 1 and report["records"] == 5
    size, head, admissions = snapshot(corpus.url)
    assert (size, admissions) == (2, 1) and head.hex() == report["leaf_hash"]


def test_skew_tolerates_small_clock_differences(corpus: Corpus):
    data = corpus.data("skew.jsonl")
    cose = corpus.attestation(data, not_before=corpus.now + 30, issued_at=corpus.now + 30)
    with corpus.open() as ledger:
        assert admit(ledger, cose, data, now=corpus.now).seq == 1


def test_limited_attester_may_attest_its_own_class(corpus: Corpus):
    data = corpus.data("limited.jsonl")
    with corpus.open() as ledger:
        assert admit(ledger, corpus.attestation(data, key=corpus.limited), data, now=corpus.now).data_class == "public"
