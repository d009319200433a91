"""Rights envelopes (`govtrain/serve/rights.py`, schemas/rights.cddl): issued, carried in a header, verified; every
deviation refused with its own code; the inference policy that names the issuers (`govtrain/serve/policy.py`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pycddl
import pytest
from click.testing import CliRunner
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from govtrain.attest.cose import sign_sign1
from govtrain.attest.keys import generate_key_pair, load_private_key, public_key_pem
from govtrain.cli.main import cli
from govtrain.encoding import cbor
from govtrain.encoding.cbor import Tag
from govtrain.errors import Code, ConfigError, GovtrainError
from govtrain.serve.policy import load_inference_policy
from govtrain.serve.rights import (CONTENT_TYPE, MAX_ENVELOPE_BYTES, Issuer, Rights, from_header, issue_rights,
                                   to_header, verify_rights)
from tests.conftest import REPO, sign_raw
from tests.vectors.generate import CLOCK, HERE, SECRET

NOW = 1_800_000_000
AUDIENCE = "gate.test.invalid/sentiment"
ISSUER = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
OTHER = Ed25519PrivateKey.from_private_bytes(bytes(range(1, 33)))
RIGHTS_CDDL = (REPO / "schemas" / "rights.cddl").read_text()


def _issuer(key: Ed25519PrivateKey = ISSUER, classes=None) -> dict[bytes, Issuer]:
    raw = key.public_key().public_bytes_raw()
    issuer = Issuer(name="office", public_key=raw, classes=classes)
    return {issuer.kid: issuer}


def _issue(key=ISSUER, **overrides) -> bytes:
    fields = dict(subject="alice@example.org", audience=AUDIENCE, classes=["public", "sensitive"],
                  sessions=["s-1"], valid_seconds=3600, now=NOW)
    fields.update(overrides)
    return issue_rights(key, **fields)[0]


def _verify(envelope: bytes, *, issuers=None, now: int = NOW, audience: str = AUDIENCE):
    return verify_rights(envelope, issuers=issuers or _issuer(), audience=audience, now=now, clock_skew_s=60,
                         max_validity_s=86_400)


def _refused(code: Code, envelope: bytes, **kwargs) -> GovtrainError:
    with pytest.raises(GovtrainError) as refused:
        _verify(envelope, **kwargs)
    assert refused.value.code is code, refused.value.line()
    return refused.value


def _signed_claims(claims: dict, key=ISSUER, content_type: str | None = CONTENT_TYPE) -> bytes:
    return sign_sign1(cbor.encode(claims), key, content_type=content_type)


def _claims(**overrides) -> dict:
    base = dict(v=1, subject="alice", audience=AUDIENCE, classes=["public"], sessions=[], not_before=NOW,
                not_after=NOW + 60, issued_at=NOW, rights_id=bytes(16))
    base.update(overrides)
    return base


def test_an_issued_envelope_verifies_through_its_header_and_states_its_claims():
    envelope = _issue()
    header = to_header(envelope)
    assert "=" not in header and re.fullmatch(r"[A-Za-z0-9_-]+", header)
    verified = _verify(from_header(header))
    assert verified.subject == "alice@example.org" and verified.classes == {"public", "sensitive"}
    assert verified.rights.sessions == ("s-1",) and verified.issuer == "office"
    assert (verified.rights.not_before, verified.rights.not_after) == (NOW, NOW + 3600)
    assert Rights.from_bytes(verified.rights.signed_bytes()) == verified.rights


def test_the_envelope_matches_its_cddl_and_the_schema_refuses_what_the_verifier_refuses():
    envelope = _issue()
    plain = re.sub(r"bstr \.cbor [a-z-]+", "bstr", RIGHTS_CDDL)  # pycddl 0.6 and `.cbor` in arrays: two layers
    pycddl.Schema(plain).validate_cbor(envelope)
    protected, _, payload, _ = cbor.decode(envelope, tags={18}).value
    pycddl.Schema(f"root-rule = rights-protected-header\n{RIGHTS_CDDL}").validate_cbor(protected)
    claims = pycddl.Schema(f"root-rule = rights\n{RIGHTS_CDDL}")
    claims.validate_cbor(payload)
    for bad in (_claims(extra=1), _claims(rights_id=b"short"), _claims(classes="public"), _claims(v=2)):
        with pytest.raises(Exception):
            claims.validate_cbor(cbor.encode(bad))
        with pytest.raises(GovtrainError):
            _verify(_signed_claims(bad))


def test_the_vector_regenerates_and_verifies_at_its_clock():
    token = (HERE / "rights-v1.token").read_text()
    summary = json.loads((HERE / "rights-v1.json").read_text())
    key = Ed25519PrivateKey.from_private_bytes(SECRET)
    verified = verify_rights(from_header(token), issuers=_issuer(key), audience="vectors.govtrain.invalid/gate",
                             now=CLOCK + 10, clock_skew_s=0, max_validity_s=3600)
    assert verified.rights.signed_bytes().hex() == summary["claims_hex"]
    assert verified.envelope_sha256.hex() == summary["envelope_sha256"]


def test_headers_that_carry_no_envelope_are_refused_before_any_decoding():
    for value in (None, "", "   "):
        with pytest.raises(GovtrainError) as missing:
            from_header(value)
        assert missing.value.code is Code.RIGHTS_MISSING
    good = to_header(_issue(sessions=["s-1", "s-2"]))
    assert len(good) % 4 in (2, 3)  # so that its last character has padding bits
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    padded = good[:-1] + alphabet[alphabet.index(good[-1]) ^ 1]  # one padding bit set: the same bytes, other text
    for value in (good + "=", good[:-1] + "+", "a", "A" * (MAX_ENVELOPE_BYTES * 2), "Bearer " + good, padded):
        with pytest.raises(GovtrainError) as unreadable:
            from_header(value)
        assert unreadable.value.code is Code.RIGHTS_UNREADABLE, value[:20]


def test_a_forged_or_altered_envelope_is_refused_with_its_code():
    envelope = _issue()
    tampered = bytearray(envelope)
    tampered[-80] ^= 1  # a byte of the claims: the signature no longer covers them
    _refused(Code.BAD_SIGNATURE, bytes(tampered))
    forged = bytearray(envelope)
    forged[-1] ^= 1
    _refused(Code.BAD_SIGNATURE, bytes(forged))
    # another key's signature under the issuer's kid
    protected, _, payload, _ = cbor.decode(envelope, tags={18}).value
    _refused(Code.BAD_SIGNATURE, sign_raw(payload, OTHER, protected=protected))
    _refused(Code.UNKNOWN_KEY, _issue(OTHER))  # a key this deployment does not name: the wrong issuer
    _refused(Code.TRAILING_BYTES, envelope + b"\x00")
    _refused(Code.NOT_COSE_SIGN1, b"hello")
    _refused(Code.NOT_COSE_SIGN1, cbor.encode(Tag(17, [b"", {}, b"", b""])))


def test_only_a_rights_content_type_is_rights():
    claims = _claims()
    _refused(Code.BAD_HEADER, _signed_claims(claims, content_type=None))  # no content type: could be anything
    _refused(Code.BAD_HEADER, _signed_claims(claims, content_type="application/govtrain.descriptor+cbor"))
    assert _verify(_signed_claims(claims)).subject == "alice"


def test_claims_out_of_their_window_or_for_another_deployment_are_refused():
    _refused(Code.EXPIRED, _issue(), now=NOW + 3600 + 61)
    assert _verify(_issue(), now=NOW + 3600 + 60).subject  # within the clock skew
    _refused(Code.NOT_YET_VALID, _signed_claims(_claims(not_before=NOW + 120, not_after=NOW + 300)))
    _refused(Code.ISSUED_IN_FUTURE, _signed_claims(_claims(issued_at=NOW + 61, not_after=NOW + 300)))
    _refused(Code.BAD_WINDOW, _signed_claims(_claims(not_before=NOW, not_after=NOW - 1, issued_at=NOW - 5)))
    _refused(Code.WINDOW_TOO_LONG, _issue(valid_seconds=86_401))
    _refused(Code.WRONG_AUDIENCE, _issue(), audience="gate.test.invalid/other")
    _refused(Code.KEY_NOT_AUTHORIZED, _issue(), issuers=_issuer(classes=frozenset({"public"})))


def test_claims_must_be_in_their_one_canonical_form():
    _refused(Code.BAD_VALUE, _signed_claims(_claims(classes=["sensitive", "public"])))  # unsorted
    _refused(Code.BAD_VALUE, _signed_claims(_claims(sessions=["s", "s"])))  # repeated
    _refused(Code.WRONG_TYPE, _signed_claims(_claims(classes=[1])))
    _refused(Code.MISSING_FIELD, _signed_claims({k: v for k, v in _claims().items() if k != "subject"}))
    _refused(Code.UNKNOWN_FIELD, _signed_claims(_claims(admin=True)))
    _refused(Code.UNSUPPORTED_VERSION, _signed_claims(_claims(v=2)))
    protected = cbor.encode({1: -8, 3: CONTENT_TYPE, 4: bytes(32)})
    _refused(Code.UNKNOWN_KEY, sign_raw(cbor.encode(_claims()), ISSUER, protected=protected))
    with pytest.raises(ConfigError) as bad:
        issue_rights(ISSUER, subject="a b", audience=AUDIENCE, classes=[], valid_seconds=60, now=NOW)
    assert bad.value.code is Code.BAD_ARGUMENT


# -- inference.toml ----------------------------------------------------------------------------------------------


def write_policy(folder: Path, issuer_pub: bytes, release_pub: bytes, ledger_pub: bytes, *, ledger: str,
                 extra: str = "", split: str = "") -> Path:
    """An inference policy in `folder`, its keys in files beside it."""
    for name, pem in (("issuer.pub", issuer_pub), ("release.pub", release_pub), ("ledger.pub", ledger_pub)):
        (folder / name).write_bytes(pem)
    path = folder / "inference.toml"
    path.write_text(f"""
audience = "{AUDIENCE}"
clock_skew_seconds = 60
max_rights_days = 1
{extra}
[[issuers]]
name = "office"
public_key_file = "issuer.pub"

[release]
public_key_file = "release.pub"
ledger = "{ledger}"
ledger_keys = [{{ name = "ledger", public_key_file = "ledger.pub" }}]

[sessions]
store = "sessions.db"
epsilon = 4.0
delta = 1e-6

[split]
clip_norm = 1.0
min_epsilon = 0.5
max_epsilon = 2.0
max_delta = 1e-7
{split}
""")
    return path


def _pem(key: Ed25519PrivateKey) -> bytes:
    return public_key_pem(key.public_key())


def test_the_inference_policy_reads_keys_and_rounds_toward_privacy(tmp_path: Path):
    path = write_policy(tmp_path, _pem(ISSUER), _pem(OTHER), _pem(OTHER), ledger="sqlite:///x.db",
                        split="[limits]\nmax_texts = 4")
    policy = load_inference_policy(path)
    assert policy.issuers_by_kid() == _issuer(ISSUER) | {} or list(policy.issuers_by_kid()) == list(_issuer())
    assert policy.session_store == tmp_path / "sessions.db" and policy.max_texts == 4
    assert (policy.session_epsilon_u, policy.session_delta_p, policy.clip_norm_u) == (4_000_000, 1_000_000, 1_000_000)
    assert (policy.min_epsilon_u, policy.max_epsilon_u, policy.max_delta_p) == (500_000, 2_000_000, 100_000)
    assert policy.max_rights_s == 86_400 and policy.taint_check_s == 60 and policy.grace_s == 0


@pytest.mark.parametrize("change, words", [
    (("max_epsilon = 2.0", "max_epsilon = 9.0"), "split.max_epsilon exceeds sessions.epsilon"),
    (("min_epsilon = 0.5", "min_epsilon = 3.0"), "min_epsilon must not exceed max_epsilon"),
    (("delta = 1e-6", "delta = 1.5"), "delta must be less than 1"),
    (("clock_skew_seconds = 60", "clock_skew_seconds = 60\nbogus = 1"), "bogus"),
    (('public_key_file = "release.pub"', 'public_key_file = "release.pub"\npublic_key = "AAAA"'), "exactly one"),
    (("max_delta = 1e-7", "max_delta = 1e-13"), "rounds to 0"),
])
def test_a_bad_inference_policy_is_one_line_naming_the_field(tmp_path: Path, change, words):
    path = write_policy(tmp_path, _pem(ISSUER), _pem(OTHER), _pem(OTHER), ledger="sqlite:///x.db")
    path.write_text(path.read_text().replace(*change))
    with pytest.raises(ConfigError) as bad:
        load_inference_policy(path)
    assert bad.value.code is Code.INFERENCE_POLICY_INVALID and words in bad.value.detail
    assert "\n" not in bad.value.line()


def test_a_small_order_issuer_key_never_enters_the_policy(tmp_path: Path):
    import base64

    identity = base64.b64encode(bytes([1] + [0] * 31)).decode()  # the identity point: forgeable signatures
    path = write_policy(tmp_path, _pem(ISSUER), _pem(OTHER), _pem(OTHER), ledger="sqlite:///x.db")
    path.write_text(path.read_text().replace('public_key_file = "issuer.pub"', f'public_key = "{identity}"'))
    with pytest.raises(ConfigError) as bad:
        load_inference_policy(path)
    assert bad.value.code is Code.BAD_PUBLIC_KEY and bad.value.exit_code == 2
    path.write_text("audience = [")
    with pytest.raises(ConfigError) as unreadable:
        load_inference_policy(path)
    assert unreadable.value.code is Code.INFERENCE_POLICY_UNREADABLE


def test_the_command_line_issues_a_0600_token_the_policy_accepts(tmp_path: Path):
    generate_key_pair(tmp_path, "issuer")
    issuer = load_private_key(tmp_path / "issuer.key")
    path = write_policy(tmp_path, _pem(issuer), _pem(OTHER), _pem(OTHER), ledger="sqlite:///x.db")
    runner = CliRunner()
    out = tmp_path / "alice.token"
    issued = runner.invoke(cli, ["rights", "issue", "--key", str(tmp_path / "issuer.key"), "--subject", "alice",
                                 "--audience", AUDIENCE, "--class", "public", "--session", "s-1", "--valid-hours",
                                 "2", "--out", str(out), "--json"])
    assert issued.exit_code == 0, issued.output
    assert json.loads(issued.stdout)["classes"] == ["public"] and out.stat().st_mode & 0o777 == 0o600
    checked = runner.invoke(cli, ["rights", "verify", str(out), "--policy", str(path), "--json"])
    assert checked.exit_code == 0, checked.output
    assert json.loads(checked.stdout)["subject"] == "alice" and json.loads(checked.stdout)["issuer"] == "office"
    again = runner.invoke(cli, ["rights", "issue", "--key", str(tmp_path / "issuer.key"), "--subject", "alice",
                                "--audience", AUDIENCE, "--out", str(out)])
    assert again.exit_code == 2 and "already exists" in again.stderr
    long = tmp_path / "long.token"
    runner.invoke(cli, ["rights", "issue", "--key", str(tmp_path / "issuer.key"), "--subject", "alice",
                        "--audience", AUDIENCE, "--valid-hours", "48", "--out", str(long)])
    refused = runner.invoke(cli, ["rights", "verify", str(long), "--policy", str(path)])
    assert refused.exit_code == 3 and refused.stderr.startswith("error[window_too_long]")
