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
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from govtrain.distributed.launch import free_port  # noqa: E402
from govtrain.ledger.entries import decode_entry  # noqa: E402
from govtrain.ledger.ledger import Ledger  # noqa: E402
from govtrain.verify.verifier import verify_ledger  # noqa: E402
from tests import forkserver  # noqa: E402
from tests.conftest import TEST_POLICY, Corpus, make_corpus  # noqa: E402
from tests.test_train import _admit, _config, save_tiny_bert  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONTRIBUTION = 'privacy_unit = "contribution"\nexamples_per_contribution = 4\nsampling_rate = 0.5\n'


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


def make_world(folder: Path, model: Path, *, mechanism: str = "dpsgd", unit: str = "example", steps: int = 3,
               extra: str = "", rate: float = 0.25) -> tuple[Corpus, Path]:
    """A ledger with public and sensitive contributions, their data, and a RUN.toml of `steps` steps."""
    folder.mkdir(parents=True, exist_ok=True)
    policy = TEST_POLICY.replace("sampling_rate = 0.01\n", f"sampling_rate = {rate}\n" if unit == "example" else CONTRIBUTION)
    corpus = make_corpus(folder, f"sqlite:///{folder / 'ledger.db'}", policy)
    names = ["pub", "sens"] if unit == "example" else [f"c{i}" for i in range(8)]
    for i, name in enumerate(names):
        sensitive = (i % 2 == 1)
        _admit(corpus, name, 24 if unit == "example" else 6,
               **({"data_class": "sensitive", "clip_norm_u": 500_000, "eps_budget_u": 3_000_000} if sensitive else {}))
    return corpus, _config(corpus, model, steps, mechanism, extra="physical_batch = 4\n" + extra)


def start_ranks(corpus: Corpus, config: Path, out: Path, size: int, *, seed: int = 7,
                configs: dict[int, Path] | None = None) -> list[forkserver.Child]:
    """`size` ranks of tests/distributed_worker.py (size 0: one process, no process group), forked from
    tests/forkserver.py's preloaded interpreter; `configs`: a rank's own RUN.toml instead of `config`."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    ranks = []
    for rank in range(max(size, 1)):
        spec = out / f"spec{rank}.json"
        spec.write_text(json.dumps({"config": str((configs or {}).get(rank, config)), "ledger": corpus.url,
                                    "key": None, "seed": seed, "out": str(out)}))
        env = clean_env()
        if size:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))
        ranks.append(forkserver.start(["-m", "tests.distributed_worker", str(spec)], cwd=ROOT, env=env))
    return ranks


def clean_env() -> dict[str, str]:
    # PYTHONFAULTHANDLER: a rank that crashes in native code (SIGSEGV, SIGABRT) prints its Python stack
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", GOVTRAIN_DIST_TIMEOUT_S="120", OMP_NUM_THREADS="1",
               PYTHONFAULTHANDLER="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def finish(ranks: list, timeout: float = 240) -> list[tuple[int, str]]:
    return [(p.wait(timeout=timeout), p.communicate()[1]) for p in ranks]


def spends(url: str) -> list[tuple]:
    """(contribution, epoch, steps, q, σ_eff) of every spend entry."""
    with Ledger.open(url) as ledger:
        found = [decode_entry(e.body, seq=e.seq, kind="spend") for e in ledger.store.entries(kinds=("spend",))]
    return sorted((s["contribution_id"], s["epoch"], s["steps"], s["sampling_rate_u"], s["noise_multiplier_u"])
                  for s in found)


@pytest.mark.slow
@pytest.mark.parametrize("mechanism,unit", [
    ("dpsgd", "example"), ("prism", "contribution"), ("dp-muon", "example"),
    *(pytest.param(m, u, marks=pytest.mark.long) for m, u in [("dpsgd", "contribution"), ("prism", "example"),
                                                             ("dp-muon", "contribution")])])
def test_two_ranks_release_the_single_process_gradient_to_1e_6(tmp_path, tiny, mechanism, unit):
    one = make_world(tmp_path / "one", tiny, mechanism=mechanism, unit=unit)
    two = make_world(tmp_path / "two", tiny, mechanism=mechanism, unit=unit)
    done = finish(start_ranks(*one, tmp_path / "out-one", 0) + start_ranks(*two, tmp_path / "out-two", 2))
    assert [code for code, _ in done] == [0, 0, 0], "\n".join(err[-3000:] for _, err in done)
    single, ranks = same_release(tmp_path / "out-one", tmp_path / "out-two")
    assert single["steps"] == ranks[0]["steps"] == 3
    for step, reference in enumerate(single["grads"]):
        for name in reference:  # every rank applies the lead's release, bitwise
            assert torch.equal(ranks[0]["grads"][step][name], ranks[1]["grads"][step][name])
    # the spend is written once, and is the single process's
    assert spends(two[0].url) == spends(one[0].url) != []
    report = verify_ledger(two[0].url)
    assert report.spend_recomputed and report.by_kind["run"] == 1


def same_release(one: Path, two: Path, steps: int = 3) -> tuple[dict, list[dict]]:
    """The single process's (`one`) and the 2 ranks' (`two`) recorded releases (tests/distributed_worker.py), each
    step's privatized gradient of every rank asserted equal to the single process's to 1e-6."""
    single = torch.load(one / "grads-rank0.pt")
    ranks = [torch.load(two / f"grads-rank{r}.pt") for r in range(2)]
    assert len(single["grads"]) == steps
    for step, reference in enumerate(single["grads"]):
        assert reference, "no gradient was released"
        for r in range(2):
            got = ranks[r]["grads"][step]
            assert got.keys() == reference.keys()
            for name, value in reference.items():
                torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6, msg=f"step {step} rank {r} {name}")
    return single, ranks


def govtrain_train(corpus: Corpus, config: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "govtrain", "train", "--config", str(config), "--ledger", corpus.url,
                             "--insecure-seed", "3", "--json", *extra], cwd=corpus.dir, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def children(pid: int) -> dict[int, int]:
    """The ranks a launcher started: rank -> pid (from /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) != pid:
                continue
            env = dict(v.split("=", 1) for v in (entry / "environ").read_bytes().decode().split("\0") if "=" in v)
        except (OSError, ValueError, IndexError):
            continue
        if "RANK" in env:
            found[int(env["RANK"])] = int(entry.name)
    return found


def run_entries(url: str) -> int:
    with Ledger.open(url) as ledger:
        return sum(1 for _ in ledger.store.entries(kinds=("run",)))


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["--nproc", "torchrun"])
def test_govtrain_train_nproc_2_writes_its_spend_once_reports_once_and_verifies(tmp_path, tiny, launcher):
    corpus, config = make_world(tmp_path / "w", tiny, steps=12)
    if launcher == "torchrun":  # `torchrun ... -m govtrain train`: torch's launcher, govtrain's module
        launcher = subprocess.Popen([str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", "2",
                                     "--master-port", str(free_port()), "-m", "govtrain", "train", "--config",
                                     str(config), "--ledger", corpus.url, "--insecure-seed", "3", "--json"],
                                    cwd=corpus.dir, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
    else:
        launcher = govtrain_train(corpus, config, "--nproc", "2")
    stdout, stderr = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, stderr[-3000:]
    reports = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 1 and reports[0]["ok"] and reports[0]["steps"] == 12  # the lead reports, once
    charged = spends(corpus.url)
    # one spend per contribution per ledger epoch: written by the lead alone
    assert sorted((c, e) for c, e, *_ in charged) == sorted({(c, e) for c, e, *_ in charged})
    assert charged and run_entries(corpus.url) == 1, charged
    report = verify_ledger(corpus.url)
    assert report.spend_recomputed
    output = corpus.dir / "adapter"
    assert (output / "adapter_model.safetensors").exists() and not (output / "run-state.safetensors").exists()


@pytest.mark.slow
def test_a_killed_rank_stops_every_rank_and_the_run_resumes_without_under_counting(tmp_path, tiny):
    corpus, config = make_world(tmp_path / "w", tiny, steps=40, rate=0.05)  # budgets last the 4 ledger epochs
    launcher = govtrain_train(corpus, config, "--nproc", "2")
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not any(e >= 1 for _, e, *_ in spends(corpus.url)):
        time.sleep(0.05)  # until the second ledger epoch's spend is written ahead
    ranks = children(launcher.pid)
    assert set(ranks) == {0, 1}, ranks
    os.kill(ranks[1], signal.SIGKILL)  # a follower dies mid-epoch
    _, stderr = launcher.communicate(timeout=240)
    assert launcher.returncode == 2 and "error[rank_lost]" in stderr, stderr[-3000:]
    for pid in ranks.values():  # no rank is left waiting on its peer
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    before = spends(corpus.url)
    assert run_entries(corpus.url) == 0 and before
    verify_ledger(corpus.url)  # consistent at the kill
    again = govtrain_train(corpus, config, "--nproc", "2")
    stdout, stderr = again.communicate(timeout=300)
    assert again.returncode == 0, stderr[-3000:]
    assert json.loads(stdout.splitlines()[-1])["steps"] == 40
    after = spends(corpus.url)
    assert set(before) <= set(after)  # what was charged stays charged
    steps = {}
    for contribution, _, count, *_ in after:
        steps[contribution] = steps.get(contribution, 0) + count
    assert all(count >= 40 for count in steps.values()), steps  # every step taken is covered by a spend
    assert sorted((c, e) for c, e, *_ in after) == sorted({(c, e) for c, e, *_ in after})  # each epoch charged once
    assert run_entries(corpus.url) == 1
    assert verify_ledger(corpus.url).spend_recomputed


@pytest.mark.slow
def test_a_rank_with_another_config_model_or_data_is_refused_before_any_spend(tmp_path, tiny):
    corpus, config = make_world(tmp_path / "w", tiny, steps=3)
    other_config = config.with_name("other.toml")
    other_config.write_text(config.read_text().replace("lr = 0.01", "lr = 0.02"))
    other_model = tmp_path / "other-model"
    shutil.copytree(tiny, other_model)
    (other_model / "config.json").write_text((tiny / "config.json").read_text() + "\n")  # another tree hash
    model_config = config.with_name("model.toml")
    model_config.write_text(config.read_text().replace(str(tiny), str(other_model)))
    data_config = config.with_name("data.toml")
    fewer = corpus.dir / "fewer"
    fewer.mkdir()
    shutil.copy(corpus.dir / "data" / "pub.jsonl", fewer / "pub.jsonl")  # only one contribution's data
    data_config.write_text(config.read_text().replace('data = "data"', 'data = "fewer"'))
    for name, theirs in [("config", other_config), ("base model", model_config), ("data", data_config)]:
        done = finish(start_ranks(corpus, config, tmp_path / f"out-{name}", 2, configs={1: theirs}), timeout=180)
        for code, err in done:
            assert code != 0 and "error[rank_mismatch]" in err and name in err, err[-2000:]
        assert spends(corpus.url) == [] and run_entries(corpus.url) == 0  # nothing was written
        assert not (corpus.dir / "adapter" / "run-state.safetensors").exists()
