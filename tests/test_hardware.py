"""Hardware never changes the mechanism (docs/design.md §5): physical chunks, bf16 autocast and the device only
change how the same privatized step is computed. CUDA cases run where a GPU is present and skip elsewhere."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from govtrain.errors import ConfigError  # noqa: E402
from govtrain.resolver.model import describe  # noqa: E402
from govtrain.resolver.profile import resolve  # noqa: E402
from govtrain.routing.router import Router  # noqa: E402
from govtrain.train.loop import resolve_device  # noqa: E402
from tests.test_mechanism_routing import WHOLE  # noqa: E402
from tests.test_routing import (CLASSES, assert_removing_one_moves_the_release_by_at_most_its_clip_norm, batch,  # noqa: E402
                                losses_of, model)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _step(net, router, ids, attention, labels, classes, clip, stds, chunks=None, *, autocast=None):
    """One logical step: the whole batch at once, or `chunks` (index lists) accumulated, noise added once."""
    router.begin()
    for part in chunks or [list(range(len(classes)))]:
        with router.capture(), (autocast() if autocast else torch.autocast("cpu", enabled=False)):
            logits = net(input_ids=ids[part], attention_mask=attention[part]).logits
        losses = torch.nn.functional.cross_entropy(logits.to(clip.dtype), labels[part], reduction="none")
        router.accumulate(losses, [classes[i] for i in part], clip[part])
    router.finish(stds, expected_batch_size=4.0)
    return {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mechanism", ["dpsgd", "prism", "dp-muon"])
def test_a_chunked_step_equals_the_unchunked_step(mechanism: str):
    classes_of = WHOLE if mechanism == "prism" else CLASSES
    ids, attention, labels, classes, clip = batch(7)
    results = []
    for chunks in (None, [[0, 1], [2, 3, 4], [5], [6]], [[6, 0], [3], [1, 2, 4, 5]]):
        net = model()
        resolution = resolve(classes_of, describe(net))
        stds = {g.classes: 0.2 for g in resolution.groups if g.classes}
        router = Router(net, resolution, mechanism=mechanism, insecure_seed=11)  # the same noise each time
        results.append(_step(net, router, ids, attention, labels, classes, clip, stds, chunks))
    whole = results[0]
    for chunked in results[1:]:
        assert chunked.keys() == whole.keys()
        for name in whole:
            assert torch.allclose(chunked[name], whole[name], atol=1e-6, rtol=0), name


def test_an_empty_logical_step_releases_noise_alone():
    net = model()
    resolution = resolve(CLASSES, describe(net))
    stds = {g.classes: 0.3 for g in resolution.groups if g.classes}
    first = Router(net, resolution, insecure_seed=3)
    first.begin()
    first.finish(stds, expected_batch_size=2.0)
    begun = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    second = Router(net, resolution, insecure_seed=3)
    second.noise_only(stds, expected_batch_size=2.0)
    for name, value in begun.items():
        assert torch.equal(value, net.get_parameter(name).grad), name


def test_bf16_autocast_keeps_norms_clipping_sums_and_noise_in_fp32():
    net = model(torch.float32)
    resolution = resolve(CLASSES, describe(net))
    ids, attention, labels, classes, clip = batch(6)
    clip = clip.float()
    router = Router(net, resolution, insecure_seed=5)
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    seen = []
    original = router._clipped_sum

    def spy(losses, *args):
        totals, report = original(losses, *args)
        seen.append({t.dtype for t in totals.values()})
        return totals, report

    router._clipped_sum = spy
    stds = {g.classes: 0.1 for g in resolution.groups if g.classes}
    grads = _step(net, router, ids, attention, labels, classes, clip, stds, autocast=bf16)
    assert seen == [{torch.float32}] and {g.dtype for g in grads.values()} == {torch.float32}

    def released(keep):
        router.begin()
        with router.capture(), bf16():
            logits = net(input_ids=ids[keep], attention_mask=attention[keep]).logits
        losses = torch.nn.functional.cross_entropy(logits.float(), labels[keep], reduction="none")
        router.accumulate(losses, [classes[i] for i in keep], clip[keep])
        router.finish({}, expected_batch_size=1.0)  # no noise: .grad holds the clipped sum
        return {n: p.grad.double() for n, p in net.named_parameters() if p.grad is not None}

    router._clipped_sum = original
    assert_removing_one_moves_the_release_by_at_most_its_clip_norm(released, clip.double() * (1 + 1e-6))


def test_a_cuda_device_this_machine_lacks_is_refused():
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ConfigError) as info:
        resolve_device(f"cuda:{available}")
    assert info.value.code.value == "run_config_invalid" and "cpu or auto" in info.value.detail
    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto").type == ("cuda" if available else "cpu")


@cuda
@pytest.mark.parametrize("mechanism", ["dpsgd", "prism", "dp-muon"])
def test_the_cuda_step_clips_and_sums_as_the_cpu_step(mechanism: str):
    classes_of = WHOLE if mechanism == "prism" else CLASSES
    ids, attention, labels, classes, clip = batch(7)
    sums = []
    for device in ("cpu", "cuda"):
        net = model().to(device)
        router = Router(net, resolve(classes_of, describe(net)), mechanism=mechanism, insecure_seed=0)
        on = [t.to(device) for t in (ids, attention, labels, clip)]
        sums.append({n: g.cpu() for n, g in _step(net, router, on[0], on[1], on[2], classes, on[3], {},
                                                   [[0, 1, 2], [3, 4, 5, 6]]).items()})
    for name in sums[0]:
        assert torch.allclose(sums[0][name], sums[1][name], atol=1e-9, rtol=1e-9), name


@cuda
def test_cuda_noise_is_drawn_on_the_device_with_its_standard_deviation():
    net = model(torch.float32).to("cuda")
    resolution = resolve(CLASSES, describe(net))
    router = Router(net, resolution)  # OS-seeded
    assert router.generator.device.type == "cuda"
    stds = {g.classes: 0.5 for g in resolution.groups if g.classes}
    values = []
    for _ in range(10):
        router.noise_only(stds, expected_batch_size=2.0)
        values += [p.grad.flatten() for p in net.parameters() if p.grad is not None]
    observed = float(torch.cat(values).std()) * 2.0
    assert values[0].device.type == "cuda" and abs(observed - 0.5) < 0.03


@cuda
def test_bf16_on_cuda_keeps_the_sensitivity_bound():
    net = model(torch.float32).to("cuda")
    resolution = resolve(CLASSES, describe(net))
    ids, attention, labels, classes, clip = (t.to("cuda") if isinstance(t, torch.Tensor) else t for t in batch(6))
    clip = clip.float()
    router = Router(net, resolution, insecure_seed=5)

    def released(keep):
        router.begin()
        with router.capture(), torch.autocast("cuda", dtype=torch.bfloat16):
            logits = net(input_ids=ids[keep], attention_mask=attention[keep]).logits
        losses = torch.nn.functional.cross_entropy(logits.float(), labels[keep], reduction="none")
        router.accumulate(losses, [classes[i] for i in keep], clip[keep])
        router.finish({}, expected_batch_size=1.0)  # no noise: .grad holds the clipped sum
        grads = {n: p.grad for n, p in net.named_parameters() if p.grad is not None}
        assert {g.dtype for g in grads.values()} == {torch.float32}
        return {n: g.double().cpu() for n, g in grads.items()}

    assert_removing_one_moves_the_release_by_at_most_its_clip_norm(released, clip.double().cpu() * (1 + 1e-6))


# -- the run -----------------------------------------------------------------------------------------------

from govtrain.ledger.entries import decode_entry  # noqa: E402
from govtrain.train.config import load_run_config  # noqa: E402
from govtrain.train.loop import train  # noqa: E402
from govtrain.verify.verifier import verify_ledger  # noqa: E402
from tests.conftest import Corpus, snapshot  # noqa: E402
from tests.test_train import _admit, _config, tiny_model  # noqa: E402,F401


def _run_entry(corpus: Corpus) -> dict:
    with corpus.open() as ledger:
        stored = next(iter(ledger.store.entries(kinds=("run",))))
    return decode_entry(stored.body, seq=stored.seq, kind="run")


def test_a_run_in_bf16_chunks_records_its_device_and_precision(corpus: Corpus, tiny_model):
    _admit(corpus, "pub")
    _admit(corpus, "sens", data_class="sensitive", clip_norm_u=500_000, eps_budget_u=3_000_000)
    path = _config(corpus, tiny_model, 12, extra='device = "cpu"\nprecision = "bf16"\nphysical_batch = 2')
    result = train(load_run_config(path), corpus.url, insecure_seed=1, log=lambda line: None)
    assert result.steps == 12
    run = _run_entry(corpus)
    assert (run["device"], run["precision"]) == ("cpu", "bf16")
    assert verify_ledger(corpus.url).spend_recomputed


def test_a_cuda_run_on_a_machine_without_one_is_refused_before_any_spend(corpus: Corpus, tiny_model):
    _admit(corpus, "pub")
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    path = _config(corpus, tiny_model, 5, extra=f'device = "cuda:{available}"')
    before = snapshot(corpus.url)
    with pytest.raises(ConfigError) as info:
        train(load_run_config(path), corpus.url, insecure_seed=1, log=lambda line: None)
    assert info.value.code.value == "run_config_invalid" and snapshot(corpus.url) == before


@cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_cuda_run_trains_verifies_and_records_the_device(corpus: Corpus, tiny_model, precision: str):
    _admit(corpus, "pub")
    _admit(corpus, "sens", data_class="sensitive", clip_norm_u=500_000, eps_budget_u=3_000_000)
    path = _config(corpus, tiny_model, 12, extra=f'device = "cuda"\nprecision = "{precision}"\nphysical_batch = 3')
    result = train(load_run_config(path), corpus.url, insecure_seed=1, log=lambda line: None)
    assert result.steps == 12 and all(loss == loss for loss in result.losses if loss == loss)
    run = _run_entry(corpus)
    assert (run["device"], run["precision"]) == ("cuda:0", precision)
    assert verify_ledger(corpus.url).spend_recomputed
