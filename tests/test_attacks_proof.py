"""Attacks on offline proofs and on the bulk integrity pass: each is refused with its code, nothing changed.

- A proof from another ledger signed with the same key must not pass for this ledger: the verifier
  names the origin it expects (`--origin` or a C2SP verifier key), never reads it from the proof.
- `govtrain-verify --integrity-only` must refuse a missing body outside the redactable kinds, and a
  `kind` column that disagrees with the signed body, without decoding entries.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner

from govtrain.attest.keys import load_public_key
from govtrain.cli.main import cli
from govtrain.cli.verify import verify_cli
from govtrain.errors import IntegrityError
from govtrain.gate.admission import admit
from govtrain.ledger.checkpoint import NoteKey
from govtrain.ledger.entries import run_entry
from govtrain.ledger.proof import verify_proof
from govtrain.verify.verifier import verify_ledger
from tests.conftest import Corpus, TEST_POLICY, append_runs, make_corpus, snapshot, lease, noise_groups_for
from tests.test_signed_ledger import _copy, _db

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


def _tamper(url: str, statement: str, params: tuple = ()) -> None:
    """What a database writer without the ledger's keys can do: drop the triggers, then edit rows."""
    connection = sqlite3.connect(_db(url))
    for (name,) in connection.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'").fetchall():
        connection.execute(f"DROP TRIGGER {name}")
    connection.execute(statement, params)
    connection.commit()
    connection.close()


def _rows(url: str) -> list[tuple]:
    connection = sqlite3.connect(_db(url))
    rows = connection.execute("SELECT seq, kind, time, leaf_hash, body FROM entries ORDER BY seq").fetchall()
    connection.close()
    return rows


def _integrity_only(url: str) -> tuple[int, dict, str]:
    result = CliRunner().invoke(verify_cli, ["--ledger", url, "--integrity-only", "--json"])
    return result.exit_code, json.loads(result.stdout), result.stderr


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


# -- --integrity-only: missing bodies and edited kind columns --------------------------------


@pytest.fixture
def ledger(corpus: Corpus) -> Corpus:
    """Admissions, a spend, a run and epochs: every kind a NULL body must not hide."""
    from govtrain.ledger.entries import spend_entry
    from govtrain.verify.verifier import recorded_accountant

    eps_u = recorded_accountant("prv", 10_000_000, [(10_000, 1_000_000, 10)])
    _admit(corpus, "c-0")
    _admit(corpus, "c-1")
    with corpus.open() as opened:
        leaf = opened.store.entry(1).leaf_hash
        groups = noise_groups_for(opened, ["c-0"])
        with opened.append(corpus.now) as appender:
            appender.add("spend", corpus.now, lambda seq: spend_entry(
                seq, corpus.now, contribution_id="c-0", admit_leaf=leaf, run_id="r0", run_nonce=lease("r0"), epoch=0,
                epoch_steps=10, steps=10, sampling_rate_u=10_000,
                noise_multiplier_u=1_000_000, accountant="prv", delta_p=10_000_000, privacy_unit="example",
                eps_u=eps_u, noise_groups=groups))
            appender.add("run", corpus.now, lambda seq: run_entry(
                seq, corpus.now, run_id="r0", run_nonce=lease("r0"), mechanism="dpsgd", device="cpu", precision="fp32", config_sha256=bytes(32),
                base_model_sha256=bytes(32), adapter_sha256=None))
        opened.close_epoch(now=corpus.now)
    verify_ledger(corpus.url)  # the full pass accepts it as written
    return corpus


def _seq_of(url: str, kind: str) -> int:
    return next(seq for seq, k, *_ in _rows(url) if k == kind)


def test_untampered_ledger_passes_integrity_only(ledger: Corpus):
    kinds = [k for _, k, *_ in _rows(ledger.url)]
    assert {"header", "admit", "spend", "run", "epoch"} <= set(kinds)
    exit_code, report, _ = _integrity_only(ledger.url)
    assert exit_code == 0 and report["ok"], report
    result = CliRunner().invoke(verify_cli, ["--ledger", ledger.url, "--integrity-only"])
    assert result.exit_code == 0 and "not checked" in result.stdout.lower()


@pytest.mark.parametrize("kind", ["epoch", "run", "header", "policy"])
def test_null_body_outside_the_redactable_kinds_is_refused(ledger: Corpus, kind: str):
    if kind == "policy":  # a later policy entry, as a key rotation writes
        with ledger.open() as opened:
            opened.change_policy(opened.policy, bytes(32), "same policy, recorded again", now=ledger.now)
    if kind == "header":  # a header-kind row past entry 0: an epoch relabelled, then its body dropped
        seq = _seq_of(ledger.url, "epoch")
        _tamper(ledger.url, "UPDATE entries SET kind = 'header' WHERE seq = ?", (seq,))
    else:
        seq = _seq_of(ledger.url, kind)
    before = _rows(ledger.url)
    _tamper(ledger.url, "UPDATE entries SET body = NULL WHERE seq = ?", (seq,))
    tampered = _rows(ledger.url)
    exit_code, report, stderr = _integrity_only(ledger.url)
    assert (exit_code, report["code"], report["first_bad_entry"]) == (4, "bad_entry", seq), report
    assert f"entry {seq}" in report["detail"] and stderr.startswith("error[bad_entry]")
    assert _rows(ledger.url) == tampered and len(tampered) == len(before)  # the verifier wrote nothing


@pytest.mark.parametrize("from_kind,to_kind", [("spend", "epoch"), ("admit", "run"), ("epoch", "spend"),
                                               ("header", "admit"), ("run", "summary")])
def test_edited_kind_column_is_refused(ledger: Corpus, from_kind: str, to_kind: str):
    seq = _seq_of(ledger.url, from_kind)
    _tamper(ledger.url, "UPDATE entries SET kind = ? WHERE seq = ?", (to_kind, seq))
    tampered = _rows(ledger.url)
    exit_code, report, stderr = _integrity_only(ledger.url)
    assert (exit_code, report["code"], report["first_bad_entry"]) == (4, "bad_entry", seq), report
    assert f"entry {seq}" in report["detail"] and repr(to_kind) in report["detail"]
    assert stderr.startswith("error[bad_entry]")
    assert _rows(ledger.url) == tampered
    # The full pass agrees.
    with pytest.raises(IntegrityError):
        verify_ledger(ledger.url)


def test_relabelled_and_redacted_entry_is_left_to_the_full_pass(ledger: Corpus):
    """An epoch relabelled as spend and its body dropped looks like a redaction to the bulk pass (whose
    output says it does not check redaction coverage); the full pass refuses it: no summary covers it."""
    seq = _seq_of(ledger.url, "epoch")
    _tamper(ledger.url, "UPDATE entries SET kind = 'spend', body = NULL WHERE seq = ?", (seq,))
    with pytest.raises(IntegrityError) as info:
        verify_ledger(ledger.url)
    assert info.value.code.value == "bad_entry"


def test_kind_check_on_the_parallel_path(corpus: Corpus, tmp_path: Path):
    """Past 2^16 entries the bulk pass splits between two processes; both halves check kinds."""
    with corpus.open() as opened:
        append_runs(opened, 70_000, corpus.now)
    assert _integrity_only(corpus.url)[0] == 0
    for seq, statement in ((30_000, "UPDATE entries SET kind = 'epoch' WHERE seq = ?"),
                           (69_000, "UPDATE entries SET body = NULL WHERE seq = ?")):
        url = _copy(corpus.url, tmp_path / f"copy-{seq}.db")
        _tamper(url, statement, (seq,))
        exit_code, report, _ = _integrity_only(url)
        assert (exit_code, report["code"], report["first_bad_entry"]) == (4, "bad_entry", seq), report


@pytest.mark.parametrize("seq", [1, 23, 24, 255, 256, 65_535, 65_536, (1 << 32) - 1, 1 << 32])
def test_envelope_check_reads_every_kind_at_every_seq_width(seq: int):
    """The bulk check reads the kind each builder writes, for every width of the sequence number, without
    falling back to decoding, and refuses every other label."""
    from govtrain.encoding import cbor
    from govtrain.ledger.entries import _TEMPLATES, ENTRY_VERSION, SPECS
    from govtrain.verify import integrity

    dummies = {int: 7, str: "x", bytes: bytes(range(32)), dict: {}, list: []}
    ((_, _, width),) = integrity._seq_widths(seq, 1)
    assert width == len(cbor.encode(seq)) and set(integrity._ENVELOPES) == set(SPECS)
    for kind, spec in SPECS.items():
        fields = {name: dummies[t if isinstance(t, type) else t[0]] for name, t in spec.items()}
        fields.update(v=ENTRY_VERSION, seq=seq, kind=kind, time=1)
        body = _TEMPLATES[kind].encode(fields)
        lead, seq_at, kind_field = integrity._ENVELOPES[kind]
        assert body.startswith(lead) and body.startswith(kind_field, seq_at + width), kind  # the fast path
        assert integrity._check_kinds([kind], [body], seq) is None
        for other in set(SPECS) - {kind}:
            failure = integrity._check_kinds([other], [body], seq)
            assert failure is not None and (failure.code.value, failure.seq) == ("bad_entry", seq)
