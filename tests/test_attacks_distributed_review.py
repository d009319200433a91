"""Adversarial review of training as several processes (issue 25, data parallelism): each test is an attack on the
guarantee that N ranks keep exactly the single process's, and fails while the attack works.

Ranks are real processes (gloo on the CPU, `tests/distributed_review_worker.py` through the library API) against a
real ledger, built with tests/test_distributed.py's helpers.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests import forkserver

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from govtrain.distributed.launch import free_port  # noqa: E402
from tests.test_distributed import make_world, spends  # noqa: E402
from tests.test_train import save_tiny_bert  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


def start(specs: list[dict], out: Path, *, env: dict | None = None) -> list[forkserver.Child]:
    """One rank of tests/distributed_review_worker.py per spec (rank r runs specs[r]), all in one process group."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        base.pop(k, None)
    ranks = []
    for rank, spec in enumerate(specs):
        path = out / f"spec-{rank}.json"
        path.write_text(json.dumps({"seed": 7, "out": str(out), **spec}))
        e = dict(base, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(len(specs)), MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port), GOVTRAIN_DIST_TIMEOUT_S="60")
        e.update((env or {}).get(rank, {}))
        ranks.append(forkserver.start(["-m", "tests.distributed_review_worker", str(path)], cwd=ROOT, env=e))
    return ranks


def finish(ranks: list[forkserver.Child], timeout: float = 180) -> list[tuple[int, str]]:
    return [(p.wait(timeout=timeout), p.communicate()[1]) for p in ranks]


def records(out: Path, size: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(size)]


# -- a follower that differs subtly --------------------------------------------------------------------------------


@pytest.mark.slow
def test_follower_whose_data_files_are_named_otherwise_trains_only_what_the_lead_drew(tmp_path, tiny):
    """A follower on another node holds the same RUN.toml (byte for byte) and the same admitted data files (same
    digests), only named otherwise: its data folder sorts them in another order, so its example indices are not
    the lead's. The fingerprint compares per-contribution counts only, so it agrees; the lead then broadcasts example
    *indices*, and the follower trains on examples the lead never drew (another contribution's, another class's,
    with that class's clip norm): Poisson sampling and each contribution's charged steps no longer describe what is
    trained. Either the follower is refused before any spend, or every rank trains exactly the lead's draw."""
    corpus, config = make_world(tmp_path / "lead", tiny, steps=3)
    node = tmp_path / "node2"
    (node / "data").mkdir(parents=True)
    shutil.copyfile(config, node / "run.toml")  # the same bytes: the same config hash
    # lead: pub.jsonl, sens.jsonl (in that order); follower: the same bytes as a.jsonl (sens) and b.jsonl (pub)
    shutil.copyfile(corpus.dir / "data" / "sens.jsonl", node / "data" / "a.jsonl")
    shutil.copyfile(corpus.dir / "data" / "pub.jsonl", node / "data" / "b.jsonl")
    out = tmp_path / "out"
    done = finish(start([{"config": str(config), "ledger": corpus.url},
                         {"config": str(node / "run.toml"), "ledger": corpus.url}], out))
    if any(code for code, _ in done):  # refused: on every rank, before any spend
        assert all("rank_mismatch" in err for _, err in done), "\n".join(err[-2000:] for _, err in done)
        assert spends(corpus.url) == []
        return
    lead, follower = records(out, 2)
    assert lead["steps"] == 3 and len(lead["drawn"]) == len(lead["took"]) == len(follower["took"]) == 3
    for step, drawn in enumerate(lead["drawn"]):
        trained = sorted(lead["took"][step] + follower["took"][step])
        assert trained == drawn, (f"step {step}: the ranks trained on {trained}, the lead drew {drawn} (the "
                                  f"follower's share: {follower['took'][step]})")


@pytest.mark.slow
def test_follower_on_a_copy_of_the_ledger_is_refused_before_any_spend(tmp_path, tiny):
    """A follower whose ledger URL names a copy of the ledger (a node's own replica, a restored backup): the copy has
    the same header, so the fingerprint's ledger identity agrees; the lead then writes the epoch's spend to the real
    ledger, and the follower, reading its copy, never finds it. The rank must be refused before any spend is
    written (the issue: "a rank that joins with a different ... is refused before any spend is written"), with a
    one-line error, not a traceback."""
    corpus, config = make_world(tmp_path / "lead", tiny, steps=2)
    copy = tmp_path / "replica.db"
    shutil.copyfile(corpus.url.removeprefix("sqlite:///"), copy)
    out = tmp_path / "out"
    done = finish(start([{"config": str(config), "ledger": corpus.url},
                         {"config": str(config), "ledger": f"sqlite:///{copy}"}], out))
    detail = "\n".join(err[-2000:] for _, err in done)
    assert any(code for code, _ in done), "a follower on another ledger trained: " + detail
    assert spends(corpus.url) == [], "the lead wrote spend for a run a rank of which could never step:\n" + detail
    assert "Traceback" not in done[1][1], "the follower failed with a traceback, not a refusal:\n" + done[1][1][-2000:]


# -- noise ---------------------------------------------------------------------------------------------------------


def family_world(folder: Path, model: Path, noise: str, *, steps: int) -> tuple:
    """Two contributions admitted at σ = 2 (the noise families' floor), sampled at the policy's q = 0.01 over 48
    examples: most steps draw 0 or 1 example, so one rank's share is often empty while the other's is not."""
    from tests.conftest import make_corpus
    from tests.test_train import _admit, _config

    folder.mkdir(parents=True, exist_ok=True)
    corpus = make_corpus(folder, f"sqlite:///{folder / 'ledger.db'}")
    _admit(corpus, "pub", 24, noise_multiplier_u=2_000_000, eps_budget_u=8_000_000)
    _admit(corpus, "sens", 24, data_class="sensitive", clip_norm_u=500_000, noise_multiplier_u=2_000_000,
           eps_budget_u=3_000_000)
    return corpus, _config(corpus, model, steps, "dpsgd", extra=f"physical_batch = 4\n[noise]\n{noise}\n")


@pytest.mark.slow
@pytest.mark.parametrize("noise", ['privatizer = "discrete-gaussian"\ngranularity_bits = 12',
                                   'privatizer = "skellam"'])
def test_a_quantising_privatizer_survives_a_step_where_one_rank_has_no_examples(tmp_path, tiny, noise):
    """A quantising privatizer's clipped sums are float64 integers (`materialized.clipped_sum`), but a rank whose
    share of the step is empty holds the router's `_zeros()`, float32. `World.sum_` flattens per dtype, so the two
    ranks enter the all-reduce with buffers of different dtypes and sizes: the step fails (or sums bytes of
    another type) as soon as one rank draws nothing and the other something, which at a small q is most steps.
    A 2-rank run must complete as the single process does."""
    corpus, config = family_world(tmp_path / "w", tiny, noise, steps=6)
    out = tmp_path / "out"
    done = finish(start([{"config": str(config), "ledger": corpus.url}] * 2, out))
    assert [code for code, _ in done] == [0, 0], "\n".join(err[-1500:] for _, err in done)
    lead, follower = records(out, 2)
    uneven = [s for s, (a, b) in enumerate(zip(lead["took"], follower["took"])) if bool(a) != bool(b)]
    assert uneven, "no step gave one rank examples and the other none: the proof needs another seed"
    assert lead["steps"] == 6
