"""`govtrain privacy epsilon|sigma` and `govtrain plan`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from govtrain.accounting import Bucket, PLDAccountant, PRVAccountant
from govtrain.accounting.spend import SpendCalculator
from govtrain.cli.main import cli
from tests.conftest import Corpus, snapshot
from tests.test_signed_ledger import _admit, _spend


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def test_privacy_epsilon_text_and_json():
    text = run("privacy", "epsilon", "--q", "0.01", "--sigma", "1", "--steps", "1000", "--delta", "1e-5")
    expected = PLDAccountant().epsilon([Bucket(0.01, 1.0, 1000)], 1e-5)
    assert text.exit_code == 0 and f"ε <= {expected.epsilon:.6f}" in text.stdout
    body = json.loads(run("privacy", "epsilon", "--q", "0.01", "--sigma", "1", "--steps", "1000", "--delta", "1e-5",
                          "--accountant", "prv", "--json").stdout)
    prv = PRVAccountant().epsilon([Bucket(0.01, 1.0, 1000)], 1e-5)
    assert body["eps_u"] == prv.epsilon_u and body["lower"] <= body["estimate"] <= body["eps"]


def test_privacy_epsilon_reports_the_prv_fallback():
    body = json.loads(run("privacy", "epsilon", "--q", "0.1", "--sigma", "0.6", "--steps", "100", "--delta", "1e-5",
                          "--accountant", "prv", "--json").stdout)
    assert body["fallback"].startswith("pld (prv-accountant raised")
    text = run("privacy", "epsilon", "--q", "0.1", "--sigma", "0.6", "--steps", "100", "--delta", "1e-5",
               "--accountant", "prv")
    assert "note: answered by pld" in text.stdout


def test_privacy_sigma_single_release_and_subsampled():
    single = json.loads(run("privacy", "sigma", "--epsilon", "0.5", "--delta", "1e-5", "--json").stdout)
    assert single["analytic_sigma"] < single["classical_sigma"] and single["classical_valid"]
    warned = run("privacy", "sigma", "--epsilon", "2", "--delta", "1e-5")
    assert "not a guarantee" in warned.stdout
    body = json.loads(run("privacy", "sigma", "--epsilon", "2", "--delta", "1e-5", "--q", "0.01", "--steps", "500",
                          "--accountant", "rdp", "--json").stdout)
    assert body["eps_at_sigma"] <= 2 and body["sigma"] > 0


@pytest.mark.parametrize("args", [
    ("privacy", "epsilon", "--q", "1.5", "--sigma", "1", "--steps", "10", "--delta", "1e-5"),
    ("privacy", "epsilon", "--q", "0.1", "--sigma", "-1", "--steps", "10", "--delta", "1e-5"),
    ("privacy", "epsilon", "--q", "0.1", "--sigma", "1", "--steps", "0", "--delta", "1e-5"),
    ("privacy", "epsilon", "--q", "0.1", "--sigma", "1", "--steps", "10", "--delta", "1"),
    ("privacy", "epsilon", "--q", "0.1", "--sigma", "nan", "--steps", "10", "--delta", "1e-5"),
    ("privacy", "epsilon", "--q", "0.1", "--sigma", "1", "--steps", "10", "--delta", "1e-5", "--accountant", "moments"),
    ("privacy", "sigma", "--epsilon", "1", "--delta", "1e-5", "--q", "0.1"),
    ("privacy", "sigma", "--epsilon", "0", "--delta", "1e-5"),
])
def test_privacy_bad_arguments_exit_2_with_one_line(args):
    result = run(*args)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error[")


def _ledger(corpus: Corpus) -> None:
    _admit(corpus, "pub-a")
    _admit(corpus, "pub-b", noise_multiplier_u=1_200_000)  # the strictest public signer sets the public noise
    _admit(corpus, "sens", data_class="sensitive", clip_norm_u=500_000, eps_budget_u=300_000)
    _admit(corpus, "gone")
    with corpus.open() as ledger:
        ledger.withdraw("gone", "test", now=corpus.now)


def test_plan_projects_each_contribution(corpus: Corpus):
    _ledger(corpus)
    before = snapshot(corpus.url)
    result = run("plan", "--ledger", corpus.url, "--steps", "25", "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert snapshot(corpus.url) == before  # planning writes nothing
    assert plan["sampling_rate"] == 0.01 and plan["steps_per_epoch"] == 10 and plan["withdrawn"] == 1
    rows = {r["contribution_id"]: r for r in plan["contributions"]}
    assert set(rows) == {"pub-a", "pub-b", "sens"}
    assert rows["pub-a"]["sigma_eff"] == rows["pub-b"]["sigma_eff"] == 1.2
    assert rows["sens"]["sigma_eff"] == 1.0  # no model: its class counted alone, which is conservative
    calculator = SpendCalculator("prv", 10_000_000)
    public = calculator.epsilon_u([(10_000, 1_200_000, 10), (10_000, 1_200_000, 10), (10_000, 1_200_000, 5)])
    assert rows["pub-a"]["eps_projected"] == public / 1e6 and rows["pub-a"]["retires_at_step"] is None
    # sens's budget (0.3) runs out: it retires at the last step that keeps it within budget
    step = rows["sens"]["retires_at_step"]
    assert step is not None and 0 < step < 25
    history = [(10_000, 1_000_000, min(10, step - e * 10)) for e in range(math.ceil(step / 10))]
    assert calculator.epsilon_u(history) == round(rows["sens"]["eps_projected"] * 1e6) <= 300_000
    assert calculator.epsilon_u(history[:-1] + [(10_000, 1_000_000, history[-1][2] + 1)]) > 300_000
    assert plan["classes"]["sensitive"]["retiring"] == 1 and plan["classes"]["restricted"]["contributions"] == 0


def test_plan_starts_from_recorded_spend(corpus: Corpus):
    _ledger(corpus)
    implied = SpendCalculator("prv", 10_000_000).epsilon_u([(10_000, 1_000_000, 10)])
    _spend(corpus, "pub-a", eps_u=implied, steps=10)
    plan = json.loads(run("plan", "--ledger", corpus.url, "--steps", "10", "--json").stdout)
    rows = {r["contribution_id"]: r for r in plan["contributions"]}
    assert plan["first_epoch"] == 1  # this epoch's spend is already written ahead
    assert rows["pub-a"]["eps_now"] == implied / 1e6 and rows["pub-b"]["eps_now"] == 0
    assert rows["pub-a"]["eps_projected"] > rows["pub-b"]["eps_projected"]


def test_plan_text_output(corpus: Corpus):
    _ledger(corpus)
    result = run("plan", "--ledger", corpus.url, "--steps", "25")
    assert result.exit_code == 0, result.output
    assert "no --model" in result.stdout and "pub-a" in result.stdout and "sensitive" in result.stdout


def test_plan_refuses_a_batch_size_when_the_policy_fixes_q(corpus: Corpus):
    _ledger(corpus)
    result = run("plan", "--ledger", corpus.url, "--steps", "10", "--expected-batch-size", "4")
    assert result.exit_code == 2 and result.stderr.startswith("error[bad_argument]: this policy fixes sampling_rate")


def test_plan_with_a_model_resolves_profiles(corpus: Corpus, tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(hidden_size=16, num_hidden_layers=6, num_attention_heads=2, intermediate_size=20,
                                     vocab_size=40, max_position_embeddings=16)
    config.save_pretrained(tmp_path / "tiny")
    _ledger(corpus)
    plan = json.loads(run("plan", "--ledger", corpus.url, "--steps", "10", "--model", str(tmp_path / "tiny"),
                          "--json").stdout)
    assert plan["classes"]["public"]["layers"] == "3-5" and plan["classes"]["sensitive"]["layers"] == "4-5"
    assert "own LoRA adapter" in plan["classes"]["restricted"]["reaches"]
    signatures = {tuple(g["classes"]): g["noise_std"] for g in plan["groups"]}
    assert signatures[("public", "sensitive")] == pytest.approx(1.2)  # max(1.2 * 1.0, 1.0 * 0.5)
    rows = {r["contribution_id"]: r for r in plan["contributions"]}
    assert rows["sens"]["sigma_eff"] == 2.4  # it shares layers 4-5 with public: 1.2 / 0.5
    bad = run("plan", "--ledger", corpus.url, "--steps", "10", "--model", str(tmp_path / "nowhere"))
    assert bad.exit_code == 2 and bad.stderr.startswith("error[model_unreadable]")


def tiny_run_config(tmp_path: Path, name: str, training: str = "") -> Path:
    """A run config for a tiny 6-layer BERT saved (config only) under tmp_path/tiny; `training` adds lines."""
    transformers = pytest.importorskip("transformers")
    if not (tmp_path / "tiny").exists():
        transformers.BertConfig(hidden_size=16, num_hidden_layers=6, num_attention_heads=2, intermediate_size=20,
                                vocab_size=40, max_position_embeddings=16).save_pretrained(tmp_path / "tiny")
    path = tmp_path / name
    path.write_text(f"""
[model]
base = "{tmp_path / 'tiny'}"
[lora]
r = 2
target_modules = ["query", "value"]
[training]
steps = 20
data = "data"
output = "adapter"
{training}
""")
    return path


def test_plan_reads_a_run_config(corpus: Corpus, tmp_path):
    config_file = tiny_run_config(tmp_path, "run.toml", "epoch_steps = 5")
    _ledger(corpus)
    plan = json.loads(run_cli_json(corpus, "--config", str(config_file)))
    assert plan["steps"] == 20 and plan["steps_per_epoch"] == 5
    public = plan["classes"]["public"]
    assert public["layers"] == "3-5" and public["parameters"] == 3 * 2 * 2 + 2  # LoRA A, B of q, v; the head
    assert "its own LoRA adapter 'restricted'" in plan["classes"]["restricted"]["reaches"]
    assert json.loads(run_cli_json(corpus, "--config", str(config_file), "--steps", "7"))["steps"] == 7  # flags win
    missing = run("plan", "--ledger", corpus.url)
    assert missing.exit_code == 2 and "--steps" in missing.stderr


def run_cli_json(corpus: Corpus, *args: str) -> str:
    result = run("plan", "--ledger", corpus.url, "--json", *args)
    assert result.exit_code == 0, result.output
    return result.stdout


def test_plan_refuses_prism_where_a_heads_profile_splits_a_lora_pair(tmp_path):
    """Caught before a run starts: the same check the routing layer makes, on the meta-device model."""
    from tests.conftest import TEST_POLICY, make_corpus

    heads = TEST_POLICY.replace("band = [4, 5]\n", "band = [4, 5]\nheads = {5 = [1]}\n")
    assert heads != TEST_POLICY
    corpus = make_corpus(tmp_path, f"sqlite:///{tmp_path / 'heads.db'}", heads)
    _ledger(corpus)
    for mechanism, ok in (("dpsgd", True), ("dp-muon", True), ("prism", False)):
        config_file = tiny_run_config(tmp_path, f"{mechanism}.toml", f'mechanism = "{mechanism}"')
        result = run("plan", "--ledger", corpus.url, "--config", str(config_file))
        if ok:
            assert result.exit_code == 0, result.output
        else:
            assert result.exit_code == 2 and result.stderr.startswith("error[mechanism_unsupported]")
            assert "'sensitive'" in result.stderr and "layer.5.attention.self" in result.stderr
