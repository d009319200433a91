"""The noise schedule (docs/design.md §5): s_g per parameter group, sigma_eff and retirement per contribution.

For one ledger epoch, from public metadata only and before any of its steps run:

- s_g = max over the contributions taking part in the epoch (eligible at its start and able to afford
  at least one of its steps) whose class reaches group g of sigma_i * C_i (their signed values), kept
  exact as an integer in pico-units (micro * micro). A group no such contribution reaches gets no
  gradient and no noise that epoch. One that cannot afford a step retires without adding noise: the
  ledger bounds s_g by the contributions its spend charges (`spend_rules`, rule 7).
- sigma_eff,i = min over the groups g its class reaches of s_g / C_i, rounded down to micro-units and
  then bucketed down to 3 significant digits (`bucket_sigma_u`), never below the signed sigma_i.
- Contribution i is charged (q, sigma_eff,i) for every step it is eligible. If the whole epoch would
  take its cumulative epsilon past its signed budget, it is eligible for the largest number k of the
  epoch's steps that keeps it within, and retires at step first_step + k. s_g stays fixed for the
  whole epoch: a contribution that retires mid-epoch keeps adding its share of noise, which only
  helps the others.

Contributions with the same class, bounds, budget and history are the same to the accountant; a
`Cohort` carries them together, so a corpus costs one computation per distinct cohort, not per
contribution. Without a model, `disjoint_groups` treats each class as reaching a group of its own:
the real groups' s_g can only be larger, so that is a conservative stand-in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

from govtrain import units
from govtrain.accounting.spend import History, SpendCalculator, bucket_sigma_u
from govtrain.privatizers.charges import bucketer

if TYPE_CHECKING:
    from govtrain.privatizers.base import Privatizer

Signature = frozenset  # the set of classes that reach a group


@dataclass(frozen=True, slots=True)
class Member:
    """The public metadata of one admitted contribution that the schedule uses."""

    contribution_id: str
    data_class: str
    clip_norm_u: int
    noise_multiplier_u: int
    eps_budget_u: int


@dataclass(eq=False)
class Cohort:
    data_class: str
    clip_norm_u: int
    noise_multiplier_u: int
    eps_budget_u: int
    members: set[str]  # contribution ids
    history: History = ()
    eps_u: int = 0
    retired_at: int | None = None  # global step from which it is no longer eligible

    @property
    def key(self) -> tuple:
        return (self.data_class, self.clip_norm_u, self.noise_multiplier_u, self.eps_budget_u, self.history,
                self.eps_u, self.retired_at)

    @property
    def eligible(self) -> bool:
        return self.retired_at is None and bool(self.members)


@dataclass(frozen=True, slots=True)
class CohortSpend:
    cohort: Cohort
    sigma_eff_u: int
    steps: int  # steps of this epoch in which its members are eligible
    eps_u: int  # cumulative epsilon after those steps
    retires_at: int | None  # global step, if it retires in this epoch


@dataclass(frozen=True)
class EpochPlan:
    epoch: int
    first_step: int
    steps: int
    sampling_rate_u: int
    group_noise_pu: Mapping[Signature, int]  # s_g in pico-units
    spends: tuple[CohortSpend, ...] = field(default=())

    def group_std(self, signature: Signature) -> float:
        return self.group_noise_pu.get(signature, 0) / units.PICO

    def spend_records(self) -> list[tuple[str, int, int, int]]:
        """(contribution_id, steps, sigma_eff_u, eps_u) for every member charged this epoch: what
        `Ledger.record_spend` writes ahead."""
        return sorted((member, spend.steps, spend.sigma_eff_u, spend.eps_u)
                      for spend in self.spends if spend.steps for member in spend.cohort.members)


def cohorts_of(members: Iterable[Member], histories: Mapping[str, tuple[History, int]] | None = None,
               retired: Iterable[str] = ()) -> list[Cohort]:
    """Group contributions that the accountant cannot tell apart; `histories` maps an id to its
    recorded (history in epoch order, cumulative eps_u). `retired` ones (the ledger charged them for
    part of an epoch: their budget is spent) are never eligible again."""
    histories = histories or {}
    retired = set(retired)
    by_key: dict[tuple, Cohort] = {}
    for m in members:
        history, eps_u = histories.get(m.contribution_id, ((), 0))
        done = m.contribution_id in retired
        key = (m.data_class, m.clip_norm_u, m.noise_multiplier_u, m.eps_budget_u, tuple(history), eps_u, done)
        cohort = by_key.get(key)
        if cohort is None:
            cohort = by_key[key] = Cohort(m.data_class, m.clip_norm_u, m.noise_multiplier_u, m.eps_budget_u, set(),
                                          tuple(history), eps_u, 0 if done else None)
        cohort.members.add(m.contribution_id)
    return list(by_key.values())


def disjoint_groups(classes: Iterable[str]) -> dict[str, list[Signature]]:
    return {name: [frozenset((name,))] for name in classes}


def group_noise(class_groups: Mapping[str, Sequence[Signature]], cohorts: Iterable[Cohort]) -> dict[Signature, int]:
    """s_g (pico-units) for every group some eligible contribution reaches."""
    top: dict[str, int] = {}
    for cohort in cohorts:
        if cohort.eligible:
            product = cohort.noise_multiplier_u * cohort.clip_norm_u
            if product > top.get(cohort.data_class, 0):
                top[cohort.data_class] = product
    noise: dict[Signature, int] = {}
    for name, product in top.items():
        for signature in class_groups[name]:
            if product > noise.get(signature, 0):
                noise[signature] = product
    return noise


def sigma_eff_u(cohort: Cohort, class_groups: Mapping[str, Sequence[Signature]], noise: Mapping[Signature, int]) -> int:
    """min over the cohort's groups of s_g / C, rounded down to micro-units, then bucketed down."""
    exact = min(noise[signature] for signature in class_groups[cohort.data_class]) // cohort.clip_norm_u
    return bucket_sigma_u(exact, cohort.noise_multiplier_u)


class Scheduler:
    def __init__(self, calculator: SpendCalculator, class_groups: Mapping[str, Sequence[Signature]], *,
                 sampling_rate_u: int, steps_per_epoch: int, privatizer: "Privatizer | None" = None) -> None:
        """`privatizer`: the run's (None: the i.i.d. Gaussian); what a spend of k steps charges follows from it
        (`Privatizer.charge`: a matrix factorization amplified over a cycle of b steps is charged ceil(k / b)
        rounds at rate min(1, b·q))."""
        missing = [name for name, groups in class_groups.items() if not groups]
        if missing:
            raise ValueError(f"class {missing[0]!r} reaches no parameter group")
        self.calculator = calculator
        self.class_groups = class_groups
        self.sampling_rate_u = sampling_rate_u
        self.steps_per_epoch = steps_per_epoch
        self.bucket = bucketer(privatizer)

    def plan_epoch(self, cohorts: Sequence[Cohort], epoch: int, first_step: int, steps: int | None = None,
                   *, commit: bool = True) -> EpochPlan:
        """The epoch's s_g and every eligible cohort's charge. With `commit`, cohorts take the charge:
        their history and epsilon grow, and those that run out retire."""
        steps = self.steps_per_epoch if steps is None else steps
        q = self.sampling_rate_u
        # A cohort that cannot afford one step at the noise the others set takes no part: it is charged
        # nothing and adds no noise (noise for a contribution that is never sampled would only look like
        # cover the ledger cannot justify: spend rule 7 bounds s_g by the contributions charged). Dropping it
        # can only lower s_g, and so every other sigma_eff, so the loop ends with every member affording one.
        taking = [c for c in cohorts if c.eligible]
        while True:
            noise = group_noise(self.class_groups, taking)
            sigmas = [sigma_eff_u(c, self.class_groups, noise) for c in taking]
            self.calculator.prefetch([c.history + (self.bucket(q, s, steps),) for c, s in zip(taking, sigmas)])
            spends = []
            for cohort, sigma in zip(taking, sigmas):
                full = self.calculator.epsilon_u(cohort.history + (self.bucket(q, sigma, steps),))
                if full <= cohort.eps_budget_u:
                    taken, eps_u = steps, full
                else:
                    taken, eps_u = self.calculator.max_steps(cohort.history, q, sigma, steps, cohort.eps_budget_u,
                                                             bucket=self.bucket)
                retires = first_step + taken if taken < steps else None
                spends.append(CohortSpend(cohort, sigma, taken, max(eps_u, cohort.eps_u), retires))
            if all(spend.steps for spend in spends) or not any(spend.steps for spend in spends):
                break
            taking = [spend.cohort for spend in spends if spend.steps]
        spends += [CohortSpend(c, 0, 0, c.eps_u, first_step) for c in cohorts if c.eligible and c not in taking]
        if not any(spend.steps for spend in spends):
            noise = {}
        if commit:
            for spend in spends:
                cohort = spend.cohort
                if spend.steps:
                    cohort.history += (self.bucket(q, spend.sigma_eff_u, spend.steps),)
                    cohort.eps_u = spend.eps_u
                cohort.retired_at = spend.retires_at
        return EpochPlan(epoch, first_step, steps, q, noise, tuple(spends))

    def project(self, cohorts: Sequence[Cohort], *, first_epoch: int, total_steps: int) -> list[EpochPlan]:
        """Plan `total_steps` steps from `first_epoch` on, one ledger epoch at a time (the last may be short)."""
        plans, done, epoch = [], 0, first_epoch
        while done < total_steps and any(c.eligible for c in cohorts):
            steps = min(self.steps_per_epoch, total_steps - done)
            plans.append(self.plan_epoch(cohorts, epoch, done, steps))
            done += steps
            epoch += 1
        return plans
