"""`ModelState.changed` (train/model_state.py) against a plain oracle: the comparison it made before issue 35 made it
cheap (every module's plain attributes flattened to "path.name" keys and compared one by one). For each way of
setting state between two checks, the report is the oracle's, word for word, and None exactly where the oracle's
is."""

from __future__ import annotations

import math
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from govtrain.train.model_state import ModelState, _copy, _plain, _same  # noqa: E402


class _Missing:
    def __repr__(self) -> str:
        return "nothing"


MISSING = _Missing()


def oracle_attributes(model: nn.Module) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        where = path or "run.model"
        for name, value in vars(module).items():
            if name != "training" and _plain(value):
                found[f"{where}.{name}"] = _copy(value)
    return found


def oracle_changed(kept: dict[str, Any], model: nn.Module) -> str | None:
    attributes = oracle_attributes(model)
    for where, then in kept.items():
        if not _same(attributes.get(where, MISSING), then):
            return f"run.model's {where} was set (to {attributes.get(where, MISSING)!r}, from {then!r})"
    return None


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.scaling = {"default": 0.5}
        self.r = {"default": 4}
        self.active = ["default"]
        self.dims = (3, (1, 2))
        self.rate = 0.1
        self.name = "block"
        self.flag = False
        self.nothing = None
        self.nan = math.nan


def make() -> nn.Module:
    model = nn.Sequential(Block(), Block())
    model.shared = model[0]  # one module at two paths
    model.top = 7
    return model


EDITS = {
    "nothing": lambda m: None,
    "a float": lambda m: setattr(m[0], "rate", 0.2),
    "a float to NaN": lambda m: setattr(m[0], "rate", math.nan),
    "NaN to NaN": lambda m: setattr(m[1], "nan", float("nan")),
    "NaN to a float": lambda m: setattr(m[1], "nan", 1.0),
    "a float to an int": lambda m: setattr(m[0], "rate", 0),
    "a bool to an int": lambda m: setattr(m[1], "flag", 0),
    "None to 0": lambda m: setattr(m[0], "nothing", 0),
    "a string": lambda m: setattr(m[1], "name", "other"),
    "a dict entry": lambda m: m[0].scaling.__setitem__("default", 2.0),
    "a dict key added": lambda m: m[1].r.__setitem__("other", 8),
    "a list written in place": lambda m: m[0].active.append("second"),
    "a nested tuple": lambda m: setattr(m[1], "dims", (3, (1, 3))),
    "a tuple to a list": lambda m: setattr(m[1], "dims", [3, (1, 2)]),
    "the root's": lambda m: setattr(m, "top", 8),
    "deleted": lambda m: delattr(m[0], "rate"),
    "a plain one to a tensor": lambda m: setattr(m[1], "rate", torch.tensor(0.1)),
    "added (ignored)": lambda m: setattr(m[0], "new_setting", 3),
    "a module added (ignored)": lambda m: m.add_module("extra", nn.Linear(2, 2)),
    "a module replaced by one like it": lambda m: m.__setitem__(1, Block()),
    "a module replaced by another kind": lambda m: m.__setitem__(1, nn.ReLU()),
    "through the second path": lambda m: setattr(m.shared, "name", "shared"),
    "the second path rebound": lambda m: setattr(m, "shared", m[1]),
    "the training flag (ignored here)": lambda m: m.eval(),
    "a linear's own plain attribute": lambda m: setattr(m[0].linear, "in_features", 4),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_the_report_is_the_oracles_word_for_word(edit):
    model = make()
    state = ModelState(model)
    kept = oracle_attributes(model)
    EDITS[edit](model)
    expected = oracle_changed(kept, model)
    assert state.changed() == expected
    if edit in ("nothing", "NaN to NaN", "added (ignored)", "a module added (ignored)",
                "a module replaced by one like it", "the second path rebound", "the training flag (ignored here)"):
        assert expected is None
    else:
        assert expected is not None and "was set" in expected


def test_a_record_taken_again_accepts_what_it_saw_and_copies_containers():
    model = make()
    state = ModelState(model)
    model[0].rate = 0.3
    assert state.changed() is not None
    state.take()
    assert state.changed() is None
    model[0].scaling["default"] = 9.0  # the record holds a copy, not the dict the module holds
    assert state.changed() == oracle_changed({"0.scaling": {"default": 0.5}}, model)
