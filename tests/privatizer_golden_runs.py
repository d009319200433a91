"""Whole runs' final adapters under a fixed seed, as SHA-256 of adapter_model.safetensors per case: the golden
values tests/test_privatizers_core.py holds a run with no RUN.toml [noise] (the i.i.d. Gaussian privatizer) to.

tests/vectors/privatizer-golden-runs.json was first written by this script run on main at 1382b01 (before the router
delegated its noise to a privatizer), with `python -m tests.privatizer_golden_runs --write`; never regenerate it
from code that routes noise through a privatizer unless what changed is proven to be something else. Without
`--write` it prints what the current code gives.

Regenerated once, for issue 34 item 1, when the sampler's draws became keyed by each unit's identity instead of its
position in the corpus (routing/sampler.py): every case's draws changed, and nothing else. Before writing, the same
code with the position-keyed draws put back (the previous `Run._draw`: one uniform per corpus position from the
step's generator, `take` seeded with [step seed, position]) reproduced all four 1382b01 values (dpsgd-example
8:d0b95e67…, prism-example 8:7351660c…, dp-muon-example 8:69a0dda5…, dpsgd-contribution 8:03bd79e3…), so the
noise and the update are still byte-identical to the router before privatizers.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

GOLDEN = Path(__file__).parent / "vectors" / "privatizer-golden-runs.json"
CASES = {  # name -> (mechanism, RUN.toml extra, contribution unit)
    "dpsgd-example": ("dpsgd", "", False),
    "prism-example": ("prism", "[prism]\nlr = 0.01", False),
    "dp-muon-example": ("dp-muon", "[muon]\nlr = 0.02\niteration = \"quintic\"", False),
    "dpsgd-contribution": ("dpsgd", "physical_batch = 5", True),
}


def run_case(name: str, folder: Path, model: Path, noise: str = "") -> str:
    """Train the case's 8 steps (insecure_seed 3, three contributions in three classes) in `folder`; the hash of
    the adapter's weights. `noise` is appended to RUN.toml (a [noise] section)."""
    from govtrain.train.config import load_run_config
    from govtrain.train.loop import train
    from tests.conftest import make_corpus
    from tests.test_contribution_unit import contribution_corpus
    from tests.test_train import _admit, _config

    mechanism, extra, contribution = CASES[name]
    corpus = contribution_corpus(folder) if contribution else make_corpus(folder, f"sqlite:///{folder / 'ledger.db'}")
    _admit(corpus, "pub", noise_multiplier_u=2_000_000, eps_budget_u=8_000_000)
    _admit(corpus, "sens", data_class="sensitive", clip_norm_u=500_000, noise_multiplier_u=2_000_000,
           eps_budget_u=4_000_000)
    _admit(corpus, "restr", data_class="restricted", clip_norm_u=500_000, noise_multiplier_u=2_000_000,
           eps_budget_u=2_000_000)
    config = load_run_config(_config(corpus, model, 8, mechanism, extra + ("\n" + noise if noise else "")))
    result = train(config, corpus.url, insecure_seed=3, log=lambda _: None)
    return f"{result.steps}:" + hashlib.sha256((corpus.dir / "adapter" / "adapter_model.safetensors").read_bytes()).hexdigest()


def compute() -> dict[str, str]:
    from tests.test_train import save_tiny_bert

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "model").mkdir()
        model = save_tiny_bert(root / "model")
        found = {}
        for name in CASES:
            (root / name).mkdir()
            found[name] = run_case(name, root / name, model)
        return found


if __name__ == "__main__":
    found = compute()
    if "--write" in sys.argv[1:]:
        import torch

        found["_machine"] = {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__}
        GOLDEN.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
    print(json.dumps(found, indent=1, sort_keys=True))
