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
    assert config.file.training.steps == 50 and config.file.optimizer.name == "adamw"
    assert config.file.model.pooling == "mean" and config.file.lora.layers == [4, 5]
    assert config.file.optimizer.head_lr > config.file.optimizer.lr
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
    (lambda t: t.replace("steps = 50 ", "steps = 0 "), "training.steps"),
    (lambda t: t.replace("steps = 50 ", 'steps = "50" '), "training.steps"),
    (lambda t: t.replace("lr = 0.001", "lr = -1.0"), "optimizer.lr"),
    (lambda t: t.replace("lr = 0.001", "lr = nan"), "optimizer.lr"),
    (lambda t: t.replace('"intermediate.dense", "output.dense"', '"dense"'), "lora"),
    (lambda t: t.replace('mechanism = "dpsgd"', 'mechanism = "magic"'), "training.mechanism"),
    (lambda t: t.replace("[lora]", "[lora]\nrank = 4"), "lora.rank"),
    (lambda t: t.replace("num_labels = 2", "num_labels = 1"), "model.num_labels"),
    (lambda t: t.replace('pooling = "mean"', 'pooling = "max"'), "model.pooling"),
    (lambda t: t.replace("layers = [4, 5]", "layers = [4, 4]"), "layers lists a layer twice"),
    (lambda t: t.replace("head_lr = 0.02", "head_lr = 0"), "optimizer.head_lr"),
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


@pytest.mark.parametrize("mechanism", ["dpsgd", "prism", "dp-muon"])
def test_head_lr_sets_the_step_of_the_parameters_outside_the_layer_stack(mechanism: str):
    import torch

    from govtrain.mechanisms.update import Update
    from govtrain.train.config import RunFile
    from govtrain.train.model import wrap_lora
    from tests.test_pooling import bert

    run = RunFile.model_validate({"model": {"base": "minilm"}, "lora": {"target_modules": ["query", "value"]},
                                  "optimizer": {"lr": 0.001, "head_lr": 0.05}, "training": {
                                      "mechanism": mechanism, "steps": 1, "data": "d", "output": "o"}})
    model = wrap_lora(bert(), run.lora, [])
    update = Update.build(model, run)
    groups = {group["lr"]: {id(p) for p in group["params"]} for group in update.optimizer.param_groups}
    head = {id(p) for n, p in model.named_parameters() if p.requires_grad and "classifier" in n}
    assert groups[0.05] == head  # the classifier's weight and bias, and nothing else
    if mechanism == "dpsgd":  # the LoRA factors: the optimizer's lr (PRISM and DP-Muon step them themselves)
        assert len(groups[0.001]) == sum(1 for n, p in model.named_parameters() if p.requires_grad and "lora_" in n)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "classifier" in n and p.requires_grad}
    for p in model.parameters():
        p.grad = torch.ones_like(p) if p.requires_grad else None
    update.optimizer.step()
    for n, p in model.named_parameters():
        if n in before:  # Adam's first step moves every coordinate by lr
            assert torch.allclose((before[n] - p.detach()).abs(), torch.full_like(p, 0.05), rtol=1e-4), n
    assert Update.build(model, run.model_copy(update={"optimizer": run.optimizer.model_copy(
        update={"head_lr": None})})).optimizer.param_groups[-1]["lr"] == 0.001  # absent: lr
