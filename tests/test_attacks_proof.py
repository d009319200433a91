"""Attacks on offline proofs: each is refused with its code, nothing changed.

- A proof from another ledger signed with the same key must not pass for this ledger: the verifier
  names the origin it expects (`--origin` or a C2SP verifier key), never reads it from the proof.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from govtrain.attest.keys import load_public_key
from govtrain.cli.main import cli
from govtrain.errors import IntegrityError
from govtrain.gate.admission import admit
from govtrain.ledger.checkpoint import NoteKey
from govtrain.ledger.proof import verify_proof
from tests.conftest import TEST_POLICY, Corpus, make_corpus, snapshot

ORIGIN_A = "test.invalid/govtrain/1"
ORIGIN_B = "test.invalid/govtrain/2"
KEY_NAME = ORIGIN_A  # both ledgers sign under the same key and the same key name


def _admit(corpus: Corpus, name: str) -> None:
    data = corpus.data(f"{name}.jsonl")
    with corpus.open() as ledger:
        admit(ledger, corpus.attestation(data, contribution_id=name), data, now=corpus.now)


def _prove(corpus: Corpus, contribution_id: str, out: Path) -> Path:
    result = CliRunner().invoke(cli, ["ledger", "prove", contribution_id, "--ledger", corpus.url, "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


# -- a proof is checked against the origin the verifier expects, never the proof's own --------


@pytest.fixture
def two_ledgers(tmp_path: Path) -> tuple[Corpus, Corpus]:
    """Two ledgers, two origins, one ledger key (and key name): each admits one contribution."""
    a = make_corpus(tmp_path / "a", f"sqlite:///{tmp_path / 'a.db'}")
    policy_b = TEST_POLICY.replace(f'origin = "{ORIGIN_A}"', f'origin = "{ORIGIN_B}"')
    assert policy_b != TEST_POLICY and f'name = "{KEY_NAME}"' in policy_b
    b = make_corpus(tmp_path / "b", f"sqlite:///{tmp_path / 'b.db'}", policy_b)
    _admit(a, "in-a")
    _admit(b, "in-b")
    return a, b


def test_a_proof_from_another_ledger_under_the_same_key_is_refused(two_ledgers, tmp_path: Path):
    a, b = two_ledgers
    before = snapshot(a.url), snapshot(b.url)
    foreign = _prove(b, "in-b", tmp_path / "b.proof").read_text()
    key = NoteKey(KEY_NAME, load_public_key(a.dir / "ledger.pub"))
    with pytest.raises(IntegrityError) as info:
        verify_proof(foreign, [key], origin=ORIGIN_A)
    assert info.value.code.value == "bad_proof" and ORIGIN_B in info.value.detail
    # The same over the command line: exit 4, one error[bad_proof] line.
    pub = str(a.dir / "ledger.pub")
    result = CliRunner().invoke(cli, ["ledger", "verify-proof", str(tmp_path / "b.proof"), "--key", pub,
                                      "--origin", ORIGIN_A, "--name", KEY_NAME])
    assert result.exit_code == 4, result.output
    assert result.stderr.startswith("error[bad_proof]: ") and result.stderr.count("\n") == 1
    # With the verifier key string (its name is the key name; here also ledger A's origin).
    result = CliRunner().invoke(cli, ["ledger", "verify-proof", str(tmp_path / "b.proof"), "--vkey", key.vkey()])
    assert result.exit_code == 4 and result.stderr.startswith("error[bad_proof]: "), result.output
    assert (snapshot(a.url), snapshot(b.url)) == before


def test_verify_proof_needs_the_origin(two_ledgers, tmp_path: Path):
    a, _ = two_ledgers
    proof = _prove(a, "in-a", tmp_path / "a.proof")
    key = NoteKey(KEY_NAME, load_public_key(a.dir / "ledger.pub"))
    with pytest.raises(TypeError):
        verify_proof(proof.read_text(), [key])  # type: ignore[call-arg]  # no silent fallback to the proof's origin
    result = CliRunner().invoke(cli, ["ledger", "verify-proof", str(proof), "--key", str(a.dir / "ledger.pub")])
    assert result.exit_code == 2 and result.stderr.startswith("error[usage]: ") and "--origin" in result.stderr
    assert result.stderr.count("\n") == 1


def test_the_right_origin_passes(two_ledgers, tmp_path: Path):
    a, b = two_ledgers
    key = NoteKey(KEY_NAME, load_public_key(a.dir / "ledger.pub"))
    for corpus, origin, name in ((a, ORIGIN_A, "in-a"), (b, ORIGIN_B, "in-b")):
        proof = _prove(corpus, name, tmp_path / f"{name}.proof")
        assert verify_proof(proof.read_text(), [key], origin=origin).entry["contribution_id"] == name
        result = CliRunner().invoke(cli, ["ledger", "verify-proof", str(proof), "--key", str(corpus.dir / "ledger.pub"),
                                          "--origin", origin, "--name", KEY_NAME, "--json"])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["origin"] == origin
    # Ledger A's key name is its origin, so --origin alone (or --vkey alone) is enough there.
    proof = tmp_path / "in-a.proof"
    assert CliRunner().invoke(cli, ["ledger", "verify-proof", str(proof), "--key", str(a.dir / "ledger.pub"),
                                    "--origin", ORIGIN_A]).exit_code == 0
    assert CliRunner().invoke(cli, ["ledger", "verify-proof", str(proof), "--vkey", key.vkey()]).exit_code == 0
