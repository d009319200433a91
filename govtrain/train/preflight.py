"""What a run settles before its first write-ahead spend, besides the rehearsal (`rehearsal.py`): the output
folder it may write, the contributions other runs already charged, and the plan it would charge (issue 21).

- **The output folder is the run's.** A run that does not resume its own state (`<output>/run-state.safetensors` of the
  same config) starts only in a missing or empty folder (`check_output`): an earlier run's adapter or run state
  there would be mixed with this run's files, and a second run of a finished config would start in the adapter
  folder of the first and charge the contributions again (`output_taken`).
- **Charging again needs consent.** `charged_by` reads which runs charged each contribution; a fresh run that
  would charge contributions another run charged says so, with each class's epsilon before and after
  (`Plan`), and is refused (`charged_before`) unless the caller confirmed (`--yes`, `confirm=True`). The run
  state keeps the consent; a run that has none is asked again when it resumes and at each write-ahead, under
  the ledger's write lock (`Ledger.record_spend(consent=...)`): another run may charge its contributions after
  it opened.
- **The run state is the ledger's.** It names the ledger it was written against (`Ledger.identity`); a state of
  another ledger, or one that took steps under a lease this ledger never recorded, is refused (`output_taken`,
  `Run._check_ledger`).
- **The plan** (`project`): the run's remaining steps, q, each class's sigma_eff and epsilon before and after,
  projected with the ledger's accountant from what the ledger says now (other runs may charge in between).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from govtrain import units
from govtrain.errors import Code, ConfigError

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


def check_output(folder: Path, left: Iterable[str]) -> None:
    """Refuse (`output_taken`) a fresh run's output `folder` unless it is missing or holds only the files named
    in `left` (the run-state lock a stopped run leaves, a state file it never finished writing)."""
    if not folder.exists():
        return
    if not folder.is_dir():
        raise ConfigError(Code.OUTPUT_TAKEN, f"training.output {folder} is a file, not a folder: give the run a "
                                             "folder of its own")
    found = sorted(p.name for p in folder.iterdir() if p.name not in set(left))
    if not found:
        return
    adapter = [name for name in found if name in ADAPTER_FILES]
    shown = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
    what = (f"another run's adapter ({', '.join(adapter)})" if adapter else
            f"{len(found)} file(s) no run of this config wrote ({shown})")
    raise ConfigError(Code.OUTPUT_TAKEN, f"training.output {folder} holds {what}: a run starts in an empty folder "
                                         "and saves only its own adapter there; give this run another "
                                         "training.output (resuming a run needs its own run-state.safetensors and "
                                         "config)")


def charged_by(ledger: Any) -> dict[str, set[str]]:
    """Contribution id -> the ids of the runs whose spend charged it (from the entries; a spend that retention
    redacted counts under the run its summary names)."""
    from govtrain.ledger.verified import verified_entries

    runs: dict[str, set[str]] = {}
    entries = verified_entries(ledger.store)  # every row, its kind its body's: a relabelled spend is refused
    for item in entries:
        if item.kind != "spend":
            continue
        if item.entry is not None:
            runs.setdefault(item.entry["contribution_id"], set()).add(item.entry["run_id"])
            continue
        record, spent = entries.redacted.spends[item.seq]
        runs.setdefault(record["contribution_id"], set()).add(str(spent.get("run_id", "a compacted run")))
    return runs


@dataclass(frozen=True, kw_only=True)
class ClassPlan:
    """One class as the run would charge it: its contributions (and how many other runs charged before), the
    sigma_eff of its first epoch and its largest cumulative epsilon before the run and after it."""

    name: str
    contributions: int
    charged_before: int
    sigma_eff: tuple[float, ...]
    eps_before: float
    eps_after: float


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What a run would charge from here, projected from what the ledger says now."""

    run_id: str
    steps: int  # steps still to take
    total_steps: int
    first_epoch: int
    steps_per_epoch: int
    sampling_rate: float
    expected_batch_size: float
    accountant: str
    delta: float
    resumed: bool
    classes: Mapping[str, ClassPlan] = field(default_factory=dict)

    @property
    def charged_before(self) -> int:
        return sum(c.charged_before for c in self.classes.values())

    def lines(self) -> list[str]:
        head = (f"{self.run_id}: {self.steps} of {self.total_steps} steps to take from ledger epoch {self.first_epoch} "
                f"({self.steps_per_epoch} per epoch), q = {self.sampling_rate:g} (expected batch "
                f"{self.expected_batch_size:g}), {self.accountant} at delta = {self.delta:g}")
        rows = [f"  {'class':<14}{'contributions':>14}{'charged before':>16}{'sigma_eff':>12}{'ε before':>10}"
                f"{'ε after':>10}"]
        for c in self.classes.values():
            if not c.contributions:
                continue
            sigma = (f"{min(c.sigma_eff):g}" + (f"-{max(c.sigma_eff):g}" if len(set(c.sigma_eff)) > 1 else "")
                     if c.sigma_eff else "-")
            rows.append(f"  {c.name:<14}{c.contributions:>14}{c.charged_before:>16}{sigma:>12}{c.eps_before:>10.4f}"
                        f"{c.eps_after:>10.4f}")
        return [head, *rows]

    def epsilons(self) -> str:
        """Each class's epsilon before -> after, on one line."""
        return ", ".join(f"{c.name} ε {c.eps_before:.4f} -> {c.eps_after:.4f}" for c in self.classes.values()
                         if c.contributions)

    def as_json(self) -> dict:
        return {"run_id": self.run_id, "steps": self.steps, "total_steps": self.total_steps,
                "first_epoch": self.first_epoch, "steps_per_epoch": self.steps_per_epoch,
                "sampling_rate": self.sampling_rate, "expected_batch_size": self.expected_batch_size,
                "accountant": self.accountant, "delta": self.delta, "resumed": self.resumed,
                "charged_before": self.charged_before,
                "classes": {c.name: {"contributions": c.contributions, "charged_before": c.charged_before,
                                     "sigma_eff": list(c.sigma_eff), "eps_before": c.eps_before,
                                     "eps_after": c.eps_after} for c in self.classes.values()}}


def project(*, run_id: str, cohorts: list, classes: Mapping[str, str], scheduler: Any, q_u: int,
            expected_batch: float, first_epoch: int, steps: int, total_steps: int, policy: Any, resumed: bool,
            charged_before: Iterable[str] = ()) -> Plan:
    """The `Plan` of `steps` more steps over `cohorts` (the run's live contributions as the ledger has them now:
    they take the projected charge, so pass copies), from `first_epoch` on. `classes` maps each of the run's
    contributions to its class."""
    before = {member: cohort.eps_u for cohort in cohorts for member in cohort.members}
    scheduler.sampling_rate_u = q_u
    plans = scheduler.project(cohorts, first_epoch=first_epoch, total_steps=steps) if q_u and steps else []
    sigmas: dict[str, set[float]] = {}
    for spend in plans[0].spends if plans else ():
        if spend.steps:
            sigmas.setdefault(spend.cohort.data_class, set()).add(spend.sigma_eff_u / units.MICRO)
    after = {member: cohort.eps_u for cohort in cohorts for member in cohort.members}
    again = set(charged_before)
    rows = {}
    for name in sorted(policy.classes):
        mine = [c for c, k in classes.items() if k == name and c in before]
        rows[name] = ClassPlan(name=name, contributions=len(mine), charged_before=len(again.intersection(mine)),
                               sigma_eff=tuple(sorted(sigmas.get(name, ()))),
                               eps_before=max((before[c] for c in mine), default=0) / units.MICRO,
                               eps_after=max((after[c] for c in mine), default=0) / units.MICRO)
    return Plan(run_id=run_id, steps=steps, total_steps=total_steps, first_epoch=first_epoch,
                steps_per_epoch=scheduler.steps_per_epoch, sampling_rate=q_u / units.MICRO,
                expected_batch_size=expected_batch, accountant=policy.accountant,
                delta=policy.delta_p / units.PICO, resumed=resumed, classes=rows)


def consent_error(plan: Plan, *, flag: str = "--yes (confirm=True)") -> ConfigError:
    """The refusal of a fresh run that would charge contributions other runs charged, unconfirmed."""
    return ConfigError(Code.CHARGED_BEFORE, f"{plan.charged_before} contribution(s) this run would charge were "
                                            f"already charged by other runs on this ledger ({plan.epsilons()} "
                                            f"after its {plan.steps} steps): charging them again spends more of "
                                            f"their budgets; pass {flag} to charge them, or train against a "
                                            "scratch ledger (make scratch)")
