"""RUN.toml [noise] microbatches and [training] compiled through the run (docs/privatizers.md, per-microbatch noise;
docs/performance.md, compiled routing): `govtrain train` and `GovernedRun` split each step's units into microbatches
by the public rule and hand each chunk's microbatch to the router; the ledger records k > 1 in the privatizer and
charges what the ordinary step charges; a correlated privatizer refuses k > 1; compiled routing trains the same
adapter bytes as the hooks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from click.testing import CliRunner  # noqa: E402

import govtrain  # noqa: E402
from govtrain.cli.main import cli  # noqa: E402
from govtrain.errors import ConfigError  # noqa: E402
from govtrain.ledger.entries import decode_entry  # noqa: E402
from govtrain.ledger.ledger import Ledger  # noqa: E402
from govtrain.privatizers import build, from_record  # noqa: E402
from govtrain.privatizers.gaussian import IIDGaussian  # noqa: E402
from govtrain.routing import microbatch  # noqa: E402
from govtrain.routing.router import Router  # noqa: E402
from govtrain.train.config import NoiseSection  # noqa: E402
from govtrain.verify.verifier import verify_ledger  # noqa: E402
from tests.conftest import make_corpus, snapshot  # noqa: E402
from tests.test_api import BATCH_POLICY, QUIET  # noqa: E402
from tests.test_contribution_unit import contribution_corpus  # noqa: E402
from tests.test_train import _admit, _config, tiny_model  # noqa: E402,F401

TWO = "\n[noise]\nmicrobatches = 2"


def _corpus(tmp_path: Path, name: str, *, contribution: bool = False):
    folder = tmp_path / name
    folder.mkdir()
    corpus = contribution_corpus(folder) if contribution else make_corpus(folder, f"sqlite:///{folder / 'ledger.db'}",
                                                                          BATCH_POLICY)
    for cid in ("pub", "more", "most"):
        _admit(corpus, cid, records=12)
    _admit(corpus, "sens", records=12, data_class="sensitive", clip_norm_u=500_000, eps_budget_u=3_000_000)
    return corpus


def _entries(url: str) -> list[dict]:
    with Ledger.open(url) as ledger:
        return [decode_entry(e.body, seq=e.seq, kind=e.kind) for e in ledger.store.entries(kinds=("spend", "run"))]


def _charged(entries: list[dict]) -> list[tuple]:
    """What each spend charged: (epoch, contribution, steps, q, sigma, eps)."""
    return [(e["epoch"], e["contribution_id"], e["steps"], e["sampling_rate_u"], e["noise_multiplier_u"], e["eps_u"])
            for e in entries if e["kind"] == "spend"]


class Accumulated:
    """Router.accumulate, spied on: each call's microbatch and the number of units it clipped."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[tuple[int, int]] = []
        original = Router.accumulate

        def spy(router, losses, classes, clip_norms, units=None, *, microbatch=0):
            self.calls.append((microbatch, len(classes)))
            return original(router, losses, classes, clip_norms, units, microbatch=microbatch)

        monkeypatch.setattr(Router, "accumulate", spy)


# -- the privatizer records k > 1 and charges as k = 1 ----------------------------------------------------

def test_the_iid_gaussian_records_microbatches_only_above_one_and_charges_the_same():
    assert build(NoiseSection()).record() == {"name": "gaussian"}  # k = 1: the record as before, byte for byte
    two = build(NoiseSection(microbatches=2))
    assert two.record() == {"name": "gaussian", "microbatches": 2} and from_record(two.record()).microbatches == 2
    charge = dict(sampling_rate_u=10_000, noise_multiplier_u=1_200_000, steps=7)
    assert two.charge(**charge) == IIDGaussian().charge(**charge)  # parallel composition: the same charge
    for bad in ({"name": "gaussian", "microbatches": 1}, {"name": "gaussian", "microbatches": 0},
                {"name": "gaussian", "microbatches": True}, {"name": "gaussian", "microbatches": "2"}):
        with pytest.raises(ConfigError) as info:
            from_record(bad)
        assert info.value.code.value == "privatizer_invalid", bad


@pytest.mark.parametrize("privatizer, fields", [("banded-mf", "bands = 4"), ("laplace", "")])
def test_a_privatizer_other_than_the_iid_gaussian_refuses_microbatches(privatizer, fields):
    """banded-mf's state advances once per step (correlated); a noise family's record does not carry k: both refuse
    microbatches = 2 (`privatizer_unsupported`) before anything is built, and take microbatches = 1."""
    import tomllib

    noise = NoiseSection.model_validate(tomllib.loads(f'privatizer = "{privatizer}"\n{fields}'))
    with pytest.raises(ConfigError) as info:
        build(noise.model_copy(update={"microbatches": 2}), horizon=8)
    assert info.value.code.value == "privatizer_unsupported" and "microbatches = 2" in info.value.detail
    assert ("correlated" in info.value.detail) == (privatizer == "banded-mf")
    assert build(noise, horizon=8).name == privatizer  # k = 1: the ordinary step, as before


def test_a_correlated_privatizer_refuses_microbatches_in_one_line_and_nothing_changes(tmp_path, tiny_model):
    """`govtrain train` with [noise] microbatches = 2 and banded-mf: one line `error[privatizer_unsupported]`, exit
    2, the ledger and the output folder as they were."""
    corpus = _corpus(tmp_path, "refused")
    before = snapshot(corpus.url)
    config = _config(corpus, tiny_model, 3, extra='\n[noise]\nprivatizer = "banded-mf"\nbands = 4\nmicrobatches = 2')
    result = CliRunner().invoke(cli, ["train", "--config", str(config), "--ledger", corpus.url])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error[privatizer_unsupported]") and result.stderr.count("\n") == 1, result.stderr
    assert snapshot(corpus.url) == before
    assert not (corpus.dir / "adapter").exists()


# -- per-microbatch noise through govtrain train and GovernedRun --------------------------------------------

def test_govtrain_train_with_two_microbatches_verifies_and_charges_what_one_noise_charges(tmp_path, tiny_model,
                                                                                       monkeypatch):
    """The same run (insecure seed, ledger, data) with k = 1 and k = 2: both verify, their spend entries charge the
    same, k = 2's spend and run entries record the privatizer with "microbatches": 2 (k = 1's as before), and every
    chunk of k = 2 went to the router with a microbatch, both microbatches used."""
    spy = Accumulated(monkeypatch)
    found = {}
    for k, noise in ((1, ""), (2, TWO)):
        corpus = _corpus(tmp_path, f"k{k}")
        config = _config(corpus, tiny_model, 4, extra="expected_batch_size = 8" + noise)
        spy.calls.clear()
        result = CliRunner().invoke(cli, ["train", "--config", str(config), "--ledger", corpus.url,
                                          "--insecure-seed", "3", "--json"])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["steps"] == 4
        verify_ledger(corpus.url)
        found[k] = (_entries(corpus.url), list(spy.calls))
    (one, one_calls), (two, two_calls) = found[1], found[2]
    assert _charged(two) == _charged(one) and _charged(one)
    assert {json.dumps(e["privatizer"]) for e in one} == {'{"name": "gaussian"}'}
    assert all(e["privatizer"] == {"name": "gaussian", "microbatches": 2} for e in two)
    assert {m for m, _ in one_calls} == {0} and {m for m, _ in two_calls} == {0, 1}
    assert sum(n for _, n in two_calls) == sum(n for _, n in one_calls)  # the same draws, split


def test_a_governed_run_splits_each_step_by_the_public_rule_per_contribution(tmp_path, tiny_model, monkeypatch):
    """Through GovernedRun at the contribution unit: each chunk holds one microbatch's contributions, the one
    `routing.microbatch.assign` gives each under the run's sampling key at that step, and the router is handed that
    microbatch; the run saves, verifies, and its spend is what k = 1's is."""
    import torch.nn.functional as F

    spy = Accumulated(monkeypatch)
    charged = {}
    for k, noise in ((1, ""), (2, TWO)):
        corpus = _corpus(tmp_path, f"governed-k{k}", contribution=True)
        spy.calls.clear()
        checked = 0
        with govtrain.GovernedRun.open(_config(corpus, tiny_model, 3, extra=noise), corpus.url, insecure_seed=4,
                                       **QUIET) as run:
            for batch in run.batches():
                if not batch.rehearsal:
                    inner = run._run
                    chunk = run._guard.drawn.chunks[batch.chunk]
                    owners = [o for i, o in enumerate(chunk.owners) if i == 0 or chunk.units[i] != chunk.units[i - 1]]
                    assert {microbatch.assign(inner.sampler.key, batch.step, o, k) for o in owners} == \
                           {chunk.microbatch}
                    checked += 1
                out = run.model(**batch.inputs)
                run.step(F.cross_entropy(out.logits.float(), batch.targets, reduction="none"))
            run.save()
        verify_ledger(corpus.url)
        real = spy.calls[-checked:]
        assert {m for m, _ in real} == ({0} if k == 1 else {0, 1}), real
        charged[k] = _charged(_entries(corpus.url))
    assert charged[2] == charged[1] and charged[1]


def test_the_example_unit_splits_by_contribution_and_index(tmp_path, tiny_model):
    """At the example unit each example's id is its contribution's id and its index within it
    (`microbatch.example_id`): every drawn example's chunk is the microbatch that id is assigned."""
    from govtrain.train.config import load_run_config
    from govtrain.train.run import Run

    corpus = _corpus(tmp_path, "examples")
    ledger = Ledger.open(corpus.url)
    run = Run(load_run_config(_config(corpus, tiny_model, 2, extra="expected_batch_size = 12" + TWO)), ledger,
              insecure_seed=2, log=lambda _: None)
    try:
        run.prepare()
        assert run.plan_epoch() and run.write_ahead()
        chunks = run.draw()
        drawn = [i for chunk in chunks for i in chunk.indices]
        assert len({c.microbatch for c in chunks}) == 2 and len(drawn) == len(set(drawn)) > 4
        for chunk in chunks:
            for i in chunk.indices:
                cid = run.ids[run.owner[i]]
                index = list(run.members[run.owner[i]]).index(i)
                assert microbatch.assign(run.sampler.key, run.result.steps, microbatch.example_id(cid, index), 2) \
                       == chunk.microbatch
    finally:
        run.router.close()
        run.release()
        ledger.close()


# -- compiled routing through the run ----------------------------------------------------------------------

@pytest.mark.slow  # the clipping stage traced through torch.compile for each class subset (~30-60 s on 2 cores)
@pytest.mark.long  # a whole run of the compiled stage, which releases the hooks' bits (tests/test_compiled_routing.py,
# default tier); that `compiled = true` builds the run's router compiled is the next test's, in the default tier
def test_a_compiled_run_trains_the_adapter_bytes_of_the_hooks(tmp_path, tiny_model, monkeypatch):
    """[training] compiled = true: the same adapter bytes, float32 on the CPU, as the same run without it. The
    compiled stage runs the kernels eager mode runs, in its order (`routing/compiled.py`, aot_eager), so equality is
    exact, not to a tolerance."""
    from govtrain.routing.compiled import CompiledStage

    graphs: list[int] = []
    original = CompiledStage.__call__

    def counted(stage, *args):
        out = original(stage, *args)
        graphs.append(stage.compiled)
        return out

    monkeypatch.setattr(CompiledStage, "__call__", counted)
    found = {}
    for name, extra in (("hooks", ""), ("compiled", "compiled = true")):
        corpus = _corpus(tmp_path, name)
        config = _config(corpus, tiny_model, 3, extra="expected_batch_size = 6\n" + extra)
        result = CliRunner().invoke(cli, ["train", "--config", str(config), "--ledger", corpus.url,
                                          "--insecure-seed", "5"])
        assert result.exit_code == 0, result.output
        found[name] = (corpus.dir / "adapter" / "adapter_model.safetensors").read_bytes()
        verify_ledger(corpus.url)
    assert graphs and graphs[-1] == len(graphs)  # every step of the compiled run clipped in a compiled graph
    assert found["compiled"] == found["hooks"]


def test_compiled_is_a_performance_flag_the_router_is_built_with(tmp_path, tiny_model):
    from govtrain.train.config import load_run_config
    from govtrain.train.run import Run

    corpus = _corpus(tmp_path, "flag")
    ledger = Ledger.open(corpus.url)
    run = Run(load_run_config(_config(corpus, tiny_model, 2, extra="compiled = true")), ledger, insecure_seed=2,
              log=lambda _: None, check=True)
    try:
        run.prepare()
        assert run.router._compiled is not None and run.privatizer.record() == {"name": "gaussian"}
    finally:
        run.router.close()
        run.release()
        ledger.close()
