"""Attacks on the faster `ModelState` (issue 35; train/model_state.py): its review's proofs, kept.

The record by module path and attribute name (`_by_module`) is only the old flat record ("path.name" keys) when each
pair has a key of its own; `nn.Module.__setattr__` takes any name, so user code inside the loop can give two modules
one path (a child named "" or "a.b"), two pairs one key (an attribute "b.scaling", a child path "run.model", an int
key in `__dict__`) or a `__dict__` whose `get` lies. Each such model is recorded and compared as before (the
oracle in tests/test_model_state.py): a change the old comparison reported is reported in the same words."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from govtrain.train.model_state import ModelState  # noqa: E402
from tests.test_model_state import oracle_attributes, oracle_changed  # noqa: E402


class Root(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(3, 3)
        self.scaling = {"default": 0.5}  # read by the forward
        self.rate = 0.1

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.body(x) * self.scaling["default"] * self.rate


def _decoy_at_the_roots_path() -> nn.Module:
    model = Root()
    setattr(model, "", nn.ReLU())  # a second module at path ""
    return model


def _decoy_at_a_dotted_path() -> nn.Module:
    model = nn.Module()
    model.a = nn.Module()
    model.a.b = nn.Linear(2, 2)
    model.a.b.scaling = 0.5
    setattr(model, "a.b", nn.ReLU())  # a second module at path "a.b"
    return model


def _child_at_run_model() -> nn.Module:
    model = nn.Module()
    model.scaling = 0.5
    model.run = nn.Module()
    model.run.model = nn.Linear(2, 2)  # its "where" is the root's
    model.run.model.scaling = 0.25
    return model


def _dotted_attribute() -> nn.Module:
    model = nn.Module()
    model.a = nn.Module()
    model.a.b = nn.Linear(2, 2)
    setattr(model.a, "b.scaling", 0.5)  # the "where" of a.b's scaling
    return model


def _int_key() -> nn.Module:
    model = nn.Module()
    model.p = nn.Linear(2, 2)
    vars(model.p)["1"] = 0.5
    return model


class Lying(dict):
    def get(self, key, default=None):  # type: ignore[no-untyped-def]
        return dict.get(self, "_kept_" + key, dict.get(self, key, default))


def _lying_dict() -> nn.Module:
    model = nn.Sequential(nn.Linear(2, 2))
    model[0].scaling = 0.5
    model[0].__dict__ = Lying(model[0].__dict__, _kept_scaling=0.5)
    return model


ATTACKS = {
    "a decoy child at the root's path, the root's scaling set": (
        _decoy_at_the_roots_path, lambda m: (m.scaling.__setitem__("default", 100.0), setattr(m, "rate", 7.0))),
    "a decoy child at a dotted path, the real module's scaling set": (
        _decoy_at_a_dotted_path, lambda m: setattr(m.a.b, "scaling", 100.0)),
    "a child at run.model given the root's attribute's where": (
        _child_at_run_model, lambda m: setattr(m.run.model, "scaling", 2.0)),
    "the root's and run.model's scaling both set": (
        _child_at_run_model, lambda m: (setattr(m, "scaling", 1.0), setattr(m.run.model, "scaling", 2.0))),
    "a dotted attribute's where given to a.b's scaling, added": (
        _dotted_attribute, lambda m: setattr(m.a.b, "scaling", 100.0)),
    "an int key added beside its string": (_int_key, lambda m: vars(m.p).__setitem__(1, 100.0)),
    "a __dict__ whose get lies": (_lying_dict, lambda m: dict.__setitem__(vars(m[0]), "scaling", 100.0)),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_a_model_whose_names_collide_is_compared_as_before(attack):
    build, edit = ATTACKS[attack]
    model = build()
    state = ModelState(model)
    kept = oracle_attributes(model)
    edit(model)
    expected = oracle_changed(kept, model)
    assert expected is not None, "the attack changes nothing the old comparison saw"
    assert state.changed() == expected
    state.take()  # taken again (after a governed forward): what it saw is the record
    assert state.changed() is None


class Scaled(nn.Linear):
    scaling = 0.5  # a class attribute the forward reads

    def forward(self, x):  # type: ignore[no-untyped-def]
        return super().forward(x) * self.scaling


def test_an_instance_attribute_set_over_a_class_attribute_the_forward_reads_is_refused():
    """The review's proof 5, which the comparison before issue 35 missed as well: an attribute set on the module since
    the record is "one added since", yet `scaling` there hides the class's, and the forward reads the new value."""
    model = nn.Sequential(Scaled(2, 2))
    x = torch.ones(1, 2)
    before = model(x)
    state = ModelState(model)
    model[0].scaling = 100.0
    assert not torch.equal(before, model(x))
    assert state.changed() == "run.model's 0.scaling was set (to 100.0, over its class's 0.5)"
    model[0].accelerate_prepared = True  # one no class has: still a setting the forward never read
    del model[0].scaling
    assert state.changed() is None
    model[0].dump_patches = True  # nn.Module's own class attributes count too
    assert state.changed() == "run.model's 0.dump_patches was set (to True, over its class's False)"
    del model[0].dump_patches
    model[0].model_tags = ["trl", "sft"]  # text and lists (TRL tags the model it trains) stay out
    Scaled.model_tags = None
    try:
        assert state.changed() is None
    finally:
        del Scaled.model_tags
