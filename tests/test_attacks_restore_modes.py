"""Adversarial review of `restore_modes` (issue 35, `routing/independence.py`), which puts back the modes the
batch-independence probe and a rehearsal forward (`train/governed_loop.py: rehearsing`) switched to eval. It replaced
`for module, training in saved: module.train(training)`, one walk of each module's subtree, by one pass; the claim is
that every module ends as the loop left it. The review proved three models where the first version did not:
- F1: a module added inside the window (a lazy `nn.Dropout` built at the first forward) kept its own default mode,
  where the loop's `train(False)` on its parent set it to eval: an eval model left stochastic after the probe;
- F2: a `train` patched onto the instance (as `torch.export`'s `ExportedProgram.module()` does) was never called, so
  what it manages was left in eval;
- F3: a module at two places in the tree ended in its saved mode, where the loop let its second parent's walk set it.
Each case now runs the loop itself (`restore_modes` takes the fast pass only on the tree it saved, with no patched
`train` and bool flags); these tests compare every module's flag, the calls made and any error with the loop's.
"""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from govtrain.routing import independence  # noqa: E402
from govtrain.routing.independence import measure_batch_independence, restore_modes, saved_modes  # noqa: E402
from govtrain.train.governed_loop import rehearsing  # noqa: E402


def loop(model: nn.Module, saved) -> None:  # noqa: ARG001 (the signature of restore_modes)
    for module, training in saved:
        module.train(training)


def flags(net: nn.Module) -> dict[str, bool]:
    found = {name or "<root>": m.training for name, m in net.named_modules(remove_duplicate=False)}
    if "_side" in vars(net):
        found["<managed by the patched train>"] = vars(net)["_side"].training
    return found


def compare(build, window=lambda net: net.eval()):
    """(flags, calls logged, error) after `window` and a restore, by the loop and by `restore_modes`."""
    outcomes = []
    for restore in (loop, restore_modes):
        log: list = []
        net = build(log)
        saved = saved_modes(net)
        window(net)
        log.clear()
        try:
            restore(net, saved)
            error = None
        except Exception as e:  # noqa: BLE001 (the loop's own error, compared)
            error = f"{type(e).__name__}: {e}"
        outcomes.append((flags(net), log, error))
    return outcomes


def shared(log):
    drop = nn.Dropout(0.5)
    net = nn.Sequential(nn.Sequential(nn.Linear(2, 2), drop), nn.Sequential(nn.Linear(2, 2), drop))
    net.train()
    drop.eval()
    return net


def patched(log):
    net = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1))
    side = nn.Dropout(0.3)
    plain = net.train

    def train(mode=True):
        log.append(("root.train", mode))
        side.train(mode)
        return plain(mode)

    net.train = train
    net.train(True)
    object.__setattr__(net, "_side", side)
    return net


def lazy(log):
    return nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2))).eval()


def add_child(net):
    net.eval()
    net[1].add_module("late", nn.Dropout(0.5))


def not_bool(log):
    net = nn.Sequential(nn.Linear(2, 2))
    net[0].training = 1
    return net


@pytest.mark.parametrize("build, window", [(shared, None), (patched, None), (lazy, add_child), (not_bool, None)],
                         ids=["F3-shared", "F2-patched-train", "F1-added-in-the-window", "flag-not-a-bool"])
def test_a_tree_other_than_the_one_saved_is_restored_as_the_loop_restored_it(build, window):
    old, new = compare(build, *(() if window is None else (window,)))
    assert new == old


class Counted(nn.Linear):
    def __init__(self, log):
        super().__init__(2, 2)
        self.log = log

    def train(self, mode=True):
        self.log.append(mode)
        return super().train(mode)


def test_on_the_tree_saved_an_override_ends_called_with_its_own_flag():
    """The fast pass: the same flags, and the override's last call carries its saved flag, as the loop's did (the
    loop also called it from each ancestor's walk; the pass does not)."""
    def counted(log):
        net = nn.Sequential(nn.Sequential(Counted(log)))
        net.train()
        net[0].eval()
        net[0][0].train()
        return net

    (old_flags, old_log, old_error), (new_flags, new_log, new_error) = compare(counted)
    assert new_flags == old_flags and new_error is old_error is None
    assert new_log and new_log[-1] == old_log[-1] is True


class LazyNet(nn.Module):
    """Builds its dropout at its first forward: the probe's window is where it appears."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, input_ids, attention_mask):
        if not hasattr(self, "drop"):
            self.drop = nn.Dropout(0.5)
        return self.out((self.drop(self.emb(input_ids)) * attention_mask[..., None]).sum(1))


class Task:
    def probe_examples(self):
        return [[1, 2], [3, 4, 5], [6, 7, 8, 9]]

    def encode(self, examples, tokenizer, max_length, device):
        width = max(map(len, examples))
        ids = torch.tensor([e + [0] * (width - len(e)) for e in examples])
        mask = torch.tensor([[1] * len(e) + [0] * (width - len(e)) for e in examples])
        return types.SimpleNamespace(inputs={"input_ids": ids, "attention_mask": mask})

    def per_example_loss(self, out, batch):
        return out.pow(2).sum(1)


def test_f1_an_eval_model_that_builds_a_dropout_during_the_probe_is_left_in_eval():
    net = LazyNet().eval()
    measure_batch_independence(net, Task(), None, 8, torch.device("cpu"))
    x = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert not net.drop.training and torch.equal(net(x, torch.ones_like(x)), net(x, torch.ones_like(x)))


def test_f3_a_rehearsal_leaves_a_shared_module_as_the_loop_left_it(monkeypatch):
    ends = []
    for restore in (loop, restore_modes):
        monkeypatch.setattr("govtrain.train.governed_loop.restore_modes", restore)
        net = shared([])
        with rehearsing(net):
            pass
        ends.append(flags(net))
    assert ends[0] == ends[1]
    assert independence.restore_modes is restore_modes
