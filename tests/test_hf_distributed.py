"""`GovernedTrainer` under torchrun (docs/hf-trainer.md, "Under torchrun"): each rank opens the run and trains it
with the Trainer, with gloo on the CPU.

Two ranks (`tests/hf_distributed_worker.py`, started with the environment torchrun gives) train the adapter the
single process trains on the same seed; the spend is written once, one run
entry is recorded, the ledger verifies; the model is never wrapped in DDP; each rank's Trainer takes as many steps,
also where one rank's share of a draw is empty, at the single process's learning rates, and evaluates the held-out
rows as the single process does. A Trainer that sees another number of processes than the run is
refused before anything is written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import forkserver

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from govtrain.distributed.launch import free_port  # noqa: E402
from govtrain.errors import Code, ConfigError  # noqa: E402
from govtrain.verify.verifier import verify_ledger  # noqa: E402
from tests.conftest import Corpus, snapshot  # noqa: E402
from tests.test_distributed import ROOT, clean_env, finish, make_world, run_entries, spends  # noqa: E402
from tests.test_train import save_tiny_bert  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


def start_trainers(corpus: Corpus, config: Path, out: Path, size: int, *, seed: int = 2) -> list[forkserver.Child]:
    """`size` ranks of tests/hf_distributed_worker.py (size 0: one process, no process group)."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    ranks = []
    for rank in range(max(size, 1)):
        spec = out / f"spec{rank}.json"
        spec.write_text(json.dumps({"config": str(config), "ledger": corpus.url, "seed": seed, "out": str(out),
                                    "trainer": str(out / "trainer")}))
        env = clean_env()
        if size:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))
        ranks.append(forkserver.start(["-m", "tests.hf_distributed_worker", str(spec)], cwd=ROOT, env=env))
    return ranks


def adapter_of(output: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(output / "adapter_model.safetensors")


def assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and got
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6, msg=name)


@pytest.mark.slow
def test_two_trainer_ranks_train_the_single_process_adapter_and_write_the_spend_once(tmp_path, tiny, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # three processes on a few cores: threads that spin only contend
    # contribution unit, 8 contributions at q = 0.5: a step may draw one, and one rank's share is then empty (seed 2
    # does, under the identity-keyed draws of issue 34; seed 7 no longer did)
    one = make_world(tmp_path / "one", tiny, unit="contribution", steps=8)
    two = make_world(tmp_path / "two", tiny, unit="contribution", steps=8)
    done = finish(start_trainers(*one, tmp_path / "out-one", 0) + start_trainers(*two, tmp_path / "out-two", 2))
    assert [code for code, _ in done] == [0] * 3, "\n".join(err[-3000:] for _, err in done)
    single = torch.load(tmp_path / "out-one" / "trainer-rank0.pt")
    ranks = [torch.load(tmp_path / "out-two" / f"trainer-rank{r}.pt") for r in range(2)]

    # the adapter: the single process's, and the same on every rank
    assert_close(ranks[0]["adapter"], single["adapter"])
    assert all(torch.equal(ranks[1]["adapter"][n], p) for n, p in ranks[0]["adapter"].items())
    saved = adapter_of(two[0].dir / "adapter")
    assert_close(saved, adapter_of(one[0].dir / "adapter"))

    # each rank's Trainer took the same steps, the single process's, some with an empty share on one rank
    assert ranks[0]["world_size"] == ranks[1]["world_size"] == 2 and single["world_size"] == 1
    assert ranks[0]["steps"] == ranks[1]["steps"] == single["steps"] == 8
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == single["global_step"] > 0
    assert single["idle"] == 0 and ranks[0]["idle"] + ranks[1]["idle"] > 0, "no rank's share was ever empty"
    losses = [[log["loss"] for log in rank["logs"] if "loss" in log] for rank in (single, *ranks)]
    assert losses[1] == losses[2] and losses[1] == pytest.approx(losses[0], abs=1e-6)  # over every rank's share
    rates = [[log["learning_rate"] for log in rank["logs"] if "loss" in log] for rank in (single, *ranks)]
    assert rates[0] == rates[1] == rates[2]  # the linear schedule stepped at the same draws
    # evaluation: each rank scores its part of the held-out rows, and the metrics are gathered over all of them
    evals = [[(log["eval_accuracy"], log["eval_loss"]) for log in rank["logs"] if "eval_loss" in log]
             for rank in (single, *ranks)]
    assert evals[0] and evals[1] == evals[2] and len(evals[1]) == len(evals[0])
    for (accuracy, loss), (one_accuracy, one_loss) in zip(evals[1], evals[0]):
        assert accuracy == one_accuracy and loss == pytest.approx(one_loss, abs=1e-5)

    # the model the Trainer trained is run.model itself: accelerate wrapped nothing in DDP
    assert ranks[0]["wrapped"] == ranks[1]["wrapped"] == single["wrapped"] == "PeftModel"

    # the spend once per contribution per epoch, the single process's; one run entry; the ledger verifies
    charged = spends(two[0].url)
    assert charged == spends(one[0].url) != []
    assert sorted((c, e) for c, e, *_ in charged) == sorted({(c, e) for c, e, *_ in charged})
    assert run_entries(two[0].url) == 1
    report = verify_ledger(two[0].url)
    assert report.spend_recomputed and report.by_kind["run"] == 1

    # the Trainer's checkpoints are the lead's alone
    checkpoints = sorted((tmp_path / "out-two" / "trainer").glob("checkpoint-*"))
    assert checkpoints and all(not list(c.glob("rng_state_1*")) for c in checkpoints)


def test_a_trainer_that_sees_another_number_of_processes_than_the_run_is_refused(tmp_path, tiny, monkeypatch):
    from govtrain.integrations.hf import GovernedTrainer
    from govtrain.train.governed import GovernedRun

    corpus, config = make_world(tmp_path / "w", tiny, steps=2)
    monkeypatch.setattr(transformers.TrainingArguments, "world_size", property(lambda self: 2))  # the run: one
    before = snapshot(corpus.url)
    with GovernedRun.open(config, corpus.url, insecure_seed=1, log=lambda line: None) as run:
        args = transformers.TrainingArguments(output_dir=str(tmp_path / "trainer"), use_cpu=True, report_to=[])
        with pytest.raises(ConfigError) as refused:
            GovernedTrainer(run, args=args)
        assert run.steps == 0
    assert refused.value.code is Code.RUN_CONFIG_INVALID
    assert "the Trainer sees 2 processes, but the run was opened in 1" in str(refused.value)
    assert snapshot(corpus.url) == before and not (tmp_path / "trainer").exists()
