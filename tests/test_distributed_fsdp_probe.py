"""The routing layer on a model sharded by FSDP2 (`fully_shard`; `govtrain/distributed/fsdp.py`), in 2 gloo
processes against the single process.

`tests/fsdp_probe_worker.py` runs both ranks. Per case (dpsgd, prism, dp-muon; a profile mixing a class that
reaches both layers with one that reaches only the top layer, and one that leaves layer 0 untouched), on a tiny
float64 Llama with LoRA whose factors shard unevenly:
- the per-sample norms on each rank equal the single-process router's, and plain autograd one example at a time;
- FSDP writes no `.grad` (no reduce-scatter of a non-private gradient) before the router's release;
- the release (ranks' clipped sums summed, the lead's noise, broadcast) is each rank's shard of the
  single-process release, to 1e-6, as a DTensor the optimizer steps;
- a rank with fewer chunks runs a zero-weight filler (norm exactly 0) so that every rank makes the same
  all-gathers;
- a parameter no class reaches (layer 0 under the top-only profile) gets `.grad = None` on every rank;
- an empty Poisson batch under prism, noised by the lead alone, makes no collective the followers skip.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests import forkserver

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Both ranks' reports (each rank's own measurements; both ranks run every case)."""
    folder = tmp_path_factory.mktemp("fsdp")
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    procs = [forkserver.start(["-m", "tests.fsdp_probe_worker", str(rank), str(WORLD), str(folder / "init"),
                               str(folder)], cwd=ROOT, env=env) for rank in range(WORLD)]
    errors = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            raise
        if proc.returncode:
            errors.append(err[-3000:])
    assert not errors, "\n".join(errors)
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


CASES = ["dpsgd/mixed", "prism/mixed", "dp-muon/mixed", "dpsgd/top", "prism/top"]


@pytest.mark.parametrize("case", CASES)
def test_per_sample_norms_on_the_sharded_model_are_the_single_process_ones(ranks, case):
    for report in ranks:
        found = report["cases"][case]
        assert found["norms"] < 1e-9 and found["min_norm"] > 0, found
        if found["autograd"] is not None:
            assert found["autograd"] < 1e-9, found


@pytest.mark.parametrize("case", CASES)
def test_the_release_is_each_ranks_shard_of_the_single_process_release(ranks, case):
    for report in ranks:
        found = report["cases"][case]
        assert found["release"] < 1e-6 and found["sharded"], found


@pytest.mark.parametrize("case", CASES)
def test_fsdp_writes_no_gradient_before_the_release(ranks, case):
    for report in ranks:
        assert report["cases"][case]["written_before_release"] == []


def test_every_rank_runs_as_many_chunks_and_a_filler_adds_exactly_nothing(ranks):
    for case in CASES:
        assert [r["cases"][case]["chunks"] for r in ranks] == [2, 2]
        assert ranks[0]["cases"][case]["fillers"] == [] and ranks[1]["cases"][case]["fillers"] == [0.0]


def test_a_profile_that_leaves_a_layer_untouched_leaves_its_gradients_none_on_every_rank(ranks):
    for report in ranks:
        for case in ("dpsgd/top", "prism/top"):
            found = report["cases"][case]
            assert found["untouched"] == found["reference_untouched"] == 10  # layer 0's five LoRA pairs
        assert report["cases"]["dpsgd/mixed"]["untouched"] == 0


def test_an_empty_batch_under_prism_is_noised_by_the_lead_alone_without_a_collective_it_skips(ranks):
    """`begin` all-gathers the LoRA factors on every rank, so the lead's tangent noise needs no collective the
    followers would not join (without it the lead waits in an all-gather until the group's timeout)."""
    for report in ranks:
        assert report["noise_only"] == 0.0 and report["noise_only_grads"] == 10  # layer 1's five pairs, noised
