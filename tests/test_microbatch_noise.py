"""Per-microbatch noise (docs/privatizers.md; `Router(microbatches=k)`, `routing/microbatch.py`): a public
assignment by unit id and step, one clipped sum per microbatch, each noised on its own."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from govtrain.resolver.model import describe  # noqa: E402
from govtrain.resolver.profile import resolve  # noqa: E402
from govtrain.routing import microbatch  # noqa: E402
from govtrain.routing.router import Router  # noqa: E402
from tests.test_routing import CLASSES, batch, losses_of, model  # noqa: E402

KEY = bytes(range(32))
K = 3
SIZE = 9


def ids_of(size: int) -> list[str]:
    return [microbatch.example_id(f"contribution-{i // 2}", i % 2) for i in range(size)]


def microbatch_sums(router: Router, keep: list[int], parts: list[list[int]]) -> list[dict[str, torch.Tensor]]:
    """Each microbatch's clipped sum (no noise) of the test batch's examples `keep`, split by `parts` (positions
    into the full batch), every microbatch its own chunk."""
    net = router.model
    ids, attention, labels, classes, clip = batch(SIZE, seed=5)
    router.begin()
    for m, part in enumerate(parts):
        rows = [i for i in part if i in keep]
        if rows:
            with router.capture():
                losses = losses_of(net, ids[rows], attention[rows], labels[rows])
            router.accumulate(losses, [classes[i] for i in rows], clip[rows], microbatch=m)
    sums = [router._totals or router._zeros()] + [router._parts.get(m) or router._zeros() for m in range(1, K)]
    router.begin()
    return [{name: value.clone() for name, value in part.items()} for part in sums]


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float((a[name] - b[name]).pow(2).sum()) for name in a))


def test_removing_one_unit_changes_its_own_microbatch_alone_by_at_most_its_clip_norm():
    net = model()
    router = Router(net, resolve(CLASSES, describe(net)), insecure_seed=0, microbatches=K)
    clip = batch(SIZE, seed=5)[4]
    units = ids_of(SIZE)
    everyone = list(range(SIZE))
    for step in (0,):  # one step keeps this under ~10 s; the assignment's test covers other steps
        full_parts = microbatch.split(KEY, step, units, K)
        assert sum(map(len, full_parts)) == SIZE and sum(1 for p in full_parts if p) >= 2
        full = microbatch_sums(router, everyone, full_parts)
        for drop in everyone:
            keep = [i for i in everyone if i != drop]
            # the rule runs again on the neighbouring batch: each remaining unit lands where it did
            kept_parts = microbatch.split(KEY, step, [units[i] for i in keep], K)
            assert [[keep[j] for j in part] for part in kept_parts] == [[i for i in p if i != drop] for p in full_parts]
            without = microbatch_sums(router, keep, full_parts)
            own = microbatch.assign(KEY, step, units[drop], K)
            for m in range(K):
                if m == own:
                    assert distance(full[m], without[m]) <= float(clip[drop]) * (1 + 1e-9)
                else:
                    assert all(torch.equal(full[m][n], without[m][n]) for n in full[m]), (drop, m)


def test_a_positional_split_would_move_other_microbatches():
    """What the id rule avoids: by position in the batch, removing a unit shifts every later unit's microbatch."""
    net = model()
    router = Router(net, resolve(CLASSES, describe(net)), insecure_seed=0, microbatches=K)
    everyone = list(range(SIZE))
    by_position = [[i for i in everyone if i % K == m] for m in range(K)]
    full = microbatch_sums(router, everyone, by_position)
    keep = everyone[1:]  # unit 0 removed: the others move up one position
    shifted = [[keep[j] for j in range(len(keep)) if j % K == m] for m in range(K)]
    without = microbatch_sums(router, keep, shifted)
    changed = [m for m in range(K) if not all(torch.equal(full[m][n], without[m][n]) for n in full[m])]
    assert len(changed) == K


def test_each_microbatch_gets_its_own_noise_and_the_release_is_their_sum():
    net = model(torch.float32)
    resolution = resolve(CLASSES, describe(net))
    stds = {group.classes: 0.5 + i for i, group in enumerate(g for g in resolution.groups if g.classes)}
    router = Router(net, resolution, insecure_seed=7, microbatches=4)
    single = Router(model(torch.float32), resolution, insecure_seed=7)
    single.noise_only(stds, expected_batch_size=4.0)
    single.close()
    samples: dict[frozenset, list] = {s: [] for s in stds}
    for _ in range(12):
        router.noise_only(stds, expected_batch_size=4.0)
        for group in resolution.groups:
            if group.classes:
                for part in group.parts:
                    grad = net.get_parameter(part.name).grad
                    values = grad if part.dim is None else grad.index_select(part.dim, torch.tensor(part.index))
                    samples[group.classes].append(values.flatten())
        assert router.noise_std == pytest.approx({n: 2 * v for n, v in single.noise_std.items()})  # sqrt(4)
    for signature, std in stds.items():
        observed = float(torch.cat(samples[signature]).std()) * 4.0  # the step divides by the expected batch size
        assert abs(observed - 2 * std) <= 0.05 * 2 * std, (sorted(signature), observed, std)  # sqrt(4) s_g

    # without noise the step releases the sum of the microbatches' clipped sums: the one-noise step's sum
    released = []
    ids, attention, labels, classes, clip = batch(SIZE, seed=5)
    parts = microbatch.split(KEY, 0, ids_of(SIZE), K)
    for k in (1, K):
        net = model()
        router = Router(net, resolve(CLASSES, describe(net)), insecure_seed=0, microbatches=k)
        router.begin()
        for m, rows in enumerate(parts):
            if not rows:
                continue
            with router.capture():
                losses = losses_of(net, ids[rows], attention[rows], labels[rows])
            router.accumulate(losses, [classes[i] for i in rows], clip[rows], microbatch=m if k > 1 else 0)
        router.finish({}, expected_batch_size=4.0)
        released.append({n: p.grad for n, p in net.named_parameters() if p.grad is not None})
    assert released[0].keys() == released[1].keys()
    assert all(torch.allclose(released[0][n], released[1][n], rtol=1e-12, atol=1e-15) for n in released[0])


def test_one_microbatch_is_the_step_as_before():
    """k = 1 runs the step as before per-microbatch noise existed: `Router()` and `Router(microbatches=1)`, the
    same seed and chunks, release the same bytes (the golden hashes of the i.i.d. Gaussian's step hold for both)."""
    out = []
    for kwargs in ({}, {"microbatches": 1}):
        net = model()
        resolution = resolve(CLASSES, describe(net))
        router = Router(net, resolution, insecure_seed=3, **kwargs)
        std = {g.classes: 0.4 for g in resolution.groups if g.classes}
        ids, attention, labels, classes, clip = batch(SIZE, seed=5)
        router.begin()
        for rows in (list(range(5)), list(range(5, SIZE))):
            with router.capture():
                losses = losses_of(net, ids[rows], attention[rows], labels[rows])
            router.accumulate(losses, [classes[i] for i in rows], clip[rows])
        router.finish(std, expected_batch_size=4.0)
        out.append({n: p.grad.numpy().tobytes() for n, p in net.named_parameters() if p.grad is not None})
    assert out[0] == out[1] and out[0]


def test_a_microbatch_outside_the_routers_is_refused_and_nothing_is_summed():
    net = model()
    router = Router(net, resolve(CLASSES, describe(net)), insecure_seed=0, microbatches=2)
    ids, attention, labels, classes, clip = batch(4, seed=5)
    router.begin()
    for bad in (2, -1, True, 1.0):
        with router.capture():
            losses = losses_of(net, ids, attention, labels)
        with pytest.raises(ValueError, match="microbatch must be"):
            router.accumulate(losses, classes, clip, microbatch=bad)
        assert router._totals is None and router._parts == {}
    for bad in (0, -2, True, 2.5):
        with pytest.raises(ValueError, match="microbatches must be"):
            Router(net, resolve(CLASSES, describe(net)), microbatches=bad)


def test_the_assignment_depends_on_the_unit_and_the_step_alone():
    units = [f"c{i}" for i in range(3000)]
    parts = microbatch.split(KEY, 7, units, 4)
    counts = [sum(len(microbatch.split(KEY, step, units[:1000], 4)[m]) for step in range(20)) for m in range(4)]
    assert sum((c - 5000) ** 2 / 5000 for c in counts) < 16.27  # uniform: chi-square, 3 degrees, p = 0.001
    where = {units[i]: m for m, part in enumerate(parts) for i in part}
    subset = units[::3]  # another batch: each unit keeps its microbatch
    assert all(where[subset[i]] == m for m, part in enumerate(microbatch.split(KEY, 7, subset, 4)) for i in part)
    moved = sum(microbatch.assign(KEY, 7, u, 4) != microbatch.assign(KEY, 8, u, 4) for u in units)
    assert 0.6 * 3000 < moved < 0.9 * 3000  # a fresh assignment each step (3/4 move)
    assert microbatch.assign(KEY, 7, "c1", 1) == 0
    with pytest.raises(ValueError):
        microbatch.assign(KEY, -1, "c1", 2)
