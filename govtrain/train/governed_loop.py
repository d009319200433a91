"""The loop's side of a governed run (`GovernedRun`, `governed.py`): the draws handed out as batches, the rehearsal
first (`rehearsal.py`), each chunk's losses taken, and a step kept one transaction from its draw to its update.

`GovernedRun` is the API the loop calls (`batches()`, `step()`, `save()`) and what it reads; this is what runs
behind it, split along the class's own seam: the public methods check what the loop handed them and call these.
Every check of the weights, the model's state and its modes (`weights.py`, `model_state.py`) runs here at the
points the module docstring of `governed.py` lists, and a governed forward runs under the run's capture and
precision with randomness keyed by the draw alone (`keyed_random`).
"""

from __future__ import annotations

import contextlib
import copy
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from govtrain.errors import Code, ConfigError
from govtrain.routing.independence import restore_modes, saved_modes
from govtrain.train.drawn import Drawn, GovernedBatch, Waiting
from govtrain.train.guard import Guard
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
from govtrain.train.run import Chunk, Run
from govtrain.train.weights import Weights, check_optimizer_hooks

if TYPE_CHECKING:
    from torch import nn


class GovernedLoop:
    """What a `GovernedRun` holds while the loop runs: the guard on its model, the model's state as the last
    governed step left it, its own copy of the tokenizer, the rehearsal, and what broke a step (None: nothing)."""

    def __init__(self, run: Run, weights: Weights, on_step: Callable[[int, float], None] | None) -> None:
        self.run, self.weights, self.on_step = run, weights, on_step
        self.broken: str | None = None  # what raised inside a step, after its draw (`in_step`)
        self.guard = Guard(run.model, self.governed_forward)  # the run owns sampling
        self.state = ModelState(run.model)  # buffers, plain settings and modes the forward reads (`model_state.py`)
        self.tokenizer = copy.deepcopy(run.tokenizer)  # encodes every draw: patching run.tokenizer changes none
        self.rehearsal: Rehearsal | None = None  # built when first handed out
        self.rehearsed = False  # the rehearsal's last chunk was stepped: the run may write spend
        self.random: tuple | None = None  # torch's random state when the rehearsal was drawn, put back after it

    def hand_out(self, *, idle: bool) -> Iterator[GovernedBatch | None]:
        """`GovernedRun._batches` once it found the run open and not already iterated: the rehearsal, then every
        remaining step's chunks, each planned epoch's spend written ahead first."""
        guard = self.guard
        self.check_whole()
        guard.iterating = True
        run = self.run
        try:
            if not run.done and not self.rehearsed:  # before any spend: the loop's bugs cost nothing
                yield from self.rehearse()
                run.world.barrier()  # every rank's rehearsal passed before the lead plans (saves) or writes anything
            if run.check:
                self.report_check()
                return
            while not run.done:
                self.check_governed(f"before step {run.result.steps}")  # before anything saves the run state
                if run.pending is None and not run.plan_epoch():
                    run.log(f"no contribution is eligible after {run.result.steps} steps: every one is withdrawn or "
                            "has spent its budget")
                    return
                if not run.write_ahead():
                    continue  # another run holds this ledger epoch: plan the next one
                while not run.epoch_done:
                    if guard.drawn is None:
                        self.check_governed(f"before step {run.result.steps}")  # and before each draw
                        with self.in_step():
                            chunks = run.draw()
                            if chunks:
                                guard.drawn = Drawn(run.result.steps, copy.deepcopy(chunks))  # the run's own record
                            else:  # an empty draw is still a step: its noise is drawn and the update runs
                                loss = self.apply()
                        self.observe(chunks)
                        if not chunks:
                            self.stepped(loss)
                            if idle and run.drawn_examples:  # other ranks had examples (move sums the counts)
                                yield None
                            continue
                    batch = self.encode(guard.drawn)
                    guard.wait(batch)
                    yield batch
                    if guard.waiting is not None:
                        raise RuntimeError("call run.step(losses) on each batch before asking for the next")
                self.check_governed(f"at the end of ledger epoch {run.pending['epoch']}")  # it saves the state
                run.close_epoch()
        finally:
            guard.iterating, guard.waiting = False, None

    def take(self, waiting: Waiting, drawn: Drawn, losses: "torch.Tensor") -> float | None:
        """A real chunk's step, once `GovernedRun.step` checked its batch and losses: sum its clipped per-sample
        gradients; after the step's last chunk, noise the sum once and move the parameters."""
        guard = self.guard
        total = float(losses.detach().sum())  # read before anything is summed
        with self.in_step():
            self.run.accumulate(waiting.chunk, losses, total)
            guard.waiting = None
            drawn.next += 1
            if not waiting.last:
                return None
            guard.drawn = None
            loss = self.apply()
        self.stepped(loss)
        return loss

    def rehearse(self) -> Iterator[GovernedBatch]:
        """The rehearsal's chunks, each handed out as a governed batch; its last stepped, the run may write spend.
        Left mid-way and iterated again, it goes on from the chunk handed out and not stepped."""
        guard, run = self.guard, self.run
        while not self.rehearsed:
            self.check_governed("before the rehearsal")  # and before each of its chunks, as before a step's
            if guard.drawn is None:
                if not run.check:
                    run._check_owner()  # a process that no longer owns the run stops here, as at a draw
                rehearsal = self.rehearsal = self.rehearsal or self.new_rehearsal()
                rehearsal.losses.clear()
                self.random = random_state(run.device)
                run.router.begin(run.rehearsal_std())  # a lattice for a quantising privatizer's rounding
                guard.drawn = Drawn(run.result.steps, copy.deepcopy(rehearsal.chunks), rehearsal=True)
            batch = self.encode(guard.drawn)
            guard.wait(batch)
            yield batch
            if guard.waiting is not None:
                raise RuntimeError("call run.step(losses) on each batch before asking for the next")

    def new_rehearsal(self) -> Rehearsal:
        run = self.run
        length, seed = run.config.file.model.max_length, rehearsal_seed(run.insecure_seed)
        count = max(3, len(set(run.classes.values())))
        examples = synthetic_examples(run.task, self.tokenizer, length, count, seed=seed, admitted=run.examples.items)
        # one chunk of the real size at max_length: a failure that depends on the size (out of memory) is met here
        full = full_chunk_rows(physical_batch=run.chunk, expected_batch=run.expected_batch,
                               per_contribution=run.per_contribution, examples=len(run.examples.items))
        examples += synthetic_examples(run.task, self.tokenizer, length, full, seed=seed + b" full",
                                       admitted=run.examples.items, lengths=(length + 4,))
        return plan_rehearsal(examples, class_clips(run.policy, list(run.classes.values())), chunk=run.chunk,
                              per_contribution=run.per_contribution, Chunk=Chunk, full=full)

    def rehearsal_step(self, waiting: Any, drawn: Drawn, losses: "torch.Tensor") -> None:
        """A rehearsal chunk's step: the router forms, measures and clips its per-sample gradients as in a real
        step (every check of its runs), and the sum is dropped at the rehearsal's end; no noise, no update."""
        run, guard = self.run, self.guard
        assert self.rehearsal is not None
        values = [float(v) for v in losses.detach().float().cpu()]  # read before anything is summed
        with self.in_step():
            chunk = waiting.chunk
            run.router.accumulate(losses, chunk.classes, chunk.clips, units=chunk.units, microbatch=chunk.microbatch)
            self.rehearsal.losses[drawn.next] = values
            guard.waiting = None
            drawn.next += 1
            if not waiting.last:
                return None
            guard.drawn = None
            run.router.begin(run.rehearsal_std())  # the rehearsal's clipped sums are dropped: nothing of it reaches an update
            restore_random(self.random, run.device)
            self.check_governed("after the rehearsal")
            self.rehearsal.check_alone(run.precision)
            self.rehearsed = True
        run.log(f"{run.run_id}: rehearsal passed: your loop ran {len(drawn.chunks)} chunk(s) of synthetic rows "
                "through every check of a step; nothing was spent")
        return None

    def plan(self) -> Plan:
        """`GovernedRun.plan`: what the run's remaining steps would charge, projected from what the ledger says now."""
        if self.run.plan is None or not self.run.check:
            self.run.plan = self.run.projection()
        return self.run.plan

    def report_check(self) -> None:
        run = self.run
        plan = self.plan()
        for line in plan.lines():
            run.log(line)
        if plan.charged_before:
            run.log(f"{plan.charged_before} contribution(s) were charged by other runs: training needs --yes "
                    "(confirm=True)")
        run.log(f"{run.run_id}: check passed; nothing was spent or written (run again without --check to train)")

    def encode(self, drawn: Drawn) -> GovernedBatch:
        """The next chunk of `drawn` as a batch, encoded afresh by the task with the run's own tokenizer."""
        run = self.run
        chunk = drawn.chunks[drawn.next]
        items = self.rehearsal.examples if drawn.rehearsal and self.rehearsal is not None else run.items(chunk)
        encoded = run.task.encode([items[i] for i in chunk.indices], self.tokenizer,
                                  run.config.file.model.max_length, run.device)
        return GovernedBatch(encoded.inputs, encoded.targets, encoded.extra,
                             _place=(drawn.step, drawn.next, len(drawn.chunks)), _rehearsal=drawn.rehearsal)

    def apply(self) -> float:
        """The step's noise and update (inside `in_step`), on the weights as the last governed step left them."""
        run, update = self.run, self.run.update
        self.check_governed(f"at step {run.result.steps}'s update")  # every hyperparameter the step's own
        update.hyperparameters.apply(update, run.result.steps)  # the schedule's values, as plain floats
        loss = run.move()
        self.weights.update()  # before anything else runs: the step's bookkeeping and checkpoint come after
        self.state.take()
        run.record(loss)
        update.hyperparameters.apply(update, run.result.steps)  # the next step's rates
        return loss

    def stepped(self, loss: float) -> None:
        if self.on_step is not None:  # the step is whole: what the callback does is after it
            self.on_step(self.run.result.steps, loss)

    def observe(self, chunks: list) -> None:
        run = self.run
        if run.observe is not None:  # after the draw is recorded: raising here cannot make the run draw again
            step = run.result.steps - (0 if chunks else 1)
            run.observe(step, [c for chunk in chunks for c in chunk.owners])

    @contextlib.contextmanager
    def in_step(self) -> Iterator[None]:
        """A step is one transaction from its draw to its update: anything raised in between (a hook of yours, a
        loss that raises once summed, a parameter swapped under the update) leaves the run broken in this
        process, as a kill would, and it refuses to go on. Otherwise the loop could catch the error and have the
        step drawn again until it liked the draw, or summed a chunk twice, or moved the weights without a
        counted step (review 3, F1, F2, F6)."""
        try:
            yield
        except BaseException as error:
            self.broken = (f"step {self.run.result.steps} raised {type(error).__name__} after its draw "
                            f"({str(error)[:120]})")
            raise

    def check_whole(self) -> None:
        if self.broken is not None:
            raise ConfigError(Code.STEP_FAILED, f"{self.broken}: what this process holds is no longer what the "
                                                "ledger charged; close the run and open the same config again (it "
                                                "resumes from its last checkpoint and draws the same rows)")

    def check_governed(self, when: str) -> None:
        check_optimizer_hooks()
        changed = self.weights.changed()
        if changed is not None and self.weights.unscheduled:
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
        changed = self.state.changed()
        if changed is not None:
            raise ConfigError(Code.UNGOVERNED_UPDATE, f"{changed} {when}, outside a governed step: every example's "
                                                      "forward reads it, and one set from the data (the training "
                                                      "loss, an evaluation) makes each clipped gradient depend on all "
                                                      "of it, which no spend charges; put it back, and leave the "
                                                      "model's buffers and settings alone while the run is open")

    @contextlib.contextmanager
    def governed_forward(self) -> Iterator[None]:
        """The guard's context for a governed forward: the weights as the last step left them, then the run's
        capture and precision. Gradients taken at weights moved by other code are a query the ledger never saw."""
        self.check_governed("at a governed forward")
        drawn, waiting = self.guard.drawn, self.guard.waiting
        assert waiting is not None  # the guard enters this context only for the waiting batch's forward
        rehearsal = drawn is not None and drawn.rehearsal
        switched = None if rehearsal else self.state.check_modes()
        if switched is not None:
            raise ConfigError(Code.UNGOVERNED_BATCH, f"{switched} since this process's first governed forward: "
                                                     "dropout on or off at a step is a choice the loop could make "
                                                     "from the data; keep run.model in one mode for every governed "
                                                     "forward (evaluate under torch.no_grad() and switch back)")
        modes = rehearsing(self.run.model) if rehearsal else contextlib.nullcontext()
        place = (drawn.step, drawn.next) if drawn is not None else (-1, -1)
        with self.run.forward(waiting.chunk), modes, keyed_random(self.run, *place):
            yield
        self.state.take()  # what the forward itself wrote (BatchNorm's running statistics)


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


@contextlib.contextmanager
def rehearsing(model: "nn.Module") -> Iterator[None]:
    """A rehearsal forward: eval mode (no dropout) and full fp32 matmul precision (no TF32), so that the row
    alone and in a batch differ only if the loop couples them; the modes and precision are put back after."""
    modes = saved_modes(model)
    precision = torch.get_float32_matmul_precision()
    model.eval()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(precision)
        restore_modes(model, modes)


def random_state(device: "torch.device") -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def restore_random(state: tuple | None, device: "torch.device") -> None:
    """Torch's global random state as the rehearsal found it: a seeded run draws what it drew without it."""
    if state is None:
        return
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)
