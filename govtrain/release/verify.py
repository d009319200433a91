"""An adapter folder against its ledger: is this folder what the run entry recorded? Never imports torch.

    report = verify_adapter("adapter", "sqlite:///ledger.db")   # raises adapter_mismatch unless it is
    print(report)                                               # the run, its entry and ε per class

Checked in order:
  1. the folder is one govtrain released (`govtrain.json`, `artifact.read_record`);
  2. the ledger is the one its record names (the policy's origin);
  3. the ledger has a run entry for its run id (`card.run_facts`);
  4. that entry records this folder's adapter hash (`artifact.adapter_sha256`: every file but README.md), the
     base model's tree hash and the run config's hash the record states.
The ledger itself (its entries, signatures and spend) is `govtrain-verify`'s to check; this binds the folder to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from govtrain.errors import Code, IntegrityError
from govtrain.release.artifact import CARD, adapter_sha256, read_record
from govtrain.release.card import RunFacts, eps_text, render_card, run_facts


@dataclass(frozen=True, kw_only=True)
class AdapterReport:
    """What `verify_adapter` found: the run entry the folder matches, and whether its model card is the one the
    ledger's facts give (`"matches"`, `"differs"`: edited since, e.g. on the Hub; `"absent"`)."""

    folder: str
    facts: RunFacts
    card: str

    def __str__(self) -> str:
        eps = ", ".join(f"{c.data_class} ε {eps_text(c.eps_u)}" for c in self.facts.classes) or "no spend"
        warning = f"the model card {self.card}: trust the ledger's figures below, not the card's; " \
            if self.card != "matches" else ""
        return (f"{warning}ok: {self.folder} is run {self.facts.run_id}'s adapter (run entry {self.facts.seq} of "
                f"{self.facts.origin}); {eps} at δ = {self.facts.delta_p / 1e12:g}; model card {self.card}")


def verify_adapter(folder: str | Path, ledger_url: str) -> AdapterReport:
    """Raise `adapter_mismatch` (exit 4) unless the ledger at `ledger_url` has a run entry recording exactly this
    folder's adapter hash, base model and config; return what it records."""
    from govtrain.ledger.ledger import Ledger

    folder = Path(folder)
    # 1.
    record = read_record(folder)
    digest = adapter_sha256(folder)
    with Ledger.open(ledger_url) as ledger:
        # 2.
        if ledger.policy.origin != record.run.ledger_origin:
            raise IntegrityError(Code.ADAPTER_MISMATCH, f"{folder} was trained on the ledger of "
                                                        f"{record.run.ledger_origin!r}, not {ledger.policy.origin!r}")
        # 3.
        facts = run_facts(ledger, record.run.run_id)
    # 4.
    problems = []
    if facts.adapter_sha256 != digest:
        problems.append(f"its files hash to {digest.hex()}, the run entry records "
                        f"{facts.adapter_sha256.hex() if facts.adapter_sha256 else 'none'}")
    if facts.base_model_sha256.hex() != record.base_model.sha256:
        problems.append("its base model is not the one the run entry records")
    if facts.config_sha256.hex() != record.run.config_sha256:
        problems.append("its run config is not the one the run entry records")
    if problems:
        raise IntegrityError(Code.ADAPTER_MISMATCH, f"{folder} is not what run {record.run.run_id!r} recorded "
                                                    f"(entry {facts.seq}): {'; '.join(problems)}")
    card = folder / CARD
    state = ("absent" if not card.is_file() else
             "matches" if card.read_bytes() == render_card(record, facts).encode() else "differs")
    return AdapterReport(folder=str(folder), facts=facts, card=state)
