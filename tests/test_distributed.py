"""Training as several processes (docs/distributed.md) against the single process, with gloo on the CPU.

Each test starts real ranks (`tests/distributed_worker.py` through the library API, or `govtrain train --nproc 2`)
against a real ledger. The privatized gradient of every step equals the single process's on the same seed to 1e-6
(dpsgd, prism, dp-muon; example and contribution units); the spend is written once; a killed rank stops the run,
and running it again completes it without under-counting; a rank that joins with another config, model or data is
refused before any spend.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from govtrain.distributed.launch import free_port  # noqa: E402
from govtrain.ledger.entries import decode_entry  # noqa: E402
from govtrain.ledger.ledger import Ledger  # noqa: E402
from govtrain.verify.verifier import verify_ledger  # noqa: E402
from tests.conftest import TEST_POLICY, Corpus, make_corpus  # noqa: E402
from tests.test_train import _admit, save_tiny_bert  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONTRIBUTION = 'privacy_unit = "contribution"\nexamples_per_contribution = 4\nsampling_rate = 0.5\n'


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


def make_world(folder: Path, model: Path, *, mechanism: str = "dpsgd", unit: str = "example", steps: int = 3,
               extra: str = "") -> tuple[Corpus, Path]:
    """A ledger with public and sensitive contributions, their data, and a RUN.toml of `steps` steps."""
    folder.mkdir(parents=True, exist_ok=True)
    policy = TEST_POLICY.replace("sampling_rate = 0.01\n", "sampling_rate = 0.25\n" if unit == "example" else CONTRIBUTION)
    corpus = make_corpus(folder, f"sqlite:///{folder / 'ledger.db'}", policy)
    names = ["pub", "sens"] if unit == "example" else [f"c{i}" for i in range(8)]
    for i, name in enumerate(names):
        sensitive = (i % 2 == 1)
        _admit(corpus, name, 24 if unit == "example" else 6,
               **({"data_class": "sensitive", "clip_norm_u": 500_000, "eps_budget_u": 3_000_000} if sensitive else {}))
    config = corpus.dir / "run.toml"
    config.write_text(f"""
[model]
base = "{model}"
max_length = 16
[lora]
r = 2
target_modules = ["query", "value", "attention.output.dense"]
[optimizer]
name = "adamw"
lr = 0.01
[training]
mechanism = "{mechanism}"
steps = {steps}
data = "data"
output = "adapter"
run_id = "dist-run"
physical_batch = 4
{extra}
""")
    return corpus, config


def start_ranks(corpus: Corpus, config: Path, out: Path, size: int, *, seed: int = 7,
                env: dict | None = None) -> list[subprocess.Popen]:
    """`size` ranks of tests/distributed_worker.py (size 0: one process, no process group)."""
    out.mkdir(parents=True, exist_ok=True)
    spec = out / "spec.json"
    spec.write_text(json.dumps({"config": str(config), "ledger": corpus.url, "key": None,
                                "seed": seed, "out": str(out)}))
    port = free_port()
    base = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        base.pop(k, None)
    ranks = []
    for rank in range(max(size, 1)):
        e = dict(base)
        if size:
            e.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(port))
        e.update((env or {}).get(rank, {}))
        ranks.append(subprocess.Popen([sys.executable, "-m", "tests.distributed_worker", str(spec)], cwd=ROOT, env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return ranks


def finish(ranks: list[subprocess.Popen], timeout: float = 240) -> list[tuple[int, str]]:
    return [(p.wait(timeout=timeout), p.communicate()[1]) for p in ranks]


def spends(url: str) -> list[tuple]:
    """(contribution, epoch, steps, q, σ_eff) of every spend entry."""
    with Ledger.open(url) as ledger:
        found = [decode_entry(e.body, seq=e.seq, kind="spend") for e in ledger.store.entries(kinds=("spend",))]
    return sorted((s["contribution_id"], s["epoch"], s["steps"], s["sampling_rate_u"], s["noise_multiplier_u"])
                  for s in found)


@pytest.mark.slow
@pytest.mark.parametrize("unit", ["example", "contribution"])
@pytest.mark.parametrize("mechanism", ["dpsgd", "prism", "dp-muon"])
def test_two_ranks_release_the_single_process_gradient_to_1e_6(tmp_path, tiny, mechanism, unit):
    one = make_world(tmp_path / "one", tiny, mechanism=mechanism, unit=unit)
    two = make_world(tmp_path / "two", tiny, mechanism=mechanism, unit=unit)
    done = finish(start_ranks(*one, tmp_path / "out-one", 0) + start_ranks(*two, tmp_path / "out-two", 2))
    assert [code for code, _ in done] == [0, 0, 0], "\n".join(err[-3000:] for _, err in done)
    single = torch.load(tmp_path / "out-one" / "grads-rank0.pt")
    ranks = [torch.load(tmp_path / "out-two" / f"grads-rank{r}.pt") for r in range(2)]
    assert single["steps"] == ranks[0]["steps"] == 3 and len(single["grads"]) == 3
    for step, reference in enumerate(single["grads"]):
        assert reference, "no gradient was released"
        for r in range(2):
            got = ranks[r]["grads"][step]
            assert got.keys() == reference.keys()
            for name, value in reference.items():
                torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6, msg=f"step {step} rank {r} {name}")
        for name in reference:  # every rank applies the lead's release, bitwise
            assert torch.equal(ranks[0]["grads"][step][name], ranks[1]["grads"][step][name])
    # the spend is written once, and is the single process's
    assert spends(two[0].url) == spends(one[0].url) != []
    report = verify_ledger(two[0].url)
    assert report.spend_recomputed and report.by_kind["run"] == 1
