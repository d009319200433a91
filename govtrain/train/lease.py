"""A run's hold on the ledger (docs/design.md §5-6, spend rule 1): what makes one run, and one process, the only one
that trains on a ledger epoch's write-ahead spend.

- **The lease.** A run id is a one-time lease: the run draws a random `run_nonce` when it starts and keeps it
  in its run state; every spend and its run entry carry it, and `write_ahead` accepts an epoch only for the
  same id *and* nonce (another run under the id: `run_id_taken`).
- **The lock** (`lock_state`): an exclusive flock on `<output>/run-state.lock` while a process owns the run
  state; the kernel drops it when the process dies, so a killed run resumes.
- **The owner** (`claim`, `check_owner`): the ledger store records the one process that owns each run, for
  copies of a run state that a folder lock cannot see.
- **The written plan** (`written_plan`): a held epoch is trained exactly as the ledger charged it, whatever
  plan the run state holds.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Collection

from govtrain import units
from govtrain.errors import Code, ConfigError, GovtrainError, RejectedError
from govtrain.ledger.ledger import Ledger

LOCK_FILE = "run-state.lock"  # held (flock) by the one process that owns the run state
OWNER_SETTING = "run_owner:"  # + run id and lease nonce: the ledger store's record of the one process that owns a run


def owner_setting(lease: tuple[str, bytes]) -> str:
    """The store setting that names a run's owner: one per lease, so a copy of a run state (the same lease) takes
    the run over, and another run that merely reuses the id (another lease) takes nothing: its write-ahead is
    refused (`run_id_taken`) while the run that holds the id trains on."""
    run_id, nonce = lease
    return f"{OWNER_SETTING}{run_id}:{nonce.hex()}"


def lock_state(folder: Path):  # type: ignore[no-untyped-def]
    """Hold `folder`'s run-state lock (an exclusive flock, released by the kernel when the process dies, so a
    killed run resumes) while this process owns the run: two processes of one config would otherwise resume
    one state under one lease and both train on its write-ahead."""
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    handle = open(folder / LOCK_FILE, "a+b")
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        handle.close()
        raise RejectedError(Code.RUN_ID_TAKEN, f"another process holds this run's state ({folder / LOCK_FILE}): a run "
                                               "has one owner; wait for it to end, or give this run another "
                                               "training.output and training.run_id") from e
    return handle


class Replan(Exception):
    """A contribution the pending plan charges withdrew before the plan's spend was written."""


def write_ahead(ledger: Ledger, pending: dict, lease: tuple[str, bytes], now: Callable[[], int],
                log: Callable[[str], None], *, consent: Collection[str] | None = None) -> bool:
    """Make sure this run's spend for the pending ledger epoch is in the ledger before its steps run
    (docs/design.md §5). True when it is: written now, or written by this same run (its id *and* its lease nonce)
    before a kill (a contribution withdrawn since is then simply not drawn). False when another run holds the
    epoch (its write-ahead charged its own steps, not ours): that epoch is then closed, if it is still open,
    and the caller plans the next one. `Replan` when the plan, not yet written, charges a contribution that
    has withdrawn since. Another run under this run's id (another nonce) is refused (`run_id_taken`). Any
    spend that is not this run's never lets this run's steps go uncharged. `consent`: as `Ledger.record_spend`'s
    (an unconfirmed run is refused, `charged_before`, where another run charged its contributions meanwhile)."""
    epoch = pending["epoch"]
    run_id, nonce = lease
    book, _, withdrawn = ledger.spend_state()  # from the verified entries, never the index columns (its epoch too)
    if run_id in book.finished:
        raise RejectedError(Code.RUN_ID_TAKEN, f"run {run_id!r} already recorded its run entry: its lease is spent; "
                                               "nothing more trains under it")
    holder = book.holder(epoch)
    if holder is None and book.ledger_epoch == epoch:
        if any(record[0] in withdrawn for record in pending["spend"]):
            raise Replan  # not written yet: its plan counted a contribution that has since withdrawn
        try:
            ledger.record_spend(epoch, pending["q_u"], pending["spend"], run_id=run_id, run_nonce=nonce,
                                epoch_steps=pending["steps"], noise_groups=pending["noise_groups"], now=now(),
                                consent=consent, privatizer=pending.get("privatizer"))
            return True
        except GovtrainError as e:  # a concurrent run got the epoch first, or closed it
            if e.code in (Code.ALREADY_WITHDRAWN, Code.REDACTED):
                raise Replan from e  # withdrawn or retired by retention since the check: plan the epoch again
            book = ledger.spend_book()
            holder = book.holder(epoch)
            if e.code is not Code.EPOCH_HELD and book.ledger_epoch == epoch:
                raise
    if holder == lease:
        return True
    if holder is not None and holder[0] == run_id:
        raise RejectedError(Code.RUN_ID_TAKEN, f"ledger epoch {epoch} is held by another run with this run's id "
                                               f"{run_id!r} (another lease): two runs may not share an id; nothing "
                                               "of this run was trained or charged; give it another training.run_id")
    log(f"ledger epoch {epoch} is held by {holder[0] if holder else 'a closed epoch'}: planning the next epoch")
    ledger.close_epoch(now=now(), epoch=epoch)
    return False


def trial_of_recorded_tune(ledger: Ledger, run_id: str) -> str | None:
    from govtrain.ledger.tuning import TRIAL_RUN_ID

    named = TRIAL_RUN_ID.fullmatch(run_id)
    return named.group(1) if named is not None and named.group(1) in ledger.tune_book().tunes else None


def written_plan(ledger: Ledger, epoch: int, lease: tuple[str, bytes]) -> dict:
    """What the ledger's spend for `epoch` under `lease` charged, as the fields of a pending plan: the epoch is
    trained as written, whatever plan the run state holds (a run state older than the ledger's record of its
    lease, e.g. a copied folder or a restored backup, would otherwise train the held epoch under a plan of its
    own: other contributions, other noise)."""
    from govtrain.ledger.spend_rules import privatizer_of
    from govtrain.ledger.verified import verified_entries

    spends, classes = [], {}
    entries = verified_entries(ledger.store, policy=ledger.policy)  # every row, its kind its body's, as signed
    for item in entries:
        if item.kind == "admit":
            admit = item.entry if item.entry is not None else entries.redacted.admits[item.seq]
            classes[admit["contribution_id"]] = admit["data_class"]
        elif item.kind == "spend" and item.entry is not None and item.entry["epoch"] == epoch \
                and (item.entry["run_id"], item.entry["run_nonce"]) == lease:
            spends.append(item.entry)
    eps: dict[str, int] = {}
    for entry in spends:
        data_class = classes.get(entry["contribution_id"], "")
        eps[data_class] = max(eps.get(data_class, 0), entry["eps_u"])
    if not spends:  # a process that reads another store than the one the spend was written to (a copy)
        raise ConfigError(Code.RANK_MISMATCH, f"this ledger holds no spend for epoch {epoch} under run {lease[0]!r}'s "
                                              "lease: this process reads another ledger than the one that run wrote "
                                              "to; give every rank the same ledger URL")
    first = spends[0]
    return {"q_u": first["sampling_rate_u"], "epoch_steps": first["epoch_steps"],
            "allowed": {e["contribution_id"]: e["steps"] for e in spends},
            "retiring": sorted(e["contribution_id"] for e in spends if e["steps"] < e["epoch_steps"]),
            "spend": sorted((e["contribution_id"], e["steps"], e["noise_multiplier_u"], e["eps_u"]) for e in spends),
            "noise_groups": first["noise_groups"],
            "group_std": {tuple(group["classes"]): group["s_pu"] / units.PICO for group in first["noise_groups"]},
            "eps": eps, "privatizer": privatizer_of(first)}


def claim(ledger: Ledger, lease: tuple[str, bytes]) -> str:
    """Record this process as the run's one owner in the ledger store (outside the signed tree: it orders
    processes, it proves nothing) and return its token. The lock on the run state keeps two processes off one
    folder; this keeps two copies of one run state (a copied output folder, a crafted state file: the lease
    nonce is public) from both training on its write-ahead. The last process to open the run owns it: one that
    resumes a copy takes the run over, and the other stops at its next step (`check_owner`) as a kill would
    stop it."""
    token = os.urandom(16).hex()
    ledger.store.set_setting(owner_setting(lease), token)
    return token


def check_owner(ledger: Ledger, lease: tuple[str, bytes], token: str | None) -> None:
    run_id = lease[0]
    if ledger.store.setting(owner_setting(lease)) != token:
        raise RejectedError(Code.RUN_ID_TAKEN, f"run {run_id!r} was opened by another process since this one opened "
                                               "it (a copy of its run state resumed elsewhere): this process stops, its "
                                               "steps since the last checkpoint dropped as a kill drops them; one "
                                               "process trains a run")
