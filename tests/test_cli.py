"""The command line: help text shown in README.md and docs/ matches the real one, one-line errors, exit codes,
nothing changed on error."""

from __future__ import annotations

import json
import stat
import subprocess
import sys

import pytest
from click.testing import CliRunner

from govtrain.cli.main import cli
from govtrain.cli.verify import verify_cli
from tests.conftest import REPO, Corpus, copy_demo_keys, snapshot
from tests.readme_help import BLOCK, pages, real_help

README = (REPO / "README.md").read_text()
HELP_BLOCKS = [(str(page.relative_to(REPO)), command, expected) for page in pages()
               for command, expected in BLOCK.findall(page.read_text())]


def test_readme_names_the_two_commands():
    assert "make demo" in README and "make test" in README
    assert "make test" in (REPO / ".ci" / "run").read_text()


@pytest.mark.parametrize("page,command,expected", HELP_BLOCKS)
def test_help_blocks_match_the_real_help(page, command, expected):
    assert real_help(command) == expected.rstrip(), f"{page}'s `{command} --help` is stale: make readme"


def test_the_readme_shows_the_top_level_help():
    # Every command's help is in docs/reference/cli.md, generated from click: tests/test_docs.py checks that
    # the built page has every command.
    assert ("README.md", "govtrain") in {(page, command) for page, command, _ in HELP_BLOCKS}


def test_console_scripts_run(tmp_path):
    result = subprocess.run([sys.executable, "-m", "govtrain.cli.main", "--version"], capture_output=True,
                            text=True, cwd=REPO)
    assert result.returncode == 0 and "govtrain" in result.stdout


def _invoke(*args: str):
    return CliRunner().invoke(cli, list(args))


def test_keys_generate(tmp_path):
    result = _invoke("keys", "generate", "--out", str(tmp_path), "--name", "op", "--json")
    report = json.loads(result.stdout)
    assert result.exit_code == 0 and len(report["key_id"]) == 64
    assert stat.S_IMODE((tmp_path / "op.key").stat().st_mode) == 0o600
    again = _invoke("keys", "generate", "--out", str(tmp_path), "--name", "op")
    assert again.exit_code == 2 and again.stderr.startswith("error[key_exists]")


def test_usage_errors_are_one_line_exit_2(tmp_path):
    result = _invoke("admit", "--ledger", "x.db", "--bogus")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and result.stderr.startswith("error[usage]")
    result = _invoke("attest")
    assert result.exit_code == 2 and result.stderr.startswith("error[usage]")


def test_init_errors_change_nothing(tmp_path):
    keys = copy_demo_keys(tmp_path / "keys")
    db = tmp_path / "l.db"
    bad = keys / "bad.toml"
    bad.write_text((keys / "policy.toml").read_text().replace("delta = 1e-5", "delta = 2"))
    result = _invoke("init", "--policy", str(bad), "--ledger", f"sqlite:///{db}", "--key", str(keys / "ledger.key"))
    assert result.exit_code == 2 and result.stderr.startswith("error[policy_invalid]: ") and "delta" in result.stderr
    assert not db.exists()
    # The signing key must be one the policy lists.
    result = _invoke("init", "--policy", str(keys / "policy.toml"), "--ledger", f"sqlite:///{db}",
                     "--key", str(keys / "attester.key"))
    assert result.exit_code == 2 and result.stderr.startswith("error[key_mismatch]") and not db.exists()
    (keys / "ledger.key").chmod(0o644)
    result = _invoke("init", "--policy", str(keys / "policy.toml"), "--ledger", f"sqlite:///{db}",
                     "--key", str(keys / "ledger.key"))
    assert result.exit_code == 2 and result.stderr.startswith("error[key_permissions]") and not db.exists()


def test_init_twice_is_refused(corpus: Corpus):
    before = snapshot(corpus.url)
    result = _invoke("init", "--policy", str(corpus.policy_path), "--ledger", corpus.url,
                     "--key", str(corpus.dir / "ledger.key"), "--json")
    assert result.exit_code == 2 and json.loads(result.stdout)["code"] == "ledger_exists"
    assert snapshot(corpus.url) == before


@pytest.mark.parametrize("change,code", [
    ({"--clip-norm": "zero"}, "bad_argument"),
    ({"--noise-multiplier": "0"}, "bad_argument"),
    ({"--id": "no spaces allowed"}, "bad_argument"),
    ({"--valid-days": "0"}, "bad_argument"),
    ({"DATA": "missing.jsonl"}, "data_unreadable"),
    ({"DATA": "bad.jsonl"}, "bad_data"),
    ({"--key": "missing.key"}, "key_unreadable"),
])
def test_attest_errors(corpus: Corpus, change, code):
    data = corpus.data("d.jsonl")
    (corpus.dir / "bad.jsonl").write_text("[1, 2]\n")
    args = {"DATA": str(data), "--key": str(corpus.attester_key), "--contributor": "a", "--class": "public",
            "--clip-norm": "1", "--noise-multiplier": "1", "--eps-budget": "1", "--valid-days": "10",
            "--out": str(corpus.dir / "d.cose")}
    for key, value in change.items():
        args[key] = value if not value.endswith((".jsonl", ".key")) else str(corpus.dir / value)
    argv = ["attest", args.pop("DATA")] + [x for kv in args.items() for x in kv]
    result = _invoke(*argv)
    assert result.exit_code == 2 and result.stderr.startswith(f"error[{code}]"), result.output
    assert not (corpus.dir / "d.cose").exists()


def test_attest_refuses_to_overwrite(corpus: Corpus):
    data = corpus.data("o.jsonl")
    out = corpus.dir / "o.cose"
    out.write_bytes(b"keep")
    result = _invoke("attest", str(data), "--key", str(corpus.attester_key), "--contributor", "a", "--class",
                     "public", "--clip-norm", "1", "--noise-multiplier", "1", "--eps-budget", "1", "--out", str(out))
    assert result.exit_code == 2 and out.read_bytes() == b"keep"


def test_attest_then_admit_then_verify(corpus: Corpus):
    data = corpus.data("flow.jsonl", records=7)
    cose = corpus.dir / "flow.jsonl.cose"
    result = _invoke("attest", str(data), "--key", str(corpus.attester_key), "--contributor", "dana", "--class",
                     "sensitive", "--clip-norm", "0.5", "--noise-multiplier", "1.25", "--eps-budget", "2",
                     "--valid-days", "7", "--out", str(cose), "--json")
    assert result.exit_code == 0, result.output
    contribution = json.loads(result.stdout)["contribution_id"]
    result = _invoke("admit", str(cose), "--data", str(data), "--ledger", corpus.url)
    assert result.exit_code == 0 and f"admitted {contribution} (class sensitive, 7 records)" in result.stdout
    result = CliRunner().invoke(verify_cli, ["--ledger", corpus.url])
    assert result.exit_code == 0 and "ok: 2 entries verified" in result.stdout
    result = _invoke("ledger", "verify", "--ledger", corpus.url, "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["admissions"] == 1


def test_batch_admit(corpus: Corpus, tmp_path):
    batch = corpus.dir.parent / "batch"
    batch.mkdir()
    for i in range(5):
        data = corpus.data(f"../batch/p{i}.jsonl")
        overrides = {"data_class": "secret"} if i == 2 else {}
        (batch / f"p{i}.jsonl.cose").write_bytes(corpus.attestation(data, contribution_id=f"p{i}", **overrides))
    result = _invoke("admit", "--batch", str(batch), "--ledger", corpus.url, "--json")
    report = json.loads(result.stdout)
    assert result.exit_code == 3 and (report["admitted"], report["rejected"]) == (4, 1)
    assert "error[unknown_class]: p2.jsonl.cose:" in result.stderr
    assert snapshot(corpus.url)[0] == 5


def test_admit_to_missing_ledger_is_usage_error(tmp_path, corpus: Corpus):
    data = corpus.data("m.jsonl")
    cose = corpus.dir / "m.cose"
    cose.write_bytes(corpus.attestation(data))
    result = _invoke("admit", str(cose), "--data", str(data), "--ledger", str(tmp_path / "nowhere.db"))
    assert result.exit_code == 2 and result.stderr.startswith("error[ledger_missing]")
    assert not (tmp_path / "nowhere.db").exists()


def test_ledger_url_from_environment(corpus: Corpus):
    result = CliRunner().invoke(verify_cli, [], env={"GOVTRAIN_LEDGER": corpus.url})
    assert result.exit_code == 0


def test_cli_default_validity_matches_the_library():
    from govtrain.attest.attest import DEFAULT_VALID_DAYS
    from govtrain.cli import main

    assert main.DEFAULT_VALID_DAYS == DEFAULT_VALID_DAYS


def test_help_and_attest_do_not_import_the_store():
    code = ("import sys; from govtrain.cli.main import cli; "
            "assert 'sqlalchemy' not in sys.modules and 'pydantic' not in sys.modules; print('light')")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "light" in result.stdout, result.stderr
