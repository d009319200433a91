"""The model card (README.md of an adapter folder): what the run spent, whose ledger records it, and how to check
and load it, with YAML front matter for the Hugging Face Hub.

Every figure is the ledger's (`run_facts`), read once the run entry is written, never recomputed another way: ε
per class is the `TuneBook` total over the contributions the run charged, as of its run entry (the number a
`tune` entry states, and `govtrain ledger status --contribution` shows for each contribution), δ, the privacy
unit and the accountant are the run's spend entries' own, the checkpoint is the first signed one covering the
run entry. The card is outside the adapter hash (`artifact.adapter_sha256`): it cites the run entry, which
records that hash.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from govtrain.errors import Code, IntegrityError
from govtrain.ledger.entries import decode_stored
from govtrain.release.artifact import CARD, ArtifactRecord

if TYPE_CHECKING:
    from govtrain.ledger.ledger import Ledger

MECHANISM_NAMES = {"dpsgd": "DP-SGD", "prism": "PRISM (DP-SGD on a low-rank retraction)",
                   "dp-muon": "DP-Muon (orthogonalized momentum on privatized gradients)"}


@dataclass(frozen=True, kw_only=True)
class ClassSpend:
    data_class: str
    eps_u: int  # the largest cumulative ε (micro-units) of a contribution the run charged, as of the run entry
    contributions: int  # how many of the class's contributions the run charged


@dataclass(frozen=True, kw_only=True)
class RunFacts:
    """A run as its ledger records it."""

    run_id: str
    origin: str
    seq: int  # the run entry's
    leaf_hash: bytes
    mechanism: str
    adapter_sha256: bytes | None
    base_model_sha256: bytes
    config_sha256: bytes
    device: str
    precision: str
    privacy_unit: str  # the policy's `unit`: "example", or "contribution (at most N examples)"
    delta_p: int
    accountant: str
    sampling_rates_u: tuple[int, ...]  # the q of each ledger epoch it trained, in order
    steps: int  # the steps its spend covers (epoch_steps summed over its epochs)
    classes: tuple[ClassSpend, ...]
    checkpoint_size: int | None  # the first signed checkpoint that covers the run entry
    checkpoint_note: str | None

    @property
    def eps_by_class(self) -> dict[str, int]:
        return {c.data_class: c.eps_u for c in self.classes}


def run_facts(ledger: "Ledger", run_id: str) -> RunFacts:
    """What the ledger records of run `run_id`: its run entry, its spend entries and their ε totals per class as of
    the run entry, and the checkpoint that covers it."""
    from govtrain.ledger.tuning import TuneBook

    store, policy = ledger.store, ledger.policy
    run = next((s for s in store.entries(start=1, kinds=("run",))
                if s.body is not None and decode_stored(s)["run_id"] == run_id), None)
    if run is None:
        raise IntegrityError(Code.ADAPTER_MISMATCH, f"the ledger of {policy.origin} records no run entry for run "
                                                    f"{run_id!r}")
    entry = decode_stored(run)
    rates, epochs, charged = [], {}, {}
    for stored in store.entries(start=1, kinds=("spend",)):
        if stored.seq > run.seq:
            break
        if stored.body is None:
            continue  # redacted by retention: its ε counts through its summary (TuneBook)
        spend = decode_stored(stored)
        if spend["run_id"] == run_id:
            if spend["epoch"] not in epochs:
                rates.append(spend["sampling_rate_u"])
                epochs[spend["epoch"]] = spend["epoch_steps"]
            charged[spend["contribution_id"]] = spend
    book = TuneBook.read(store, until=run.seq)
    _, totals = book.totals([run_id])
    count: dict[str, int] = {}
    for cid in book.charged.get(run_id, set()):
        data_class = book.spent[cid][0]
        count[data_class] = count.get(data_class, 0) + 1
    some = next(iter(charged.values()), None)
    checkpoint = store.checkpoint_covering(run.seq)
    return RunFacts(
        run_id=run_id, origin=policy.origin, seq=run.seq, leaf_hash=run.leaf_hash, mechanism=entry["mechanism"],
        adapter_sha256=entry["adapter_sha256"], base_model_sha256=entry["base_model_sha256"],
        config_sha256=entry["config_sha256"], device=entry["device"], precision=entry["precision"],
        privacy_unit=policy.unit, delta_p=some["delta_p"] if some else policy.delta_p,
        accountant=some["accountant"] if some else policy.accountant, sampling_rates_u=tuple(rates),
        steps=sum(epochs.values()),
        classes=tuple(ClassSpend(data_class=t["data_class"], eps_u=t["eps_u"],
                                 contributions=count.get(t["data_class"], 0)) for t in totals),
        checkpoint_size=None if checkpoint is None else checkpoint.size,
        checkpoint_note=None if checkpoint is None else checkpoint.note)


def eps_text(eps_u: int) -> str:
    """ε in micro-units as the ledger's commands print it: six decimals, exact."""
    return f"{eps_u // 1_000_000}.{eps_u % 1_000_000:06d}"


def render_card(record: ArtifactRecord, facts: RunFacts) -> str:
    """The card's text."""
    base = record.base_model
    classifier = record.task == "sequence-classification"
    on_hub = "/" in base.name  # a Hugging Face id; else a local folder's own name
    auto = "AutoModelForSequenceClassification" if classifier else "AutoModelForCausalLM"
    tag = "dp-sgd" if facts.mechanism == "dpsgd" else facts.mechanism
    front = ["---", "library_name: peft", *([f"base_model: {_yaml(base.name)}"] if on_hub else []),
             f"pipeline_tag: {'text-classification' if classifier else 'text-generation'}", "tags:",
             "- govtrain", "- differential-privacy", f"- {tag}", "- lora", "---", ""]
    delta = f"{facts.delta_p / 1e12:g}"
    rows = [f"| {c.data_class} | {eps_text(c.eps_u)} | {delta} | {c.contributions} |" for c in facts.classes]
    q = ", ".join(f"{rate / 1e6:g}" for rate in facts.sampling_rates_u) or "-"
    named = f"[{base.name}](https://huggingface.co/{base.name})" if on_hub else f"`{base.name}`"
    if classifier:
        labels = ", ".join(record.id2label[str(i)] for i in range(record.num_labels or 0))
        pooling = {"mean": "the masked mean of its final token states (as sentence-transformers models pool)",
                   "model": "the architecture's own pooler"}[record.pooling]
        what = f"a {record.num_labels}-label sequence classifier ({labels}) on {pooling}"
    else:
        what = "a causal language model"
    unit = facts.privacy_unit.split(" ")[0]
    adapter_hash = facts.adapter_sha256.hex() if facts.adapter_sha256 else "-"
    revision = f" at revision `{base.revision}`" if base.revision else ""
    if base.spec:
        load = 'loaded = govtrain.load("THIS_FOLDER")  # finds the base model, checks its tree hash'
    else:
        load = f'loaded = govtrain.load("THIS_FOLDER", base="PATH/TO/{base.name}")  # checks its tree hash'
    use = ('print(loaded.predict(["an example text"]))  # label ids, as `govtrain eval` scores them' if classifier
           else "model, tokenizer = loaded.model, loaded.tokenizer")
    text = [
        *front,
        f"# {facts.run_id}",
        "",
        f"A LoRA adapter for {named}: {what}, trained with differential privacy by "
        f"[govtrain](https://pypi.org/project/govtrain/) on contributions admitted to the ledger `{facts.origin}`, "
        "which records every step's privacy spend before the step runs.",
        "",
        "## Privacy",
        "",
        "| class | ε | δ | contributions trained on |",
        "|---|---|---|---|",
        *(rows or [f"| (none) | 0 | {delta} | 0 |"]),
        "",
        f"- **ε**, per class: the largest cumulative ε of any {unit} of that class this run trained on, as the "
        "ledger's spend entries record it up to the run entry (it includes what earlier runs on this ledger charged "
        f"them), by the `{facts.accountant}` accountant at **δ = {delta}**.",
        f"- **Privacy unit**: {facts.privacy_unit}. What ε protects is the presence or absence of one such unit.",
        f"- **Mechanism**: {MECHANISM_NAMES.get(facts.mechanism, facts.mechanism)} on LoRA factors"
        f"{' and the classifier head' if record.heads and classifier else ''}: Poisson sampling at q = {q} per ledger "
        f"epoch, each unit's gradient clipped to its class's norm, Gaussian noise added once per step; {facts.steps} "
        f"steps{_schedule(record)}.",
        "",
        "## Ledger",
        "",
        f"- run id: `{facts.run_id}`",
        f"- ledger origin: `{facts.origin}`",
        f"- run entry: entry {facts.seq}, leaf hash `{facts.leaf_hash.hex()}`",
        f"- adapter hash (what the run entry records): `{adapter_hash}`, over every file in this folder but this "
        "README.md",
        f"- base model: `{base.name}`{revision}, tree hash `{base.sha256}`",
        f"- run config hash: `{facts.config_sha256.hex()}`; computed on {facts.device} in {facts.precision}",
    ]
    if facts.checkpoint_note is not None:
        text += [f"- the signed checkpoint that covers the run entry (tree size {facts.checkpoint_size}):", "",
                 "```text", facts.checkpoint_note.rstrip("\n"), "```"]
    text += [
        "",
        "## Verify",
        "",
        "With read access to the ledger (its URL, e.g. `sqlite:///ledger.db`), save the checkpoint above as "
        "`checkpoint.txt`, then:",
        "",
        "```bash",
        "govtrain-verify --ledger LEDGER_URL --trusted-checkpoint checkpoint.txt",
        "python -c \"from govtrain.release import verify_adapter; print(verify_adapter('THIS_FOLDER', 'LEDGER_URL'))\"",
        "```",
        "",
        "The first checks every entry, signature and spend of the ledger, and that it extends this checkpoint; the "
        "second that the run entry records this folder's hash and base model, and prints the ε per class above.",
        "",
        "## Load",
        "",
        "```python",
        "import govtrain",
        "",
        load,
        use,
        "```",
        "",
        f"`loaded.model` is a peft `PeftModel` over transformers' `{auto}` in eval mode; `loaded.tokenizer` is the "
        "run's tokenizer (saved here).",
    ]
    if record.plain_refusal is None:
        labels_arg = f", num_labels={record.num_labels}" if classifier else ""
        path = base.name if on_hub else f"PATH/TO/{base.name}"
        text += ["", "Plain transformers and peft reproduce it too (load the base in float32, as govtrain does):", "",
                 "```python", "import torch", f"from transformers import AutoTokenizer, {auto}",
                 "from peft import PeftModel", "",
                 f'base = {auto}.from_pretrained("{path}"{labels_arg}, dtype=torch.float32)',
                 'model = PeftModel.from_pretrained(base, "THIS_FOLDER").eval()',
                 'tokenizer = AutoTokenizer.from_pretrained("THIS_FOLDER")', "```"]
    else:
        text += ["", f"Plain transformers and peft refuse this folder on purpose: {record.plain_refusal}. Use "
                     "`govtrain.load`."]
    return "\n".join(text) + "\n"


def _yaml(value: str) -> str:
    return value if all(c.isalnum() or c in "/._-" for c in value) else '"' + value.replace('"', '\\"') + '"'


def _schedule(record: ArtifactRecord) -> str:
    """The learning rates' schedule as govtrain.json records it (nothing for a folder written before it did)."""
    schedule = record.run.schedule
    if schedule is None:
        return ""
    warmup = f" after {schedule.warmup} warm-up step(s)" if schedule.warmup else ""
    return f"; learning rates: RUN.toml's, on the `{schedule.kind}` schedule{warmup}"


def write_card(folder: Path, record: ArtifactRecord, facts: RunFacts) -> Path:
    """Write the card into `folder` (replacing whatever README.md is there) and read it back."""
    text = render_card(record, facts).encode()
    path = Path(folder) / CARD
    path.unlink(missing_ok=True)  # a link planted there is replaced, never written through
    path.write_bytes(text)
    if path.read_bytes() != text:
        raise OSError(f"{path} does not read back as written")
    return path
