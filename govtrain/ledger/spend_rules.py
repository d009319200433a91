"""The rules a `spend` entry must meet given the spend entries before it (DESIGN §5-6), in one place:
`Ledger.record_spend` refuses a batch that breaks them and the verifier fails an entry that does.

A ledger epoch's spend is written ahead by one run, in one transaction: every spend of an epoch names
that run and the number of steps it will run in the epoch (`epoch_steps`). Then:

1. One run holds an epoch. A second run (or the same config restarted without its state) plans the next
   epoch; it never trains on another run's write-ahead, which did not charge its steps.
2. 1 ≤ steps ≤ epoch_steps ≤ the policy's steps_per_epoch. A contribution is charged for fewer steps than
   the epoch has only where it retires (its budget allows no more), and is never charged again.
3. A run's epochs all have the length of its first one, but for its last, which may be shorter (the run
   ends); after a shorter epoch the run writes no more spend.
4. Under a policy that sets an expected batch size B rather than q, q is at least B over the records of
   the contributions admitted and not withdrawn at that point: no run samples below that.
5. Per contribution: one spend per epoch, in the epoch the ledger is in, and cumulative ε never falls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from govtrain.errors import Code


def min_sampling_rate_u(expected_batch_size: int, records: int) -> int:
    """ceil(B · 10⁶ / records): the lowest q (micro-units) a run with expected batch B can sample at."""
    if records <= 0:
        return 1_000_001  # nothing can be sampled at any rate
    return -(-expected_batch_size * 1_000_000 // records)


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
class SpendBook:
    """The state the rules read, built by feeding every spend entry in ledger order to `add`."""

    holders: dict[int, tuple[str, int]] = field(default_factory=dict)  # epoch -> (run_id, epoch_steps)
    runs: dict[str, tuple[int, bool]] = field(default_factory=dict)  # run -> (first epoch_steps, ended)
    charged: dict[str, _Charged] = field(default_factory=dict)  # contribution -> its latest spend
    rates: dict[int, set[int]] = field(default_factory=dict)  # epoch -> the sampling rates its spend charged

    def check(self, entry: dict, *, ledger_epoch: int, steps_per_epoch: int, min_rate_u: int | None) -> None:
        """Raise `SpendRuleError` if `entry` (a decoded spend, or its fields) breaks a rule."""
        epoch, run, length, steps = entry["epoch"], entry["run_id"], entry["epoch_steps"], entry["steps"]
        cid = entry["contribution_id"]
        if epoch != ledger_epoch:
            raise SpendRuleError(Code.BAD_ARGUMENT, f"spend for epoch {epoch} while the ledger is in epoch {ledger_epoch}")
        holder = self.holders.get(epoch)
        if holder is not None and holder[0] != run:
            raise SpendRuleError(Code.EPOCH_HELD, f"run {holder[0]!r} already wrote the spend of ledger epoch {epoch}; "
                                                  f"run {run!r} must plan the next epoch")
        if holder is not None and holder[1] != length:
            raise SpendRuleError(Code.BAD_ARGUMENT, f"epoch {epoch} has {holder[1]} steps in its other spend entries, "
                                                    f"not {length}")
        if not 1 <= steps <= length <= steps_per_epoch:
            raise SpendRuleError(Code.BAD_ARGUMENT, f"{cid!r}: {steps} steps of a {length}-step epoch: need "
                                                    f"1 <= steps <= epoch steps <= {steps_per_epoch}")
        first_length, ended = self.runs.get(run, (length, False))
        if holder is None and (ended or length > first_length):
            raise SpendRuleError(Code.BAD_ARGUMENT, f"run {run!r} ended with a shorter epoch, or its epochs grew past "
                                                    f"its first one's {first_length} steps")
        if min_rate_u is not None and entry["sampling_rate_u"] < min_rate_u:
            raise SpendRuleError(Code.BAD_ARGUMENT, f"sampling rate {entry['sampling_rate_u']} is below "
                                                    f"{min_rate_u}, the expected batch size over the records of the "
                                                    "contributions admitted and not withdrawn")
        last = self.charged.get(cid)
        if last is not None and last.retired:
            raise SpendRuleError(Code.BUDGET_EXCEEDED, f"{cid!r} retired in epoch {last.epoch}: no more spend")
        if last is not None and (last.epoch == epoch or entry["eps_u"] < last.eps_u):
            raise SpendRuleError(Code.BUDGET_EXCEEDED, f"{cid!r}: spend already written for epoch {epoch}, or epsilon "
                                                       f"{entry['eps_u']} below the recorded {last.eps_u}")

    def add(self, entry: dict) -> None:
        epoch, run, length = entry["epoch"], entry["run_id"], entry["epoch_steps"]
        if epoch not in self.holders:
            first_length, _ = self.runs.get(run, (length, False))
            self.runs[run] = (first_length, length < first_length)
            self.holders[epoch] = (run, length)
        self.rates.setdefault(epoch, set()).add(entry["sampling_rate_u"])
        self.charged[entry["contribution_id"]] = _Charged(epoch, entry["eps_u"], entry["steps"] < length)

    def holder(self, epoch: int) -> str | None:
        """The run that wrote `epoch`'s spend, if any."""
        held = self.holders.get(epoch)
        return held[0] if held is not None else None
