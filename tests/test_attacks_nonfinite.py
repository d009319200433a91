"""Issue 34, item 2, end to end: a contribution whose loss is nan (every example holding its word: the gradient is
nan, as a diverging run's) through `train()` and the Python API, in one process and with 2 ranks (gloo, CPU).

On main its nan passed the clip (coefficient 1), reached `.grad`, the weights and the adapter, and the run stopped
later with a misleading `ungoverned_update`. Here each such unit contributes exactly zero and is counted in the step
log; by default the run never stops on that count (it is private: tests/test_attacks_nonfinite_review.py); past the
opt-in `training.unsafe_stop_after_nonfinite_units` the run warns and stops with `diverged` before the step releases
anything, and writes no later epoch's spend."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests import forkserver

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from govtrain.errors import Code, ConfigError  # noqa: E402
from govtrain.train import loop  # noqa: E402
from govtrain.train.config import load_run_config  # noqa: E402
from govtrain.train.governed import GovernedRun  # noqa: E402
from tests.conftest import TEST_POLICY, Corpus, make_corpus  # noqa: E402
from tests.nonfinite_worker import poisoned  # noqa: E402
from tests.test_distributed import ROOT, clean_env, finish, spends  # noqa: E402
from tests.test_train import _admit, _config, save_tiny_bert  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


def world(folder: Path, model: Path, *, steps: int, limit: int | None, extra: str = "") -> tuple[Corpus, Path]:
    """A public contribution and the poisoned one ("example": no other text holds that word), q = 0.25, ledger
    epochs of 2 steps; `limit`: training.unsafe_stop_after_nonfinite_units (None: not set, the default: no stop)."""
    folder.mkdir(parents=True, exist_ok=True)
    policy = TEST_POLICY.replace("sampling_rate = 0.01\n", "sampling_rate = 0.25\n")
    corpus = make_corpus(folder, f"sqlite:///{folder / 'ledger.db'}", policy)
    _admit(corpus, "pub", 24)
    _admit(corpus, "example", 24)
    setting = "" if limit is None else f"unsafe_stop_after_nonfinite_units = {limit}\n"
    return corpus, _config(corpus, model, steps, extra="epoch_steps = 2\n" + setting + extra)


def _poisoned_task(monkeypatch, token: int) -> None:
    """`train()`'s loop with the task's loss poisoned for the "example" contribution (as a diverging loss would)."""
    from govtrain.tasks.classification import Classification

    plain = Classification.per_example_loss
    monkeypatch.setattr(Classification, "per_example_loss",
                        lambda self, output, batch: poisoned(plain(self, output, batch), batch, token))


def test_train_completes_with_a_nan_contribution_counts_it_and_saves_a_finite_adapter(tmp_path, tiny, monkeypatch):
    from safetensors.torch import load_file

    corpus, config = world(tmp_path, tiny, steps=4, limit=None)
    _poisoned_task(monkeypatch, (tiny / "vocab.txt").read_text().split("\n").index("example"))
    lines: list[str] = []
    result = loop.train(load_run_config(config), corpus.url, insecure_seed=3, log=lines.append)
    assert result.steps == 4 and result.nonfinite > 0
    logged = [line for line in lines if "non-finite gradient contributed zero" in line]
    assert logged and logged[-1].endswith(f"({result.nonfinite} in the run)")
    assert not any("unsafe" in line for line in lines)  # the default stops nothing, so it warns of nothing
    weights = load_file(corpus.dir / "adapter" / "adapter_model.safetensors")
    assert weights and all(bool(torch.isfinite(w).all()) for w in weights.values())


def test_a_diverging_run_stops_before_the_step_releases_and_charges_nothing_more(tmp_path, tiny):
    """The opt-in stop: it warns that it weakens the guarantee, and stops before the step releases anything."""
    corpus, config = world(tmp_path, tiny, steps=8, limit=2)
    moved: list[dict[str, torch.Tensor]] = []
    counts: list[int] = []
    lines: list[str] = []
    with GovernedRun.open(str(config), corpus.url, insecure_seed=3, log=lines.append) as run:
        assert [line for line in lines if line.startswith("warning: training.unsafe_stop_after_nonfinite_units = 2 "
                                                          "weakens the guarantee")]
        token = run.tokenizer.convert_tokens_to_ids("example")
        trainable = {n: p for n, p in run.model.named_parameters() if p.requires_grad}
        with pytest.raises(ConfigError) as caught:
            for batch in run.batches():  # one poisoned example per step: the third stops the run
                output = run.model(**batch.inputs)
                losses = poisoned(run.per_example_loss(output, batch), batch, token, first_only=True)
                if run.step(losses) is not None:
                    moved.append({n: p.detach().clone() for n, p in trainable.items()})
                    counts.append(run.nonfinite)
        assert caught.value.code == Code.DIVERGED and "\n" not in str(caught.value)
        assert "withdraw the contribution" in str(caught.value) and "learning rate" not in str(caught.value)
        stopped_in = run._run.pending["epoch"]
        # the step in progress released nothing: no .grad written, the weights as the last step left them
        assert all(p.grad is None for p in trainable.values())
        assert moved and all(torch.equal(p, moved[-1][n]) for n, p in trainable.items())
        assert all(math.isfinite(float(p.detach().abs().max())) for p in trainable.values())
        assert counts[-1] == 2 and run.nonfinite == 2  # the stopping step's unit is not counted in
        with pytest.raises(ConfigError) as again:  # the run is broken in this process: it goes no further
            next(iter(run.batches()))
        assert again.value.code == Code.STEP_FAILED
    epochs = {epoch for _, epoch, *_ in spends(corpus.url)}
    assert max(epochs) == stopped_in  # no later epoch was written ahead


def test_by_default_a_run_with_nonfinite_units_completes_and_every_step_is_finite(tmp_path, tiny):
    """By default (no stop) a run completes, every released gradient finite."""
    corpus, config = world(tmp_path, tiny, steps=2, limit=None)
    released: list[bool] = []
    with GovernedRun.open(str(config), corpus.url, insecure_seed=3, log=lambda line: None) as run:
        token = run.tokenizer.convert_tokens_to_ids("example")
        trainable = {n: p for n, p in run.model.named_parameters() if p.requires_grad}
        for batch in run.batches():
            output = run.model(**batch.inputs)
            if run.step(poisoned(run.per_example_loss(output, batch), batch, token)) is not None:
                released.append(all(bool(torch.isfinite(p).all()) for p in trainable.values()))
        run.save()
        assert released == [True, True]
        assert run.nonfinite > 0


def start_ranks(corpus: Corpus, config: Path, out: Path, size: int, *, seed: int = 7,
                also: str | None = None) -> list[forkserver.Child]:
    """`size` ranks of tests/nonfinite_worker.py (size 0: one process, no process group), as
    tests/test_distributed.py starts its workers."""
    from govtrain.distributed.launch import free_port

    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    ranks = []
    for rank in range(max(size, 1)):
        spec = out / f"spec{rank}.json"
        spec.write_text(json.dumps({"config": str(config), "ledger": corpus.url, "key": None, "seed": seed,
                                    "out": str(out), "also": also}))
        env = clean_env()
        if size:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))
        ranks.append(forkserver.start(["-m", "tests.nonfinite_worker", str(spec)], cwd=ROOT, env=env))
    return ranks


def _read(out: Path, rank: int) -> dict:
    return torch.load(out / f"nonfinite-rank{rank}.pt")


@pytest.mark.slow
@pytest.mark.parametrize("sharded", [False, pytest.param(True, marks=pytest.mark.long)], ids=["ranks", "fsdp"])
def test_two_ranks_take_the_nan_units_out_and_release_the_single_process_gradient(tmp_path, tiny, sharded):
    """The poisoned contribution's examples that also say "good" (3 of its 24: about one a step, on either rank),
    by default (no stop): every rank's release is the single process's, finite."""
    one = world(tmp_path / "one", tiny, steps=3, limit=None, extra="physical_batch = 4\n")
    two = world(tmp_path / "two", tiny, steps=3, limit=None,
                extra="physical_batch = 4\n" + ("fsdp = true\n" if sharded else ""))
    done = finish(start_ranks(*one, tmp_path / "out-one", 0, also="good")
                  + start_ranks(*two, tmp_path / "out-two", 2, also="good"))
    assert [code for code, _ in done] == [0, 0, 0], "\n".join(err[-3000:] for _, err in done)
    single, ranks = _read(tmp_path / "out-one", 0), [_read(tmp_path / "out-two", r) for r in range(2)]
    assert single["counts"] == ranks[0]["counts"] == ranks[1]["counts"] and single["counts"][-1] > 0
    assert len(single["grads"]) == 3
    for step, reference in enumerate(single["grads"]):
        assert reference
        for r in range(2):
            for name, value in reference.items():
                got = ranks[r]["grads"][step][name]
                assert bool(torch.isfinite(got).all()), (step, r, name)
                torch.testing.assert_close(got, value, rtol=0, atol=1e-6, msg=f"step {step} rank {r} {name}")
    assert spends(two[0].url) == spends(one[0].url) != []


@pytest.mark.slow
def test_two_ranks_stop_together_when_the_run_diverges(tmp_path, tiny):
    corpus, config = world(tmp_path, tiny, steps=6, limit=0, extra="physical_batch = 4\n")
    done = finish(start_ranks(corpus, config, tmp_path / "out", 2))
    assert [code for code, _ in done] == [2, 2], "\n".join(err[-3000:] for _, err in done)
    assert all("error[diverged]" in err for _, err in done)
    records = [_read(tmp_path / "out", r) for r in range(2)]
    assert [r["error"] for r in records] == ["diverged", "diverged"]
    assert records[0]["grads"] == [] and records[1]["grads"] == []  # the first poisoned step released nothing
    assert {epoch for _, epoch, *_ in spends(corpus.url)} == {0}  # nothing after the first epoch was written
