"""Mistakes a new user makes at the command line: each one line `error[code]: …` that says what to do, its
documented exit code, and nothing written."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from govtrain.cli.main import cli
from govtrain.cli.verify import verify_cli
from tests.conftest import Corpus, copy_demo_keys, snapshot


def _invoke(*args: str, command=cli):
    return CliRunner().invoke(command, list(args))


def _one_line(result, code: str, exit_code: int) -> str:
    assert result.exit_code == exit_code, result.output
    assert result.stderr.startswith(f"error[{code}]: ") and result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.output and "sqlalche.me" not in result.output
    return result.stderr


@pytest.mark.parametrize("as_url", [False, True])
def test_a_file_that_is_no_database_given_as_the_ledger(tmp_path, as_url):
    data = tmp_path / "reviews.jsonl"
    data.write_text('{"text": "a", "label": 1}\n')
    before = data.read_bytes()
    ledger = f"sqlite:///{data}" if as_url else str(data)
    line = _one_line(_invoke("ledger", "status", "--ledger", ledger), "ledger_not_database", 2)
    assert f"{data} is not a SQLite database" in line and "govtrain init" in line
    _one_line(_invoke("--ledger", ledger, command=verify_cli), "ledger_not_database", 2)
    keys = copy_demo_keys(tmp_path / "keys")  # init refuses it too, and leaves the file as it was
    _one_line(_invoke("init", "--policy", str(keys / "policy.toml"), "--ledger", ledger, "--key",
                      str(keys / "ledger.key")), "ledger_not_database", 2)
    assert data.read_bytes() == before


@pytest.mark.parametrize("command", ["attest", "init", "checkpoint"])
def test_a_public_key_given_as_the_signing_key(corpus: Corpus, command):
    public = {"attest": corpus.dir / "attester.pub", "init": corpus.dir / "ledger.pub",
              "checkpoint": corpus.dir / "ledger.pub"}[command]
    args = {
        "attest": ["attest", str(corpus.data("d.jsonl")), "--contributor", "a", "--class", "public", "--clip-norm", "1",
                   "--noise-multiplier", "1", "--eps-budget", "1", "--out", str(corpus.dir / "d.cose")],
        "init": ["init", "--policy", str(corpus.policy_path), "--ledger", str(corpus.dir / "new.db")],
        "checkpoint": ["ledger", "checkpoint", "--ledger", corpus.url],
    }[command]
    before = snapshot(corpus.url)
    line = _one_line(_invoke(*args, "--key", str(public)), "key_is_public", 2)
    assert f"{public} is a public key" in line and f"give {public.with_suffix('.key')}" in line
    assert "chmod" not in line
    assert snapshot(corpus.url) == before and not (corpus.dir / "new.db").exists()
    assert not (corpus.dir / "d.cose").exists()


def test_a_public_key_without_its_pair_says_which_file_to_give(tmp_path):
    from govtrain.attest.keys import load_private_key
    from govtrain.errors import Code, ConfigError

    keys = copy_demo_keys(tmp_path / "keys")
    lone = tmp_path / "operator.pem"
    lone.write_bytes((keys / "ledger.pub").read_bytes())
    with pytest.raises(ConfigError) as info:
        load_private_key(lone)
    assert info.value.code is Code.KEY_IS_PUBLIC and "NAME.key" in info.value.detail


@pytest.mark.parametrize("content,shown", [
    (b'{"text": "great film", "label": 1}\n', "'{\"text\": \"great film\", \"…'"),
    (b"text,label\ngreat,1\n", "'text,label…'"),
    (b"PAR1\x15\x04\x15\x10\x15\x14L\x15\x02\x15\x00\x12", "the bytes 50 41 52 31"),
])
def test_a_data_file_given_as_the_attestation(corpus: Corpus, content, shown):
    data = corpus.data("d.jsonl")
    wrong = corpus.dir / "d.data"
    wrong.write_bytes(content)
    before = snapshot(corpus.url)
    line = _one_line(_invoke("admit", str(wrong), "--data", str(data), "--ledger", corpus.url), "not_cose_sign1", 3)
    assert "not an attestation (COSE_Sign1)" in line and shown in line and "announced" not in line
    assert snapshot(corpus.url) == before


def test_an_attestation_truncated_still_reports_its_encoding(corpus: Corpus):
    data = corpus.data("d.jsonl")
    cose = corpus.dir / "d.cose"
    cose.write_bytes(corpus.attestation(data)[:-10])
    _one_line(_invoke("admit", str(cose), "--data", str(data), "--ledger", corpus.url), "malformed_cbor", 3)


def test_a_sqlite_url_with_three_slashes_before_a_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    keys = copy_demo_keys(tmp_path / "keys")
    line = _one_line(_invoke("init", "--policy", str(keys / "policy.toml"), "--ledger", "sqlite:///tmp/x.db",
                             "--key", str(keys / "ledger.key")), "ledger_url", 2)
    assert "write sqlite:////tmp/x.db for /tmp/x.db, or sqlite:///./tmp/x.db for ./tmp/x.db" in line
    assert not (tmp_path / "tmp").exists()
    _one_line(_invoke("ledger", "status", "--ledger", "sqlite:///tmp/x.db"), "ledger_url", 2)
    _one_line(_invoke("--ledger", "sqlite:///tmp/x.db", command=verify_cli), "ledger_url", 2)
    # What the error says to write works, and so do a bare file name and a plain relative path.
    for url, where in [("sqlite:///./tmp/x.db", tmp_path / "tmp" / "x.db"), ("sqlite:///top.db", tmp_path / "top.db"),
                       ("sub/y.db", tmp_path / "sub" / "y.db"), (f"sqlite:///{tmp_path}/abs.db", tmp_path / "abs.db")]:
        result = _invoke("init", "--policy", str(keys / "policy.toml"), "--ledger", url, "--key",
                         str(keys / "ledger.key"))
        assert result.exit_code == 0 and where.is_file(), (url, result.output)
        assert _invoke("ledger", "status", "--ledger", url).exit_code == 0


def test_normalized_bare_paths_pass_the_url_rule(tmp_path, monkeypatch):
    from ledger_store import normalize_url
    from ledger_store.engines import _backend

    monkeypatch.chdir(tmp_path)
    for path in ["ledger.db", "a/b.db", "./a/b.db", "../a/b.db", str(tmp_path / "a.db"), "~/x.db"]:
        assert _backend(normalize_url(path)) == "sqlite", path
    assert normalize_url("a/b.db") == "sqlite:///./a/b.db" and normalize_url("l.db") == "sqlite:///l.db"
    assert normalize_url("~/x.db") == f"sqlite:///{os.path.expanduser('~/x.db')}"


@pytest.mark.parametrize("args,code,exit_code", [
    (["ledger", "prove", "x", "--checkpoint", "{missing}"], "bad_argument", 2),
    (["ledger", "prove", "x", "--checkpoint", "{binary}"], "bad_argument", 2),
    (["ledger", "verify-proof", "{missing}", "--key", "{pub}", "--origin", "o"], "bad_argument", 2),
    (["ledger", "verify-proof", "{binary}", "--key", "{pub}", "--origin", "o"], "bad_proof", 4),
    (["ledger", "verify-proof", "{text}", "--key", "{pub}", "--origin", "o", "--attestation", "{missing}"],
     "bad_argument", 2),
])
def test_unreadable_files_named_by_ledger_commands(corpus: Corpus, args, code, exit_code):
    names = {"missing": str(corpus.dir / "missing"), "binary": str(corpus.dir / "b.bin"),
             "text": str(corpus.data("t.jsonl")), "pub": str(corpus.dir / "ledger.pub")}
    (corpus.dir / "b.bin").write_bytes(b"\x00\xfa\xff" * 10)
    args = [a.format(**names) for a in args]
    if args[1] == "prove":
        args += ["--ledger", corpus.url]
    _one_line(_invoke(*args), code, exit_code)
