"""The rules a `spend` or `run` entry must meet given the entries before it (docs/design.md §5-6), in one place:
`Ledger.record_spend` and `Ledger.record_run` refuse what breaks them and the verifier fails an entry that does.

A ledger epoch's spend is written ahead by one run, in one transaction: every spend of an epoch names
that run, its lease, the number of steps it will run in the epoch (`epoch_steps`) and the epoch's noise
schedule (`noise_groups`). Then:

1. A run id is a one-time lease. A run draws a random `run_nonce` when it starts (kept in its run state, so
   that a killed run resumes under it): every spend and the run entry of one run id carry that nonce, a run
   id has at most one run entry, and no spend of it follows its run entry. Two runs started with one id
   cannot both train on one run's write-ahead.
2. One run holds an epoch. A second run (or the same config restarted without its state) plans the next
   epoch; it never trains on another run's write-ahead, which did not charge its steps.
3. 1 ≤ steps ≤ epoch_steps ≤ the policy's steps_per_epoch. A contribution is charged for fewer steps than
   the epoch has only where it retires (its budget allows no more), and is never charged again.
4. A run's epochs all have the length of its first one, but for its last, which may be shorter (the run
   ends); after a shorter epoch the run writes no more spend.
5. Under a policy that sets an expected batch size B rather than q, q is at least B over the records of
   the contributions admitted and not withdrawn at that point: no run samples below that.
6. Per contribution: one spend per epoch, in the epoch the ledger is in, and cumulative ε never falls.
7. The noise schedule (docs/design.md §5) bounds σ_eff from public metadata alone. Every spend of an epoch records
   the same groups, each as the classes that reach it and s_g (pico-units); a spend's σ_eff is at most min
   over the groups its class reaches of s_g / C_i; and s_g is at most the largest signed σ_j·C_j of a
   contribution whose class is one of the group's and that the epoch's spend charges. The charged contributions
   are exactly the ones the schedule was planned with: one that cannot afford a step adds no noise
   (`Scheduler.plan_epoch`), and a run whose planned contribution withdraws before the write plans again
   (`Run.write_ahead`). So an operator cannot charge less than the noise the signed bounds of what it trains on
   justify: σ_eff = 100 where those contributions imply 1 is refused, and a contribution that retired, withdrew
   or never afforded a step justifies nothing.

8. A run adds its noise with one privatizer: every spend of a run id and its run entry record the same privatizer
   record (`privatizers`; an entry written before privatizers records none: the i.i.d. Gaussian's).

A spend whose body retention redacted is read as its summary recorded it (`retention.Redacted.spend_entry`:
every field the rules read), and is held to the same rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Collection, Iterable, Mapping

from govtrain.errors import Code
from govtrain.ledger import retention
from govtrain.ledger.verified import feed, verified_entries

if TYPE_CHECKING:
    import ledger_store
    from govtrain.ledger.verified import Verified
    from govtrain.policy.model import Policy

NONCE_BYTES = 16


def min_sampling_rate_u(expected_batch_size: int, records: int) -> int:
    """ceil(B · 10⁶ / records): the lowest q (micro-units) a run with expected batch B can sample at."""
    if records <= 0:
        return 1_000_001  # nothing can be sampled at any rate
    return -(-expected_batch_size * 1_000_000 // records)


def noise_groups_record(group_noise_pu: Mapping[frozenset, int]) -> list[dict]:
    """The schedule's s_g (signature -> pico-units) as a spend entry's `noise_groups`: sorted by classes."""
    return sorted(({"classes": sorted(signature), "s_pu": s_pu} for signature, s_pu in group_noise_pu.items()),
                  key=lambda group: group["classes"])


class SpendRuleError(Exception):
    def __init__(self, code: Code, detail: str) -> None:
        super().__init__(detail)
        self.code, self.detail = code, detail


@dataclass
class _Charged:
    epoch: int
    eps_u: int
    retired: bool


@dataclass
class _Signed:
    """What a contribution signed that the noise schedule reads."""

    data_class: str
    clip_u: int
    noise_pu: int  # sigma_u * C_u


@dataclass
class _Epoch:
    """What rule 7 reads about one ledger epoch: its schedule, and the signed sigma*C that may justify it."""

    first_seq: int | None  # its first spend entry (where a failure is reported)
    schedule: list[dict] | None  # its noise_groups (None: every spend of it was redacted)
    charged: dict[str, int] = field(default_factory=dict)  # class -> largest sigma*C of one it charged


@dataclass
class SpendBook:
    """The state the rules read, built by feeding every admit, spend and run entry in ledger order (`admit`,
    `add`, `add_run`; a spend that retention redacted as its summary recorded it, `Redacted.spend_entry`)."""

    holders: dict[int, tuple[str, bytes, int]] = field(default_factory=dict)  # epoch -> (run, nonce, epoch_steps)
    runs: dict[str, tuple[int, bool]] = field(default_factory=dict)  # run -> (first epoch_steps, ended short)
    charged: dict[str, _Charged] = field(default_factory=dict)  # contribution -> its latest spend
    charged_by: dict[str, set[str]] = field(default_factory=dict)  # contribution -> the runs whose spend charged it
    rates: dict[int, set[int]] = field(default_factory=dict)  # epoch -> the sampling rates its spend charged
    leases: dict[str, bytes] = field(default_factory=dict)  # run id -> the nonce its spend carries
    finished: dict[str, bytes] = field(default_factory=dict)  # run id -> the nonce of its run entry
    signed: dict[str, _Signed] = field(default_factory=dict)  # contribution -> its signed bounds
    epochs: dict[int, _Epoch] = field(default_factory=dict)  # epoch -> its schedule and what may justify it
    privatizers: dict[str, dict] = field(default_factory=dict)  # run id -> the privatizer record its spend carries
    ledger_epoch: int = 0  # the epoch the ledger is in: its epoch entries, counted by their bodies

    # -- feeding -------------------------------------------------------------------------------------

    def admit(self, contribution_id: str, data_class: str, clip_norm_u: int, noise_multiplier_u: int) -> None:
        self.signed[contribution_id] = _Signed(data_class, clip_norm_u, noise_multiplier_u * clip_norm_u)

    def add(self, entry: dict, seq: int | None = None) -> None:
        epoch, run, length = entry["epoch"], entry["run_id"], entry["epoch_steps"]
        if epoch not in self.holders:
            first_length, _ = self.runs.get(run, (length, False))
            self.runs[run] = (first_length, length < first_length)
            self.holders[epoch] = (run, entry["run_nonce"], length)
        self.leases.setdefault(run, entry["run_nonce"])
        self.privatizers.setdefault(run, privatizer_of(entry))
        record = self.epochs.setdefault(epoch, _Epoch(seq, None))
        if record.schedule is None:
            record.schedule = entry["noise_groups"]
        self._charge(record, entry["contribution_id"])
        self.rates.setdefault(epoch, set()).add(entry["sampling_rate_u"])
        self.charged[entry["contribution_id"]] = _Charged(epoch, entry["eps_u"], entry["steps"] < length)
        self.charged_by.setdefault(entry["contribution_id"], set()).add(run)

    def add_run(self, entry: dict) -> None:
        self.finished[entry["run_id"]] = entry["run_nonce"]

    def _charge(self, record: _Epoch, contribution_id: str) -> None:
        signed = self.signed.get(contribution_id)
        if signed is not None:
            record.charged[signed.data_class] = max(record.charged.get(signed.data_class, 0), signed.noise_pu)

    # -- queries -------------------------------------------------------------------------------------

    def holder(self, epoch: int) -> tuple[str, bytes] | None:
        """(run id, nonce) of the run that wrote `epoch`'s spend, if any."""
        held = self.holders.get(epoch)
        return held[:2] if held is not None else None

    def used(self, run_id: str) -> bool:
        """Whether `run_id` already wrote spend or a run entry: a fresh run may not take it."""
        return run_id in self.leases or run_id in self.finished

    # -- the rules -----------------------------------------------------------------------------------

    def check(self, entry: dict, *, ledger_epoch: int, steps_per_epoch: int, min_rate_u: int | None,
              classes: Collection[str]) -> None:
        """Raise `SpendRuleError` if `entry` (a decoded spend, or its fields) breaks a rule. `classes`: the
        policy's class names. The bound on the epoch's s_g (rule 7) needs all of the epoch's spend: check it
        with `check_schedule` once the epoch's spend is in."""
        epoch, run, length, steps = entry["epoch"], entry["run_id"], entry["epoch_steps"], entry["steps"]
        cid = entry["contribution_id"]
        if epoch != ledger_epoch:
            raise SpendRuleError(Code.BAD_ARGUMENT, f"spend for epoch {epoch} while the ledger is in epoch {ledger_epoch}")
        self._check_lease(run, entry["run_nonce"])  # 1.
        holder = self.holders.get(epoch)  # 2.
        if holder is not None and holder[0] != run:
            raise SpendRuleError(Code.EPOCH_HELD, f"run {holder[0]!r} already wrote the spend of ledger epoch {epoch}; "
                                                  f"run {run!r} must plan the next epoch")
        if holder is not None and holder[2] != length:
            raise SpendRuleError(Code.BAD_ARGUMENT, f"epoch {epoch} has {holder[2]} steps in its other spend entries, "
                                                    f"not {length}")
        if not 1 <= steps <= length <= steps_per_epoch:  # 3.
            raise SpendRuleError(Code.BAD_ARGUMENT, f"{cid!r}: {steps} steps of a {length}-step epoch: need "
                                                    f"1 <= steps <= epoch steps <= {steps_per_epoch}")
        first_length, ended = self.runs.get(run, (length, False))  # 4.
        if holder is None and (ended or length > first_length):
            raise SpendRuleError(Code.BAD_ARGUMENT, f"run {run!r} ended with a shorter epoch, or its epochs grew past "
                                                    f"its first one's {first_length} steps")
        if min_rate_u is not None and entry["sampling_rate_u"] < min_rate_u:  # 5.
            raise SpendRuleError(Code.BAD_ARGUMENT, f"sampling rate {entry['sampling_rate_u']} is below "
                                                    f"{min_rate_u}, the expected batch size over the records of the "
                                                    "contributions admitted and not withdrawn")
        last = self.charged.get(cid)  # 6.
        if last is not None and last.retired:
            raise SpendRuleError(Code.BUDGET_EXCEEDED, f"{cid!r} retired in epoch {last.epoch}: no more spend")
        if last is not None and (last.epoch == epoch or entry["eps_u"] < last.eps_u):
            raise SpendRuleError(Code.BUDGET_EXCEEDED, f"{cid!r}: spend already written for epoch {epoch}, or ε "
                                                       f"{entry['eps_u']} below the recorded {last.eps_u}")
        self._check_sigma(entry, classes)  # 7.
        self._check_privatizer(entry)  # 8.

    def check_schedule(self, epoch: int) -> None:
        """Rule 7's bound on s_g, over all of `epoch`'s spend so far: each group's s_g is at most the largest
        signed sigma*C of a contribution whose class reaches it and that this epoch's spend charged."""
        record = self.epochs.get(epoch)
        if record is None or record.schedule is None:
            return
        for group in record.schedule:
            bound = max((record.charged.get(name, 0) for name in group["classes"]), default=0)
            if group["s_pu"] > bound:
                raise SpendRuleError(Code.BAD_ARGUMENT, f"noise group {'+'.join(group['classes'])} of epoch {epoch}: "
                                                        f"s_g {group['s_pu']} (pico) exceeds {bound}, the largest "
                                                        "signed sigma*C of a contribution of its classes that the "
                                                        "epoch's spend charged")

    def check_run(self, entry: dict) -> None:
        """Raise `SpendRuleError` if a run entry (decoded, or its fields) breaks rule 1."""
        run = entry["run_id"]
        if run in self.finished:
            raise SpendRuleError(Code.RUN_ID_TAKEN, f"run {run!r} already has a run entry: a run id is used once")
        self._check_lease(run, entry["run_nonce"])
        self._check_privatizer(entry)

    def _check_privatizer(self, entry: dict) -> None:
        run, record = entry["run_id"], privatizer_of(entry)
        held = self.privatizers.get(run)
        if held is not None and held != record:
            raise SpendRuleError(Code.BAD_ARGUMENT, f"run {run!r} records privatizer {record!r} here and {held!r} in "
                                                    "its spend before: a run adds its noise with one privatizer")

    def _check_lease(self, run: str, nonce: bytes) -> None:
        if len(nonce) != NONCE_BYTES:
            raise SpendRuleError(Code.BAD_ARGUMENT, f"run {run!r}: run_nonce must be {NONCE_BYTES} bytes")
        if run in self.finished:
            raise SpendRuleError(Code.RUN_ID_TAKEN, f"run {run!r} already recorded its run entry: no spend follows it")
        held = self.leases.get(run)
        if held is not None and held != nonce:
            raise SpendRuleError(Code.RUN_ID_TAKEN, f"run id {run!r} is held by another run (its spend carries another "
                                                    "lease nonce): two runs may not share an id; give this one another "
                                                    "training.run_id")

    def _check_sigma(self, entry: dict, classes: Collection[str]) -> None:
        epoch, cid, groups = entry["epoch"], entry["contribution_id"], entry["noise_groups"]
        signed = self.signed.get(cid)
        if signed is None:
            raise SpendRuleError(Code.BAD_ARGUMENT, f"{cid!r}: spend for a contribution not admitted before it")
        record = self.epochs.get(epoch)
        if record is not None and record.schedule is not None:
            if groups != record.schedule:
                raise SpendRuleError(Code.BAD_ARGUMENT, f"{cid!r}: its noise_groups differ from those of the other "
                                                        f"spend entries of epoch {epoch}: an epoch has one schedule")
        else:
            _check_groups(groups, classes)
        reached = [group["s_pu"] for group in groups if signed.data_class in group["classes"]]
        if not reached:
            raise SpendRuleError(Code.BAD_ARGUMENT, f"{cid!r}: no noise group of epoch {epoch} is reached by its class "
                                                    f"{signed.data_class!r}")
        implied = min(reached) // signed.clip_u
        if entry["noise_multiplier_u"] > implied:
            raise SpendRuleError(Code.BAD_ARGUMENT, f"{cid!r}: sigma_eff {entry['noise_multiplier_u']} (micro) exceeds "
                                                    f"{implied}, min over its class's noise groups of s_g / C: the "
                                                    "schedule does not imply that much noise")


def privatizer_of(entry: Mapping) -> dict:
    """The privatizer record of a spend or run entry: an entry written before privatizers was the i.i.d. Gaussian."""
    from govtrain.privatizers import GAUSSIAN_RECORD

    return dict(entry.get("privatizer", GAUSSIAN_RECORD))


def _check_groups(groups: Iterable[dict], classes: Collection[str]) -> None:
    groups = list(groups)
    if not groups:
        raise SpendRuleError(Code.BAD_ARGUMENT, "noise_groups is empty: a charged contribution's noise must be recorded")
    for group in groups:
        names = group["classes"]
        if not names or names != sorted(set(names)) or any(name not in classes for name in names):
            raise SpendRuleError(Code.BAD_ARGUMENT, f"noise group {names!r}: classes must be the policy's, sorted, "
                                                    "each once")
        if group["s_pu"] <= 0:
            raise SpendRuleError(Code.BAD_ARGUMENT, f"noise group {'+'.join(names)}: s_g must be positive")
    keys = [group["classes"] for group in groups]
    if keys != sorted(keys) or len({tuple(k) for k in keys}) != len(keys):
        raise SpendRuleError(Code.BAD_ARGUMENT, "noise_groups must be sorted by classes, each group once")


class SpendState:
    """What a new spend is checked against, fed the verified entries in ledger order (`take`; `verified.feed`):
    the spend book (with the ledger epoch), each contribution's records and the withdrawn ids. An entry
    retention redacted counts as its summary recorded it."""

    def __init__(self, policy: "Policy", redacted: "Callable[[], retention.Redacted]") -> None:
        self.policy, self._redacted = policy, redacted
        self.book, self.records, self.withdrawn = SpendBook(), {}, set()

    def take(self, item: "Verified") -> None:
        kind, entry = item.kind, item.entry
        if entry is None and kind in ("admit", "spend", "withdraw"):
            redacted = self._redacted()
            if kind == "admit":
                entry = redacted.admits[item.seq]
            elif kind == "withdraw":
                entry = redacted.withdrawals[item.seq]
            else:
                policy = self.policy
                entry = redacted.spend_entry(item.seq, accountant=policy.accountant, delta_p=policy.delta_p,
                                             privacy_unit=policy.privacy_unit)
        if kind == "epoch":
            self.book.ledger_epoch += 1
        elif kind == "admit":
            self.records[entry["contribution_id"]] = entry["records"]
            self.book.admit(entry["contribution_id"], entry["data_class"], entry["clip_norm_u"],
                            entry["noise_multiplier_u"])
        elif kind == "withdraw":
            self.withdrawn.add(entry["contribution_id"])
        elif kind == "spend":
            self.book.add(entry, item.seq)
        elif kind == "run":
            self.book.add_run(entry)

    def live_units(self) -> int:
        """The sampling units (`Policy.sampling_units`: examples, or contributions) of the contributions admitted
        and not withdrawn."""
        return sum(self.policy.sampling_units(n) for cid, n in self.records.items() if cid not in self.withdrawn)


def read_spend_state(store: "ledger_store.LedgerStore", policy: "Policy") -> tuple[SpendBook, int, set[str]]:
    """What a new spend is checked against, read from `store`'s verified entries in ledger order (`verified`: every
    row, never selected by its kind column): (the spend book, the sampling units of the contributions admitted
    and not withdrawn, the withdrawn ids). The book's `ledger_epoch` is the epoch entries' count, by their bodies."""
    state = spend_state(store, policy)
    return state.book, state.live_units(), state.withdrawn


def spend_state(store: "ledger_store.LedgerStore", policy: "Policy") -> SpendState:
    """`SpendState` from one verified pass over `store`."""
    entries = verified_entries(store, policy=policy)
    state = SpendState(policy, lambda: entries.redacted)
    feed(entries, state.take)
    return state
