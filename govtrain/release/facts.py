"""What a ledger records of a run, as a release manifest states it (never imports torch): its run entry with an
inclusion proof under a signed checkpoint, the privacy terms of its spend, ε per class, and the withdrawals of the
contributions it trained on. `govtrain release` writes these facts into the predicate; `verify_release` with a live
ledger reads them again, as of the release's checkpoint, and compares.

ε per class is the card's (`card.run_facts`): the largest cumulative ε, as of the run entry, of a contribution of
that class the run charged. For a trial of a `tune` it is the tune entry's: the largest cumulative ε after the last
trial of a contribution any trial charged, since the selection depended on every trial (`ledger/tuning.py`). A run
named as a trial of a tune the ledger has not recorded yet is refused: its total is not known.

Every fact is read from the ledger as its checkpoints signed it (`ledger/signed.py`: each entry by its body, never
its kind column; the leaves folded into the signed root; the largest checkpoint that verifies, never the last row),
so that a database writer without keys can neither hide an entry nor have its edit blamed on a release.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from govtrain.errors import Code, IntegrityError, RejectedError
from govtrain.ledger.checkpoint import Checkpoint, NoteKey
from govtrain.ledger.merkle import ProofError, leaf_hash, verify_inclusion
from govtrain.ledger.proof import InclusionProof
from govtrain.ledger.signed import LogEntry, SignedLog, read_log
from govtrain.ledger.tuning import TRIAL_RUN_ID, TuneBook
from govtrain.policy.model import Policy
from govtrain.release import predicate

if TYPE_CHECKING:
    from govtrain.ledger.ledger import Ledger


@dataclass(frozen=True, kw_only=True)
class Withdrawal:
    contribution_id: str
    data_class: str
    seq: int  # its withdraw entry
    leaf_hash: bytes
    time: int | None = None  # its entry's time, from the body (None: stated by a release); see `withdrawals`
    time_bound: bool = False  # `time` is a signed lower bound, not the entry's own (retention dropped its body)


@dataclass(frozen=True, kw_only=True)
class TuneFacts:
    tune_id: str
    seq: int
    leaf_hash: bytes
    trials: tuple[str, ...]
    selected_run_id: str | None


@dataclass(frozen=True, kw_only=True)
class LedgerFacts:
    """A run as the first `checkpoint.size` entries of its ledger record it."""

    origin: str
    run: dict  # the run entry, decoded
    proof: InclusionProof  # of the run entry, under `checkpoint`
    checkpoint: Checkpoint
    policy: Policy  # in force when the run trained: its classes' profiles drew the groups
    release_policy: Policy  # in force at the checkpoint: its release keys may sign
    tune: TuneFacts | None
    eps_by_class: dict[str, int]
    contributions_by_class: dict[str, int]
    charged: frozenset[str]  # the contributions the run (or its tune's trials) charged
    classes: dict[str, str]  # contribution -> class, of `charged`
    sampling_rates_u: tuple[int, ...]  # the q of each ledger epoch it trained, in order
    steps: int
    noise_signatures: frozenset[frozenset[str]]  # the groups its spend charged noise on, by the classes reaching them
    withdrawn: tuple[Withdrawal, ...]  # of `charged`, before the checkpoint


def signed_log(ledger: "Ledger", *, keys: Callable[[str], list[NoteKey]] | None = None,
               trusted: Sequence[Checkpoint] = ()) -> SignedLog:
    """The ledger's entries as its checkpoints signed them (`ledger/signed.py`): the reading every fact here comes
    from. `keys`, `trusted`: ledger keys and checkpoints the caller pins."""
    return read_log(ledger.store, origin=ledger.policy.origin, keys=keys, trusted=trusted)


def current_checkpoint(ledger: "Ledger", *, log: SignedLog | None = None) -> Checkpoint:
    """The ledger's latest signed state: the largest checkpoint that verifies under its ledger keys and is the
    stored tree at its size (`ledger/signed.py`), never merely the last checkpoint row."""
    return (log or signed_log(ledger)).checkpoint


def ledger_facts(ledger: "Ledger", run_id: str, checkpoint: Checkpoint, *, log: SignedLog | None = None
                 ) -> LedgerFacts:
    """What the first `checkpoint.size` entries record of run `run_id` (`checkpoint` verified by the caller), read
    from `log` (default: `signed_log(ledger)`), which must extend it: by their bodies, never the kind column."""
    log = log or signed_log(ledger, trusted=[checkpoint])  # which checks that the stored entries extend it
    size = checkpoint.size
    signed = [(e.seq, e.kind, e.entry) for e in log.entries[:size]]
    run = next((e for e in log.of_kind("run", start=1, stop=size) if e.entry["run_id"] == run_id), None)
    if run is None:
        raise RejectedError(Code.UNKNOWN_RUN, f"the ledger of {ledger.policy.origin} records no run entry for run "
                                              f"{run_id!r} (in its first {size} entries)")
    book = TuneBook.of(signed, log.redacted)
    tune = _tune(log, book, run_id)
    if tune is None:
        trials, eps_book = [run_id], TuneBook.of(signed[:run.seq + 1], log.redacted)
    else:
        trials, eps_book = list(tune.trials), TuneBook.of(signed[:tune.seq + 1], log.redacted)
    _, totals = eps_book.totals(trials)
    charged = frozenset().union(*(eps_book.charged.get(t, set()) for t in trials))
    classes = {cid: eps_book.spent[cid][0] for cid in charged}
    counts: dict[str, int] = {}
    for data_class in classes.values():
        counts[data_class] = counts.get(data_class, 0) + 1
    rates, epochs, signatures, first_spend = [], {}, set(), None
    for spend in log.of_kind("spend", start=1, stop=run.seq):
        body = spend.entry if spend.entry is not None else log.redacted.spends[spend.seq][1]
        if body["run_id"] != run_id:
            continue
        first_spend = spend.seq if first_spend is None else first_spend
        if body["epoch"] not in epochs:
            rates.append(body["sampling_rate_u"])
            epochs[body["epoch"]] = body["epoch_steps"]
        signatures.update(frozenset(group["classes"]) for group in body["noise_groups"])
    trained_under = first_spend if first_spend is not None else run.seq
    return LedgerFacts(
        origin=ledger.policy.origin, run=run.entry, proof=_prove(log, run, checkpoint), checkpoint=checkpoint,
        policy=log.policy_at(trained_under), release_policy=log.policy_at(size), tune=tune,
        eps_by_class={t["data_class"]: t["eps_u"] for t in totals}, contributions_by_class=counts,
        charged=charged, classes=classes, sampling_rates_u=tuple(rates), steps=sum(epochs.values()),
        noise_signatures=frozenset(signatures), withdrawn=withdrawals(log, charged, classes, stop=size))


def withdrawals(log: SignedLog, charged: frozenset[str], classes: dict[str, str], *, start: int = 0,
                stop: int | None = None) -> tuple[Withdrawal, ...]:
    """The withdraw entries in [start, stop) (default: every entry stored, past the checkpoint too) of the
    contributions `charged`, read from the entries themselves (a body retention dropped, from the summary that
    retired it), never from the withdrawals index or the kind column. Each with its time: its body's, or where
    retention dropped the body (the summary keeps no time, and the row's time column is no one's statement), the
    time of the last entry before it that kept its body (`time_bound`): entry times never decrease, so that is a
    time a signature covers and no later than the withdrawal's own, the bound that ends a grace period soonest."""
    found = []
    for stored in log.of_kind("withdraw", start=max(start, 1), stop=stop):
        if stored.entry is not None:
            cid = stored.entry["contribution_id"]
        else:
            cid = log.redacted.withdrawals[stored.seq]["contribution_id"]
        if cid in charged:
            if stored.entry is not None:
                time, bound = stored.entry["time"], False
            else:  # entry 0, the header, always keeps its body
                time = next(e.entry["time"] for e in reversed(log.entries[:stored.seq]) if e.entry is not None)
                bound = True
            found.append(Withdrawal(contribution_id=cid, data_class=classes[cid], seq=stored.seq,
                                    leaf_hash=stored.leaf_hash, time=time, time_bound=bound))
    return tuple(found)


def _tune(log: SignedLog, book: TuneBook, run_id: str) -> TuneFacts | None:
    tune_id = book.tuned.get(run_id)
    if tune_id is None:
        named = TRIAL_RUN_ID.fullmatch(run_id)
        if named is not None:
            raise RejectedError(Code.TUNE_UNRECORDED, f"run {run_id!r} is named as a trial of tune "
                                                      f"{named.group(1)!r}, which the ledger has not recorded: its "
                                                      "ε covers every trial; release it once govtrain tune ends")
        return None
    stored = log.entries[book.tunes[tune_id]]
    entry = stored.entry
    assert entry is not None  # tune entries are never redacted
    return TuneFacts(tune_id=tune_id, seq=stored.seq, leaf_hash=stored.leaf_hash,
                     trials=tuple(t["run_id"] for t in entry["trials"]), selected_run_id=entry["selected_run_id"])


def _prove(log: SignedLog, run: LogEntry, checkpoint: Checkpoint) -> InclusionProof:
    """The run entry's inclusion proof under `checkpoint`, from the leaves in memory, checked against its signed
    root before it is given."""
    body = run.body
    assert body is not None  # run entries are never redacted
    hashes = log.tree(checkpoint.size).inclusion_proof(run.seq, checkpoint.size)
    try:
        verify_inclusion(run.seq, checkpoint.size, leaf_hash(body), hashes, checkpoint.root)
    except ProofError as e:
        raise IntegrityError(Code.FORK, f"the stored entries do not prove entry {run.seq} under the signed "
                                        f"checkpoint ({e.detail}); run govtrain-verify") from e
    return InclusionProof(body, run.seq, hashes, checkpoint.note)


def privacy_of(facts: LedgerFacts) -> predicate.Privacy:
    """The predicate's privacy terms, from the ledger's facts of the run."""
    policy = facts.policy
    return predicate.Privacy(unit=policy.privacy_unit, examples_per_contribution=policy.examples_per_contribution,
                             accountant=policy.accountant, delta_p=policy.delta_p, mechanism=facts.run["mechanism"],
                             sampling_rates_u=list(facts.sampling_rates_u), steps=facts.steps)


def tune_of(facts: LedgerFacts) -> predicate.Tune | None:
    """The predicate's tune: the `tune` entry that lists the run as a trial, or None."""
    tune = facts.tune
    return None if tune is None else predicate.Tune(tune_id=tune.tune_id, seq=tune.seq, leaf_hash=tune.leaf_hash.hex(),
                                                    trials=list(tune.trials), selected_run_id=tune.selected_run_id)


def withdrawn_of(found: tuple[Withdrawal, ...]) -> list[predicate.Withdrawal]:
    """The predicate's list of withdrawals."""
    return [predicate.Withdrawal(contribution_id=w.contribution_id, data_class=w.data_class, seq=w.seq,
                                 leaf_hash=w.leaf_hash.hex()) for w in found]
