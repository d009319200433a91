"""What the Hugging Face Trainer costs over `govtrain train`: seconds per governed step on the demo's MiniLM.

    make demo                                   # builds demo-out/: the admitted corpus, its ledger and keys
    .venv/bin/python bench/trainer.py --steps 6 --repeats 3 --threads 2

Each repeat copies the demo's ledger (with its own copy of the ledger key and the key's signed-head record),
then runs the same config (examples/run.toml, `--steps` steps, the demo's q) on the same seed through
`govtrain train` and through `GovernedTrainer`, one after the other in this process. A step's time is the
interval between two steps' ends, the first step of each run left out (warm-up). It prints the median seconds
per step of each path and their ratio, and checks that both released the same adapter weights and wrote the
same spend. Benchmark only: the seed is fixed (`insecure_seed`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

import govtrain  # noqa: E402
from govtrain.integrations.hf import GovernedTrainer  # noqa: E402
from govtrain.train.config import run_config  # noqa: E402
from govtrain.train.loop import train  # noqa: E402


def copy_corpus(demo: Path, into: Path) -> tuple[str, Path]:
    """A copy of the demo's ledger and its signing key (with the key's record of signed heads)."""
    into.mkdir(parents=True)
    for name in ("ledger.db", "ledger.db-wal", "ledger.db-shm"):
        if (demo / name).exists():
            shutil.copy2(demo / name, into / name)
    shutil.copytree(demo / "keys", into / "keys")
    return f"sqlite:///{into / 'ledger.db'}", into / "keys" / "ledger.key"


def config_for(demo: Path, steps: int, output: Path):  # type: ignore[no-untyped-def]
    document = tomllib.loads((ROOT / "examples" / "run.toml").read_text())
    document["training"].update(steps=steps, data=str(demo / "data"), output=str(output), run_id="bench-trainer")
    return run_config(document, base=ROOT / "examples")


def cli_path(demo: Path, work: Path, steps: int, seed: int) -> tuple[list[float], Path, str]:
    url, key = copy_corpus(demo, work)
    ends: list[float] = []
    config = config_for(demo, steps, work / "adapter")
    original = govtrain.GovernedRun._end_step

    def timed(self):  # type: ignore[no-untyped-def]
        loss = original(self)
        ends.append(time.perf_counter())
        return loss

    govtrain.GovernedRun._end_step = timed
    try:
        train(config, url, key=str(key), insecure_seed=seed, log=lambda line: None)
    finally:
        govtrain.GovernedRun._end_step = original
    return [b - a for a, b in zip(ends, ends[1:])], work / "adapter", url


class _Ends(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.ends.append(time.perf_counter())


def trainer_path(demo: Path, work: Path, steps: int, seed: int) -> tuple[list[float], Path, str]:
    url, key = copy_corpus(demo, work)
    ends = _Ends()
    with govtrain.GovernedRun.open(config_for(demo, steps, work / "adapter"), url, key=key, insecure_seed=seed,
                                   log=lambda line: None) as run:
        arguments = transformers.TrainingArguments(output_dir=str(work / "trainer"), use_cpu=True, report_to=[],
                                                   save_strategy="no", logging_strategy="no", disable_tqdm=True,
                                                   lr_scheduler_type="constant")
        GovernedTrainer(run, args=arguments, callbacks=[ends]).train()
    return [b - a for a, b in zip(ends.ends, ends.ends[1:])], work / "adapter", url


def spend(url: str) -> list[tuple]:
    from govtrain.ledger.entries import decode_entry
    from govtrain.ledger.ledger import Ledger

    with Ledger.open(url) as ledger:
        rows = [decode_entry(e.body, seq=e.seq, kind=e.kind) for e in ledger.store.entries(kinds=("spend",))]
    return [(r["run_id"], r["epoch"], r["contribution_id"], r["steps"], r["eps_u"]) for r in rows]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", type=Path, default=ROOT / "demo-out", help="what `make demo` wrote")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not (args.demo / "ledger.db").exists():
        sys.exit(f"no {args.demo / 'ledger.db'}: run `make demo` first")
    torch.set_num_threads(args.threads)
    cli, hf = [], []
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(args.repeats):
            ours, cli_adapter, cli_url = cli_path(args.demo, Path(folder) / f"cli-{repeat}", args.steps, args.seed)
            theirs, hf_adapter, hf_url = trainer_path(args.demo, Path(folder) / f"hf-{repeat}", args.steps, args.seed)
            same = all((cli_adapter / n).read_bytes() == (hf_adapter / n).read_bytes()
                       for n in ("adapter_model.safetensors", "adapter_config.json")) and spend(cli_url) == spend(hf_url)
            cli += ours
            hf += theirs
            print(f"repeat {repeat}: govtrain train {statistics.median(ours):.3f} s/step, GovernedTrainer "
                  f"{statistics.median(theirs):.3f} s/step; same adapter weights and spend: {same}")
    a, b = statistics.median(cli), statistics.median(hf)
    print(f"median over {len(cli)} steps each ({args.threads} threads, MiniLM, examples/run.toml, q of the demo): "
          f"govtrain train {a:.3f} s/step, GovernedTrainer {b:.3f} s/step, ratio {b / a:.3f}")


if __name__ == "__main__":
    main()
