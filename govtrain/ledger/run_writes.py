"""The entries a training run and a hyperparameter search write: `spend` (one epoch's, written ahead of its
steps), `run` (what the run was and produced) and `tune` (a search binding its trials). `Ledger.record_spend`,
`record_run` and `record_tune` call these; each refuses, writing nothing, what the verifier would fail.
"""

from __future__ import annotations

import functools
import time as _time
from typing import Any, Collection, Mapping, Sequence

import ledger_store
from govtrain.errors import Code, ConfigError, IntegrityError, RejectedError
from govtrain.ledger import retention
from govtrain.ledger.entries import DEVICE, MECHANISMS, PRECISIONS, decode_stored, run_entry, spend_entry, tune_entry
from govtrain.ledger.signed_append import WritingLedger
from govtrain.ledger.spend_rules import SpendBook, SpendRuleError, SpendState, min_sampling_rate_u
from govtrain.ledger.tuning import TuneBook, TuneRuleError
from govtrain.ledger.verified import feed, verified_entries

_REJECTED = (Code.EPOCH_HELD, Code.BUDGET_EXCEEDED, Code.RUN_ID_TAKEN)  # a request refused, not a bad argument


def record_spend(ledger: WritingLedger, epoch: int, sampling_rate_u: int,
                 spends: "Sequence[tuple[str, int, int, int]]", *, run_id: str, run_nonce: bytes, epoch_steps: int,
                 noise_groups: "Sequence[dict]",
                 now: int | None = None, consent: Collection[str] | None = None,
                 privatizer: "Mapping[str, Any] | None" = None) -> list[ledger_store.StoredEntry]:
    """`Ledger.record_spend`: one ledger epoch's spend entries, written ahead of its steps (the rules it refuses
    by are listed there)."""
    now = int(_time.time()) if now is None else now
    policy = ledger.policy
    record = _privatizer_record(privatizer)
    if policy.sampling_rate_u is not None and sampling_rate_u != policy.sampling_rate_u:
        raise ConfigError(Code.BAD_ARGUMENT, f"sampling rate {sampling_rate_u} differs from the policy's "
                                             f"{policy.sampling_rate_u}")
    if not 0 < sampling_rate_u <= 1_000_000:
        raise ConfigError(Code.BAD_ARGUMENT, "the sampling rate must be in (0, 1]")
    signed: dict[str, tuple[bytes, dict]] = {}
    for contribution_id, steps, sigma_u, eps_u in spends:
        admission = ledger.store.admission(contribution_id)
        if admission is None:
            raise RejectedError(Code.UNKNOWN_CONTRIBUTION, f"no admitted contribution {contribution_id!r}")
        admit = ledger.store.entry(admission.seq)
        if admit is None or admit.body is None:
            raise RejectedError(Code.REDACTED, f"{contribution_id!r} was summarized by retention and is retired")
        entry = decode_stored(admit)
        if entry["contribution_id"] != contribution_id:
            raise IntegrityError(Code.INDEX_MISMATCH, f"the admissions index points {contribution_id!r} at entry "
                                                      f"{admit.seq}, which admits {entry['contribution_id']!r}")
        if sigma_u < entry["noise_multiplier_u"] or eps_u > entry["eps_budget_u"]:
            raise RejectedError(Code.BUDGET_EXCEEDED,
                                f"spend for {contribution_id!r} ({steps} steps, sigma {sigma_u}, ε {eps_u}) "
                                f"breaks its signed bounds (sigma >= {entry['noise_multiplier_u']}, "
                                f"ε <= {entry['eps_budget_u']})")
        signed[contribution_id] = (admit.leaf_hash, entry)
    if len(signed) != len(spends):
        raise ConfigError(Code.BAD_ARGUMENT, "a contribution appears twice in one epoch's spend")
    with ledger.append(now) as appender:
        t = ledger.dated(appender, now)
        entries = verified_entries(ledger.store, policy=policy)  # one pass, every row, none selected by kind
        state, tunes, classes = SpendState(policy, lambda: entries.redacted), TuneBook(), {}
        feed(entries, state.take, lambda item: tunes.take(item, classes, lambda: entries.redacted))
        book, live_records, withdrawn = state.book, state.live_units(), state.withdrawn
        retired = retention.RetiredKeys.read(ledger.store)
        floor = (min_sampling_rate_u(policy.expected_batch_size, live_records)
                 if policy.expected_batch_size is not None else None)
        ledger_epoch = book.ledger_epoch  # the epoch entries by their bodies, never by the kind column
        if consent is not None:
            _check_consent(book, [record[0] for record in spends], {run_id, *consent}, run_id, epoch)
        stored = []
        for contribution_id, steps, sigma_u, eps_u in spends:
            leaf, _ = signed[contribution_id]
            if contribution_id in withdrawn:
                raise RejectedError(Code.ALREADY_WITHDRAWN, f"{contribution_id!r} was withdrawn: no more spend")
            if contribution_id in retired:
                raise RejectedError(Code.REDACTED, f"{contribution_id!r} was retired by a retention summary")
            fields = dict(contribution_id=contribution_id, admit_leaf=leaf, run_id=run_id, run_nonce=run_nonce,
                          epoch=epoch, epoch_steps=epoch_steps, steps=steps, sampling_rate_u=sampling_rate_u,
                          noise_multiplier_u=sigma_u, accountant=policy.accountant, delta_p=policy.delta_p,
                          privacy_unit=policy.privacy_unit, eps_u=eps_u, noise_groups=list(noise_groups),
                          privatizer=dict(record))
            try:
                book.check(fields, ledger_epoch=ledger_epoch, steps_per_epoch=policy.steps_per_epoch,
                           min_rate_u=floor, classes=policy.classes)
            except SpendRuleError as e:
                error = RejectedError if e.code in _REJECTED else ConfigError
                raise error(e.code, e.detail) from e
            try:  # the run is no trial of a recorded tune: that tune's total would no longer hold
                tunes.check_spend(fields)
            except TuneRuleError as e:
                raise RejectedError(Code.RUN_ID_TAKEN, f"{e.detail}; give the run another id") from e
            book.add(fields)
            stored.append(appender.add("spend", t, functools.partial(_spend_at, now=t, fields=fields)))
        try:  # rule 7's bound on s_g reads the whole epoch's spend: the transaction rolls back if it fails
            book.check_schedule(ledger_epoch)
        except SpendRuleError as e:
            raise ConfigError(e.code, e.detail) from e
    return stored


def record_run(ledger: WritingLedger, run_id: str, mechanism: str, config_sha256: bytes, base_model_sha256: bytes,
               adapter_sha256: bytes | None, now: int | None = None, *, run_nonce: bytes, device: str = "cpu",
               precision: str = "fp32", privatizer: "Mapping[str, Any] | None" = None
               ) -> ledger_store.StoredEntry:
    """`Ledger.record_run`: the `run` entry that ends a run's lease on its id."""
    if mechanism not in MECHANISMS:
        raise ValueError(f"unknown mechanism {mechanism!r}: one of {', '.join(MECHANISMS)}")
    if precision not in PRECISIONS or not DEVICE.fullmatch(device):
        raise ValueError(f"a run's precision is one of {', '.join(PRECISIONS)} and its device cpu or cuda:N")
    now = int(_time.time()) if now is None else now
    record = _privatizer_record(privatizer)
    with ledger.append(now) as appender:
        t = ledger.dated(appender, now)
        try:
            ledger.spend_book().check_run({"run_id": run_id, "run_nonce": run_nonce, "privatizer": record})
        except SpendRuleError as e:
            raise (RejectedError if e.code in _REJECTED else ConfigError)(e.code, e.detail) from e
        return appender.add("run", t, lambda seq: run_entry(
            seq, t, run_id=run_id, run_nonce=run_nonce, mechanism=mechanism, config_sha256=config_sha256,
            base_model_sha256=base_model_sha256, adapter_sha256=adapter_sha256, device=device,
            precision=precision, privatizer=dict(record)))


def record_tune(ledger: WritingLedger, *, tune_id: str, config_sha256: bytes, grid_sha256: bytes,
                trials: "Sequence[tuple[str, bytes]]",
                selection_sha256: bytes, metric: str, selected_run_id: str | None,
                now: int | None = None) -> tuple[ledger_store.StoredEntry, dict]:
    """`Ledger.record_tune`: the `tune` entry binding a search's trials, with the epsilon their spend charged."""
    now = int(_time.time()) if now is None else now
    with ledger.append(now) as appender:
        t = ledger.dated(appender, now)
        book = ledger.tune_book()
        run_ids = [run_id for run_id, _ in trials]
        eps_u, by_class = book.totals(run_ids)
        selected = book.runs.get(selected_run_id) if selected_run_id is not None else None
        fields = dict(tune_id=tune_id, config_sha256=config_sha256, grid_sha256=grid_sha256,
                      trials=[{"run_id": run_id, "config_sha256": sha} for run_id, sha in trials],
                      selection_sha256=selection_sha256, metric=metric, selected_run_id=selected_run_id,
                      adapter_sha256=selected[-1][1] if selected else None, accounting="composition",
                      eps_u=eps_u, eps_by_class=by_class)
        try:
            book.check(fields)
        except TuneRuleError as e:
            error = ConfigError if e.code in (Code.TUNE_EXISTS, Code.SELECTION_ADMITTED) else RejectedError
            raise error(e.code, e.detail) from e
        stored = appender.add("tune", t, functools.partial(_tune_at, now=t, fields=fields))
    return stored, fields


def _check_consent(book: SpendBook, contributions: Sequence[str], mine: set[str], run_id: str, epoch: int) -> None:
    """Refuse (`charged_before`) a spend of contributions that runs outside `mine` charged, unconfirmed."""
    others = {cid: sorted(book.charged_by.get(cid, set()) - mine) for cid in contributions}
    others = {cid: runs for cid, runs in others.items() if runs}
    if others:
        runs = sorted({run for found in others.values() for run in found})
        raise ConfigError(Code.CHARGED_BEFORE, f"{len(others)} contribution(s) run {run_id!r} would charge in ledger "
                                               f"epoch {epoch} were charged by other runs since it opened "
                                               f"({', '.join(runs[:3])}{', ...' if len(runs) > 3 else ''}): "
                                               "charging them again spends more of their budgets and needs "
                                               "consent; nothing was written; open the run again with --yes "
                                               "(confirm=True) to charge them")


def _privatizer_record(privatizer: "Mapping[str, Any] | None") -> dict:
    """A privatizer record to write (None: the i.i.d. Gaussian's), refused (`privatizer_unknown`/`_invalid`, nothing
    written) where its privatizer could not be rebuilt from it: the verifier could not recompute the charge."""
    from govtrain.ledger.entries import check_privatizer_record
    from govtrain.privatizers import GAUSSIAN_RECORD, from_record

    record = dict(GAUSSIAN_RECORD if privatizer is None else privatizer)
    try:
        check_privatizer_record(record, what="the privatizer record")
    except IntegrityError as e:
        raise ConfigError(Code.PRIVATIZER_INVALID, e.detail) from e
    from_record(record)
    return record


def _spend_at(seq: int, *, now: int, fields: dict) -> bytes:
    return spend_entry(seq, now, **fields)


def _tune_at(seq: int, *, now: int, fields: dict) -> bytes:
    return tune_entry(seq, now, **fields)
