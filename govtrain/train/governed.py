"""`GovernedRun`: governed training from your own code. `govtrain train` and the Hugging Face integration
(`govtrain.integrations.hf`) drive this same object, so every path samples, privatizes and charges alike.

    with GovernedRun.open("run.toml", "sqlite:///ledger.db", key="keys/ledger.key") as run:
        for batch in run.batches():              # Poisson over the eligible data; withdrawals take effect
            out = run.model(**batch.inputs)
            run.step(run.per_example_loss(out, batch))   # clip; at a logical step's end, noise and update
        result = run.save()                      # adapter + run entry

The run owns sampling. `batches()` plans each ledger epoch, writes its spend ahead, then hands out every
logical Poisson batch in physical chunks (`GovernedBatch`, at most `training.physical_batch` examples);
`step(losses)` adds a chunk's clipped per-sample gradients and, after the step's last chunk, draws the
noise once and moves the parameters. The run keeps its own copy of each draw and encodes it with its own copy
of the tokenizer: what a batch says about its draw is for reading, and a step left mid-way is completed as
drawn when `batches()` is iterated again. A forward of `run.model` on a governed batch runs under the router's
capture and the run's precision (forward hooks on the model: its type and state_dict keys are unchanged).
Anything that would train on batches the sampler did not draw is refused (`ungoverned_batch`, `guard.py`): a
loader or sampler handed to `batches()`, a forward with gradients enabled outside a governed batch (of
`run.model` or of any module in it holding a trainable parameter), a governed forward that is not given
exactly the batch's input tensors (each under its own keyword), a batch whose tensors changed after the draw, a
model whose hooks, methods or modules changed after the run opened, a second forward of one batch, a loss for a
batch that is not the one waiting. The accountant's q holds only if govtrain drew the
batch.

A step is one transaction from its draw to its update. An exception in between (a hook of yours raising in the
per-sample backward, a parameter swapped under the update) stops the run in this process, as a kill would:
`batches()`, `step()` and `save()` refuse (`step_failed`), leaving the block saves nothing, and the config
opened again resumes from the last checkpoint, drawing the same rows (the sampler is keyed). `observe` sees a
draw only once it is recorded, and `step()` takes a plain `torch.Tensor` whose sum it reads before anything is
summed. The weights move only in governed steps (`Weights`): the trainable ones as the last step left them
(compared by value), every parameter's identity and class, every frozen one's version counter, and the update's
state, groups and defaults (exact types, so no object of the loop's runs inside the update), and every
hyperparameter it reads, which must be RUN.toml's on the run's schedule (`set_schedule`, a function of the step
alone: a rate set from an evaluation or the training loss is a use of the data no spend charges), are
checked before each draw, each governed forward, each update, each Trainer checkpoint and at `save()`, and
torch's global optimizer hooks are refused (they run inside the update), and so are hooks and methods placed on the
update's own optimizer, PRISM or DP-Muon (`mechanisms/sealed.py`) and a buffer or plain module setting the forward
reads set since the last governed forward or step (`model_state.py`); all `ungoverned_update`. A module's mode must
be the first governed forward's (`ungoverned_batch`), and a governed forward's randomness is the run's
(`keyed_random`). Leaving the
block after such a change saves nothing: the run state stays its last checkpoint's.

Leaving the `with` block before the last step keeps the run's state in `<output>/run-state.safetensors`: opening
the same config again resumes it (same run id, same ledger history; spend already written is never
written again). An exception (a kill) keeps the last checkpoint, as `govtrain train` does.

Where each part lives: this module is the API the loop calls; what runs behind `batches()` and `step()` (the
hand-out, the rehearsal, a step as one transaction, the governed forward) is `governed_loop.py`; the checks that
the weights moved only in governed steps are `weights.py`; the records of a draw (`GovernedBatch` among them),
which the guard (`guard.py`) reads too, are `drawn.py`.
"""

from __future__ import annotations

import copy
import time
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Collection, Iterator, Mapping

import torch

from govtrain import units
from govtrain.errors import Code, ConfigError
from govtrain.mechanisms.hyperparameters import Schedule
from govtrain.train.config import RunConfig, run_config
from govtrain.train.drawn import NOT_YOURS, Drawn, GovernedBatch
from govtrain.train.governed_loop import GovernedLoop
from govtrain.train.preflight import Plan
from govtrain.train.run import LOG, Run, RunResult
from govtrain.train.weights import Weights, check_optimizer_hooks

if TYPE_CHECKING:
    from torch import nn

    from govtrain.data.rows import AdmittedRows
    from govtrain.ledger.ledger import Ledger

__all__ = ["GovernedBatch", "GovernedRun"]


class GovernedRun:
    """An open governed run: its ledger, its model (a peft model on its device) and its sampler."""

    def __init__(self, run: Run, ledger: "Ledger", *, on_step: Callable[[int, float], None] | None = None) -> None:
        self._run, self._ledger = run, ledger
        self._saved = self._closed = False
        check_optimizer_hooks()
        self._opened_at = run.result.steps  # the schedule is fixed before the first update in this process
        hyperparameters = run.update.hyperparameters
        # a resumed run keeps the schedule its steps were taken under: one chosen again after seeing how they went
        # (the loss, an evaluation) would be a rate set from the data, which no spend charges
        hyperparameters.schedule = self._resumed_schedule() or Schedule(total=max(run.total, 1))
        hyperparameters.apply(run.update, run.result.steps)  # RUN.toml's, whatever a run state held
        # the model and update as the last governed step left them
        self._weights = Weights(run.model, run.update, lambda: run.result.steps)
        self._release = run.export  # what save() may write: peft's files for this model, govtrain's own
        # the guard (the run owns sampling), the model's state, its own tokenizer, the rehearsal (`governed_loop.py`)
        self._loop = loop = GovernedLoop(run, self._weights, on_step)
        self._guard, self._state, self._tokenizer = loop.guard, loop.state, loop.tokenizer

    @classmethod
    def open(cls, config: RunConfig | Mapping[str, Any] | str | Path, ledger_url: str, *, key: str | Path | None = None,
             insecure_seed: int | None = None, log: LOG = print, now: Callable[[], int] = lambda: int(time.time()),
             checkpoint_every: int = 10, observe: Callable[[int, list[str]], None] | None = None,
             on_step: Callable[[int, float], None] | None = None, confirm: bool = False,
             check: bool = False, siblings: Collection[str] = ()) -> "GovernedRun":
        """Open the ledger at `ledger_url` and prepare the run `config` describes (a RUN.toml path, its
        contents as a dict, or a `RunConfig`): match the data to the admitted contributions, load the model,
        resolve the profiles and probe the router. Everything that can refuse the run does so here, before any
        spend is written; a config whose run state exists resumes it. `key` signs the ledger's entries;
        `insecure_seed` (tests only) fixes sampling and noise; `on_step(step, loss)` is called after every
        logical step, `observe(step, contribution_ids)` with every draw.

        A fresh run that would charge contributions other runs on this ledger already charged is refused
        (`charged_before`, with each class's epsilon before and after) unless `confirm`; so is an unconfirmed run's
        write-ahead of contributions another run charged after it opened (read under the ledger's write lock,
        nothing written). `siblings`: runs whose charges need no consent besides this one's (`govtrain tune`
        passes its other trials). With `check`, the run
        writes nothing: `batches()` hands out the rehearsal only, then logs the plan (`plan`) and ends; `save()`
        saves and records nothing."""
        from govtrain.distributed.world import World
        from govtrain.ledger.ledger import Ledger
        from govtrain.train.model import resolve_device

        config = run_config(config)
        # under torchrun or `govtrain train --nproc N`: this process is one rank of the run (docs/distributed.md)
        world = World.from_env(resolve_device(config.file.training.device).type)
        try:
            ledger = Ledger.open(ledger_url, key=key)  # only the lead writes with it
        except BaseException:
            world.close()
            raise
        run = None
        try:
            run = Run(config, ledger, insecure_seed=insecure_seed, log=log, now=now, checkpoint_every=checkpoint_every,
                      observe=observe, confirm=confirm, check=check, siblings=siblings, world=world)
            run.prepare()
            return cls(run, ledger, on_step=on_step)
        except BaseException:
            if run is not None:
                run.release()
            ledger.close()
            world.close()
            raise

    def __enter__(self) -> "GovernedRun":
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        run = self._run
        stopped = self._loop.broken or (None if self._saved or self._closed else
                                   self._weights.changed() or self._state.changed())
        if stopped is not None:
            run.log(f"{self.run_id} stopped ({stopped}): its state is its last checkpoint's; open the same config "
                    "again to resume from there")
        elif kind is None and not self._saved and not run.check and (run.pending is not None or run.result.steps):
            run._save()  # between logical steps: what is saved is exactly what the ledger charged for
            run.log(f"{self.run_id} paused at step {self.steps}/{self.total_steps}: open the same config again "
                    "to resume it")
        self.close()

    def close(self) -> None:
        """Remove the model's hooks and close the ledger (done by the `with` block)."""
        if self._closed:
            return
        self._closed = True
        self._guard.remove()
        self._run.router.close()
        self._run.release()
        self._ledger.close()
        self._run.world.close(settled=self._saved)

    # -- what the run holds ----------------------------------------------------------------------------

    @property
    def model(self) -> "nn.Module":
        """The peft model being trained, on its device. Call it on a governed batch's inputs."""
        return self._run.model

    @property
    def tokenizer(self) -> Any:
        """The tokenizer the model was loaded with, for your own use: the run encodes its draws with its own copy."""
        return self._run.tokenizer

    @property
    def config(self) -> RunConfig:
        return self._run.config

    @property
    def ledger(self) -> "Ledger":
        return self._ledger

    @property
    def run_id(self) -> str:
        return self._run.run_id

    @property
    def steps(self) -> int:
        """Logical steps taken so far (a resumed run counts those before the resume)."""
        return self._run.result.steps

    @property
    def total_steps(self) -> int:
        return self._run.total

    @property
    def nonfinite(self) -> int:
        """The run's units with a non-finite gradient so far: each contributed zero (docs/training.md)."""
        return self._run.result.nonfinite

    @property
    def result(self) -> RunResult:
        """A copy of the run's record (steps, losses, epochs, epsilons, adapter hash): the run's own is read
        inside each step and written at each checkpoint, so no object of the loop's may sit in it (review 8)."""
        return copy.deepcopy(self._run.result)

    @property
    def sampling_rate(self) -> float | None:
        """The q the current epoch's spend charged, which the sampler draws at (None: no epoch written)."""
        return self._run.pending["q_u"] / units.MICRO if self._run.pending is not None else None

    def set_schedule(self, kind: str, warmup_steps: int = 0) -> None:
        """Scale the learning rates RUN.toml configured by `kind` (`hyperparameters.SCHEDULES`: constant, the default,
        constant_with_warmup, linear or cosine, Hugging Face's formulas) at each governed step of the run's
        `training.steps`, after `warmup_steps` rising from 0. Only before this process's first governed update:
        the rates are then a function of the step alone, and the run writes each step's own (a scheduler of yours
        may write the same; any other value is refused, `ungoverned_update`)."""
        run = self._run
        if run.result.steps != self._opened_at:
            taken = run.result.steps - self._opened_at
            raise ConfigError(Code.UNGOVERNED_UPDATE, f"set_schedule({kind!r}) after {taken} governed update(s) in "
                                                      "this process: a schedule chosen during a run may follow what it "
                                                      "saw; set it before the first step")
        try:
            schedule = Schedule(kind=kind, warmup=warmup_steps, total=max(run.total, 1))
        except ValueError as e:
            raise ConfigError(Code.RUN_CONFIG_INVALID, f"set_schedule: {e}") from None
        resumed = self._resumed_schedule()
        if resumed is not None and resumed != schedule:
            raise ConfigError(Code.UNGOVERNED_UPDATE, f"set_schedule({kind!r}, {warmup_steps}): this run's state "
                                                      f"(at step {run.result.steps}) was saved under {resumed}, and a "
                                                      "resumed run keeps its schedule (one chosen after seeing how "
                                                      "the steps went, those a kill undid included, would follow the "
                                                      "data): set that one")
        self._check_governed("before set_schedule")
        hyperparameters = run.update.hyperparameters
        hyperparameters.schedule = schedule
        hyperparameters.apply(run.update, run.result.steps)
        self._weights.adopt_schedule()

    def _resumed_schedule(self) -> Schedule | None:
        """The schedule a resumed run's state recorded (None: a new run). Every state is saved after the schedule
        was fixed, and steps a kill undid before the first checkpoint were taken under it too."""
        run = self._run
        if run.schedule is None:
            return None
        try:
            return Schedule.of_record(run.schedule, total=max(run.total, 1))
        except ValueError as e:
            raise ConfigError(Code.RUN_STATE_INVALID, f"{run.state_path}: {e}: the run state is not one govtrain "
                                                      "wrote; restore it, or move it away and start afresh") from None

    @property
    def schedule(self) -> Schedule:
        """The learning rates' schedule (`set_schedule`)."""
        return self._run.update.hyperparameters.schedule

    def epsilons(self) -> dict[str, float]:
        """Each class's epsilon as charged so far, the epoch written ahead included."""
        return self._run.epsilons()

    @property
    def checking(self) -> bool:
        """Opened with `check=True`: the rehearsal, then the plan; nothing is spent or written."""
        return self._run.check

    @property
    def rehearsed(self) -> bool:
        """Whether the rehearsal passed in this process (the run writes spend only after it)."""
        return self._loop.rehearsed

    @property
    def plan(self) -> Plan:
        """What the run's remaining steps would charge (`preflight.Plan`: steps, q, each class's sigma_eff and
        epsilon before and after), projected from what the ledger says now."""
        return self._loop.plan()

    @cached_property
    def admitted_rows(self) -> "AdmittedRows":
        """The examples this run loaded from its admitted, not withdrawn contributions' data, each with its
        contribution, and their row digests (`govtrain.data.rows`, computed on first use): the rows an
        evaluation that chooses what is released may not score on."""
        from govtrain.data.rows import AdmittedRows

        return AdmittedRows(tuple(self._run.examples.items), tuple(self._run.examples.owner))

    # -- the loop --------------------------------------------------------------------------------------

    def batches(self, loader: object = None) -> Iterator[GovernedBatch]:
        """Every physical chunk of every remaining logical step, each planned epoch's spend written ahead
        first. Ends when the run has taken `training.steps` steps, or when no contribution is eligible any
        more (`result.exhausted`). Call `step(losses)` on each batch before asking for the next. A step is
        completed as drawn: iterated again after leaving a step mid-way, it hands out that draw's remaining
        chunks, the one handed out and not stepped first."""
        if loader is not None:
            raise ConfigError(Code.UNGOVERNED_BATCH, f"run.batches() got a {type(loader).__name__}: it draws its "
                                                     f"own batches, and {NOT_YOURS}")
        yield from self._batches(idle=False)  # type: ignore[misc]

    def _batches(self, *, idle: bool) -> Iterator[GovernedBatch | None]:
        """`batches()`; with `idle`, also None after each step this rank took with an empty share of a draw that
        other ranks had examples of, before the next draw: a Trainer (integrations/hf.py) then counts the step on
        every rank alike, and its own collectives (the logged loss) stay in step with the run's."""
        guard = self._guard
        if guard.iterating:
            raise RuntimeError("run.batches() is already being iterated")
        if self._closed:
            raise RuntimeError("the run is closed")
        yield from self._loop.hand_out(idle=idle)

    def per_example_loss(self, output: Any, batch: GovernedBatch) -> "torch.Tensor":
        """The task's loss of each example in `batch` (fp32, shape [len(batch)]), from the model's `output`."""
        self._guard.check_waiting(batch)
        return self._run.task.per_example_loss(output, batch)

    def step(self, losses: "torch.Tensor") -> float | None:
        """Add the clipped per-sample gradients of the waiting batch from its per-example `losses` (one value
        per example, each depending on its own example only). After the logical step's last chunk, noise the
        sum once, move the parameters and return the step's mean loss per example; None before that. A batch
        whose tensors changed after the draw is refused here too (`ungoverned_batch`), before anything is summed.
        What is clipped, with which norms and classes, and whether the step ends here come from the run's own
        record of the draw, never from the batch."""
        self._check_whole()
        guard = self._guard
        waiting, drawn = guard.waiting, guard.drawn
        if waiting is None:
            raise ConfigError(Code.UNGOVERNED_BATCH, f"run.step() with no batch waiting: {NOT_YOURS}")
        if not waiting.forwarded:
            raise ConfigError(Code.UNGOVERNED_BATCH, "run.step() before run.model ran on the waiting batch: its "
                                                     "losses must come from that forward")
        guard.check_unchanged(waiting)
        size = len(waiting.chunk.indices)
        if type(losses) is not torch.Tensor:  # a subclass or proxy runs its own code inside the step (F6)
            raise ValueError(f"run.step() needs a torch.Tensor of losses, not a {type(losses).__name__}: use "
                             "run.per_example_loss, or a reduction='none' loss averaged over each example's own tokens")
        if losses.shape != (size,):
            raise ValueError(f"run.step() needs one loss per example, shape ({size},); got shape "
                             f"{tuple(losses.shape)}: use run.per_example_loss, or a reduction='none' "
                             "loss averaged over each example's own tokens")
        if drawn.rehearsal:
            return self._rehearsal_step(waiting, drawn, losses)
        return self._loop.take(waiting, drawn, losses)

    def save(self) -> RunResult:
        """Save the adapter to the config's output folder and record the run entry (adapter and config hashes,
        mechanism, device, precision). The run must have taken all its steps, or run out of eligible
        contributions (`result.exhausted`)."""
        run = self._run
        if self._saved:
            raise RuntimeError("the run is already saved")
        self._check_whole()
        if run.check:
            run.log(f"{self.run_id}: checked; nothing was spent, saved or recorded")
            return self.result
        if not (run.done or run.result.exhausted):
            raise RuntimeError(f"the run has taken {run.result.steps} of {run.total} steps: iterate run.batches() to "
                               "the end, or leave the with block to keep its state and resume later")
        self._check_governed("at run.save()")
        self._guard.check_structure()  # a state_dict hook or a replaced save_pretrained writes what is saved
        self._guard.remove()  # the saved model carries no hook of the run
        kept = self._weights.trainable
        if run.sharded:  # the last governed step's weights whole, gathered by every rank before the lead writes
            from govtrain.distributed import fsdp

            kept = {name: fsdp.full(value) for name, value in kept.items()}
        result = run.finish(check=lambda output: self._release.check(output, kept))
        self._saved = True
        return result

    # -- what the loop calls behind the public methods (`governed_loop.py`) ----------------------------

    def _rehearsal_step(self, waiting: Any, drawn: Drawn, losses: "torch.Tensor") -> None:
        """A rehearsal chunk's step (`GovernedLoop.rehearsal_step`): its per-sample gradients formed, measured and
        clipped as in a real step, the sum dropped at the rehearsal's end; no noise, no update."""
        return self._loop.rehearsal_step(waiting, drawn, losses)

    def _check_whole(self) -> None:
        self._loop.check_whole()

    def _check_governed(self, when: str) -> None:
        """The weights, the update's state and the model's buffers and settings as the last governed step left
        them, and no global optimizer hook (`GovernedLoop.check_governed`): `ungoverned_update` otherwise."""
        self._loop.check_governed(when)
