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
"""

from __future__ import annotations

import collections
import contextlib
import copy
import operator
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Collection, Iterator, Mapping

import torch

from govtrain import units
from govtrain.distributed.fsdp import is_sharded
from govtrain.errors import Code, ConfigError
from govtrain.mechanisms.hyperparameters import RATE_KEYS, Schedule
from govtrain.mechanisms.sealed import Sealed
from govtrain.tasks.base import Batch
from govtrain.train.config import RunConfig, run_config
from govtrain.train.guard import NOT_YOURS, Drawn, Guard
from govtrain.train.model_state import ModelState
from govtrain.train.preflight import Plan
from govtrain.train.rehearsal import (
    Rehearsal,
    class_clips,
    full_chunk_rows,
    plan_rehearsal,
    rehearsal_seed,
    synthetic_examples,
)
from govtrain.train.run import LOG, Chunk, Run, RunResult

if TYPE_CHECKING:
    from torch import nn

    from govtrain.data.rows import AdmittedRows
    from govtrain.ledger.ledger import Ledger
    from govtrain.mechanisms.update import Update

@dataclass
class GovernedBatch(Batch):
    """One physical chunk of a logical Poisson step: the model's keyword `inputs` and the task's `targets`
    on the run's device. `step` counts logical steps over the whole run; `chunk` of `chunks` places this one
    in its step (the optimizer moves after the last). The place is read-only and only says what the run's own
    record of the draw says: nothing written into a batch changes how it is clipped or when its step ends."""

    _place: tuple[int, int, int] = field(default=(0, 0, 1), repr=False, compare=False)
    _rehearsal: bool = field(default=False, repr=False, compare=False)

    @property
    def rehearsal(self) -> bool:
        """Whether this chunk is of the rehearsal (`rehearsal.py`): synthetic rows, never a contribution's, handed
        out before the run writes any spend; stepping it moves nothing. Read-only, as the place is: the run's own
        record of the draw says which chunks are the rehearsal's."""
        return self._rehearsal

    @property
    def step(self) -> int:
        return self._place[0]

    @property
    def chunk(self) -> int:
        return self._place[1]

    @property
    def chunks(self) -> int:
        return self._place[2]

    @property
    def last(self) -> bool:
        return self.chunk == self.chunks - 1


class GovernedRun:
    """An open governed run: its ledger, its model (a peft model on its device) and its sampler."""

    def __init__(self, run: Run, ledger: "Ledger", *, on_step: Callable[[int, float], None] | None = None) -> None:
        self._run, self._ledger, self._on_step = run, ledger, on_step
        self._saved = self._closed = False
        self._broken: str | None = None  # what raised inside a step, after its draw (`_in_step`)
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
        self._guard = Guard(run.model, self._governed_forward)  # the run owns sampling
        self._state = ModelState(run.model)  # buffers, plain settings and modes the forward reads (`model_state.py`)
        self._tokenizer = copy.deepcopy(run.tokenizer)  # encodes every draw: patching run.tokenizer changes none
        self._rehearsal: Rehearsal | None = None  # built when first handed out
        self._rehearsed = False  # the rehearsal's last chunk was stepped: the run may write spend
        self._random: tuple | None = None  # torch's random state when the rehearsal was drawn, put back after it

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
        stopped = self._broken or (None if self._saved or self._closed else
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
        return self._rehearsed

    @property
    def plan(self) -> Plan:
        """What the run's remaining steps would charge (`preflight.Plan`: steps, q, each class's sigma_eff and
        epsilon before and after), projected from what the ledger says now."""
        if self._run.plan is None or not self._run.check:
            self._run.plan = self._run.projection()
        return self._run.plan

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
        self._check_whole()
        guard.iterating = True
        run = self._run
        try:
            if not run.done and not self._rehearsed:  # before any spend: the loop's bugs cost nothing
                yield from self._rehearse()
                run.world.barrier()  # every rank's rehearsal passed before the lead plans (saves) or writes anything
            if run.check:
                self._report_check()
                return
            while not run.done:
                self._check_governed(f"before step {run.result.steps}")  # before anything saves the run state
                if run.pending is None and not run.plan_epoch():
                    run.log(f"no contribution is eligible after {run.result.steps} steps: every one is withdrawn or "
                            "has spent its budget")
                    return
                if not run.write_ahead():
                    continue  # another run holds this ledger epoch: plan the next one
                while not run.epoch_done:
                    if guard.drawn is None:
                        self._check_governed(f"before step {run.result.steps}")  # and before each draw
                        with self._in_step():
                            chunks = run.draw()
                            if chunks:
                                guard.drawn = Drawn(run.result.steps, copy.deepcopy(chunks))  # the run's own record
                            else:  # an empty draw is still a step: its noise is drawn and the update runs
                                loss = self._apply()
                        self._observe(chunks)
                        if not chunks:
                            self._stepped(loss)
                            if idle and run.drawn_examples:  # other ranks had examples (move sums the counts)
                                yield None
                            continue
                    batch = self._encode(guard.drawn)
                    guard.wait(batch)
                    yield batch
                    if guard.waiting is not None:
                        raise RuntimeError("call run.step(losses) on each batch before asking for the next")
                self._check_governed(f"at the end of ledger epoch {run.pending['epoch']}")  # it saves the state
                run.close_epoch()
        finally:
            guard.iterating, guard.waiting = False, None

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
        total = float(losses.detach().sum())  # read before anything is summed
        with self._in_step():
            self._run.accumulate(waiting.chunk, losses, total)
            guard.waiting = None
            drawn.next += 1
            if not waiting.last:
                return None
            guard.drawn = None
            loss = self._apply()
        self._stepped(loss)
        return loss

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

    # -- internals -------------------------------------------------------------------------------------

    def _encode(self, drawn: Drawn) -> GovernedBatch:
        """The next chunk of `drawn` as a batch, encoded afresh by the task with the run's own tokenizer."""
        run = self._run
        chunk = drawn.chunks[drawn.next]
        items = self._rehearsal.examples if drawn.rehearsal and self._rehearsal is not None else run.items(chunk)
        encoded = run.task.encode([items[i] for i in chunk.indices], self._tokenizer,
                                  run.config.file.model.max_length, run.device)
        return GovernedBatch(encoded.inputs, encoded.targets, encoded.extra,
                             _place=(drawn.step, drawn.next, len(drawn.chunks)), _rehearsal=drawn.rehearsal)

    # -- the rehearsal (`rehearsal.py`) ------------------------------------------------------------------

    def _rehearse(self) -> Iterator[GovernedBatch]:
        """The rehearsal's chunks, each handed out as a governed batch; its last stepped, the run may write spend.
        Left mid-way and iterated again, it goes on from the chunk handed out and not stepped."""
        guard, run = self._guard, self._run
        while not self._rehearsed:
            self._check_governed("before the rehearsal")  # and before each of its chunks, as before a step's
            if guard.drawn is None:
                if not run.check:
                    run._check_owner()  # a process that no longer owns the run stops here, as at a draw
                rehearsal = self._rehearsal = self._rehearsal or self._new_rehearsal()
                rehearsal.losses.clear()
                self._random = _random_state(run.device)
                run.router.begin(run.rehearsal_std())  # a lattice for a quantising privatizer's rounding
                guard.drawn = Drawn(run.result.steps, copy.deepcopy(rehearsal.chunks), rehearsal=True)
            batch = self._encode(guard.drawn)
            guard.wait(batch)
            yield batch
            if guard.waiting is not None:
                raise RuntimeError("call run.step(losses) on each batch before asking for the next")

    def _new_rehearsal(self) -> Rehearsal:
        run = self._run
        length, seed = run.config.file.model.max_length, rehearsal_seed(run.insecure_seed)
        count = max(3, len(set(run.classes.values())))
        examples = synthetic_examples(run.task, self._tokenizer, length, count, seed=seed, admitted=run.examples.items)
        # one chunk of the real size at max_length: a failure that depends on the size (out of memory) is met here
        full = full_chunk_rows(physical_batch=run.chunk, expected_batch=run.expected_batch,
                               per_contribution=run.per_contribution, examples=len(run.examples.items))
        examples += synthetic_examples(run.task, self._tokenizer, length, full, seed=seed + b" full",
                                       admitted=run.examples.items, lengths=(length + 4,))
        return plan_rehearsal(examples, class_clips(run.policy, list(run.classes.values())), chunk=run.chunk,
                              per_contribution=run.per_contribution, Chunk=Chunk, full=full)

    def _rehearsal_step(self, waiting: Any, drawn: Drawn, losses: "torch.Tensor") -> None:
        """A rehearsal chunk's step: the router forms, measures and clips its per-sample gradients as in a real
        step (every check of its runs), and the sum is dropped at the rehearsal's end; no noise, no update."""
        run, guard = self._run, self._guard
        assert self._rehearsal is not None
        values = [float(v) for v in losses.detach().float().cpu()]  # read before anything is summed
        with self._in_step():
            chunk = waiting.chunk
            run.router.accumulate(losses, chunk.classes, chunk.clips, units=chunk.units, microbatch=chunk.microbatch)
            self._rehearsal.losses[drawn.next] = values
            guard.waiting = None
            drawn.next += 1
            if not waiting.last:
                return None
            guard.drawn = None
            run.router.begin(run.rehearsal_std())  # the rehearsal's clipped sums are dropped: nothing of it reaches an update
            _restore_random(self._random, run.device)
            self._check_governed("after the rehearsal")
            self._rehearsal.check_alone(run.precision)
            self._rehearsed = True
        run.log(f"{self.run_id}: rehearsal passed: your loop ran {len(drawn.chunks)} chunk(s) of synthetic rows "
                "through every check of a step; nothing was spent")
        return None

    def _report_check(self) -> None:
        run = self._run
        plan = self.plan
        for line in plan.lines():
            run.log(line)
        if plan.charged_before:
            run.log(f"{plan.charged_before} contribution(s) were charged by other runs: training needs --yes "
                    "(confirm=True)")
        run.log(f"{self.run_id}: check passed; nothing was spent or written (run again without --check to train)")

    def _apply(self) -> float:
        """The step's noise and update (inside `_in_step`), on the weights as the last governed step left them."""
        run, update = self._run, self._run.update
        self._check_governed(f"at step {run.result.steps}'s update")  # every hyperparameter the step's own
        update.hyperparameters.apply(update, run.result.steps)  # the schedule's values, as plain floats
        loss = run.move()
        self._weights.update()  # before anything else runs: the step's bookkeeping and checkpoint come after
        self._state.take()
        run.record(loss)
        update.hyperparameters.apply(update, run.result.steps)  # the next step's rates
        return loss

    def _stepped(self, loss: float) -> None:
        if self._on_step is not None:  # the step is whole: what the callback does is after it
            self._on_step(self._run.result.steps, loss)

    def _observe(self, chunks: list) -> None:
        run = self._run
        if run.observe is not None:  # after the draw is recorded: raising here cannot make the run draw again
            step = run.result.steps - (0 if chunks else 1)
            run.observe(step, [c for chunk in chunks for c in chunk.owners])

    @contextlib.contextmanager
    def _in_step(self) -> Iterator[None]:
        """A step is one transaction from its draw to its update: anything raised in between (a hook of yours, a
        loss that raises once summed, a parameter swapped under the update) leaves the run broken in this
        process, as a kill would, and it refuses to go on. Otherwise the loop could catch the error and have the
        step drawn again until it liked the draw, or summed a chunk twice, or moved the weights without a
        counted step (review 3, F1, F2, F6)."""
        try:
            yield
        except BaseException as error:
            self._broken = (f"step {self._run.result.steps} raised {type(error).__name__} after its draw "
                            f"({str(error)[:120]})")
            raise

    def _check_whole(self) -> None:
        if self._broken is not None:
            raise ConfigError(Code.STEP_FAILED, f"{self._broken}: what this process holds is no longer what the "
                                                "ledger charged; close the run and open the same config again (it "
                                                "resumes from its last checkpoint and draws the same rows)")

    def _check_governed(self, when: str) -> None:
        check_optimizer_hooks()
        changed = self._weights.changed()
        if changed is not None and self._weights.unscheduled:
            raise ConfigError(Code.UNGOVERNED_UPDATE, f"{changed}, {when}: an update's hyperparameters are RUN.toml's, "
                                                      "scaled by the run's schedule (set_schedule); one set by other "
                                                      "code (a callback on an evaluation or on the training loss, a "
                                                      "loop writing param_groups) may follow data that no spend "
                                                      "charges: put it back, and leave the optimizer's groups alone "
                                                      "while the run is open")
        if changed is not None:
            raise ConfigError(Code.UNGOVERNED_UPDATE, f"{changed} {when}, outside a governed step: only the run's "
                                                      "noised updates may move what it trains, or the released "
                                                      "weights carry what no step charged; leave the model's "
                                                      "parameters alone while the run is open")
        changed = self._state.changed()
        if changed is not None:
            raise ConfigError(Code.UNGOVERNED_UPDATE, f"{changed} {when}, outside a governed step: every example's "
                                                      "forward reads it, and one set from the data (the training "
                                                      "loss, an evaluation) makes each clipped gradient depend on all "
                                                      "of it, which no spend charges; put it back, and leave the "
                                                      "model's buffers and settings alone while the run is open")

    @contextlib.contextmanager
    def _governed_forward(self) -> Iterator[None]:
        """The guard's context for a governed forward: the weights as the last step left them, then the run's
        capture and precision. Gradients taken at weights moved by other code are a query the ledger never saw."""
        self._check_governed("at a governed forward")
        drawn, waiting = self._guard.drawn, self._guard.waiting
        assert waiting is not None  # the guard enters this context only for the waiting batch's forward
        rehearsal = drawn is not None and drawn.rehearsal
        switched = None if rehearsal else self._state.check_modes()
        if switched is not None:
            raise ConfigError(Code.UNGOVERNED_BATCH, f"{switched} since this process's first governed forward: "
                                                     "dropout on or off at a step is a choice the loop could make "
                                                     "from the data; keep run.model in one mode for every governed "
                                                     "forward (evaluate under torch.no_grad() and switch back)")
        rehearsing = _rehearsing(self._run.model) if rehearsal else contextlib.nullcontext()
        place = (drawn.step, drawn.next) if drawn is not None else (-1, -1)
        with self._run.forward(waiting.chunk), rehearsing, keyed_random(self._run, *place):
            yield
        self._state.take()  # what the forward itself wrote (BatchNorm's running statistics)


class Weights:
    """The model's parameters and the update's state as the last governed step left them: a copy of each
    trainable parameter's values, each parameter's identity and version counter (a frozen one is never written
    by a step: an in-place write bumps its counter), and a copy of the update's state (optimizer moments and
    step counts, PRISM's and DP-Muon's), and every hyperparameter the update reads, which must be RUN.toml's scaled
    by the run's schedule at the coming step (`mechanisms/hyperparameters.py`). `changed()` names the first that
    differs. Writes to a frozen parameter's storage that bypass its counter (`.data`, `.numpy()`)
    are not seen: that, like patching a library, is out of reach."""

    def __init__(self, model: "nn.Module", mechanism: "Update", steps: Callable[[], int]) -> None:
        self.model, self.mechanism, self.steps = model, mechanism, steps  # steps(): the coming update's step
        self.unscheduled = False  # what `changed()` last found is a hyperparameter the schedule did not set
        # the update's own objects (no hook, no method replaced on an instance) and the reference its hyperparameters
        # are compared with (the frozen copies of RUN.toml's and the schedule set_schedule fixed), as the run opened
        self.sealed = Sealed.of(mechanism)
        self.hyperparameters = mechanism.hyperparameters
        self.reference = mechanism.hyperparameters.reference()
        self.update()

    def adopt_schedule(self) -> None:
        """`set_schedule` fixed the update's schedule: it is the reference from now on."""
        self.reference = self.hyperparameters.reference()
        self.update()

    def update(self) -> None:
        self.trainable = trainable_weights(self.model)
        self.params = [(name, p, _version(p)) for name, p in self.model.named_parameters()]
        self.kinds = [type(p) for _, p, _ in self.params]  # compared before any op runs on a parameter
        self.state = _copied(self.mechanism.state_dict())
        optimizer = self.mechanism.optimizer
        self.groups = [list(group["params"]) for group in optimizer.param_groups] if optimizer is not None else []
        self.defaults = _copied(optimizer.defaults) if optimizer is not None else None

    def changed(self) -> str | None:
        self.unscheduled = False
        sealed = self.sealed.changed()  # first: the state checks below call the update's state_dict()
        if sealed is not None:
            return sealed
        hyperparameters = self.mechanism.hyperparameters
        kept = self.reference
        if hyperparameters is not self.hyperparameters or any(
                a is not b for a, b in zip(hyperparameters.reference()[:2], kept[:2])):
            return "the update's hyperparameters' reference (RUN.toml's values) was replaced"
        if type(hyperparameters.schedule) is not Schedule or hyperparameters.schedule != kept[2]:  # type first
            self.unscheduled = True
            return (f"the run's schedule is {hyperparameters.schedule}, where set_schedule fixed {kept[2]} (set "
                    "other than by set_schedule)")
        now = list(self.model.named_parameters())
        if len(now) != len(self.params) or any(p is not q for (_, p), (_, q, _) in zip(now, self.params)):
            return "a parameter of run.model was replaced or added"
        for (name, p), kind in zip(now, self.kinds):  # type() runs none of the parameter's code
            if type(p) is not kind:
                return f"{name} changed class to {type(p).__name__} (its code would run inside the update)"
        for name, p, version in self.params:
            if not p.requires_grad and _version(p) != version:
                return f"{name} (frozen) was written"
        for name, p in now:
            kept = self.trainable.get(name)
            if p.requires_grad != (kept is not None):
                return f"{name} had requires_grad switched"
            if kept is not None and not _equal(p.detach(), kept):
                return f"{name} was written"
        state = "the update's state (optimizer moments, step counts, parameter groups) was written"
        if not self._same_groups():  # types first
            return state
        step = self.steps()
        wrong = hyperparameters.changed(self.mechanism, step)
        self.unscheduled = wrong is not None  # a rate, momentum, betas, decay or eps set by other code (issue 34, 8)
        if wrong is not None:
            return f"the update's state ({wrong} at step {step}; the run's schedule: {hyperparameters.schedule})"
        if not same_state(self.mechanism.state_dict(), self.state):
            return state
        return None

    def _same_groups(self) -> bool:
        """The optimizer's groups hold, in exact lists of exact dicts, the parameters they held (`state_dict()`
        gives their indices only, so a list subclass iterated inside the update would pass it); its state is a
        defaultdict of dicts, and its defaults as they were (review 7: a state factory and a `defaults` value
        whose `__bool__` was the loop's ran inside the update and after it, before the weights were kept)."""
        optimizer = self.mechanism.optimizer
        if optimizer is None:
            return True
        state = optimizer.state  # torch calls its factory inside the update, and zero_grad reads `defaults`
        if type(state) is not collections.defaultdict or state.default_factory is not dict:
            return False
        if not same_state(optimizer.defaults, self.defaults):
            return False
        groups = optimizer.param_groups
        return (type(groups) is list and len(groups) == len(self.groups)
                and all(type(group) is dict and type(group["params"]) is list and len(group["params"]) == len(kept)
                        and all(map(operator.is_, group["params"], kept)) for group, kept in zip(groups, self.groups)))

    def same(self, weights: dict[str, "torch.Tensor"]) -> bool:
        return weights.keys() == self.trainable.keys() and all(_equal(v, self.trainable[n])
                                                               for n, v in weights.items())


_SCHEDULED = frozenset(RATE_KEYS)  # the rates: compared with the schedule's (`Hyperparameters`), not as state


_PLAIN = (int, float, bool, str, type(None))  # the values an update's state holds besides tensors and containers


def _copied(state: Any) -> Any:
    """A copy of an update's state, of the same exact types, the learning rates left out."""
    if type(state) is dict:
        return {key: _copied(value) for key, value in state.items() if key not in _SCHEDULED}
    if type(state) in (list, tuple):
        return type(state)(_copied(value) for value in state)
    return state.detach().clone() if isinstance(state, torch.Tensor) else copy.deepcopy(state)


def same_state(a: Any, b: Any) -> bool:
    """Whether two update states are equal, tensors by value, the learning rates aside. Only exact dicts, lists,
    tuples, plain tensors and plain values count as equal: a subclass of any of them (a tensor whose
    `__torch_function__`, a dict whose `__getitem__`, a tuple whose `__iter__` is code of the loop's) would run
    that code inside the governed update, which reads them (review 6)."""
    if type(a) is not type(b):
        return False
    if type(a) is dict:
        keys = {k for k in a if k not in _SCHEDULED}
        return (keys == {k for k in b if k not in _SCHEDULED} and all(type(k) in _PLAIN for k in keys)
                and all(same_state(a[k], b[k]) for k in keys))
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    if type(a) is torch.Tensor:  # accelerate moves the state to the device: compare on the CPU
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
    if is_sharded(a):  # FSDP's moments (`distributed.fsdp`)
        return same_shard(a, b)
    return type(a) in _PLAIN and (a == b or (a != a and b != b))


def same_shard(a: "torch.Tensor", b: "torch.Tensor") -> bool:
    """Two DTensors (FSDP's sharded parameters or moments), exactly of torch's class, of one layout, equal on this
    rank's shard: each rank compares its own, with no collective (a rank that finds a difference stops the run)."""
    from torch.distributed.tensor import DTensor

    return (type(a) is DTensor and type(b) is DTensor and a.placements == b.placements and a.shape == b.shape
            and a.dtype == b.dtype and torch.equal(a.to_local().cpu(), b.to_local().cpu()))


def _version(p: "torch.Tensor") -> Any:
    """A parameter's version counter. A DTensor's wrapper has its own, and a write through `to_local()` bumps only its
    shard's (which FSDP's gathers never write): both are kept."""
    return (p._version, p.to_local()._version) if is_sharded(p) else p._version


def _equal(a: "torch.Tensor", b: "torch.Tensor") -> bool:
    return same_shard(a, b) if is_sharded(a) or is_sharded(b) else torch.equal(a, b)


def check_optimizer_hooks() -> None:
    """torch's global optimizer-step hooks run inside every governed update, with the weights and the step in
    hand: a pre-hook that raises could reject draws, a post-hook could move the weights again (review 3, F1)."""
    from torch.optim import optimizer

    hooks = [*optimizer._global_optimizer_pre_hooks.values(), *optimizer._global_optimizer_post_hooks.values()]
    if hooks:
        raise ConfigError(Code.UNGOVERNED_UPDATE, f"torch has {len(hooks)} global optimizer step hook(s) registered "
                                                  "(register_optimizer_step_pre_hook/post_hook): they would run inside "
                                                  "each governed update; remove them while the run is open")


def trainable_weights(model: "nn.Module") -> dict[str, "torch.Tensor"]:
    """A copy of every trainable parameter, by name."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


@contextlib.contextmanager
def _rehearsing(model: "nn.Module") -> Iterator[None]:
    """A rehearsal forward: eval mode (no dropout) and full fp32 matmul precision (no TF32), so that the row
    alone and in a batch differ only if the loop couples them; the modes and precision are put back after."""
    modes = [(module, module.training) for module in model.modules()]
    precision = torch.get_float32_matmul_precision()
    model.eval()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(precision)
        for module, training in modes:
            module.train(training)


@contextlib.contextmanager
def keyed_random(run: Run, step: int, chunk: int) -> Iterator[None]:
    """A governed forward's randomness (dropout's masks) from the run's own generator state, seeded by the run's
    lease (its nonce, or the insecure seed of a test) and the rank, step and chunk, with torch's global generators
    put back after it: the loop could seed those from the data between steps (an outside review seeded them from
    the training loss, and every example's masked forward, hence its clipped gradient, followed all the data).
    Fixed by the draw alone, so a resumed run draws the same masks. The backward reuses the forward's masks."""
    import hashlib

    material = run.run_nonce if run.insecure_seed is None else b"insecure %d" % run.insecure_seed
    seed = hashlib.sha256(b"govtrain forward randomness\0" + (material or run.run_id.encode()) +
                          b"%d %d %d" % (run.world.rank, step, chunk)).digest()
    seed = int.from_bytes(seed[:8], "big") >> 1  # a generator's seed is below 2**63
    device = run.device
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.random.default_generator.manual_seed(seed)
        for index in cuda:
            torch.cuda.default_generators[index].manual_seed(seed)
        yield


def _random_state(device: "torch.device") -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _restore_random(state: tuple | None, device: "torch.device") -> None:
    """Torch's global random state as the rehearsal found it: a seeded run draws what it drew without it."""
    if state is None:
        return
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)
