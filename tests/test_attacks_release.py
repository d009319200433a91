"""Attacks on a release manifest (docs/release-manifest.md, docs/threat-model.md): whoever holds the file between
the operator and its user, and an operator who holds the release key. Each test asserts the specific error code
and that nothing changed: the ledger (size, head, admissions), the adapter folder's files, no file written.

A key holder can sign anything, so what binds the release to the run is what the key cannot forge: the run entry's
inclusion proof under a checkpoint signed by a ledger key the auditor pins, the subjects hashing to the adapter hash
that entry records, and, against the live ledger, every ledger-derived figure of the predicate.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Callable

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from click.testing import CliRunner  # noqa: E402
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402

from govtrain.attest.keys import raw_public_key  # noqa: E402
from govtrain.cli.main import cli  # noqa: E402
from govtrain.errors import Code, GovtrainError  # noqa: E402
from govtrain.ledger.checkpoint import sign_checkpoint  # noqa: E402
from govtrain.ledger.proof import parse_proof  # noqa: E402
from govtrain.release import dsse  # noqa: E402
from govtrain.release.artifact import folder_files  # noqa: E402
from tests.conftest import snapshot  # noqa: E402
from tests.release_setup import ORIGIN, RUN_ID, Released, trained_release  # noqa: E402


@pytest.fixture
def released(tmp_path_factory, tmp_path: Path) -> Released:
    return trained_release(tmp_path_factory).copy(tmp_path / "copy")


@pytest.fixture
def envelope(released: Released) -> bytes:
    return released.build()


def _statement(envelope: bytes) -> dict:
    return json.loads(base64.b64decode(json.loads(envelope)["payload"]))


def _edit(envelope: bytes, change: Callable[[dict], None], *, key: Ed25519PrivateKey | None = None) -> bytes:
    """The envelope with its statement changed: under the original signature, or signed again by `key` (what a
    release key holder can do)."""
    statement = _statement(envelope)
    change(statement)
    body = json.dumps(statement, sort_keys=True, separators=(",", ":")).encode()
    if key is not None:
        return dsse.sign(body, key).to_json()
    document = json.loads(envelope)
    document["payload"] = base64.b64encode(body).decode()
    return json.dumps(document).encode()


def _refused(released: Released, envelope: bytes, code: Code, **options) -> GovtrainError:
    """Verification raises `code`, and changes neither the ledger nor the adapter folder."""
    ledger, files = snapshot(released.url), folder_files(released.adapter)
    with pytest.raises(GovtrainError) as caught:
        released.verify(envelope, **options)
    assert caught.value.code == code, caught.value.line()
    assert snapshot(released.url) == ledger and folder_files(released.adapter) == files
    return caught.value


# -- the files ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["byte", "extra", "missing", "card"])
def test_a_changed_added_or_removed_file_fails_against_the_folder(released: Released, envelope: bytes, damage: str):
    weights = released.adapter / "restricted" / "adapter_model.safetensors"
    if damage == "byte":
        raw = bytearray(weights.read_bytes())
        raw[len(raw) // 2] ^= 1
        weights.write_bytes(bytes(raw))
    elif damage == "extra":
        (released.adapter / "notes.txt").write_text("added after the release")
    elif damage == "missing":
        weights.unlink()
    else:  # the card is a subject too, though the adapter hash leaves it out
        (released.adapter / "README.md").write_text("edited on the Hub: ε 0.0001")
    error = _refused(released, envelope, Code.SUBJECT_MISMATCH, adapter=released.adapter)
    assert {"byte": "changed: restricted/adapter_model.safetensors", "extra": "not in the release: notes.txt",
            "missing": "missing: restricted/adapter_model.safetensors", "card": "changed: README.md"}[damage] \
        in error.detail
    released.verify(envelope)  # the manifest itself is intact


# -- the envelope ------------------------------------------------------------------------------------------


def test_a_predicate_field_changed_under_the_signature_fails(released: Released, envelope: bytes):
    def lower_epsilon(statement: dict) -> None:
        for item in statement["predicate"]["classes"]:
            item["eps_u"] = 1
        for group in statement["predicate"]["groups"]:
            for item in group["classes"]:
                item["eps_u"] = 1

    _refused(released, _edit(envelope, lower_epsilon), Code.BAD_SIGNATURE)


@pytest.mark.parametrize("damage, code", [
    ("flip", Code.BAD_SIGNATURE), ("none", Code.BAD_ENVELOPE), ("other key", Code.UNKNOWN_KEY),
    ("payload type", Code.BAD_ENVELOPE), ("two payloads", Code.BAD_ENVELOPE)])
def test_a_damaged_or_foreign_signature_fails(released: Released, envelope: bytes, damage: str, code: Code):
    document = json.loads(envelope)
    if damage == "flip":
        sig = bytearray(base64.b64decode(document["signatures"][0]["sig"]))
        sig[0] ^= 1
        document["signatures"][0]["sig"] = base64.b64encode(bytes(sig)).decode()
    elif damage == "none":
        document["signatures"] = []
    elif damage == "other key":
        document = json.loads(dsse.sign(base64.b64decode(document["payload"]), Ed25519PrivateKey.generate()).to_json())
    elif damage == "payload type":
        document["payloadType"] = "application/json"
    raw = json.dumps(document).encode()
    if damage == "two payloads":
        raw = raw[:-1] + b', "payload": "e30="}'
    _refused(released, raw, code)


def test_an_unknown_release_key_pinned_fails(released: Released, envelope: bytes):
    other = raw_public_key(Ed25519PrivateKey.generate().public_key())
    _refused(released, envelope, Code.UNKNOWN_KEY, release_key=other)


def test_a_key_the_policy_does_not_name_cannot_release(released: Released, tmp_path: Path):
    before = snapshot(released.url)
    result = CliRunner().invoke(cli, ["release", "--run", RUN_ID, "--adapter", str(released.adapter), "--out",
                                      str(tmp_path / "r.dsse"), "--ledger", released.url, "--key",
                                      str(released.keys / "attester.key"), "--base", str(released.base)])
    assert result.exit_code == 3 and "error[key_not_authorized]" in result.output, result.output
    assert not (tmp_path / "r.dsse").exists() and snapshot(released.url) == before
    # Signed outside govtrain with such a key, an auditor who pins it is told so by the ledger.
    from govtrain.release.manifest import release_statement
    from govtrain.release.predicate import statement_bytes

    with released.open() as ledger:
        statement = release_statement(ledger, RUN_ID, released.adapter, key=released.release_key, base=released.base)
    rogue = Ed25519PrivateKey.generate()
    forged = dsse.sign(statement_bytes(statement), rogue).to_json()
    pinned = raw_public_key(rogue.public_key())
    released.verify(forged, release_key=pinned)  # offline, the auditor's pin is the trust
    _refused(released, forged, Code.KEY_NOT_AUTHORIZED, release_key=pinned, ledger=released.url)


# -- the proof and the checkpoint --------------------------------------------------------------------------


def _proof_edit(edit: Callable[[str], str]) -> Callable[[dict], None]:
    def change(statement: dict) -> None:
        statement["predicate"]["ledger"]["proof"] = edit(statement["predicate"]["ledger"]["proof"])
    return change


def test_a_changed_inclusion_proof_fails_even_signed_again(released: Released, envelope: bytes):
    key = released.release_key
    proof = parse_proof(_statement(envelope)["predicate"]["ledger"]["proof"])
    sibling = base64.b64encode(proof.hashes[0]).decode()
    flipped = base64.b64encode(bytes([proof.hashes[0][0] ^ 1]) + proof.hashes[0][1:]).decode()
    _refused(released, _edit(envelope, _proof_edit(lambda text: text.replace(sibling, flipped)), key=key),
             Code.BAD_PROOF)
    _refused(released, _edit(envelope, _proof_edit(lambda text: text.replace(f"index {proof.index}\n",
                                                                              f"index {proof.index - 1}\n")), key=key),
             Code.BAD_PROOF)
    _refused(released, _edit(envelope, _proof_edit(lambda text: text.replace("c2sp.org/tlog-proof@v1", "proof")),
                             key=key), Code.BAD_PROOF)


def test_a_changed_or_foreign_checkpoint_fails_even_signed_again(released: Released, envelope: bytes):
    key = released.release_key
    proof = parse_proof(_statement(envelope)["predicate"]["ledger"]["proof"])
    note = proof.checkpoint_note
    root = note.split("\n")[2]
    other_root = base64.b64encode(bytes(32)).decode()
    _refused(released, _edit(envelope, _proof_edit(lambda text: text.replace(root, other_root)), key=key),
             Code.BAD_CHECKPOINT)
    # A whole ledger of the attacker's: its own key signs a checkpoint of the same origin over a tree holding the
    # run entry, with a proof that checks against it. The auditor pinned the real ledger key.
    from govtrain.ledger.merkle import leaf_hash

    forged = sign_checkpoint(ORIGIN, 1, leaf_hash(proof.entry), Ed25519PrivateKey.generate()).note
    text = proof.text().split("\n\n", 1)[0].replace(f"index {proof.index}", "index 0").split("\n")[:3]
    fake = "\n".join(text) + "\n\n" + forged

    def whole(statement: dict) -> None:
        statement["predicate"]["ledger"]["proof"] = fake
        statement["predicate"]["ledger"]["checkpoint_size"] = 1
        statement["predicate"]["run"]["seq"] = 0

    _refused(released, _edit(envelope, whole, key=key), Code.BAD_CHECKPOINT)
    _refused(released, _edit(envelope, lambda s: s["predicate"]["ledger"].update(checkpoint_size=3), key=key),
             Code.PREDICATE_MISMATCH)
    _refused(released, envelope, Code.BAD_CHECKPOINT, ledger_keys=[raw_public_key(
        Ed25519PrivateKey.generate().public_key())])


# -- an operator holding the release key -------------------------------------------------------------------


def test_an_operator_cannot_release_another_adapter_as_the_runs(released: Released, envelope: bytes, tmp_path: Path):
    # govtrain release refuses a folder whose files are not the run entry's adapter; nothing is written.
    weights = released.adapter / "adapter_model.safetensors"
    original = weights.read_bytes()
    weights.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    before = snapshot(released.url)
    result = CliRunner().invoke(cli, ["release", "--run", RUN_ID, "--adapter", str(released.adapter), "--out",
                                      str(tmp_path / "r.dsse"), "--ledger", released.url, "--key",
                                      str(released.release_key_path), "--base", str(released.base)])
    assert result.exit_code == 4 and "error[adapter_mismatch]" in result.output, result.output
    assert not (tmp_path / "r.dsse").exists() and snapshot(released.url) == before
    # Signed by hand over the other folder's files, the subjects do not hash to what the run entry records.
    digest = folder_files(released.adapter)["adapter_model.safetensors"].hex()

    def other_weights(statement: dict) -> None:
        for subject in statement["subject"]:
            if subject["name"] == "adapter_model.safetensors":
                subject["digest"]["sha256"] = digest

    forged = _edit(envelope, other_weights, key=released.release_key)
    _refused(released, forged, Code.ADAPTER_MISMATCH, adapter=released.adapter)
    weights.write_bytes(original)
    # Serving another folder under the true release: the folder check names it.
    released.verify(envelope, adapter=released.adapter)
    weights.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    _refused(released, envelope, Code.SUBJECT_MISMATCH, adapter=released.adapter)


def test_a_key_holder_who_restates_the_run_is_caught_offline(released: Released, envelope: bytes):
    key = released.release_key
    for change in (lambda s: s["predicate"]["run"].update(seq=s["predicate"]["run"]["seq"] - 1),
                   lambda s: s["predicate"]["run"].update(mechanism="prism"),
                   lambda s: s["predicate"]["base_model"].update(sha256="0" * 64),
                   lambda s: s["predicate"]["privacy"].update(mechanism="dp-muon")):
        _refused(released, _edit(envelope, change, key=key), Code.PREDICATE_MISMATCH)

    def public_adapter_only(statement: dict) -> None:  # so that a gate would merely disable an adapter
        for item in statement["predicate"]["classes"]:
            if item["data_class"] == "public":
                item["adapter"] = "default"

    _refused(released, _edit(envelope, public_adapter_only, key=key), Code.BAD_STATEMENT)


def test_a_key_holder_who_understates_epsilon_or_hides_a_withdrawal_is_caught_by_the_ledger(released: Released):
    with released.open() as ledger:
        ledger.withdraw("sens", "before the release")
    envelope = released.build(confirm=True)
    key = released.release_key

    def lower_epsilon(statement: dict) -> None:
        for item in statement["predicate"]["classes"]:
            item["eps_u"] //= 10
        for group in statement["predicate"]["groups"]:
            for item in group["classes"]:
                item["eps_u"] //= 10

    for change in (lower_epsilon, lambda s: s["predicate"].update(withdrawn=[]),
                   lambda s: s["predicate"]["privacy"].update(delta_p=1)):
        forged = _edit(envelope, change, key=key)
        released.verify(forged)  # offline these are the key holder's statement (docs/release-manifest.md)
        _refused(released, forged, Code.PREDICATE_MISMATCH, ledger=released.url)


# -- the live ledger ---------------------------------------------------------------------------------------


def test_a_withdrawal_after_the_release_taints_it_and_the_command_exits_6(released: Released, tmp_path: Path):
    path = tmp_path / "release.dsse"
    path.write_bytes(released.build())
    with released.open() as ledger:
        ledger.withdraw("restr", "the contributor asked")
    before, files = snapshot(released.url), folder_files(released.adapter)
    result = CliRunner().invoke(cli, ["release", "verify", str(path), "--key", str(released.keys / "release.pub"),
                                      "--ledger-key", str(released.keys / "ledger.pub"), "--ledger", released.url,
                                      "--json"])
    assert result.exit_code == 6, result.output
    report = json.loads(result.stdout)
    assert report["tainted"] and [w["contribution_id"] for w in report["withdrawn_since"]] == ["restr"]
    assert report["withdrawn_since"][0]["data_class"] == "restricted"
    assert snapshot(released.url) == before and folder_files(released.adapter) == files


def test_a_rolled_back_or_forked_ledger_fails(released: Released, tmp_path: Path):
    earlier = released.copy(tmp_path / "earlier")  # the ledger before the entries the release covers
    with released.open() as ledger:
        ledger.withdraw("pub", "one branch")
    envelope = released.build(confirm=True)  # (a run trained on pub: signed all the same)
    _refused(released, envelope, Code.ROLLBACK, ledger=earlier.url)
    with earlier.open() as ledger:
        ledger.withdraw("sens", "another branch")  # the same size, another tree
    _refused(released, envelope, Code.FORK, ledger=earlier.url)
