"""Off a terminal (CliRunner's streams are not one) no command writes an ANSI control code, and human output spells
ε one way: "ε", never "epsilon" or "eps" (JSON keys say `eps`). `train`, `eval` and `tune` are in test_progress.py."""

from __future__ import annotations

import json
import re

from click.testing import CliRunner

from govtrain.cli.main import cli
from govtrain.cli.verify import verify_cli
from tests.conftest import Corpus

# "privacy epsilon" and "--epsilon" name a command and an option; "--eps-budget" too
SPELLING = re.compile(r"(?<![-\w])(epsilon|eps)(?![-\w])", re.IGNORECASE)


def _commands(corpus: Corpus) -> list[list[str]]:
    data = corpus.data("c1.jsonl")
    (corpus.dir / "c1.cose").write_bytes(corpus.attestation(data, contribution_id="c1"))
    keys, url = corpus.dir, corpus.url
    return [
        ["keys", "generate", "--out", str(keys / "new"), "--name", "op"],
        ["attest", str(data), "--key", str(keys / "attester.key"), "--contributor", "a", "--class", "public",
         "--clip-norm", "1", "--noise-multiplier", "1", "--eps-budget", "2", "--out", str(keys / "other.cose")],
        ["admit", str(keys / "c1.cose"), "--data", str(data), "--ledger", url],
        ["admit", str(keys / "c1.cose"), "--data", str(data), "--ledger", url],  # a replay: rejected
        ["ledger", "status", "--ledger", url],
        ["ledger", "status", "--ledger", url, "--contribution", "c1"],
        ["ledger", "checkpoint", "--ledger", url, "--out", str(keys / "trusted.note")],
        ["ledger", "prove", "c1", "--ledger", url, "--out", str(keys / "c1.proof")],
        ["ledger", "verify-proof", str(keys / "c1.proof"), "--key", str(keys / "ledger.pub"), "--origin",
         "test.invalid/govtrain/1"],
        ["ledger", "verify", "--ledger", url, "--trusted-checkpoint", str(keys / "trusted.note")],
        ["ledger", "compact", "--ledger", url, "--before-epoch", "9"],
        ["plan", "--ledger", url, "--steps", "20"],
        ["privacy", "epsilon", "--q", "0.01", "--sigma", "1", "--steps", "100", "--delta", "1e-5", "--group", "4"],
        ["privacy", "sigma", "--epsilon", "2", "--delta", "1e-5"],
        ["privacy", "sigma", "--epsilon", "2", "--delta", "1e-5", "--q", "0.01", "--steps", "100"],
        ["withdraw", "c1", "--ledger", url, "--reason", "asked"],
        ["withdraw", "c1", "--ledger", url, "--reason", "again"],
        ["ledger", "status", "--ledger", "sqlite:///tmp/x.db"],
        ["init", "--policy", str(corpus.policy_path), "--ledger", str(keys / "c1.jsonl"), "--key",
         str(keys / "ledger.pub")],
        ["admit", str(data), "--data", str(data), "--ledger", url],
        ["bogus"],
    ]


def test_no_command_writes_control_codes_or_spells_epsilon_off_a_terminal(corpus: Corpus):
    runner = CliRunner()
    for args in _commands(corpus):
        for extra in ([], ["--json"]):
            if args == ["bogus"] and extra:
                continue
            if args[0] == "keys" and extra:
                args = [*args[:-1], "op2"]
            result = runner.invoke(cli, [*args, *extra])
            output = result.stdout + result.stderr
            assert "\x1b" not in output, (args, output)
            assert "Traceback" not in output and "error[internal]" not in output, (args, output)
            human = result.stderr if extra else output
            assert not SPELLING.search(human), (args, human)
            if extra and result.stdout.strip():
                body = json.loads(result.stdout)
                assert not any("epsilon" in key for key in _keys(body)), (args, body)
    result = runner.invoke(verify_cli, ["--ledger", corpus.url])
    assert result.exit_code == 0 and "\x1b" not in result.stdout + result.stderr


def test_help_text_spells_epsilon_one_way():
    runner = CliRunner()
    for path in (["--help"], ["privacy", "epsilon", "--help"], ["privacy", "sigma", "--help"], ["plan", "--help"],
                 ["attest", "--help"], ["tune", "--help"], ["train", "--help"], ["ledger", "status", "--help"]):
        text = runner.invoke(cli, path).stdout
        assert "\x1b" not in text
        prose = text.replace("privacy epsilon", "").replace("--epsilon", "").replace("epsilon|sigma", "")
        assert not SPELLING.search(prose), (path, prose)


def _keys(value) -> list[str]:
    if isinstance(value, dict):
        return [*value, *(k for v in value.values() for k in _keys(v))]
    if isinstance(value, list):
        return [k for v in value for k in _keys(v)]
    return []
