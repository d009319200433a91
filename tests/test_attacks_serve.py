"""Adversaries of the inference gate (docs/threat-model.md, "Serving"), each refused with its code and leaving
nothing changed: no session charged, no ledger entry, the served model as it was. Callers with an expired or forged
envelope, a caller replaying another's session id, an operator serving an adapter other than the released one, and
hostile clients: oversized bodies, malformed JSON and CBOR, NaN in vectors, huge epsilon."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("fastapi")

from click.testing import CliRunner  # noqa: E402

from govtrain.cli.main import cli  # noqa: E402
from govtrain.encoding import cbor  # noqa: E402
from govtrain.errors import Code, ConfigError  # noqa: E402
from govtrain.serve.rights import HEADER, from_header, to_header  # noqa: E402
from tests.conftest import sign_raw, snapshot  # noqa: E402
from tests.release_setup import trained_release  # noqa: E402
from tests.serve_setup import TEXTS, Deployment, deploy, split_body  # noqa: E402
from tests.test_serve import _refusal  # noqa: E402


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    deployment = deploy(trained_release(tmp_path_factory).copy(tmp_path_factory.mktemp("attacks") / "copy"))
    with deployment.serving() as (client, gate):
        yield deployment, client, gate


@pytest.fixture
def deployment(tmp_path_factory, tmp_path: Path) -> Deployment:
    return deploy(trained_release(tmp_path_factory).copy(tmp_path / "copy"))


def _state(gate, session: str, subject: str = "alice"):
    """(requests, spend, mu^2, debits) of a session: what a refusal must leave as it was."""
    from govtrain.serve.rights import session_owner

    (kid,) = gate.policy.issuers_by_kid()  # the deployment's one issuer
    owner = session_owner(kid, subject)
    held = gate.store.session(session, owner=owner)
    return None if held is None else (held.requests, held.spent_epsilon_u, held.mu_sq,
                                      len(gate.store.debits(session, owner=owner)))


def _spend_once(deployment, client, session: str, subject: str = "alice") -> None:
    answer = client.post("/v1/split", content=split_body(session, 16), headers=deployment.rights(subject,
                                                                                                  sessions=[session]))
    assert answer.status_code == 200, answer.text


# -- callers --------------------------------------------------------------------------------------------------


def test_a_caller_with_an_expired_or_forged_envelope_is_refused_and_charges_nothing(shared):
    deployment, client, gate = shared
    _spend_once(deployment, client, "victim-1")
    before, ledger = _state(gate, "victim-1"), snapshot(deployment.released.url)
    expired = deployment.rights(sessions=["victim-1"], valid_seconds=60, now=int(deployment.now()) - 3600)
    _refusal(client.post("/v1/split", content=split_body("victim-1", 16, seed=1), headers=expired), 401, "expired")
    # forged: the claims changed after signing (another subject), the signature kept
    envelope = bytearray(from_header(deployment.rights(sessions=["victim-1"])[HEADER]))
    at = bytes(envelope).index(b"alice")
    envelope[at:at + 5] = b"mallo"
    forged = {HEADER: to_header(bytes(envelope))}
    _refusal(client.post("/v1/split", content=split_body("victim-1", 16, seed=2), headers=forged), 401,
             "bad_signature")
    # forged: signed by the issuer's kid but another key, over any claims the forger likes
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    protected, _, payload, _ = cbor.decode(bytes(envelope), tags={18}).value
    other = sign_raw(payload, Ed25519PrivateKey.generate(), protected=protected)
    _refusal(client.post("/v1/split", content=split_body("victim-1", 16, seed=3), headers={HEADER: to_header(other)}),
             401, "bad_signature")
    for body in (b"{", b'{"texts": ["a"]}'):
        _refusal(client.post("/v1/classify", content=body, headers=expired), 400 if body == b"{" else 401,
                 "bad_request" if body == b"{" else "expired")
    assert _state(gate, "victim-1") == before and snapshot(deployment.released.url) == ledger


def test_a_caller_replaying_another_callers_session_id_is_refused(shared):
    deployment, client, gate = shared
    _spend_once(deployment, client, "alice-session")
    before = _state(gate, "alice-session")
    # mallory's own envelope does not name alice's session
    uncovered = deployment.rights("mallory", sessions=["mallory-session"])
    _refusal(client.post("/v1/split", content=split_body("alice-session", 16, seed=1), headers=uncovered), 403,
             "session_not_covered")
    # even an envelope that names it (an issuer that reused an id) cannot spend it: the session is alice's
    named = deployment.rights("mallory", sessions=["alice-session"])
    detail = _refusal(client.post("/v1/split", content=split_body("alice-session", 16, seed=2), headers=named), 403,
                      "session_owner_mismatch")
    assert "spent" not in detail  # nor learns how much alice has left
    assert _state(gate, "alice-session") == before  # its owner, its spend and its debits
    # alice's own session carries on
    _spend_once(deployment, client, "alice-session")
    assert _state(gate, "alice-session")[0] == before[0] + 1


def test_envelopes_for_another_deployment_or_beyond_their_issuer_are_refused(deployment: Deployment):
    from govtrain.serve.rights import issue_rights

    text = deployment.policy_path.read_text()
    deployment.policy_path.write_text(text.replace('public_key_file = "issuer.pub"',
                                                   'public_key_file = "issuer.pub"\nclasses = ["public"]'))
    with deployment.serving() as (client, _):
        beyond = deployment.rights(classes=["public", "sensitive"])
        _refusal(client.post("/v1/classify", json={"texts": TEXTS}, headers=beyond), 403, "key_not_authorized")
        envelope, _ = issue_rights(deployment.issuer, subject="alice", audience="elsewhere.invalid/gate",
                                   classes=["public"], valid_seconds=60, now=int(deployment.now()))
        _refusal(client.post("/v1/classify", json={"texts": TEXTS}, headers={HEADER: to_header(envelope)}), 403,
                 "wrong_audience")


# -- the operator -----------------------------------------------------------------------------------------------


def _start_refused(deployment: Deployment, code: Code) -> ConfigError:
    with pytest.raises(ConfigError) as refused:
        deployment.start()
    assert refused.value.code is code, refused.value.line()
    return refused.value


def test_an_operator_serving_an_adapter_other_than_the_released_one_is_refused_at_start(deployment: Deployment,
                                                                                          tmp_path: Path):
    folder = deployment.released.adapter
    weights = folder / "restricted" / "adapter_model.safetensors"
    original = weights.read_bytes()
    weights.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    assert "changed: restricted/adapter_model.safetensors" in _start_refused(deployment, Code.SUBJECT_MISMATCH).detail
    weights.write_bytes(original)
    (folder / "extra").mkdir()
    (folder / "extra" / "adapter_config.json").write_text("{}")  # another adapter slipped in beside the released
    assert "not in the release: extra/adapter_config.json" in _start_refused(deployment,
                                                                             Code.SUBJECT_MISMATCH).detail
    shutil.rmtree(folder / "extra")
    (folder / "tokenizer.json").unlink()
    assert "missing: tokenizer.json" in _start_refused(deployment, Code.SUBJECT_MISMATCH).detail
    # through the command: a copy of the folder whose weights another training moved (one byte here)
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    moved = other / "adapter_model.safetensors"
    data = moved.read_bytes()
    moved.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    result = CliRunner().invoke(cli, ["serve", "--release", str(deployment.root / "release.dsse"), "--adapter",
                                      str(other), "--policy", str(deployment.policy_path), "--base",
                                      str(deployment.released.base)])
    assert result.exit_code == 2 and result.stderr.startswith("error[subject_mismatch]")
    assert result.stderr.count("\n") == 1 and not result.stdout


def test_a_manifest_not_signed_by_the_pinned_release_key_is_refused_at_start(deployment: Deployment):
    from govtrain.attest.keys import generate_key_pair, load_private_key

    from govtrain.release import dsse

    generate_key_pair(deployment.root, "rogue")  # the same statement, signed by a key the policy does not pin
    statement = dsse.parse(deployment.envelope).payload
    (deployment.root / "release.dsse").write_bytes(dsse.sign(statement, load_private_key(deployment.root /
                                                                                         "rogue.key")).to_json())
    refused = _start_refused(deployment, Code.UNKNOWN_KEY)
    assert refused.exit_code == 2


def test_a_database_writer_cannot_stretch_the_grace_period_by_moving_a_withdrawals_time(deployment: Deployment,
                                                                                       caplog):
    """Attack: the inference policy grants a grace period after a release's first withdrawal since it; a database
    writer moves that withdraw row's `time` column a day ahead (body, leaf and checkpoints untouched). The gate read
    the withdrawal's time from that column, so the grace period ran a day longer. Adversary: a database writer
    without keys. Impact: a tainted release served past its grace period. Fix: the time is the withdraw entry's
    body's, and a signed read refuses a row whose time or kind column contradicts its body (`bad_entry`): the gate
    refuses (`taint_unknown`) until the ledger reads clean."""
    import sqlite3

    deployment.policy_path.write_text(deployment.policy_path.read_text().replace(
        'ledger = "', 'grace_period_seconds = 600\ntaint_check_seconds = 0\nledger = "'))
    with deployment.serving() as (client, gate):
        with deployment.released.open() as ledger:
            withdrawn = ledger.withdraw("pub", "the contributor asked",  # now: the release may be older than 600 s
                                        now=max(ledger.store.head().time, int(deployment.clock[0])))
        served = client.post("/v1/classify", json={"texts": TEXTS}, headers=deployment.rights())
        assert served.status_code == 200 and served.json()["grace_until"] == withdrawn.time + 600
        db = sqlite3.connect(deployment.released.root / "ledger.db")
        for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'").fetchall():
            db.execute(f"DROP TRIGGER {name}")
        db.execute(f"UPDATE entries SET time = time + 86400 WHERE seq = {withdrawn.seq}")
        db.commit()
        db.close()
        deployment.clock[0] = withdrawn.time + 600  # the grace period is over
        with caplog.at_level("WARNING", logger="govtrain.serve"):
            _refusal(client.post("/v1/classify", json={"texts": TEXTS},
                                 headers=deployment.rights(now=withdrawn.time + 599)), 503, "taint_unknown")
        # the caller gets a fixed detail; the cause is the gate's log's
        assert any("error[bad_entry]" in r.getMessage() and "govtrain-verify" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]


# -- hostile clients --------------------------------------------------------------------------------------------


def test_oversized_bodies_are_refused_413_before_they_are_read(shared):
    deployment, client, gate = shared
    _spend_once(deployment, client, "big")
    before = _state(gate, "big")
    limit = gate.policy.max_body_bytes
    headers = deployment.rights(sessions=["big"])
    _refusal(client.post("/v1/split", content=b" " * (limit + 1), headers=headers), 413, "request_too_large")

    def chunks():  # no Content-Length: chunked transfer, counted as it arrives
        for _ in range(limit // 65_536 + 2):
            yield b" " * 65_536

    _refusal(client.post("/v1/classify", content=chunks(), headers=headers), 413, "request_too_large")
    _refusal(client.post("/v1/classify", json={"texts": ["x" * 5000]}, headers=headers), 413, "request_too_large")
    _refusal(client.post("/v1/classify", json={"texts": ["a"] * 33}, headers=headers), 400, "bad_request")
    assert _state(gate, "big") == before


def test_malformed_json_and_cbor_are_refused_with_their_codes(shared):
    deployment, client, gate = shared
    headers = deployment.rights(sessions=["malformed"])
    for body, code in ((b"{", "bad_request"), (b"[]", "bad_request"), (b'{"texts": "a"}', "bad_request"),
                       (b'{"texts": ["a"], "admin": true}', "bad_request"), (b"\xff\xfe", "bad_request")):
        _refusal(client.post("/v1/classify", content=body, headers=headers), 400, code)
    _refusal(client.post("/v1/split", content=b"{", headers=headers), 400, "bad_split_request")
    _refusal(client.post("/v1/split", content=split_body("malformed", 16, edit=lambda d: d.update(vector="x")),
                         headers=headers), 400, "bad_split_request")
    envelope = from_header(headers[HEADER])
    for raw, code in ((envelope + b"\x00", "trailing_bytes"), (envelope[:-5], "malformed_cbor"),
                      (b"\xd2\x84" + b"\x5f" + envelope[3:], "indefinite_length"), (b"\x00" * 8, "not_cose_sign1")):
        _refusal(client.post("/v1/classify", json={"texts": TEXTS}, headers={HEADER: to_header(raw)}), 401, code)
    _refusal(client.post("/v1/classify", json={"texts": TEXTS}, headers={HEADER: "not base64!"}), 401,
             "rights_unreadable")
    _refusal(client.get("/v1/nothing"), 404, "not_served")
    assert _state(gate, "malformed") is None


def test_nan_infinite_or_misshapen_vectors_are_refused_and_charge_nothing(shared):
    deployment, client, gate = shared
    _spend_once(deployment, client, "vectors")
    before = _state(gate, "vectors")
    headers = deployment.rights(sessions=["vectors"])
    honest = json.loads(split_body("vectors", 16, seed=9))
    for literal in ("NaN", "Infinity", "-Infinity", "1e999"):
        text = json.dumps({**honest, "vector": [0.0] * 16}).replace("[0.0,", f"[{literal},", 1).encode()
        answer = client.post("/v1/split", content=text, headers=headers)
        assert answer.status_code in (400, 422) and answer.json()["code"] in ("bad_split_request", "bad_vector"), \
            answer.text
    _refusal(client.post("/v1/split", content=split_body("vectors", 15), headers=headers), 422, "bad_vector")
    _refusal(client.post("/v1/split", content=split_body("vectors", 16, edit=lambda d: d.update(
        vector=[0.0] * 16)), headers=headers), 422, "noise_implausible")  # no noise at all
    assert _state(gate, "vectors") == before


def test_huge_or_out_of_policy_privacy_terms_are_refused_and_charge_nothing(shared):
    deployment, client, gate = shared
    _spend_once(deployment, client, "terms")
    before = _state(gate, "terms")
    headers = deployment.rights(sessions=["terms"])
    for edit, words in ((lambda d: d.update(epsilon=1e300), "epsilon"), (lambda d: d.update(epsilon=-1.0), "epsilon"),
                        (lambda d: d.update(epsilon=1e9), "epsilon")):
        detail = _refusal(client.post("/v1/split", content=split_body("terms", 16, edit=edit), headers=headers), 422,
                          "bad_privacy_request")
        assert words in detail
    for options, words in (({"epsilon": 8.0}, "outside [0.5, 2]"), ({"epsilon": 0.1}, "outside [0.5, 2]"),
                           ({"delta": 1e-5}, "exceeds"), ({"clip_norm": 50.0}, "not the policy's 1")):
        detail = _refusal(client.post("/v1/split", content=split_body("terms", 16, **options), headers=headers), 422,
                          "bad_privacy_request")
        assert words in detail, detail
    assert _state(gate, "terms") == before
