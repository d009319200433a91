"""Contribution-level DP (docs/design.md §5, privacy_unit = "contribution"): the routing layer averages a
contribution's examples, restricts the average to its class's profile and clips it to its C_i, against a
batch-size-1 oracle."""

from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from govtrain.resolver.model import describe  # noqa: E402
from govtrain.resolver.profile import resolve  # noqa: E402
from govtrain.routing.router import Router  # noqa: E402
from govtrain.mechanisms.tangent_space import tangent_matrix  # noqa: E402
from tests.conftest import lease, noise_groups_for, record_spend  # noqa: E402
from tests.test_train import tiny_model  # noqa: E402,F401  (fixture)
from tests.test_routing import CLASSES, batch, losses_of, model, per_sample  # noqa: E402

# 8 examples in 3 contributions, interleaved: sizes 3, 2 and 3; each contribution has one class
UNITS = [0, 1, 2, 0, 2, 1, 0, 2]
UNIT_CLASSES = ["sensitive", "public", "public"]
UNIT_CLIP = torch.tensor([0.01, 10.0, 0.01], dtype=torch.float64)  # two clipped, one not


def unit_batch():
    ids, attention, labels, _, _ = batch(size=len(UNITS), seed=3)
    return ids, attention, labels


def unit_reference(net, resolution, ids, attention, labels):
    """Per contribution: the mean of its examples' batch-size-1 gradients (restricted to its class), clipped
    jointly to its C_i; summed over contributions."""
    classes = [UNIT_CLASSES[u] for u in UNITS]
    grads = per_sample(net, resolution, ids, attention, labels, classes)
    total = {n: torch.zeros_like(p) for n, p in net.named_parameters() if p.requires_grad}
    for unit, clip in enumerate(UNIT_CLIP.tolist()):
        mine = [g for g, u in zip(grads, UNITS) if u == unit]
        mean = {n: sum(g[n] for g in mine) / len(mine) for n in mine[0]}
        norm = math.sqrt(sum(float(v.pow(2).sum()) for v in mean.values()))
        factor = min(1.0, clip / norm) if norm > 0 else 1.0
        for name, value in mean.items():
            total[name] += factor * value
    return total


@pytest.mark.parametrize("strategy", ["auto", "ghost", "materialize"])
def test_a_contributions_clipped_mean_equals_the_batch_size_one_loop(strategy: str):
    """Embedding, LayerNorm, LoRA factors, the head and a heads mask, each per-sample rule regrouped by unit."""
    net = model()
    resolution = resolve(CLASSES, describe(net))
    ids, attention, labels = unit_batch()
    expected = unit_reference(net, resolution, ids, attention, labels)
    router = Router(net, resolution, insecure_seed=0, per_sample=strategy)
    with router.capture():
        losses = losses_of(net, ids, attention, labels)
    router.begin()
    report = router.accumulate(losses, UNIT_CLASSES, UNIT_CLIP, units=UNITS)
    router.finish({}, expected_batch_size=1.0)
    assert report.batch_size == 3 and report.clipped == 2
    compared = 0
    for name, param in net.named_parameters():
        if param.grad is not None:
            assert torch.allclose(param.grad, expected[name], atol=1e-10, rtol=1e-8), name
            compared += 1
    assert compared > 10
    assert all(not t.inputs and not t.formed for t in router.taps.values())  # nothing per-sample survives


@pytest.mark.parametrize("mechanism", ["dpsgd", "prism", "dp-muon"])
def test_one_example_per_contribution_is_the_example_level_step(mechanism: str):
    classes = {"public": CLASSES["public"]}  # prism: every class reaches LoRA pairs whole
    net = model()
    resolution = resolve(classes, describe(net))
    ids, attention, labels, _, clip = batch()
    released = []
    for units in (None, [5, 0, 4, 1, 3, 2]):
        router = Router(net, resolution, insecure_seed=0, mechanism=mechanism)
        with router.capture():
            losses = losses_of(net, ids, attention, labels)
        order = list(range(6)) if units is None else sorted(range(6), key=lambda i: units[i])
        router.begin()
        router.accumulate(losses, ["public"] * 6, clip[order], units=units)
        router.finish({}, expected_batch_size=1.0)
        released.append({n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None})
        router.close()
    assert released[0].keys() == released[1].keys()
    for name in released[0]:
        assert torch.allclose(released[0][name], released[1][name], atol=1e-12), name


@pytest.mark.parametrize("mechanism", ["dpsgd", "prism", "dp-muon"])
def test_removing_a_whole_contribution_moves_the_clipped_sum_by_at_most_its_clip_norm(mechanism: str):
    classes = {"public": CLASSES["public"]} if mechanism == "prism" else CLASSES
    unit_classes = [c if c in classes else "public" for c in UNIT_CLASSES]
    net = model()
    resolution = resolve(classes, describe(net))
    ids, attention, labels = unit_batch()
    router = Router(net, resolution, insecure_seed=0, mechanism=mechanism)

    def released(keep: list[int]) -> dict[str, torch.Tensor]:
        rows = [i for i, u in enumerate(UNITS) if u in keep]
        renumber = {u: k for k, u in enumerate(keep)}
        with router.capture():
            losses = losses_of(net, ids[rows], attention[rows], labels[rows])
        router.begin()
        router.accumulate(losses, [unit_classes[u] for u in keep], UNIT_CLIP[keep],
                          units=[renumber[UNITS[i]] for i in rows])
        router.finish({}, expected_batch_size=1.0)
        params = dict(net.named_parameters())
        out = {}
        for name, param in params.items():  # prism: a LoRA pair's release measured in its tangent metric
            if param.grad is None or name in router.pairs.values():
                continue
            partner = params[router.pairs[name]] if name in router.pairs else None
            out[name] = param.grad.clone() if partner is None else tangent_matrix(
                param.detach(), partner.detach().T, param.grad, partner.grad.T)
        return out

    full = released([0, 1, 2])
    for drop in range(3):
        without = released([u for u in range(3) if u != drop])
        distance = math.sqrt(sum(float((full[n] - without.get(n, 0)).pow(2).sum()) for n in full))
        assert distance <= float(UNIT_CLIP[drop]) * (1 + 1e-9)
        assert distance > 0


def test_bad_units_are_refused():
    net = model()
    router = Router(net, resolve(CLASSES, describe(net)), insecure_seed=0)
    ids, attention, labels = unit_batch()
    for units, classes in (([0] * 7, UNIT_CLASSES),  # one unit per example needed
                           ([0, 1, 3, 0, 2, 1, 0, 2], UNIT_CLASSES),  # unit 3 of 3
                           ([0, 0, 2, 0, 2, 0, 0, 2], UNIT_CLASSES)):  # unit 1 has no example
        with router.capture():
            losses = losses_of(net, ids, attention, labels)
        router.begin()
        with pytest.raises(ValueError):
            router.accumulate(losses, classes, UNIT_CLIP, units=units)
    assert all(p.grad is None for p in net.parameters())


# -- the unit through the policy, the ledger, `govtrain train`, `plan`, the verifier --------------------------

CONTRIBUTION_POLICY_LINES = 'privacy_unit = "contribution"\nexamples_per_contribution = 4\nsampling_rate = 0.5\n'


def contribution_corpus(tmp_path):
    from tests.conftest import TEST_POLICY, make_corpus

    text = TEST_POLICY.replace("sampling_rate = 0.01\n", CONTRIBUTION_POLICY_LINES)
    return make_corpus(tmp_path, f"sqlite:///{tmp_path / 'ledger.db'}", text)


def test_the_policy_fixes_the_unit_in_the_header_and_refuses_half_a_unit(tmp_path):
    from govtrain.errors import ConfigError
    from govtrain.policy.config import load_policy
    from tests.conftest import TEST_POLICY

    corpus = contribution_corpus(tmp_path)
    with corpus.open() as ledger:
        assert ledger.policy.privacy_unit == "contribution" and ledger.policy.examples_per_contribution == 4
        assert ledger.policy.unit == "contribution (at most 4 examples)"
        assert ledger.policy.sampling_units(120) == 1
    for lines in ('privacy_unit = "contribution"\nsampling_rate = 0.5\n',  # no examples_per_contribution
                  'examples_per_contribution = 4\nsampling_rate = 0.5\n',  # it without the unit
                  'privacy_unit = "user"\nsampling_rate = 0.5\n'):
        bad = corpus.dir / "bad.toml"
        bad.write_text(TEST_POLICY.replace("sampling_rate = 0.01\n", lines))
        with pytest.raises(ConfigError):
            load_policy(bad)


def test_a_policy_change_may_not_change_the_unit(tmp_path):
    from govtrain.errors import ConfigError
    from govtrain.policy.config import load_policy
    from tests.conftest import TEST_POLICY, snapshot

    corpus = contribution_corpus(tmp_path)
    before = snapshot(corpus.url)
    for text in (TEST_POLICY, TEST_POLICY.replace("sampling_rate = 0.01\n", CONTRIBUTION_POLICY_LINES.replace(
            "= 4", "= 8"))):
        other = corpus.dir / "other.toml"  # beside the key files it names
        other.write_text(text)
        policy, digest = load_policy(other)
        with corpus.open() as ledger, pytest.raises(ConfigError, match="privacy unit"):
            ledger.change_policy(policy, digest, "switch units", now=corpus.now)
        assert snapshot(corpus.url) == before


def test_a_contribution_level_run_samples_and_charges_contributions(tmp_path, tiny_model):
    """q is over contributions; each drawn contribution brings at most examples_per_contribution examples;
    every spend entry records the unit; the charged epsilon is DP-SGD's at q_contribution; the verifier
    recomputes it."""
    from govtrain.accounting import Bucket, get_accountant
    from govtrain.ledger.entries import decode_entry
    from govtrain.train.config import load_run_config
    from govtrain.train.loop import train
    from govtrain.verify.verifier import verify_ledger
    from tests.test_train import _admit, _config

    corpus = contribution_corpus(tmp_path)
    for name in ("c1", "c2", "c3"):
        _admit(corpus, name, records=40, noise_multiplier_u=2_000_000, eps_budget_u=8_000_000)
    seen: list[list[str]] = []
    config = load_run_config(_config(corpus, tiny_model, 12, extra="physical_batch = 5"))
    result = train(config, corpus.url, insecure_seed=3, log=lambda _: None,
                   observe=lambda step, owners: seen.append(owners))
    assert result.steps == 12 and len(seen) == 12
    for owners in seen:
        assert all(owners.count(c) == 4 for c in set(owners))  # examples_per_contribution of its 40
    assert sum(len(set(owners)) for owners in seen) / 12 == pytest.approx(1.5, abs=1.0)  # q = 0.5 of 3
    assert len({len(set(owners)) for owners in seen}) > 1  # Poisson: the number drawn varies
    with corpus.open() as ledger:
        spends = [decode_entry(e.body, seq=e.seq, kind=e.kind) for e in ledger.store.entries(kinds=("spend",))]
    assert spends and {s["privacy_unit"] for s in spends} == {"contribution"}
    assert {s["sampling_rate_u"] for s in spends} == {500_000}
    last = [s for s in spends if s["contribution_id"] == "c1"]
    history = [Bucket(s["sampling_rate_u"] / 1e6, s["noise_multiplier_u"] / 1e6, s["steps"]) for s in last]
    assert last[-1]["eps_u"] == get_accountant("prv").epsilon(history, 1e-5).epsilon_u
    report = verify_ledger(corpus.url)
    assert report.ok and report.spend_recomputed


def test_a_unit_too_large_for_the_physical_batch_is_refused_before_any_spend(tmp_path, tiny_model):
    from click.testing import CliRunner

    from govtrain.cli.main import cli
    from tests.conftest import snapshot
    from tests.test_train import _admit, _config

    corpus = contribution_corpus(tmp_path)
    _admit(corpus, "c1", records=10)
    before = snapshot(corpus.url)
    result = CliRunner().invoke(cli, ["train", "--config", str(_config(corpus, tiny_model, 3, extra="physical_batch = 3")),
                                      "--ledger", corpus.url])
    assert result.exit_code == 2 and "examples_per_contribution" in result.stderr
    assert snapshot(corpus.url) == before


def test_the_verifier_fails_a_spend_that_names_another_unit(tmp_path):
    """A database writer without keys cannot relabel the unit: the entry's bytes are in the signed tree, and a
    spend signed under the header that names another unit is refused as well (the recorded unit is checked)."""
    from govtrain.ledger.entries import decode_entry
    from govtrain.verify.verifier import inspect_ledger, verify_ledger
    from tests.test_train import _admit

    corpus = contribution_corpus(tmp_path)
    _admit(corpus, "c1", records=5, noise_multiplier_u=2_000_000)  # sigma_eff 2: its own signed sigma
    with corpus.open() as ledger:
        record_spend(ledger, 0, 500_000, [("c1", 3, 2_000_000, _eps(3))], run_id="r", epoch_steps=3, now=corpus.now)
        ledger.close_epoch(now=corpus.now)
        spend = next(ledger.store.entries(kinds=("spend",)))
        assert decode_entry(spend.body, seq=spend.seq, kind="spend")["privacy_unit"] == "contribution"
    assert verify_ledger(corpus.url).ok
    import govtrain.ledger.ledger as ledger_module

    original = ledger_module.Ledger.record_spend
    with corpus.open() as ledger:
        policy = ledger.policy
        object.__setattr__(policy, "privacy_unit", "example")  # a writer holding the key but not the header's unit
        object.__setattr__(policy, "examples_per_contribution", None)
        try:
            _admit(corpus, "c2", records=5, noise_multiplier_u=2_000_000)
            original(ledger, 1, 500_000, [("c2", 3, 2_000_000, _eps(3))], run_id="r2", run_nonce=lease("r2"), epoch_steps=3,
                     noise_groups=noise_groups_for(ledger, ["c2"]), now=corpus.now)
            ledger.close_epoch(now=corpus.now)
        finally:
            object.__setattr__(policy, "privacy_unit", "contribution")
            object.__setattr__(policy, "examples_per_contribution", 4)
    report = inspect_ledger(corpus.url)
    assert not report.ok and "privacy unit 'example' differs" in report.error.detail and report.bad_seq is not None


def _eps(steps: int) -> int:
    from govtrain.accounting import Bucket, get_accountant

    return get_accountant("prv").epsilon([Bucket(0.5, 2.0, steps)], 1e-5).epsilon_u


def test_plan_and_privacy_epsilon_speak_of_the_unit(tmp_path):
    from click.testing import CliRunner

    from govtrain.cli.main import cli
    from tests.test_train import _admit

    corpus = contribution_corpus(tmp_path)
    for name in ("c1", "c2"):
        _admit(corpus, name, records=30)
    result = CliRunner().invoke(cli, ["plan", "--ledger", corpus.url, "--steps", "10", "--json"])
    plan = json.loads(result.stdout)
    assert plan["privacy_unit"] == "contribution" and plan["examples_per_contribution"] == 4
    assert plan["eligible_contributions"] == 2 and plan["eligible_records"] == 60 and plan["sampling_rate"] == 0.5
    text = CliRunner().invoke(cli, ["plan", "--ledger", corpus.url, "--steps", "10"]).stdout
    assert "2 eligible contributions" in text and "protects a whole contribution" in text
    status = CliRunner().invoke(cli, ["ledger", "status", "--ledger", corpus.url])
    assert "ε per contribution" in status.stdout
    assert json.loads(CliRunner().invoke(cli, ["ledger", "status", "--ledger", corpus.url, "--json"]).stdout)[
        "examples_per_contribution"] == 4
    one = CliRunner().invoke(cli, ["privacy", "epsilon", "--q", "0.02", "--sigma", "1", "--steps", "50", "--delta",
                                   "1e-5", "--group", "120", "--json"])
    body = json.loads(one.stdout)
    assert body["unit"] == "example" and body["group"]["size"] == 120
    assert body["group"]["eps"] == pytest.approx(120 * body["eps"]) and body["group"]["delta"] > 1
    refused = CliRunner().invoke(cli, ["privacy", "epsilon", "--q", "0.02", "--sigma", "1", "--steps", "50",
                                       "--delta", "1e-5", "--unit", "contribution", "--group", "3"])
    assert refused.exit_code == 2 and "error[" in refused.stderr


def test_whole_contributions_in_separate_chunks_sum_to_the_unchunked_step():
    """`govtrain train` packs whole contributions into physical chunks: the chunks' clipped sums add up to the
    one-chunk step (noise aside, drawn once in `finish`)."""
    net = model()
    router = Router(net, resolve(CLASSES, describe(net)), insecure_seed=0)
    ids, attention, labels = unit_batch()
    released = []
    for chunks in ([[0, 1, 2]], [[0, 2], [1]]):
        router.begin()
        for keep in chunks:
            rows = [i for i, u in enumerate(UNITS) if u in keep]
            renumber = {u: k for k, u in enumerate(keep)}
            with router.capture():
                losses = losses_of(net, ids[rows], attention[rows], labels[rows])
            router.accumulate(losses, [UNIT_CLASSES[u] for u in keep], UNIT_CLIP[keep],
                              units=[renumber[UNITS[i]] for i in rows])
        router.finish({}, expected_batch_size=3.0)
        released.append({n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None})
    assert released[0].keys() == released[1].keys() and released[0]
    for name in released[0]:
        assert torch.allclose(released[0][name], released[1][name], atol=1e-12), name


def test_an_expected_batch_counts_contributions_not_examples(tmp_path):
    """Under a policy that fixes the expected batch size, q is that many contributions over the eligible
    contributions (3 of 120 examples each): 1/3, never 1/360."""
    from click.testing import CliRunner

    from govtrain.cli.main import cli
    from tests.conftest import TEST_POLICY, make_corpus
    from tests.test_train import _admit

    text = TEST_POLICY.replace("sampling_rate = 0.01\n", 'privacy_unit = "contribution"\n'
                               "examples_per_contribution = 4\nexpected_batch_size = 1\n")
    corpus = make_corpus(tmp_path, f"sqlite:///{tmp_path / 'ledger.db'}", text)
    for name in ("c1", "c2", "c3"):
        _admit(corpus, name, records=120)
    plan = json.loads(CliRunner().invoke(cli, ["plan", "--ledger", corpus.url, "--steps", "5", "--json"]).stdout)
    assert plan["sampling_rate"] == 0.333334 and plan["eligible_records"] == 360
    with corpus.open() as ledger:  # the ledger's floor on q counts contributions too
        with pytest.raises(Exception, match="below"):
            record_spend(ledger, 0, 300_000, [("c1", 5, 2_000_000, 1)], run_id="r", epoch_steps=5, now=corpus.now)
