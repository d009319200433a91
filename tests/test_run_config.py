"""The run config (RUN.toml): the example loads, the schema file is generated, bad fields are named."""

from __future__ import annotations

import json

import pytest

from govtrain.errors import ConfigError
from govtrain.train.config import json_schema, load_run_config
from tests.conftest import REPO

EXAMPLE = REPO / "examples" / "run.toml"


def test_the_example_loads_and_resolves_paths():
    config = load_run_config(EXAMPLE)
    assert config.file.model.base == "minilm" and config.model_spec == "minilm"
    assert config.file.training.steps == 300 and config.file.optimizer.name == "adamw"
    assert config.data_dir == (REPO / "examples" / "../demo-out/data")
    assert len(config.sha256) == 32


def test_schema_file_is_generated_from_the_model():
    on_disk = json.loads((REPO / "schemas" / "run.schema.json").read_text())
    assert on_disk == json_schema(), "regenerate: make schemas"


def _mechanism(text: str, mechanism: str) -> str:
    return text.replace('mechanism = "dpsgd"', f'mechanism = "{mechanism}"')


def test_mechanism_sections_take_their_defaults(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(_mechanism(EXAMPLE.read_text(), "prism"))
    prism = load_run_config(path).file
    assert prism.training.mechanism == "prism" and prism.prism.floor == 1.0 and prism.muon is None
    path.write_text(_mechanism(EXAMPLE.read_text(), "dp-muon") + '\n[muon]\niteration = "quintic"\n')
    muon = load_run_config(path).file
    assert muon.muon.iteration == "quintic" and muon.muon.steps is None and muon.prism is None


@pytest.mark.parametrize("edit, where", [
    (lambda t: t.replace('name = "adamw"', 'name = "lion"'), "optimizer.name"),
    (lambda t: t.replace("steps = 300", "steps = 0"), "training.steps"),
    (lambda t: t.replace("steps = 300", 'steps = "300"'), "training.steps"),
    (lambda t: t.replace("lr = 0.002", "lr = -1.0"), "optimizer.lr"),
    (lambda t: t.replace("lr = 0.002", "lr = nan"), "optimizer.lr"),
    (lambda t: t.replace('"intermediate.dense", "output.dense"', '"dense"'), "lora"),
    (lambda t: t.replace('mechanism = "dpsgd"', 'mechanism = "magic"'), "training.mechanism"),
    (lambda t: t.replace("[lora]", "[lora]\nrank = 4"), "lora.rank"),
    (lambda t: t.replace("num_labels = 2", "num_labels = 1"), "model.num_labels"),
    (lambda t: t.replace("[optimizer]", "[optimizer]\nmomentum = 0.9"), "optimizer"),
    (lambda t: t.replace('data = "../demo-out/data"      ', ""), "training.data"),
    (lambda t: t + "\n[prism]\nlr = 0.01\n", "[prism] applies to mechanism = 'prism' only"),
    (lambda t: t + "\n[muon]\n", "[muon] applies to mechanism = 'dp-muon' only"),
    (lambda t: _mechanism(t, "prism") + "\n[prism]\nfloor = -1.0\n", "prism.floor"),
    (lambda t: _mechanism(t, "prism") + "\n[prism]\nmax_condition = 0.5\n", "prism.max_condition"),
    (lambda t: _mechanism(t, "prism") + "\n[prism]\nbeta = 0.9\n", "prism.beta"),
    (lambda t: _mechanism(t, "dp-muon") + '\n[muon]\niteration = "cubic"\n', "muon.iteration"),
    (lambda t: _mechanism(t, "dp-muon") + "\n[muon]\nkappa = 0\n", "muon.kappa"),
    (lambda t: _mechanism(t, "dp-muon") + "\n[muon]\nmomentum = 1.0\n", "muon.momentum"),
])
def test_invalid_fields_are_named(tmp_path, edit, where):
    path = tmp_path / "run.toml"
    path.write_text(edit(EXAMPLE.read_text()))
    with pytest.raises(ConfigError) as info:
        load_run_config(path)
    assert info.value.code.value == "run_config_invalid" and info.value.exit_code == 2
    assert where in info.value.detail, info.value.detail


def test_unreadable_and_non_toml(tmp_path):
    with pytest.raises(ConfigError):
        load_run_config(tmp_path / "missing.toml")
    (tmp_path / "bad.toml").write_text("[model\n")
    with pytest.raises(ConfigError) as info:
        load_run_config(tmp_path / "bad.toml")
    assert "not valid TOML" in info.value.detail
