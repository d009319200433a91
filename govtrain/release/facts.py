"""What a ledger records of a run, as a release manifest states it (never imports torch): its run entry with an
inclusion proof under a signed checkpoint, the privacy terms of its spend, ε per class, and the withdrawals of the
contributions it trained on. `govtrain release` writes these facts into the predicate; `verify_release` with a live
ledger reads them again, as of the release's checkpoint, and compares.

ε per class is the card's (`card.run_facts`): the largest cumulative ε, as of the run entry, of a contribution of
that class the run charged. For a trial of a `tune` it is the tune entry's: the largest cumulative ε after the last
trial of a contribution any trial charged, since the selection depended on every trial (`ledger/tuning.py`). A run
named as a trial of a tune the ledger has not recorded yet is refused: its total is not known.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import ledger_store
from govtrain.errors import Code, IntegrityError, RejectedError
from govtrain.ledger.checkpoint import Checkpoint, NoteError, verify_checkpoint
from govtrain.ledger.entries import decode_stored
from govtrain.ledger.merkle import ProofError, verify_inclusion
from govtrain.ledger.policy_chain import note_keys, policy_chain
from govtrain.ledger.proof import InclusionProof
from govtrain.ledger.retention import Redacted
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


def current_checkpoint(ledger: "Ledger") -> Checkpoint:
    """The ledger's latest checkpoint, verified under the ledger keys of its current policy."""
    latest = ledger.store.latest_checkpoint()
    if latest is None:
        raise RejectedError(Code.NO_CHECKPOINT, "the ledger has no checkpoint yet")
    try:
        return verify_checkpoint(latest.note, origin=ledger.policy.origin, keys=note_keys(ledger.policy))
    except NoteError as e:
        raise IntegrityError(Code.BAD_CHECKPOINT, f"the ledger's latest checkpoint does not verify ({e.detail}); "
                                                  "run govtrain-verify") from e


def ledger_facts(ledger: "Ledger", run_id: str, checkpoint: Checkpoint) -> LedgerFacts:
    """What the first `checkpoint.size` entries record of run `run_id` (`checkpoint` verified by the caller)."""
    store, size = ledger.store, checkpoint.size
    stored = next((s for s in store.entries(start=1, kinds=("run",)) if s.seq < size and s.body is not None
                   and decode_stored(s)["run_id"] == run_id), None)
    if stored is None:
        raise RejectedError(Code.UNKNOWN_RUN, f"the ledger of {ledger.policy.origin} records no run entry for run "
                                              f"{run_id!r} (in its first {size} entries)")
    run = decode_stored(stored)
    book = TuneBook.read(store, until=size - 1)
    tune = _tune(store, book, run_id)
    if tune is None:
        trials, eps_book = [run_id], TuneBook.read(store, until=stored.seq)
    else:
        trials, eps_book = list(tune.trials), TuneBook.read(store, until=tune.seq)
    _, totals = eps_book.totals(trials)
    charged = frozenset().union(*(eps_book.charged.get(t, set()) for t in trials))
    classes = {cid: eps_book.spent[cid][0] for cid in charged}
    counts: dict[str, int] = {}
    for data_class in classes.values():
        counts[data_class] = counts.get(data_class, 0) + 1
    redacted = Redacted.read(store)
    rates, epochs, signatures, first_spend = [], {}, set(), None
    for spend in store.entries(start=1, kinds=("spend",)):
        if spend.seq > stored.seq:
            break
        body = decode_stored(spend) if spend.body is not None else redacted.spends.get(spend.seq, (None, None))[1]
        if body is None or body["run_id"] != run_id:
            continue
        first_spend = spend.seq if first_spend is None else first_spend
        if body["epoch"] not in epochs:
            rates.append(body["sampling_rate_u"])
            epochs[body["epoch"]] = body["epoch_steps"]
        signatures.update(frozenset(group["classes"]) for group in body["noise_groups"])
    chain = policy_chain(store, ledger.header)
    trained_under = first_spend if first_spend is not None else stored.seq
    return LedgerFacts(
        origin=ledger.policy.origin, run=run, proof=_prove(ledger, stored, checkpoint), checkpoint=checkpoint,
        policy=[p for seq, p in chain if seq < trained_under][-1],
        release_policy=[p for seq, p in chain if seq < size][-1], tune=tune,
        eps_by_class={t["data_class"]: t["eps_u"] for t in totals}, contributions_by_class=counts,
        charged=charged, classes=classes, sampling_rates_u=tuple(rates), steps=sum(epochs.values()),
        noise_signatures=frozenset(signatures), withdrawn=withdrawals(store, charged, classes, stop=size))


def withdrawals(store: ledger_store.LedgerStore, charged: frozenset[str], classes: dict[str, str], *,
                start: int = 0, stop: int) -> tuple[Withdrawal, ...]:
    """The withdraw entries in [start, stop) of the contributions `charged`, read from the entries themselves (a
    body retention dropped, from the summary that retired it), never from the withdrawals index."""
    redacted = None
    found = []
    for stored in store.entries(start=max(start, 1), kinds=("withdraw",)):
        if stored.seq >= stop:
            break
        if stored.body is not None:
            cid = decode_stored(stored)["contribution_id"]
        else:
            redacted = redacted or Redacted.read(store)
            if stored.seq not in redacted.withdrawals:
                raise IntegrityError(Code.BAD_SUMMARY, f"withdraw entry {stored.seq} has no body and no summary "
                                                       "records it; run govtrain-verify")
            cid = redacted.withdrawals[stored.seq]["contribution_id"]
        if cid in charged:
            found.append(Withdrawal(contribution_id=cid, data_class=classes[cid], seq=stored.seq,
                                    leaf_hash=stored.leaf_hash))
    return tuple(found)


def _tune(store: ledger_store.LedgerStore, book: TuneBook, run_id: str) -> TuneFacts | None:
    tune_id = book.tuned.get(run_id)
    if tune_id is None:
        named = TRIAL_RUN_ID.fullmatch(run_id)
        if named is not None:
            raise RejectedError(Code.TUNE_UNRECORDED, f"run {run_id!r} is named as a trial of tune "
                                                      f"{named.group(1)!r}, which the ledger has not recorded: its "
                                                      "ε covers every trial; release it once govtrain tune ends")
        return None
    stored = store.entry(book.tunes[tune_id])
    assert stored is not None and stored.body is not None  # tune entries are never redacted
    entry = decode_stored(stored)
    return TuneFacts(tune_id=tune_id, seq=stored.seq, leaf_hash=stored.leaf_hash,
                     trials=tuple(t["run_id"] for t in entry["trials"]), selected_run_id=entry["selected_run_id"])


def _prove(ledger: "Ledger", stored: ledger_store.StoredEntry, checkpoint: Checkpoint) -> InclusionProof:
    """The run entry's inclusion proof under `checkpoint`, checked against its signed root before it is given."""
    hashes = ledger.tree(checkpoint.size).inclusion_proof(stored.seq, checkpoint.size)
    try:
        verify_inclusion(stored.seq, checkpoint.size, ledger_store.leaf_hash(stored.body), hashes, checkpoint.root)
    except ProofError as e:
        raise IntegrityError(Code.FORK, f"the stored entries do not prove entry {stored.seq} under the signed "
                                        f"checkpoint ({e.detail}); run govtrain-verify") from e
    return InclusionProof(stored.body, stored.seq, hashes, checkpoint.note)


def privacy_of(facts: LedgerFacts) -> predicate.Privacy:
    """The predicate's privacy terms, from the ledger's facts of the run."""
    policy = facts.policy
    return predicate.Privacy(unit=policy.privacy_unit, examples_per_contribution=policy.examples_per_contribution,
                             accountant=policy.accountant, delta_p=policy.delta_p, mechanism=facts.run["mechanism"],
                             sampling_rates_u=list(facts.sampling_rates_u), steps=facts.steps)


def withdrawn_of(found: tuple[Withdrawal, ...]) -> list[predicate.Withdrawal]:
    """The predicate's list of withdrawals."""
    return [predicate.Withdrawal(contribution_id=w.contribution_id, data_class=w.data_class, seq=w.seq,
                                 leaf_hash=w.leaf_hash.hex()) for w in found]
