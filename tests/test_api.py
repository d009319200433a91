"""The library API (`govtrain.GovernedRun`): the loop a user writes is the loop `govtrain train` runs, the
run owns sampling (anything else is refused with nothing changed), the sampler's q is the charged q, and a
run resumed through the API continues the same ledger history."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import govtrain  # noqa: E402
from govtrain.errors import Code, ConfigError  # noqa: E402
from govtrain.train.config import load_run_config  # noqa: E402
from govtrain.release.artifact import adapter_sha256  # noqa: E402
from govtrain.train.run import STATE_FILE  # noqa: E402
from govtrain.verify.verifier import verify_ledger  # noqa: E402
from tests.conftest import TEST_POLICY, Corpus, make_corpus, snapshot  # noqa: E402
from tests.test_train import _admit, _config, tiny_model  # noqa: E402,F401

ROOT = Path(__file__).resolve().parents[1]
QUIET = {"log": lambda line: None}
BATCH_POLICY = TEST_POLICY.replace("sampling_rate = 0.01", "expected_batch_size = 4")  # q: the run's own batch


def _corpus(tmp_path: Path, name: str, policy: str = BATCH_POLICY) -> Corpus:
    """A fresh ledger under `policy` in tmp_path/name, with "pub" (public) and "sens" (sensitive) admitted."""
    folder = tmp_path / name
    folder.mkdir()
    corpus = make_corpus(folder, f"sqlite:///{folder / 'ledger.db'}", policy)
    _admit(corpus, "pub")
    _admit(corpus, "sens", data_class="sensitive", clip_norm_u=500_000, eps_budget_u=3_000_000)
    return corpus


def _spend(url: str) -> list[tuple]:
    """Every spend entry's (run, epoch, contribution, steps, q, sigma, eps), in ledger order."""
    from govtrain.ledger.entries import decode_entry
    from govtrain.ledger.ledger import Ledger

    with Ledger.open(url) as ledger:
        rows = [decode_entry(e.body, seq=e.seq, kind=e.kind) for e in ledger.store.entries(kinds=("spend",))]
    return [(r["run_id"], r["epoch"], r["contribution_id"], r["steps"], r["sampling_rate_u"], r["noise_multiplier_u"],
             r["eps_u"]) for r in rows]


def _trainable(run) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in run.model.named_parameters() if p.requires_grad}


def _same(before: dict[str, torch.Tensor], run) -> bool:
    return all(torch.equal(before[n], p) for n, p in run.model.named_parameters() if p.requires_grad)


def past_rehearsal(run, batches=None):
    """The first real batch of `batches` (default: a new `run.batches()`), the rehearsal's chunks stepped by the
    honest loop before it: for tests whose subject is a real step."""
    batches = run.batches() if batches is None else batches
    for batch in batches:
        if not batch.rehearsal:
            return batch
        run.step(run.per_example_loss(run.model(**batch.inputs), batch))
    raise AssertionError("run.batches() ended before a real batch")


# -- one path -------------------------------------------------------------------------------------------


def test_a_users_own_loop_and_govtrain_train_release_the_same_adapter_and_spend(tmp_path: Path, tiny_model: Path):
    """The documented loop (docs/python-api.md) with the user's own per-example loss gives, on the same seed, the adapter bytes and
    spend entries of `govtrain train` (chunks of 7: several physical chunks per logical step)."""
    import torch.nn.functional as F

    from govtrain.train.loop import train

    cli, api = _corpus(tmp_path, "cli"), _corpus(tmp_path, "api")
    extra = "physical_batch = 7\nexpected_batch_size = 16"
    train(load_run_config(_config(cli, tiny_model, 12, extra=extra)), cli.url, insecure_seed=5, **QUIET)
    losses, drawn = [], []
    with govtrain.GovernedRun.open(_config(api, tiny_model, 12, extra=extra), api.url, insecure_seed=5, **QUIET,
                                   observe=lambda step, ids: drawn.append(len(ids))) as run:
        assert type(run.model).__name__ == "PeftModel"  # what load_model builds; the run wraps nothing
        for batch in run.batches():
            assert isinstance(batch, govtrain.GovernedBatch) and len(batch) <= 7
            out = run.model(**batch.inputs)
            loss = run.step(F.cross_entropy(out.logits.float(), batch.targets, reduction="none"))
            if batch.rehearsal:  # before the first spend: q is not charged yet, and the step moves nothing
                assert run.sampling_rate is None and loss is None and not drawn and run.steps == 0
                continue
            assert run.sampling_rate == pytest.approx(16 / 80)
            assert (loss is not None) == batch.last
            if loss is not None:
                losses.append(loss)
        result = run.save()
    # An empty draw is a step too (noise only, no batch to step): here the last, once public's budget is spent
    # and sensitive, at its own sigma, affords one step of the second epoch.
    assert result.steps == len(drawn) == 12 and len(losses) == sum(1 for n in drawn if n) == 11
    assert adapter_sha256(api.dir / "adapter") == adapter_sha256(cli.dir / "adapter") == result.adapter_sha256
    assert _spend(api.url) == _spend(cli.url) and {row[1] for row in _spend(api.url)} == {0, 1}  # two epochs
    assert verify_ledger(api.url).by_kind["run"] == 1


def test_the_documented_loop_is_the_example_and_the_example_runs(tmp_path: Path, tiny_model: Path, capsys):
    """The loop of docs/python-api.md's snippet (which tests/test_docs.py runs) is `examples/custom_loop.py`'s,
    and that file trains, saves and records a verifiable run on a tiny model."""
    import runpy

    page = (ROOT / "docs" / "python-api.md").read_text()
    block = re.search(r"```python\n(.*?)```", page, re.S)
    assert block is not None
    example = (ROOT / "examples" / "custom_loop.py").read_text()
    loop = block.group(1).split("as run:\n", 1)[1].split("\n\n")[0]  # from the `for` to `run.save()`
    for line in loop.strip().splitlines():
        assert line.strip() in example, line

    corpus = _corpus(tmp_path, "example")
    config = _config(corpus, tiny_model, 10)
    module = runpy.run_path(str(ROOT / "examples" / "custom_loop.py"))
    assert module["main"](["--config", str(config), "--ledger", corpus.url]) == 0
    assert "test-run: 10 steps; adapter" in capsys.readouterr().out
    assert (corpus.dir / "adapter" / "adapter_model.safetensors").is_file()
    assert verify_ledger(corpus.url).by_kind["run"] == 1


def test_a_config_as_a_dict_is_hashed_canonically_and_refused_when_invalid(tmp_path: Path, tiny_model: Path):
    import tomllib

    from govtrain.train.config import run_config

    corpus = _corpus(tmp_path, "dict")
    document = tomllib.loads(_config(corpus, tiny_model, 4).read_text())
    first, second = run_config(document, base=corpus.dir), run_config(dict(reversed(document.items())), base=corpus.dir)
    assert first.sha256 == second.sha256 and first.output_dir == corpus.dir / "adapter"
    before = snapshot(corpus.url)
    with pytest.raises(ConfigError) as refused:
        govtrain.GovernedRun.open({**document, "training": {**document["training"], "stpes": 3}}, corpus.url, **QUIET)
    assert refused.value.code is Code.RUN_CONFIG_INVALID and "stpes" in refused.value.detail
    assert snapshot(corpus.url) == before
    with govtrain.GovernedRun.open(first, corpus.url, insecure_seed=1, **QUIET) as run:
        for batch in run.batches():
            run.step(run.per_example_loss(run.model(**batch.inputs), batch))
        run.save()
    assert verify_ledger(corpus.url).by_kind["run"] == 1


# -- the run owns sampling ------------------------------------------------------------------------------


def test_a_loader_or_sampler_of_the_users_is_refused_and_nothing_changes(tmp_path: Path, tiny_model: Path):
    from torch.utils.data import DataLoader, RandomSampler

    corpus = _corpus(tmp_path, "loader")
    before = snapshot(corpus.url)
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 4), corpus.url, insecure_seed=1, **QUIET) as run:
        weights = _trainable(run)
        for theirs in (DataLoader(list(range(8)), batch_size=4), RandomSampler(list(range(8)))):
            with pytest.raises(ConfigError) as refused:
                next(run.batches(theirs))
            assert refused.value.code is Code.UNGOVERNED_BATCH and "Poisson" in refused.value.detail
        # their own batches, fed through the model inside the governed loop: the training forward is refused
        inputs = run.tokenizer(["good movie", "bad film"], return_tensors="pt")
        batches = run.batches()
        past_rehearsal(run, batches)
        with pytest.raises(ConfigError) as refused:
            run.model(**inputs)  # a forward with gradients enabled, not on the waiting batch
        assert refused.value.code is Code.UNGOVERNED_BATCH
        with torch.no_grad():
            run.model(**inputs)  # evaluating inside the loop is fine
        batches.close()
        assert _same(weights, run) and snapshot(corpus.url) != before  # the first epoch's spend is written ahead
        written = snapshot(corpus.url)
    assert snapshot(corpus.url) == written


def test_each_misuse_of_the_loop_is_refused_before_anything_moves(tmp_path: Path, tiny_model: Path):
    corpus = _corpus(tmp_path, "misuse")
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 6), corpus.url, insecure_seed=1, **QUIET) as run:
        weights = _trainable(run)
        with pytest.raises(ConfigError, match="no batch waiting"):
            run.step(torch.zeros(3))
        batches = run.batches()
        batch = past_rehearsal(run, batches)
        with pytest.raises(ConfigError, match="before run.model ran"):
            run.step(torch.zeros(len(batch)))
        with pytest.raises(ConfigError, match="not the one"):
            run.per_example_loss(None, govtrain.GovernedBatch(batch.inputs, batch.targets))
        with torch.no_grad(), pytest.raises(ConfigError, match="no_grad"):
            run.model(**batch.inputs)
        out = run.model(**batch.inputs)
        with pytest.raises(ConfigError, match="second forward"):
            run.model(**batch.inputs)
        losses = run.per_example_loss(out, batch)
        for wrong in (losses.mean(), losses[:-1], losses[:, None]):
            with pytest.raises(ValueError, match="one loss per example"):
                run.step(wrong)
        with pytest.raises(RuntimeError, match="run.step"):
            next(batches)  # the waiting batch was never stepped
        with pytest.raises(RuntimeError, match="steps"):
            run.save()
        assert _same(weights, run) and run.steps == 0


def test_the_sampler_draws_at_the_rate_the_ledger_charged(tmp_path: Path, tiny_model: Path):
    corpus = _corpus(tmp_path, "rate")
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 6), corpus.url, insecure_seed=1, **QUIET) as run:
        batches = run.batches()
        for batch in batches:
            if run.step(run.per_example_loss(run.model(**batch.inputs), batch)) is not None:
                break
        charged = {row[4] for row in _spend(corpus.url)}
        assert charged == {round(run.sampling_rate * 1e6)}
        run._run.sampler.sampling_rate *= 2  # anything that changes q after the spend was written
        weights, written = _trainable(run), snapshot(corpus.url)
        with pytest.raises(ConfigError) as refused:
            next(batches)
        assert refused.value.code is Code.SAMPLING_MISMATCH
        assert _same(weights, run) and run.steps == 1 and snapshot(corpus.url) == written


# -- resumption -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["leave the with block", "killed"])
def test_a_run_resumed_through_the_api_continues_its_ledger_history(tmp_path: Path, tiny_model: Path, how: str):
    """Stopping after 3 of 14 steps (leaving the block saves the state; a kill keeps the last checkpoint)
    and opening the same config again continues the same run: same run id, the written-ahead epoch's spend
    not written again, and in the end exactly the spend of an uninterrupted run on the same corpus."""
    whole, parts = _corpus(tmp_path, "whole"), _corpus(tmp_path, "parts")
    with govtrain.GovernedRun.open(_config(whole, tiny_model, 14), whole.url, insecure_seed=2, **QUIET) as run:
        for batch in run.batches():
            run.step(run.per_example_loss(run.model(**batch.inputs), batch))
        run.save()

    config = _config(parts, tiny_model, 14)
    lines: list[str] = []
    with pytest.raises(KeyboardInterrupt) if how == "killed" else _nothing():
        with govtrain.GovernedRun.open(config, parts.url, insecure_seed=2, log=lines.append, checkpoint_every=2) as run:
            for batch in run.batches():
                run.step(run.per_example_loss(run.model(**batch.inputs), batch))
                if run.steps == 3:
                    if how == "killed":
                        raise KeyboardInterrupt
                    break
    assert (parts.dir / "adapter" / STATE_FILE).is_file()
    written = _spend(parts.url)
    assert written and {row[0] for row in written} == {"test-run"}
    with govtrain.GovernedRun.open(config, parts.url, insecure_seed=2, log=lines.append) as run:
        assert run.run_id == "test-run" and run.steps == (3 if how != "killed" else 2)
        for batch in run.batches():
            run.step(run.per_example_loss(run.model(**batch.inputs), batch))
        assert run.save().steps == 14
    assert any("resuming test-run at step" in line for line in lines)
    resumed = _spend(parts.url)
    assert resumed[:len(written)] == written  # history continued, never rewritten
    assert resumed == _spend(whole.url)
    assert verify_ledger(parts.url).by_kind["run"] == 1


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_the_api_leaves_the_models_type_and_state_dict_keys_alone(tmp_path: Path, tiny_model: Path):
    corpus = _corpus(tmp_path, "keys")
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 2), corpus.url, insecure_seed=1, **QUIET) as run:
        model, keys = run.model, list(run.model.state_dict())
        for batch in run.batches():
            run.step(run.per_example_loss(run.model(**batch.inputs), batch))
        run.save()
    assert list(model.state_dict()) == keys
    assert not model._forward_hooks and not model._forward_pre_hooks  # the run's hooks are gone
    model(**run.tokenizer(["good movie"], return_tensors="pt")).logits.sum().backward()  # a plain model again


def test_a_withdrawal_during_a_users_loop_takes_effect_at_the_next_step(tmp_path: Path, tiny_model: Path):
    from govtrain.ledger.ledger import Ledger

    corpus = _corpus(tmp_path, "withdraw")
    drawn: dict[int, set[str]] = {}
    config = _config(corpus, tiny_model, 8, extra="expected_batch_size = 16")
    with govtrain.GovernedRun.open(config, corpus.url, insecure_seed=4, observe=lambda step, ids: drawn.update(
            {step: set(ids)}), **QUIET) as run:
        for batch in run.batches():
            if run.step(run.per_example_loss(run.model(**batch.inputs), batch)) is not None and run.steps == 3:
                with Ledger.open(corpus.url) as other:  # another process withdraws mid-epoch
                    other.withdraw("sens", "consent withdrawn", now=corpus.now)
        run.save()
    assert any("sens" in drawn[step] for step in range(3))
    assert all("sens" not in drawn[step] for step in range(3, 8)) and all(drawn[step] for step in range(3, 8))
    assert verify_ledger(corpus.url).by_kind["withdraw"] == 1
