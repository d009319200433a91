"""`govtrain train`: governed DP-LoRA on admitted contributions only (docs/design.md §5-7).

`train()` is the front door: the loop of the library API (`governed.GovernedRun`, which drives a `Run`,
`run.py`, through its phases) with a progress bar.
`prepare` refuses what it must before any spend; then per ledger epoch the noise schedule is fixed from
public metadata (s_g, sigma_eff, retirement) in `plan_epoch`, the epoch's spend is written ahead to the
ledger with its signed checkpoint in `write_ahead`, and only then do its steps run. Each `step`
Poisson-samples the eligible examples (admitted, not withdrawn as of this step, not retired), privatizes
the gradient through the routing layer and steps the mechanism's update (`mechanisms/update.py`: the
run's optimizer for dpsgd; PRISM's retraction or DP-Muon's orthogonalized momentum for the matrices they
own). At the end `finish` saves the peft adapter and a `run` entry records the mechanism, config, base
model and adapter hashes, device and precision. When no contribution is eligible any more the run stops
with exit 5 (`BudgetExhausted`), after saving what it has.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable, Collection

from govtrain.errors import Code
from govtrain.train.config import RunConfig
from govtrain.train.model import check_weight_decay, resolve_device, wrap_lora  # noqa: F401 (their old home)
from govtrain.train import progress as _progress
from govtrain.train.progress import ProgressLines, progress_text, step_details
from govtrain.release.tree import tree_sha256  # noqa: F401
from govtrain.train.run import LOG, STATE_FILE, BudgetExhausted, Run, RunResult  # noqa: F401

__all__ = ["train", "progress_text", "Run", "RunResult", "BudgetExhausted", "STATE_FILE"]  # progress_text: progress.py


def _above_the_bar(log: LOG) -> LOG:
    """`log`, with each line written above the progress bar instead of through it."""
    from tqdm import tqdm

    def write(line: str) -> None:
        with tqdm.external_write_mode(file=sys.stderr):
            log(line)

    return write


def train(config: RunConfig, ledger_url: str, *, key: str | None = None, insecure_seed: int | None = None,
          log: LOG = print, now: Callable[[], int] = lambda: int(time.time()), checkpoint_every: int = 10,
          interrupt_after_steps: int | None = None, progress: bool = False,
          observe: Callable[[int, list[str]], None] | None = None, confirm: bool = False,
          check: bool = False, clock: Callable[[], float] | None = None, siblings: Collection[str] = ()) -> RunResult:
    """Run (or resume) the training `config` describes against the ledger at `ledger_url`.

    The run state (trainable weights, optimizer, the epoch in progress and its plan) is saved to
    `<output>/run-state.safetensors` at each epoch's start and end and every `checkpoint_every` steps; a
    later call with the same config resumes from it. Steps lost to a kill are re-run inside the
    epoch whose spend already covers them, so nothing is under-counted; the lost steps' results
    were never saved. `interrupt_after_steps` is a test hook that simulates a kill; `observe(step, ids)`
    sees the contributions drawn at each step (for tests and audits of the sampler). `progress` shows a
    progress bar (`progress_text`) on stderr when it is a terminal, and otherwise writes a progress line
    through `log` at least every 30 s of steps (`ProgressLines`, timed by `clock`).

    The loop's first step is the rehearsal (`rehearsal.py`), before any spend. `confirm` consents to charging
    contributions other runs charged (`--yes`; `siblings`, the runs whose charges need no consent besides this
    one's: a search's other trials); `check` stops after the rehearsal and logs the plan, writing
    nothing (`--check`): the result then holds no step, and `result.plan` what the run would charge.
    """
    from tqdm import tqdm

    from govtrain.train.governed import GovernedRun

    clock = clock or _progress.CLOCK
    if int(os.environ.get("RANK", "0") or 0) != 0:  # one rank of several: the lead logs and shows progress
        log, progress = (lambda line: None), False
    show = progress and sys.stderr.isatty()
    bar = tqdm(total=config.file.training.steps, disable=not show, dynamic_ncols=True, file=sys.stderr,
               bar_format="|{bar:20}| {desc}")
    pace = {"started": clock(), "steps": 0}
    lines: ProgressLines | None = None

    def stepped(step: int, loss: float) -> None:
        pace["steps"] += 1
        if show:
            seconds = (clock() - pace["started"]) / pace["steps"]
            bar.set_description_str(progress_text(step, run.total_steps, seconds, run.epsilons(), loss,
                                                  run.nonfinite), refresh=False)
        elif lines is not None:
            lines.update(step, lambda: step_details(run.epsilons(), loss, run.nonfinite))
        bar.update(1)
        if interrupt_after_steps is not None and pace["steps"] >= interrupt_after_steps:
            raise KeyboardInterrupt(f"test hook: interrupted after {pace['steps']} steps")

    with bar, GovernedRun.open(config, ledger_url, key=key, insecure_seed=insecure_seed,
                               log=_above_the_bar(log) if show else log, now=now, checkpoint_every=checkpoint_every,
                               observe=observe, on_step=stepped, confirm=confirm, check=check,
                               siblings=siblings) as run:
        bar.update(run.steps)
        bar.set_description_str(progress_text(run.steps, run.total_steps, None, run.epsilons()))
        if progress and not show:
            lines = ProgressLines(log, run.total_steps, done=run.steps, clock=clock)
        for batch in run.batches():  # the API's loop, as a user's own code would write it
            output = run.model(**batch.inputs)
            run.step(run.per_example_loss(output, batch))
        if lines is not None and not check:
            lines.finish(lambda: step_details(run.epsilons()))
        result = run.save()  # a check saves and records nothing
        if check:
            result.plan = run.plan
    if result.exhausted:
        raise BudgetExhausted(Code.BUDGET_EXCEEDED, f"no contribution is eligible after {result.steps} steps: "
                                                    "every one is withdrawn or has spent its budget (adapter saved)")
    return result
