"""A ledger epoch of a run (`train/run.py`): plan, write ahead, close.

`plan` fixes the next epoch's noise schedule from what the ledger says then (other runs' spend, withdrawals,
retirements) and saves it to the run state before any of its spend is written; `write_ahead` puts the run's spend
for it in the ledger (or finds it there, written by this run before a kill) and sets the epoch's sampling rate,
steps per contribution and noise; `close` closes the ledger epoch and records each class's epsilon. `projection` is
what the run's remaining epochs would charge, from the same reading of the ledger. Each function takes the `Run`
whose epoch it is: the run decides which process does it (the lead), and the others take the lead's outcome.
"""

from __future__ import annotations

from govtrain import units
from govtrain.errors import Code, ConfigError
from govtrain.ledger.spend_rules import noise_groups_record
from govtrain.train.lease import Replan, write_ahead as write_spend, written_plan
from govtrain.train.preflight import Plan, project


def plan(run) -> bool:
    if run.pending is not None:
        raise RuntimeError("plan_epoch() with an epoch pending: its written-ahead plan would be replaced")
    if run.check:
        raise RuntimeError("a check stops before the first epoch is planned: it writes nothing")
    from govtrain.resolver.plan import corpus_of

    corpus = corpus_of(run.ledger)  # one verified pass: the corpus and the epoch
    cohorts, q_u, expected_batch = run._corpus_now(corpus)
    if not any(c.eligible for c in cohorts):
        run.result.exhausted = True
        return False
    epoch = corpus.epoch
    first = run.result.steps
    steps = min(run.epoch_steps, run.total - first)
    run.scheduler.sampling_rate_u = q_u
    plan = run.scheduler.plan_epoch(cohorts, epoch, first, steps)
    pending = {"epoch": epoch, "first_step": first, "steps": steps, "q_u": q_u, "expected_batch": expected_batch,
               "allowed": {m: s.steps for s in plan.spends for m in s.cohort.members},
               "group_std": {tuple(sorted(g)): plan.group_std(g) for g in plan.group_noise_pu},
               "noise_groups": noise_groups_record(plan.group_noise_pu),
               "spend": plan.spend_records(), "eps": {s.cohort.data_class: 0 for s in plan.spends},
               "retiring": sorted(m for c in cohorts if c.retired_at is not None for m in c.members),
               "privatizer": run.privatizer.record()}
    for spend in plan.spends:
        pending["eps"][spend.cohort.data_class] = max(pending["eps"][spend.cohort.data_class], spend.eps_u)
    run.pending = pending
    run._save()
    return True


def write_ahead(run) -> bool:
    if run.pending is None:
        raise RuntimeError("write_ahead() with no epoch planned: call plan_epoch() first")
    run._check_owner()
    pending, run._written = run.pending, False
    if not pending["spend"] and any(pending["allowed"].values()):  # `_check_plan`: never drawn uncharged
        raise RuntimeError("a plan that allows steps without spend")
    lease = (run.run_id, run.run_nonce)
    # an epoch the ledger holds under this lease is trained as it charged it, whatever plan the state holds
    held = bool(pending["spend"]) or run.ledger.spend_book().holder(pending["epoch"]) == lease
    try:
        if pending["spend"] and not write_spend(run.ledger, pending, (run.run_id, run.run_nonce), run.now,
                                                run.log, consent=None if run.confirmed else run.siblings):
            run.pending = None
            run._save()
            return False
    except ConfigError as e:
        if e.code is Code.CHARGED_BEFORE:  # unconfirmed, and another run charged its contributions meanwhile
            run._drop_plan()
        raise
    except Replan:
        # Its sigma*C set the plan's noise, and the ledger justifies s_g only by the contributions the spend
        # charges (spend rule 7): plan the epoch again without it, rather than drop it from the write-ahead.
        run.log(f"a contribution planned for ledger epoch {pending['epoch']} withdrew before its spend was "
                 "written: planning the epoch again")
        run.pending = None
        run._save()
        return False
    if held:  # train the epoch exactly as the ledger charged it
        written = written_plan(run.ledger, pending["epoch"], lease)
        if written.pop("privatizer") != run.privatizer.record():  # its charge is that privatizer's
            raise ConfigError(Code.PRIVATIZER_INVALID, f"ledger epoch {pending['epoch']} was written ahead under "
                                                       "this run's lease with another privatizer than RUN.toml "
                                                       "[noise] names: restore the run's config to resume it")
        steps = min(written.pop("epoch_steps"), run.total - pending["first_step"])
        if (written["spend"], written["q_u"], steps) != (pending["spend"], pending["q_u"], pending["steps"]):
            run.log(f"ledger epoch {pending['epoch']} was written ahead under this run's lease by an earlier "
                     "state of it: training the epoch as written")
        pending.update(written, steps=steps)
        run._save()
    run._retired_here |= set(pending.get("retiring", ()))  # a plan dropped before its write retires nobody
    run.sampler.sampling_rate = pending["q_u"] / units.MICRO
    run._epoch_written()
    run._charged_rates = run.ledger.spend_book().rates.get(pending["epoch"]) if held else None
    return True


def written(run) -> None:
    import numpy as np

    pending = run.pending
    run._allowed = np.array([pending["allowed"].get(c, 0) for c in run.ids], dtype=np.int64)
    run._group_std = {frozenset(k): v for k, v in pending["group_std"].items()}
    run._written = True


def take_written(run) -> None:
    """(A follower.) The lead's written-ahead epoch, once this rank has read its spend in the ledger itself: no
    rank steps on a spend the store does not hold."""
    pending = run.pending
    if pending["spend"]:
        written = written_plan(run.ledger, pending["epoch"], (run.run_id, run.run_nonce))
        written.pop("epoch_steps")
        if written.pop("privatizer") != pending["privatizer"] or \
                (written["spend"], written["q_u"]) != (pending["spend"], pending["q_u"]):
            raise ConfigError(Code.RANK_MISMATCH, f"rank {run.world.rank} reads another spend for ledger epoch "
                                                  f"{pending['epoch']} than the lead wrote: start every rank "
                                                  "against the same ledger")
    run._epoch_written()


def drop_plan(run) -> None:
    """Forget the pending plan, not written: a run that never wrote spend leaves no run state (its folder is
    as a refusal at open leaves it), one that did keeps its state without the plan."""
    run.pending = None
    if run.result.steps == 0 and not run.ledger.spend_book().used(run.run_id):
        run.state_path.unlink(missing_ok=True)
    else:
        run._save()


def close(run) -> None:
    """Close the ledger epoch (unless another run already did), record each class's epsilon and save."""
    epoch, steps = run.pending["epoch"], run.pending["steps"]
    run.world.from_lead(lambda: run.ledger.close_epoch(now=run.now(), epoch=epoch))
    result = run.result
    result.epochs.append(epoch)
    for name, eps in run.epsilons().items():
        result.eps_by_class.setdefault(name, []).append(eps)
    run.pending, run._written = None, False
    run._save()
    seen = [x for x in result.losses[-steps:] if x == x]  # empty batches have no loss
    run.log(f"epoch {epoch}: steps {result.steps}/{run.total}, "
             f"loss {sum(seen) / len(seen) if seen else float('nan'):.4f}, "
             + ", ".join(f"{n} ε {v[-1]:.3f}" for n, v in sorted(result.eps_by_class.items())))


def epsilons(run) -> dict[str, float]:
    """Each policy class's epsilon as charged so far: its contributions' largest cumulative epsilon once
    the pending epoch's written-ahead spend is counted, else as the last closed epoch left it."""
    planned = run.pending["eps"] if run.pending is not None else {}
    closed = run.result.eps_by_class
    return {name: planned.get(name, 0) / units.MICRO or max(closed.get(name, [])[-1:], default=0.0)
            for name in run.policy.classes}


def corpus_now(run, corpus):
    """(cohorts, q_u, expected batch) from what the ledger says now (`corpus`, `resolver.plan.Corpus`: its
    verified entries): other runs may have charged these contributions, and some may have withdrawn or
    retired, since this run started."""
    from govtrain.resolver.plan import sampling_rate_for
    from govtrain.resolver.schedule import cohorts_of

    recorded, withdrawn_now = corpus.admitted, corpus.withdrawn
    live = sorted(c for c in run.present if c not in withdrawn_now and c in recorded)
    q, batch = sampling_rate_for(run.policy, run.config.file.training.expected_batch_size,
                                 sum(run.policy.sampling_units(recorded[c].records) for c in live),
                                 option="training.expected_batch_size", code=Code.RUN_CONFIG_INVALID)
    return cohorts_of([recorded[c].member for c in live],
                      {c: (tuple(recorded[c].history), recorded[c].eps_u) for c in live},
                      [c for c in live if recorded[c].retired or c in run._retired_here]), q, batch


def projection(run) -> Plan:
    """What the run's remaining steps would charge, projected from what the ledger says now."""
    from govtrain.resolver.plan import read_state

    state = read_state(run.ledger)  # one verified pass: the corpus, the epoch and who holds it
    cohorts, q_u, expected_batch = run._corpus_now(state.corpus)
    first, epoch = run.result.steps, state.book.ledger_epoch
    if run.pending is not None:  # resumed inside an epoch planned (or written) before: from the next one
        first, epoch = run.pending["first_step"] + run.pending["steps"], max(epoch, run.pending["epoch"] + 1)
    elif state.book.holder(epoch) is not None:  # another run holds this one
        epoch += 1
    return project(run_id=run.run_id, cohorts=cohorts, classes=run.classes, scheduler=run.scheduler, q_u=q_u,
                   expected_batch=expected_batch, first_epoch=epoch, steps=max(run.total - first, 0),
                   total_steps=run.total, policy=run.policy, resumed=run.resumed,
                   charged_before=run.charged_before)
