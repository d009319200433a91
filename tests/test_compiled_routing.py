"""Compiled routing (`Router(..., compiled=True)`, `routing/compiled.py`) against the hook path: the same seed and
inputs release bitwise the same `.grad` in float64, step after step, for dpsgd, prism and dp-muon, a heads
profile and the contribution unit, and agree in float32."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from govtrain.resolver.model import describe  # noqa: E402
from govtrain.resolver.profile import resolve  # noqa: E402
from govtrain.routing.router import Router  # noqa: E402
from tests.test_mechanism_routing import WHOLE  # noqa: E402
from tests.test_routing import CLASSES, batch, losses_of, model  # noqa: E402

# (batch size, seed) of each step: Poisson batches change size, and the graph must serve every size
STEPS = ((6, 1), (5, 2), (9, 3))


def released(*, compiled: bool, mechanism: str = "dpsgd", classes=CLASSES, dtype=torch.float64,
             per_contribution: bool = False, chunks: int = 1) -> tuple[list[dict[str, torch.Tensor]], list, Router]:
    """Each step's released `.grad` (noised, the model moved by SGD between steps) and report, on a fresh model."""
    net = model(dtype)
    resolution = resolve(classes, describe(net))
    router = Router(net, resolution, mechanism=mechanism, insecure_seed=11, compiled=compiled)
    std = {group.classes: 0.3 + 0.1 * i for i, group in enumerate(g for g in resolution.groups if g.classes)}
    grads, reports = [], []
    for size, seed in STEPS:
        ids, attention, labels, classes_, clip = batch(size, seed)
        if per_contribution:  # contribution unit: examples 2k and 2k+1 (if any) form unit k
            step_units = [i // 2 for i in range(size)]
            count = step_units[-1] + 1
            classes_, clip = classes_[:count], clip[:count].to(dtype)
            with router.capture(classes_, step_units):
                losses = losses_of(net, ids, attention, labels)
            router.begin()
            reports.append(router.accumulate(losses, classes_, clip, units=step_units))
        else:
            router.begin()
            for part in torch.arange(size).chunk(chunks):  # each chunk its own capture, noise once in `finish`
                with router.capture():
                    losses = losses_of(net, ids[part], attention[part], labels[part])
                reports.append(router.accumulate(losses, [classes_[i] for i in part], clip[part].to(dtype)))
        router.finish(std, expected_batch_size=4.0)
        grads.append({n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None})
        with torch.no_grad():
            for p in net.parameters():
                if p.grad is not None:
                    p -= 0.5 * p.grad
                    p.grad = None
    return grads, reports, router


def assert_bitwise(hooks, compiled) -> None:
    (expected, expected_reports, _), (got, got_reports, router) = hooks, compiled
    assert got_reports == expected_reports
    for step_expected, step_got in zip(expected, got, strict=True):
        assert step_got.keys() == step_expected.keys() and step_expected
        for name, value in step_expected.items():
            assert step_got[name].dtype == value.dtype and torch.equal(step_got[name], value), name
    # the graph ran for every chunk (not an eager fallback), and moved the model the same way
    assert router._compiled.compiled == len(got_reports) and router._compiled.eager == 0


@pytest.mark.parametrize("mechanism, classes", [("dpsgd", CLASSES), ("dp-muon", CLASSES), ("prism", WHOLE)],
                         ids=["dpsgd-heads", "dp-muon-heads", "prism"])
def test_compiled_routing_releases_the_hooks_bits_in_float64(mechanism, classes):
    assert_bitwise(released(compiled=False, mechanism=mechanism, classes=classes),
                   released(compiled=True, mechanism=mechanism, classes=classes))


@pytest.mark.slow  # two graphs compiled (~15-40 s on a shared 2-core machine)
def test_compiled_routing_releases_the_hooks_bits_per_contribution():
    """Units of two examples each: one class then holds a single unit, a row count of 1 the graph must serve."""
    assert_bitwise(released(compiled=False, per_contribution=True), released(compiled=True, per_contribution=True))


@pytest.mark.slow  # two graphs compiled (~15-40 s on a shared 2-core machine)
def test_compiled_routing_releases_the_hooks_bits_per_chunk():
    """A logical step in two chunks, each its own capture and clipping stage, the noise once in `finish`."""
    assert_bitwise(released(compiled=False, chunks=2), released(compiled=True, chunks=2))


def test_compiled_routing_agrees_in_float32():
    (expected, expected_reports, _), (got, got_reports, router) = \
        released(compiled=False, dtype=torch.float32), released(compiled=True, dtype=torch.float32)
    assert [r.clipped for r in got_reports] == [r.clipped for r in expected_reports]
    for step_expected, step_got in zip(expected, got, strict=True):
        for name, value in step_expected.items():
            assert torch.allclose(step_got[name], value, rtol=1e-5, atol=1e-6), name
    assert router._compiled.compiled == len(got_reports)


def test_one_graph_serves_new_batch_sizes_and_sequence_lengths_with_the_hooks_bits():
    """After the first steps, a new batch size and sequence length reuse the graph: no new compilation, and the
    release is still the hooks' bit for bit."""
    from torch._dynamo.utils import counters

    hooks, compiled = released(compiled=False)[2], released(compiled=True)[2]  # traced at the first step
    before, ran = counters["stats"]["unique_graphs"], compiled._compiled.compiled
    for size, seed, length in ((7, 4, 6), (11, 5, 5)):
        ids, attention, labels, classes, clip = batch(size, seed)
        ids, attention = ids[:, :length].contiguous(), attention[:, :length].contiguous()
        grads = []
        for router in (hooks, compiled):
            with router.capture():
                losses = losses_of(router.model, ids, attention, labels)
            router.privatize(losses, classes, clip, {}, expected_batch_size=4.0)
            grads.append({n: p.grad for n, p in router.model.named_parameters() if p.grad is not None})
        assert grads[0].keys() == grads[1].keys()
        assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    assert counters["stats"]["unique_graphs"] == before and compiled._compiled.compiled == ran + 2
