"""`govtrain tune`: a hyperparameter search whose every trial is a governed, charged run (issue 14).

    grid = load_grid("grid.toml")                       # [grid] dotted RUN.toml keys -> lists; [select]
    trials = plan_trials(config, grid, tune_id)         # every trial's config built and validated first
    result = tune(config, grid, ledger_url, tune_id=…)  # train each, score each, record the `tune` entry

Each trial k is `train()` on its own config (the base RUN.toml with one grid point, run id
`<tune_id>-trial-<k>`, output `<training.output>/trial-<k>`), so its spend is written ahead like any run's.
Every trial's adapter is then scored with `govtrain eval`'s code on the selection file, which must hold no
admitted data (neither an admitted file nor any row of one, by input digest and by the base model's tokens:
`govtrain.data.rows`; for a causal LM, nor a row that starts with an admitted row or is an admitted row's first
8 tokens or more, which score as that row: `PrefixIndex`): selecting on it is then post-processing. The `tune`
entry binds the trials and states the epsilon their spend entries charged (`govtrain/ledger/tuning.py`); the
verifier recomputes it.
A search stopped by a kill is resumed by running it again with the same id: finished trials (those with a
run entry) are kept, an interrupted one resumes from its run state.

Consent (issue 21): the trials charge the same contributions one after the other by design, and starting the
search consents to that; contributions that runs outside this search charged before it need `confirm`
(`--yes`), asked before the first trial (`charged_before`, with each class's epsilon so far) and again at each
trial's open and write-ahead, so that a run outside the search charging meanwhile is not charged over unasked.
Each trial's own loop is rehearsed before its first spend, as any run's is.

The output folder is the search's: `training.output` holds only its trials' `trial-<k>.json` and `trial-<k>/`
(`check_tune_output`), each config file this search's own (a resumed search); another run's adapter there, or
another search's trials, is refused (`output_taken`).

The grid and its trials' configs are `tune_grid.py`'s; the selection file and its check that no row is admitted
`tune_selection.py`'s. This module runs the search: trains, scores, selects and records.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from govtrain.errors import Code, ConfigError
from govtrain.train.config import RunConfig
from govtrain.train.resume import TEMPORARY, write_whole
from govtrain.train.tune_grid import Grid, Trial, load_grid, new_tune_id, plan_trials, selection_metric, shown
from govtrain.train.tune_selection import check_selection, read_selection

TRIAL_CONFIG = "trial-{k}.json"  # beside the trial folders: the derived config each trial's hash is over


@dataclass(kw_only=True)
class TrialOutcome:
    trial: Trial
    adapter_sha256: bytes
    score: float | None = None
    eps_u: int = 0  # the largest cumulative eps_u this trial's spend recorded


@dataclass(kw_only=True)
class TuneResult:
    tune_id: str
    metric: str
    outcomes: list[TrialOutcome] = field(default_factory=list)
    selected: TrialOutcome | None = None
    seq: int | None = None
    eps_u: int = 0
    eps_by_class: dict[str, int] = field(default_factory=dict)
    exhausted: bool = False

    def as_json(self) -> dict:
        return {
            "tune_id": self.tune_id, "accounting": "composition", "metric": self.metric, "entry": self.seq,
            "trials": [{"trial": o.trial.index, "run_id": o.trial.run_id, "values": o.trial.values,
                        "score": o.score, "eps": o.eps_u / 1e6, "adapter": str(o.trial.config.output_dir),
                        "adapter_sha256": o.adapter_sha256.hex()} for o in self.outcomes],
            "selected": None if self.selected is None else {
                "trial": self.selected.trial.index, "run_id": self.selected.trial.run_id,
                "adapter": str(self.selected.trial.config.output_dir),
                "adapter_sha256": self.selected.adapter_sha256.hex()},
            "eps": self.eps_u / 1e6, "eps_by_class": {name: eps / 1e6 for name, eps in self.eps_by_class.items()},
            "exhausted": self.exhausted,
        }


def tune(config: RunConfig, config_path: str | Path, grid: Grid, ledger_url: str, *, tune_id: str,
         key: str | None = None, insecure_seed: int | None = None, log: Callable[[str], None] = print,
         now: Callable[[], int] = lambda: int(time.time()), train_options: dict | None = None,
         confirm: bool = False) -> TuneResult:
    """Run (or resume) the search: validate everything, train each trial not yet finished, score every trial,
    select the best and record the `tune` entry. Where the budgets run out during a trial, the tune entry is
    still recorded for the trials that wrote spend, with no selection, and `BudgetExhausted` is raised.
    Contributions that runs outside this search charged need `confirm` (module docstring)."""
    from govtrain.ledger.ledger import Ledger
    from govtrain.tasks import task_for
    from govtrain.train.loop import STATE_FILE, BudgetExhausted, train
    from govtrain.release.artifact import adapter_sha256

    # Everything that can be refused is refused here, before any trial writes spend.
    trials = plan_trials(config, config_path, grid, tune_id)
    metric = selection_metric(config, grid)
    task = task_for(config.file)
    selection = read_selection(grid.selection, task, (config.file.data.label_column,))
    with Ledger.open(ledger_url, key=key) as ledger:
        check_selection(ledger, config, task, selection)
        book = ledger.tune_book()
        before = _charged_outside(ledger, {trial.run_id for trial in trials})
    if tune_id in book.tunes:
        raise ConfigError(Code.TUNE_EXISTS, f"tune {tune_id!r} is already recorded by entry {book.tunes[tune_id]}; "
                                            "a search is recorded once: give a new one another --id")
    if before and not confirm:
        so_far = ", ".join(f"{name} ε {eps / 1e6:.4f}" for name, (_, eps) in sorted(before.items()))
        raise ConfigError(Code.CHARGED_BEFORE, f"{sum(n for n, _ in before.values())} admitted contribution(s) were "
                                               f"already charged by runs outside this search ({so_far} so far), and "
                                               f"each of its {len(trials)} trials charges them again: pass --yes "
                                               "(confirm=True) to charge them, or search on a scratch ledger "
                                               "(make scratch)")
    check_tune_output(config.output_dir, trials)
    config.output_dir.mkdir(parents=True, exist_ok=True)
    result = TuneResult(tune_id=tune_id, metric=metric)
    log(f"{tune_id}: {len(trials)} trials on {grid.selection.name} by {metric}; each trial's spend is charged")
    stopped: BudgetExhausted | None = None
    stopped_at = 0
    for trial in trials:
        _write_trial_config(config.output_dir / TRIAL_CONFIG.format(k=trial.index), trial.document)
        recorded = book.runs.get(trial.run_id)
        if recorded and recorded[-1][0] != trial.config.sha256:
            raise ConfigError(Code.GRID_INVALID, f"run {trial.run_id!r} is recorded with another config than "
                                                 f"trial {trial.index} of this grid; resume with the same files")
        if recorded and not (trial.config.output_dir / STATE_FILE).exists():
            # finished before a kill: keep it, if its adapter is as recorded (one recorded and stopped before its run
            # state was removed is finished by train() below, which checks its adapter the same way)
            adapter = recorded[-1][1]
            if adapter is None or adapter_sha256(trial.config.output_dir) != adapter:
                raise ConfigError(Code.BAD_ARGUMENT, f"{trial.config.output_dir} is not the adapter run "
                                                     f"{trial.run_id!r} recorded")
            log(f"trial {trial.index} ({shown(trial.values)}): finished before, kept")
        else:
            log(f"trial {trial.index} ({shown(trial.values)})")
            seed = None if insecure_seed is None else insecure_seed + trial.index
            try:
                # the trials charge the contributions one after the other by design (siblings); runs outside
                # the search need `confirm`, asked again at each trial's open and write-ahead (one may charge
                # between the check above and a trial's spend)
                adapter = train(trial.config, ledger_url, key=key, insecure_seed=seed, log=log, now=now,
                                **{"confirm": confirm, **(train_options or {})},
                                siblings=[t.run_id for t in trials]).adapter_sha256
            except BudgetExhausted as e:
                stopped, stopped_at = e, trial.index
        with Ledger.open(ledger_url, key=key) as ledger:
            book = ledger.tune_book()
        if stopped is not None:
            if book.charged.get(trial.run_id):
                result.outcomes.append(TrialOutcome(trial=trial, adapter_sha256=book.runs[trial.run_id][-1][1],
                                                    eps_u=book.run_eps.get(trial.run_id, 0)))
            break
        assert adapter is not None
        result.outcomes.append(TrialOutcome(trial=trial, adapter_sha256=adapter,
                                            eps_u=book.run_eps.get(trial.run_id, 0)))
    if stopped is None:
        for outcome in result.outcomes:
            outcome.score = _score(outcome.trial.config, task, selection.examples, metric,
                                   log if (train_options or {}).get("progress") else None)
            log(f"trial {outcome.trial.index}: {metric} {outcome.score:.4f}")
        best = (max if metric == "accuracy" else min)(outcome.score for outcome in result.outcomes)
        result.selected = next(o for o in result.outcomes if o.score == best)  # ties: the earliest trial
    result.exhausted = stopped is not None
    if result.outcomes:
        with Ledger.open(ledger_url, key=key) as ledger:
            stored, fields = ledger.record_tune(
                tune_id=tune_id, config_sha256=config.sha256, grid_sha256=grid.sha256,
                trials=[(o.trial.run_id, o.trial.config.sha256) for o in result.outcomes],
                selection_sha256=selection.sha256, metric=metric,
                selected_run_id=None if result.selected is None else result.selected.trial.run_id, now=now())
        result.seq, result.eps_u = stored.seq, fields["eps_u"]
        result.eps_by_class = {item["data_class"]: item["eps_u"] for item in fields["eps_by_class"]}
    if stopped is not None:
        recorded = (f"tune entry {result.seq} charges the {len(result.outcomes)} trial(s) that wrote spend, total "
                    f"ε {result.eps_u / 1e6:.6f}" if result.outcomes
                    else "no trial wrote spend; nothing recorded")
        raise BudgetExhausted(stopped.code, f"tune {tune_id!r} stopped at trial {stopped_at}: "
                                            f"{stopped.detail}; {recorded}; no trial selected")
    return result


def _write_trial_config(path: Path, document: bytes) -> None:
    """Write a trial's config whole or not at all (a temporary file renamed over it): a kill mid-write must not leave
    a part of it, which `check_tune_output` would refuse as another search's."""
    write_whole(path, lambda handle: handle.write(document))  # never through a link planted at its temporary


def check_tune_output(folder: Path, trials: list[Trial]) -> None:
    """Refuse (`output_taken`) a search's `training.output` unless it is missing or holds only its trials' files:
    `trial-<k>.json` with this search's trial config (a resumed search), and `trial-<k>/` beside it (each trial
    checks its own folder as a run does). Another run's adapter there would no longer hash to what its run entry
    records, and another search's trials would be mixed with this one's."""
    from govtrain.train.lease import LOCK_FILE

    if not folder.exists():
        return
    if not folder.is_dir():
        raise ConfigError(Code.OUTPUT_TAKEN, f"training.output {folder} is a file, not a folder: give the search a "
                                             "folder of its own")
    configs = {TRIAL_CONFIG.format(k=t.index): t.document for t in trials}
    ours = {name for name, document in configs.items()
            if (folder / name).is_file() and (folder / name).read_bytes() == document}
    foreign = []
    for path in sorted(folder.iterdir()):
        name = path.name
        if name == LOCK_FILE or name in ours:  # the lock a refused run leaves; this search's own trial config
            continue
        if name.endswith(TEMPORARY) and name.removesuffix(TEMPORARY) in configs \
                and (path.is_symlink() or not path.is_dir()):  # a trial config a kill cut short (a folder: not ours)
            continue
        if path.is_dir() and name.startswith("trial-") and f"{name}.json" in ours:
            continue
        foreign.append(name + ("/" if path.is_dir() else ""))
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise ConfigError(Code.OUTPUT_TAKEN, f"training.output {folder} holds {len(foreign)} entr"
                                             f"{'y' if len(foreign) == 1 else 'ies'} this search did not write "
                                             f"({shown}): a search writes its trials into a folder of its own "
                                             "(another run's adapter, another search's trials); give it another "
                                             "training.output, or resume a search with its own --id and files")


def _charged_outside(ledger, trials: set[str]) -> dict[str, tuple[int, int]]:  # type: ignore[no-untyped-def]
    """Per class, (how many admitted, not withdrawn contributions runs other than `trials` charged, their largest
    ε so far in micro-units)."""
    from govtrain.resolver.plan import read_corpus
    from govtrain.train.preflight import charged_by

    admitted, withdrawn, _ = read_corpus(ledger)
    runs = charged_by(ledger)
    found: dict[str, tuple[int, int]] = {}
    for cid, record in admitted.items():
        if cid not in withdrawn and runs.get(cid, set()) - trials:
            count, eps = found.get(record.member.data_class, (0, 0))
            found[record.member.data_class] = (count + 1, max(eps, record.eps_u))
    return found


def _score(config: RunConfig, task, examples, metric: str,  # type: ignore[no-untyped-def]
           log: Callable[[str], None] | None = None) -> float:
    """The trial's `metric` on the selection rows; with `log`, where stderr is no terminal, progress lines."""
    import sys

    from govtrain.train.evaluate import evaluate, load_trained
    from govtrain.train.model import resolve_device
    from govtrain.train.progress import ProgressLines

    model, tokenizer = load_trained(config, config.output_dir)
    model.to(resolve_device(config.file.training.device))
    lines = ProgressLines(log, len(examples), what="example") if log is not None and not sys.stderr.isatty() else None
    return float(evaluate(model, tokenizer, task, examples, config.file.model.max_length,
                          on_batch=None if lines is None else lines.update)[metric])


__all__ = ["Grid", "Trial", "TuneResult", "load_grid", "plan_trials", "tune", "new_tune_id"]
