"""`govtrain plan`: what a run of T steps would charge every admitted contribution, before it runs.

Reads the ledger (admissions, withdrawals, recorded spend), derives q from the expected batch size
over the eligible examples (rounded **up**: a larger q charges more), resolves each class's profile
against the model when one is given, and projects the noise schedule epoch by epoch with the
ledger's accountant: sigma_eff, the cumulative epsilon at the end of the run and the retirement
step of every contribution. Without a model each class is treated as reaching a group of its own,
which can only under-state sigma_eff (see `schedule.disjoint_groups`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from govtrain import units
from govtrain.accounting.spend import SpendCalculator
from govtrain.errors import Code, ConfigError
from govtrain.ledger.ledger import Ledger
from govtrain.ledger.spend_rules import SpendBook, SpendState
from govtrain.ledger.verified import Verified, feed, verified_entries
from govtrain.privatizers.charges import spend_item
from govtrain.resolver.model import ModelLayout, role
from govtrain.resolver.profile import describe_profile, format_ranges, resolve
from govtrain.resolver.reach import check_reach
from govtrain.resolver.schedule import Cohort, Member, Scheduler, cohorts_of, disjoint_groups


@dataclass
class _Admitted:
    member: Member
    records: int
    data_sha256: bytes
    history: list[tuple[int, int, int]]
    eps_u: int = 0
    last_epoch: int = -1
    retired: bool = False  # its last spend covered part of its epoch: the budget allows no more steps


class Corpus:
    """The admitted contributions with their recorded spend, the withdrawn ids, how many admissions were compacted
    (bodies redacted after a retention summary, so they cannot be planned) and the ledger epoch, fed the verified
    entries in ledger order (`take`; `ledger.verified`: every row, its kind its body's, never selected by the kind
    column or another index column)."""

    def __init__(self) -> None:
        self.admitted: dict[str, _Admitted] = {}
        self.withdrawn: set[str] = set()
        self.compacted = 0
        self.epoch = 0
        self._retired: set[str] = set()  # summarized, bodies not yet dropped: retired all the same

    def take(self, item: Verified) -> None:
        kind, entry = item.kind, item.entry
        if kind == "epoch":
            self.epoch += 1
        elif kind == "summary":
            self._retired.update(r["contribution_id"] for r in entry["retired"])
        elif entry is None:  # redacted: a summary records it (`verified`); a compacted admission is not planned
            self.compacted += kind == "admit"
        elif kind == "admit":
            self.admitted[entry["contribution_id"]] = _Admitted(
                Member(entry["contribution_id"], entry["data_class"], entry["clip_norm_u"],
                       entry["noise_multiplier_u"], entry["eps_budget_u"]), entry["records"], entry["data_sha256"], [])
        elif kind == "withdraw":
            self.withdrawn.add(entry["contribution_id"])
        elif kind == "spend" and entry["contribution_id"] in self.admitted:
            spent = self.admitted[entry["contribution_id"]]
            spent.history.append(spend_item(entry))  # through the privatizer it records (privatizers/charges.py)
            spent.eps_u, spent.last_epoch = entry["eps_u"], entry["epoch"]
            spent.retired = entry["steps"] < entry["epoch_steps"]

    def done(self) -> "Corpus":
        for cid in [cid for cid in self.admitted if cid in self._retired]:
            del self.admitted[cid]
            self.compacted += 1
        return self


@dataclass(frozen=True)
class LedgerState:
    """What a planner reads from one moment of the ledger, in one verified pass: the corpus and the spend state."""

    corpus: Corpus
    spend: SpendState

    @property
    def book(self) -> SpendBook:
        return self.spend.book


def read_state(ledger: Ledger) -> LedgerState:
    """The corpus and the spend state from one verified pass (each body hashed and decoded once)."""
    entries = verified_entries(ledger.store, policy=ledger.policy)
    corpus, spend = Corpus(), SpendState(ledger.policy, lambda: entries.redacted)
    feed(entries, corpus.take, spend.take)
    return LedgerState(corpus.done(), spend)


def read_corpus(ledger: Ledger) -> tuple[dict[str, _Admitted], set[str], int]:
    """Admitted contributions with their recorded spend, the withdrawn ids, and how many admissions
    were compacted (bodies redacted after a retention summary) and so cannot be planned: `Corpus` from one
    verified pass."""
    corpus = corpus_of(ledger)
    return corpus.admitted, corpus.withdrawn, corpus.compacted


def corpus_of(ledger: Ledger) -> Corpus:
    """`Corpus` from one verified pass."""
    corpus = Corpus()
    feed(verified_entries(ledger.store, policy=ledger.policy), corpus.take)
    return corpus.done()


def plan_run(ledger: Ledger, steps: int, expected_batch_size: int | None = None,
             layout: ModelLayout | None = None, *, epoch_steps: int | None = None, workers: int = 1,
             mechanism: str = "dpsgd", privatizer: Any = None) -> dict[str, Any]:
    """`privatizer`: the run's (`govtrain.privatizers`; None: the i.i.d. Gaussian), whose charge the plan projects."""
    policy = ledger.policy
    if steps < 1:
        raise ConfigError(Code.BAD_ARGUMENT, "--steps must be at least 1")
    corpus = corpus_of(ledger)  # the entries as signed, never the index columns; the epoch from the same pass
    admitted, withdrawn, compacted = corpus.admitted, corpus.withdrawn, corpus.compacted
    eligible = {cid: a for cid, a in admitted.items() if cid not in withdrawn}
    records = sum(a.records for a in eligible.values())
    q_u, batch = sampling_rate_for(policy, expected_batch_size, sum(policy.sampling_units(a.records)
                                                                    for a in eligible.values()),
                                   option="--expected-batch-size", code=Code.BAD_ARGUMENT)

    classes = dict(policy.classes)
    resolution = None
    class_groups = disjoint_groups(classes)
    if epoch_steps is not None and not 0 < epoch_steps <= policy.steps_per_epoch:
        raise ConfigError(Code.BAD_ARGUMENT, f"ledger epochs of {epoch_steps} steps: need 1 to the policy's "
                                             f"{policy.steps_per_epoch}")
    steps_per_epoch = epoch_steps or policy.steps_per_epoch
    if layout is not None:
        present = {role(p.name).adapter for p in layout.trainable()}  # adapters the (wrapped) model has
        layered = {n: c for n, c in classes.items() if c.profile.kind != "adapter" or c.profile.adapter in present}
        resolution = resolve(layered, layout) if layered else None
        if resolution is not None:
            check_reach(mechanism, resolution.reach, (p.name for p in layout.trainable()))
            class_groups = {**class_groups, **resolution.class_groups()}

    epoch = corpus.epoch
    if any(a.last_epoch == epoch for a in eligible.values()):
        epoch += 1  # this epoch's spend is already written ahead: the run's steps start at the next one
    cohorts = cohorts_of([a.member for a in eligible.values()],
                         {cid: (tuple(a.history), a.eps_u) for cid, a in eligible.items()},
                         [cid for cid, a in eligible.items() if a.retired])
    start = {id(c): c.eps_u for c in cohorts}
    with SpendCalculator(policy.accountant, policy.delta_p, workers=workers) as calculator:
        scheduler = Scheduler(calculator, class_groups, sampling_rate_u=q_u, steps_per_epoch=steps_per_epoch,
                              privatizer=privatizer)
        plans = scheduler.project(cohorts, first_epoch=epoch, total_steps=steps) if q_u else []
    sigmas: dict[int, list[int]] = {}
    for plan in plans:
        for spend in plan.spends:
            if spend.steps:
                sigmas.setdefault(id(spend.cohort), []).append(spend.sigma_eff_u)

    rows = []
    for cohort in cohorts:
        for cid in sorted(cohort.members):
            rows.append(_row(cid, cohort, start[id(cohort)], sigmas.get(id(cohort), [])))
    rows.sort(key=lambda r: (r["data_class"], r["contribution_id"]))
    return {
        "ok": True,
        "ledger": ledger.store.url,
        "accountant": policy.accountant,
        "delta": policy.delta_p / units.PICO,
        "steps": steps,
        "first_epoch": epoch,
        "steps_per_epoch": steps_per_epoch,
        "privacy_unit": policy.privacy_unit,
        "examples_per_contribution": policy.examples_per_contribution,
        "sampling_rate": q_u / units.MICRO,
        "expected_batch_size": batch,
        "eligible_records": records,
        "eligible_contributions": len(eligible),
        "withdrawn": len(withdrawn),
        "compacted": compacted,
        "model": None if layout is None else layout.name,
        "groups": [] if not plans else [
            {"classes": sorted(signature), "noise_std": plans[0].group_std(signature)}
            for signature in sorted(plans[0].group_noise_pu, key=sorted)],
        "classes": {name: _class_row(name, cls, rows, resolution) for name, cls in sorted(classes.items())},
        "contributions": rows,
    }


def sampling_rate_for(policy, expected_batch_size: int | None, records: int, *, option: str,
                      code: Code) -> tuple[int, float]:
    """(q_u, expected batch size) over `records` eligible sampling units (examples, or contributions under
    privacy_unit = "contribution": `Policy.sampling_units`): the policy's fixed rate, or the expected batch size
    (`option`, else the policy's) divided by the units, rounded up (a larger q charges more)."""
    if policy.sampling_rate_u is not None:
        if expected_batch_size is not None:
            raise ConfigError(code, f"this policy fixes sampling_rate = {units.format_micro(policy.sampling_rate_u)}; "
                                    f"drop {option}")
        return policy.sampling_rate_u, policy.sampling_rate_u * records / units.MICRO
    batch = expected_batch_size or policy.expected_batch_size
    if batch < policy.expected_batch_size:
        raise ConfigError(code, f"{option}: {batch} is below the policy's expected_batch_size "
                                f"({policy.expected_batch_size}); the ledger accepts no lower sampling rate")
    if records == 0:
        return 0, batch
    if batch > records:
        raise ConfigError(code, f"expected batch size {batch} exceeds the {records} eligible "
                                f"{policy.privacy_unit}s")
    return -(-batch * units.MICRO // records), batch


def _row(cid: str, cohort: Cohort, eps_before: int, sigmas: list[int]) -> dict[str, Any]:
    return {
        "contribution_id": cid,
        "data_class": cohort.data_class,
        "clip_norm": cohort.clip_norm_u / units.MICRO,
        "noise_multiplier": cohort.noise_multiplier_u / units.MICRO,
        "sigma_eff": sigmas[0] / units.MICRO if sigmas else None,
        "sigma_eff_min": min(sigmas) / units.MICRO if sigmas else None,
        "eps_now": eps_before / units.MICRO,
        "eps_projected": cohort.eps_u / units.MICRO,
        "eps_budget": cohort.eps_budget_u / units.MICRO,
        "retires_at_step": cohort.retired_at,
    }


def _class_row(name: str, cls, rows: list[dict], resolution) -> dict[str, Any]:
    mine = [r for r in rows if r["data_class"] == name]
    out: dict[str, Any] = {
        "profile": describe_profile(cls.profile),
        "contributions": len(mine),
        "retiring": sum(r["retires_at_step"] is not None for r in mine),
        "sigma_eff": sorted({r["sigma_eff"] for r in mine if r["sigma_eff"] is not None}),
        "eps_projected_max": max((r["eps_projected"] for r in mine), default=0.0),
    }
    if resolution is not None and name in resolution.reach:
        out["layers"] = format_ranges(resolution.layers[name])
        out["parameters"] = len(resolution.reach[name])
        out["scalars"] = resolution.numel(name)
        if cls.profile.kind == "adapter":
            out["reaches"] = f"its own LoRA adapter {cls.profile.adapter!r}: {out['parameters']} tensors, " \
                             f"{out['scalars']:,} values"
    elif cls.profile.kind == "adapter":
        out["reaches"] = f"only its own LoRA adapter {cls.profile.adapter!r}, created by the run"
    return out
