"""The audit's own scratch world: keys, a policy, a tiny random model, a ledger and the real data, in a folder
the audit owns and nothing else reads (docs/auditing.md).

An audit is an experiment on the mechanism, not a run on anyone's data: it never opens a production ledger,
and its canaries are admitted only to the ledger it creates here. What it builds is what a deployment has
(attested contributions, a signed ledger, a policy with classes and profiles), so the run it audits takes the
governed path end to end.

Two profiles put the canaries' coordinates where no real example reaches (`Profile`):

- `head`: the audit class reaches the classifier head and nothing else (LoRA only on layers the audit
  class's band does not cover); the real class reaches the LoRA factors and not the head. The head is not a
  LoRA pair, so prism measures it in its Euclidean norm, and the run's `[optimizer]` moves it under every
  mechanism (plain SGD for the audit: the displacement is the noised sum times -lr).
- `adapter`: the audit class's profile is its own class adapter (`adapter = "audit"`); the real class reaches
  the default adapter and the head. Used with dpsgd only (prism measures LoRA pairs in their tangent space,
  dp-muon orthogonalizes LoRA factors: a coordinate's displacement is then no longer its noised sum).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

AUDIT_CLASS = "audit"  # the canaries' class in the audit's own policy
REAL_CLASS = "real"  # the real data's class
WORDS = "good bad movie film great awful plot acting fun dull the a is was and very not example".split()
HIDDEN, LAYERS = 16, 6
Profile = Literal["head", "adapter"]


@dataclass(frozen=True, kw_only=True)
class World:
    """Where an audit's files are: keys, policy, model, data folder, RUN.toml, and the ledger's URL."""

    folder: Path
    url: str
    policy_path: Path
    model: Path
    data: Path
    run_toml: Path

    @property
    def attester_key(self) -> Path:
        return self.folder / "keys" / "attester.key"

    @property
    def ledger_key(self) -> Path:
        return self.folder / "keys" / "ledger.key"


def save_tiny_bert(folder: Path, num_labels: int, *, seed: int = 0) -> Path:
    """A randomly initialised 6-layer BERT classifier (hidden 16) with `num_labels` labels and a word-level
    tokenizer, in `folder`: the same shape as the test suite's, with a head wide enough to hold a coordinate
    per canary (`num_labels` x 16 weights)."""
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    transformers.BertTokenizerFast(vocab=str(folder / "vocab.txt")).save_pretrained(folder)
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        config = transformers.BertConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=2,
                                         intermediate_size=24, vocab_size=len(vocab), max_position_embeddings=64,
                                         num_labels=num_labels)
        transformers.BertForSequenceClassification(config).save_pretrained(folder)
    finally:
        torch.random.set_rng_state(state)
    return folder


def policy_text(*, profile: Profile, unit: Literal["example", "contribution"], q: float, delta: float,
                epoch_steps: int, audit_sigma: float, audit_budget: float, real_sigma: float) -> str:
    """The audit's policy: a real class and the audit class, each with its own profile (see the module)."""
    unit_lines = ('privacy_unit = "contribution"\nexamples_per_contribution = 1' if unit == "contribution"
                  else 'privacy_unit = "example"')
    if profile == "head":
        real, audit = f"band = [0, {LAYERS - 2}]", f"band = [{LAYERS - 1}, {LAYERS - 1}]\nhead = true"
    else:
        real, audit = f"band = [0, {LAYERS - 1}]\nhead = true", f'adapter = "{AUDIT_CLASS}"'
    floor = min(audit_sigma, real_sigma)
    return f"""
origin = "audit.invalid/govtrain/1"
delta = {delta!r}
accountant = "prv"
{unit_lines}
sampling_rate = {q!r}
steps_per_epoch = {epoch_steps}
retention_epochs = 1000
max_validity_days = 30
clock_skew_seconds = 60

[floor]
min_noise_multiplier = {floor!r}
max_clip_norm = 1.0

[classes.{REAL_CLASS}]
clip_norm = 1.0
min_noise_multiplier = {real_sigma!r}
eps_budget = 1000.0
max_eps_budget = 1000.0
{real}

[classes.{AUDIT_CLASS}]
clip_norm = 1.0
min_noise_multiplier = {audit_sigma!r}
eps_budget = {audit_budget!r}
max_eps_budget = {audit_budget!r}
{audit}

[[attesters]]
name = "audit"
public_key_file = "attester.pub"
classes = ["{REAL_CLASS}", "{AUDIT_CLASS}"]

[[ledger_keys]]
name = "audit.invalid/govtrain/1"
public_key_file = "ledger.pub"
"""


def run_toml(*, model: Path, profile: Profile, mechanism: str, steps: int, lr: float, lora_r: int,
             noise=None) -> str:  # type: ignore[no-untyped-def]
    """RUN.toml of the audited run: plain SGD (no momentum, no weight decay), so that a coordinate only the
    canaries' class reaches moves by exactly -lr times its noised, clipped sum divided by the expected batch.
    `noise`: its [noise] section (a `train.config.NoiseSection`; None: the i.i.d. Gaussian, no section)."""
    layers = f"layers = {list(range(LAYERS - 1))}\n" if profile == "head" else ""
    section = ""
    if noise is not None:
        fields = {k: v for k, v in noise.model_dump().items() if v is not None}
        section = "[noise]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in fields.items())
    return f"""
[model]
base = "{model}"
max_length = 12
num_labels = {_labels_of(model)}
[lora]
r = {lora_r}
target_modules = ["query", "value", "attention.output.dense"]
{layers}[optimizer]
name = "sgd"
lr = {lr!r}
[training]
mechanism = "{mechanism}"
steps = {steps}
data = "data"
output = "run"
run_id = "audit"
{section}"""


def _labels_of(model: Path) -> int:
    config = json.loads((model / "config.json").read_text())
    return int(config.get("num_labels") or len(config["id2label"]))


def build(folder: Path, *, policy: str, model: Path, run: str) -> World:
    """Keys, policy, ledger (SQLite in `folder`) and RUN.toml; `model` is a saved model folder."""
    from govtrain.attest.keys import generate_key_pair
    from govtrain.ledger.ledger import Ledger
    from govtrain.policy.config import load_policy

    keys = folder / "keys"
    for name in ("attester", "ledger"):
        generate_key_pair(keys, name)
    policy_path = keys / "policy.toml"
    policy_path.write_text(policy)
    url = f"sqlite:///{folder / 'ledger.db'}"
    loaded, digest = load_policy(policy_path)
    Ledger.init(url, loaded, digest, key_path=keys / "ledger.key").close()
    (folder / "data").mkdir()
    (folder / "run.toml").write_text(run)
    return World(folder=folder, url=url, policy_path=policy_path, model=model, data=folder / "data",
                 run_toml=folder / "run.toml")


def write_rows(world: World, name: str, rows: list[dict]) -> Path:
    """A contribution's data file (JSONL) in the world's data folder."""
    path = world.data / f"{name}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
