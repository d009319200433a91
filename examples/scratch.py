"""A scratch workspace: a ledger of its own for trying govtrain's API, so no experiment spends the demo's budget.

    python examples/scratch.py                  # (or `make scratch`) writes scratch/
    python examples/scratch.py --out DIR --model PATH --data DIR --steps N

It writes, replacing an earlier scratch workspace (never any other folder):

    scratch/keys/           copies of keys.example's INSECURE demo keys and policy (private keys 0600)
    scratch/ledger.db       a fresh ledger under that policy (sqlite:///./scratch/ledger.db)
    scratch/data/           two of the demo's contributions, attested and admitted (class public)
    scratch/trainer-data/   two others, for a second experiment that charges different contributions
    scratch/heldout.jsonl   the demo's held-out snippets
    scratch/run.toml        a short run (5 steps) on data/, saving to scratch/adapter
    scratch/trainer.toml    the same run on trainer-data/, saving to scratch/trainer-adapter

The contributions are the demo's (`demo-out/data`, written by `make demo`), or made here from the bundled
snippets when the demo has not run. The model is the bundled MiniLM unless --model names a local Hugging Face
directory (the tests use a tiny one). The README's quickstart and the docs' snippets run in this workspace.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from govtrain.attest.attest import attest  # noqa: E402
from govtrain.gate.admission import admit  # noqa: E402
from govtrain.ledger.ledger import Ledger  # noqa: E402
from govtrain.policy.config import load_policy  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MARKER = ".govtrain-scratch"  # what makes a folder ours to replace
RUN = """\
# A short governed run for experiments on the scratch ledger (examples/scratch.py wrote it).
[model]
base = "{model}"
task = "sequence-classification"
num_labels = 2
max_length = 32
pooling = "mean"

[lora]
r = 8
alpha = 16
target_modules = ["query", "key", "value", "attention.output.dense", "intermediate.dense", "output.dense"]
layers = [4, 5]

[optimizer]
name = "adamw"
lr = 0.001
head_lr = 0.02

[training]
steps = {steps}
data = "{data}"
output = "{output}"
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("scratch"), help="the workspace folder (default scratch)")
    parser.add_argument("--data", type=Path, default=REPO / "demo-out" / "data",
                        help="contrib-NN.jsonl files and heldout.jsonl (default: the demo's)")
    parser.add_argument("--model", default="minilm", help="'minilm' or a local Hugging Face model directory")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)

    out = args.out
    if out.exists():
        if not (out / MARKER).is_file():
            raise SystemExit(f"error[bad_argument]: {out} exists and is not a scratch workspace; name another --out")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / MARKER).write_text("written by examples/scratch.py; replaced when it runs again\n")

    source = args.data
    if not (source / "contrib-03.jsonl").is_file():  # no demo yet: split the bundled snippets here
        source = out / "source"
        subprocess.run([sys.executable, str(REPO / "examples" / "prepare_data.py"), "--out", str(source),
                        "--contributions", "30"], check=True)

    keys = out / "keys"
    keys.mkdir()
    for name in ("policy.toml", "attester.key", "attester.pub", "ledger.key", "ledger.pub", "release.key",
                 "release.pub"):
        shutil.copy(REPO / "keys.example" / name, keys / name)
    for name in ("attester.key", "ledger.key", "release.key"):
        (keys / name).chmod(0o600)  # git keeps no modes; govtrain refuses keys that others can read

    ledger_path = out / "ledger.db"  # a relative path with a folder is written with its ./ (sqlite:///./scratch/…)
    url = f"sqlite:///{ledger_path}" if ledger_path.is_absolute() else f"sqlite:///./{ledger_path}"
    policy, digest = load_policy(keys / "policy.toml")
    Ledger.init(url, policy, digest, key_path=(keys / "ledger.key").resolve()).close()
    with Ledger.open(url) as ledger:
        for folder, numbers in (("data", (0, 1)), ("trainer-data", (2, 3))):
            (out / folder).mkdir()
            for n in numbers:
                data = out / folder / f"contrib-{n:02d}.jsonl"
                shutil.copy(source / data.name, data)
                raw, _ = attest(data, key=keys / "attester.key", contributor=f"movie-group-{n:02d}",
                                data_class="public", clip_norm=1.0, noise_multiplier=0.8, eps_budget=8,
                                contribution_id=f"contrib-{n:02d}")
                admit(ledger, raw, data)
    shutil.copy(source / "heldout.jsonl", out / "heldout.jsonl")
    model = args.model if args.model == "minilm" else str(Path(args.model).resolve())
    (out / "run.toml").write_text(RUN.format(model=model, steps=args.steps, data="data", output="adapter"))
    (out / "trainer.toml").write_text(RUN.format(model=model, steps=args.steps, data="trainer-data",
                                                 output="trainer-adapter"))
    print(f"scratch workspace in {out}/: ledger {url} with 4 admitted contributions; run configs "
          f"{out / 'run.toml'} and {out / 'trainer.toml'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
