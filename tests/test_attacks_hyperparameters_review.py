"""Review of issue 34 item 8's fix: steering channels into the governed update that the hyperparameter check and
`Weights.changed` do not see (an adversarial review; every test here fails on the reviewed main).

The adversary is the documented loop around `GovernedRun` and a `GovernedTrainer`'s callbacks, with the private
data in hand (the admitted rows, the non-noised training loss `run.step` returns, an evaluation on admitted rows).
Its goal: a released adapter that depends on that data beyond what the spend charges, with the spend unchanged.

Each channel below is set between governed steps from the non-noised training loss (a stand-in for any function
of the private data). A value that is a function of the whole data set and that every example's gradient reads
breaks the sensitivity argument: the clipped sums of two neighbouring data sets then differ in every term, not
in one example's C. Each test runs the same seeded step with the channel untouched and with it set; the fix either
refuses the setting before the next update (`ungoverned_update`, or `ungoverned_batch` where the guard's "model
as opened" refuses it, nothing moved), or makes it inert (the step's weights equal the untouched run's).
The two schedule tests: a schedule chosen again after a kill before the first checkpoint, and a schedule the
release does not record.

Probed and held (refused `ungoverned_update`, nothing moved; the shipped tests cover them): Adam moments written
in place without a hook, a `float` or `numpy.float64` subclass as a rate, `requires_grad` switched, peft's
`set_adapter` and `disable_adapter_layers`, `lora_alpha` edited in `peft_config` (the saved `adapter_config.json`
is compared byte for byte at `save()`). A global `torch.autocast` around the loop's forward breaks the step (the
router's sums refuse mixed dtypes): refused by accident, not by a check.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Callable

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

import govtrain  # noqa: E402
from govtrain.errors import Code, ConfigError  # noqa: E402
from govtrain.integrations.hf import GovernedTrainer  # noqa: E402
from govtrain.ledger.ledger import Ledger  # noqa: E402
from govtrain.train.resume import recorded_entry  # noqa: E402
from govtrain.verify.verifier import verify_ledger  # noqa: E402
from tests.conftest import snapshot  # noqa: E402
from tests.test_api import QUIET, _corpus, _same, _trainable  # noqa: E402
from tests.test_attacks_selection import _admitted, _evaluating  # noqa: E402
from tests.test_attacks_user_code import _loop, _step_once  # noqa: E402
from tests.test_hf_trainer import MECHANISMS  # noqa: E402
from tests.test_train import _config, tiny_model  # noqa: E402,F401

REFUSALS = (Code.UNGOVERNED_UPDATE, Code.UNGOVERNED_BATCH)


def _one_step(run) -> float:
    """One logical step of the honest loop (the rehearsal, if still due, stepped first)."""
    batches = run.batches()
    try:
        for batch in batches:
            loss = run.step(run.per_example_loss(run.model(**batch.inputs), batch))
            if loss is not None and not batch.rehearsal:
                return loss
    finally:
        batches.close()
    raise AssertionError("run.batches() ended before a step")


def _second_step(tmp_path: Path, model: Path, name: str, tamper: Callable | None, mechanism: str = "dpsgd"):
    """Step 0 by the honest loop; then `tamper(run, loss)` with step 0's non-noised mean loss; then step 1.
    (refusal code or None, the trainable weights after, whether they are step 0's, the ledger before/after)."""
    corpus = _corpus(tmp_path, name)
    config = _config(corpus, model, 3, mechanism, MECHANISMS[mechanism])
    with govtrain.GovernedRun.open(config, corpus.url, insecure_seed=1, **QUIET) as run:
        _step_once(run, corpus)
        loss = run.result.losses[-1]
        if tamper is not None:
            tamper(run, loss)
        weights = _trainable(run)
        try:
            _one_step(run)
        except ConfigError as refused:
            return refused.code, _trainable(run), _same(weights, run)
        return None, _trainable(run), _same(weights, run)


def _inert_or_refused(tmp_path: Path, model: Path, tamper: Callable, honest: Callable | None = None,
                      mechanism: str = "dpsgd") -> None:
    """`tamper` is refused, nothing moved, or step 1 is what it is under `honest` (by default: nothing done)."""
    honest = _second_step(tmp_path, model, "honest", honest, mechanism)
    code, weights, unmoved = _second_step(tmp_path, model, "steered", tamper, mechanism)
    if code is not None:
        assert code in REFUSALS and unmoved, (code, unmoved)
        return
    moved = {n: float((weights[n] - honest[1][n]).norm()) for n in weights if not torch.equal(weights[n], honest[1][n])}
    assert not moved, (f"step 1 followed the steering, unrefused: {len(moved)} of {len(weights)} trainable tensors "
                       f"differ from the honest run's (largest distance {max(moved.values()):.3g})")


# -- 1. the run's own optimizer's step hooks and step method (HIGH) ----------------------------------------------


def _pre_hook(run, loss: float) -> None:
    def hook(optimizer, args, kwargs):
        for group in optimizer.param_groups:  # after the run's check and its `apply`: the update meets this
            group["lr"] = 5.0 * loss
    run._run.update.optimizer.register_step_pre_hook(hook)


def _post_hook(run, loss: float) -> None:
    def hook(optimizer, args, kwargs):
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.add_(loss)  # before the run keeps the weights as the step left them
    run._run.update.optimizer.register_step_post_hook(hook)


def _wrapped_step(run, loss: float) -> None:
    optimizer = run._run.update.optimizer
    step = optimizer.step

    def steered(*args, **kwargs):
        for group in optimizer.param_groups:
            group["lr"] = 5.0 * loss
        return step(*args, **kwargs)
    optimizer.step = steered


def _hidden_moments(run, loss: float) -> None:
    optimizer = run._run.update.optimizer
    shown = copy.deepcopy(optimizer.state_dict())  # what every later state_dict() answers
    optimizer.register_state_dict_post_hook(lambda optimizer, state: copy.deepcopy(shown))
    with torch.no_grad():
        for state in optimizer.state.values():
            state["exp_avg"].add_(loss)  # the moments, from the data: the next update divides by them


def _prism_step(run, loss: float) -> None:
    prism = run._run.update.prism
    step = prism.step

    def steered(*args, **kwargs):
        prism.lr = 5.0 * loss  # after the check and `apply`; the next `apply` writes the schedule's back
        return step(*args, **kwargs)
    prism.step = steered


def _muon_orthogonalize(run, loss: float) -> None:
    muon = run._run.update.muon
    orthogonalize = muon.orthogonalize
    muon.orthogonalize = lambda X: orthogonalize(X) * (5.0 * loss)  # the step's direction, scaled from the data


def _reference(run, loss: float) -> None:
    hyperparameters = run._run.update.hyperparameters  # what `changed` compares with and `apply` writes
    for group in hyperparameters.groups:
        group["lr"] = 5.0 * loss
    hyperparameters.schedule = type(hyperparameters.schedule)(kind="linear", total=3)  # past set_schedule's guard
    hyperparameters.apply(run._run.update, run.steps)  # the groups as the rewritten reference says


OPTIMIZER = {  # how -> (mechanism, the steering)
    "the check's own reference (Hyperparameters.groups, .schedule) rewritten": ("dpsgd", _reference),
    "a state_dict post-hook hides moments written from the loss": ("dpsgd", _hidden_moments),
    "a step pre-hook on the run's optimizer sets lr": ("dpsgd", _pre_hook),
    "a step post-hook on the run's optimizer moves the weights": ("dpsgd", _post_hook),
    "the run's optimizer's step wrapped on the instance": ("dpsgd", _wrapped_step),
    "PRISM's step wrapped on the instance sets its lr": ("prism", _prism_step),
    "DP-Muon's orthogonalize replaced on the instance": ("dp-muon", _muon_orthogonalize),
}


@pytest.mark.parametrize("how", sorted(OPTIMIZER))
def test_review_code_of_the_loops_inside_the_runs_own_optimizer_is_refused(tmp_path: Path, tiny_model: Path,
                                                                           how: str):
    """Attack: code of the loop's placed inside the governed update, on the run's own update objects
    (`run._run.update.optimizer`: the optimizer whose `param_groups`, `state` and `defaults` `GovernedOptimizer`
    hands a Trainer's callbacks, reachable from them with `gc.get_referrers`; the shipped test
    `test_a_paused_run_keeps_its_schedule_when_resumed` registers a step pre-hook on it itself, unrefused):
    a step pre-hook that sets every group's lr = 5·(step 0's non-noised training loss); a post-hook that adds the
    loss to every weight; `step` wrapped on the instance; a `state_dict` post-hook that answers the state as it was
    while the Adam moments are written from the loss; PRISM's `step` wrapped to set its lr; DP-Muon's
    `orthogonalize` replaced to scale the direction by the loss; or, plainer, the check's own reference rewritten
    (`Hyperparameters.groups[i]["lr"]` and `.schedule`, mutable lists of dicts and a settable attribute, which
    `changed` compares with and `apply` writes: set_schedule's "before the first update" guard is bypassed too).
    Each runs inside `Update.step`, after `_apply`'s
    check and its `apply` of the schedule's rates; `Weights.update()` then keeps whatever the step left, and the
    next `apply` writes the schedule's rate back, so no later check sees a trace (the state_dict hook also blinds
    `same_state` and what the run state saves).
    Impact: item 8's check and "only governed steps move the weights" are both bypassed: any rate, any moment,
    any weight, set from private data, the spend unchanged and the run recorded (measured here: 74 of 74 tensors
    moved by 3.92 by the post-hook; lr from the loss moved 20 tensors by up to 15.4; hidden moments by 1.9e7).
    torch's global optimizer hooks are refused (`check_optimizer_hooks`, review 3 F1) for exactly this reason;
    the instance's own (`_optimizer_step_pre_hooks`, `_optimizer_step_post_hooks`, `_optimizer_state_dict_*`) and
    instance attributes shadowing a method (`step`, PRISM's `step`/`_move`/`_gather`, DP-Muon's `orthogonalize`)
    are not.
    Expected: `ungoverned_update` at the next check (draw, forward, update), nothing moved: e.g. `Weights` also
    refuses a non-empty instance hook dict of the run's optimizer and any instance attribute of the optimizer, PRISM
    or DP-Muon that shadows a method of its class (as the guard does for the model's modules); the reference kept
    immutable (a frozen record of RUN.toml's values and the schedule, as the house style keeps internal values)."""
    mechanism, steering = OPTIMIZER[how]
    _inert_or_refused(tmp_path, tiny_model, steering, mechanism=mechanism)


# -- 2. model state the forward reads that neither Weights nor the guard compares (MEDIUM) -----------------------


def _embeddings(run):
    return run.model.base_model.model.bert.embeddings


def _buffer_written(run, loss: float) -> None:
    positions = _embeddings(run).position_ids
    positions.copy_(torch.full_like(positions, int(1 + 10 * loss) % 16))  # every token at one position


def _buffer_replaced(run, loss: float) -> None:
    embeddings = _embeddings(run)
    embeddings.position_ids = torch.full_like(embeddings.position_ids, int(1 + 10 * loss) % 16)


def _lora_scaling(run, loss: float) -> None:
    for module in run.model.modules():
        if isinstance(getattr(module, "scaling", None), dict):  # peft's LoraLayer: alpha / r per adapter
            for adapter in module.scaling:
                module.scaling[adapter] *= 1.0 + 10 * loss


def _attention_scaling(run, loss: float) -> None:
    for module in run.model.modules():
        if type(getattr(module, "scaling", None)) is float:  # BertSelfAttention's 1/sqrt(head size)
            module.scaling = 1.0 + 10 * loss


def _train_mode(run, loss: float) -> None:
    run.model.train(loss > 0)  # the model loads in eval mode: dropout (0.1) on, from the data


def _seeded_dropout(run, loss: float) -> None:
    run.model.train()
    torch.manual_seed(int(loss * 1e6))  # dropout's masks at step 1: torch's global generator, seeded from the data


def _seeded_honestly(run, loss: float) -> None:
    run.model.train()
    torch.manual_seed(12345)


MODEL = {"a buffer written in place (position_ids)": _buffer_written,
         "a buffer replaced (position_ids)": _buffer_replaced,
         "peft's LoRA scaling": _lora_scaling,
         "an attention module's scaling": _attention_scaling,
         "train/eval mode (dropout)": _train_mode}


@pytest.mark.parametrize("how", sorted(MODEL))
def test_review_model_state_the_forward_reads_set_between_steps_is_refused_or_inert(tmp_path: Path, tiny_model: Path,
                                                                                   how: str):
    """Attack: between governed steps the loop sets, from step 0's non-noised training loss, state of `run.model`
    that every example's forward reads and that is neither a parameter, a module, a method, a hook nor a config:
    a registered buffer (BERT's `position_ids`, written in place or replaced), peft's per-adapter `scaling`
    (lora_alpha / r), BertSelfAttention's float `scaling`, the modules' `training` flag (dropout on or off).
    `Weights.changed` compares parameters and the update's state; the guard's `structure`/`fingerprint` compares
    modules, methods, hooks and configs by identity: none of them sees these.
    Impact: every example's clipped gradient at step 1 is a function of all the data (for neighbouring data sets
    the clipped sums differ in every term, not by one example's C); the released adapter follows it, the spend is
    the same and the run is recorded. The docs promise "a model changed after the run opened" is refused and
    "no frozen one may have been written in place"; a buffer is a frozen tensor the forward reads.
    Expected: refused at the next governed forward (`ungoverned_batch`/`ungoverned_update`, nothing moved), e.g.
    the run keeps every buffer's identity and version (value), each module's `training` flag and its plain
    non-callable attributes as opened; or the governed forward fixes them itself (then step 1 equals the honest
    run's)."""
    _inert_or_refused(tmp_path, tiny_model, MODEL[how])


def test_review_dropout_masks_drawn_from_a_generator_the_loop_seeded_from_the_data_are_refused_or_inert(
        tmp_path: Path, tiny_model: Path):
    """Attack: in train mode (a Trainer always trains so; the loop may too) dropout's masks come from torch's
    global generator, which the loop may seed between steps: here from step 0's non-noised loss, against an honest
    run seeding a constant. Nothing compares or owns that generator (the rehearsal puts back only its own use).
    Impact: every example's masked forward, hence its clipped gradient, at step 1 is a function of all the data;
    the release follows it with the spend unchanged (the masks are a function of the data the loop chose).
    Expected: the governed forward draws its randomness from the run's own keyed generator (torch.random.fork_rng
    seeded from the sampling key and the step), so step 1 is the same whatever the loop seeded; or train mode with
    active dropout is refused."""
    _inert_or_refused(tmp_path, tiny_model, _seeded_dropout, _seeded_honestly)


class _ScaleOnEvaluate(transformers.TrainerCallback):
    """The issue's proof with another knob: on an evaluation of admitted rows, LoRA's scaling = 8·(1 + eval_loss)."""

    def __init__(self, run, url: str) -> None:
        self.run, self.url = run, url
        self.set = False
        self.ledger: bytes | None = None

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if not self.set:
            _lora_scaling(self.run, metrics["eval_loss"] / 10)
            self.set, self.ledger = True, snapshot(self.url)


def test_review_a_trainer_callback_setting_lora_scaling_from_an_evaluation_is_refused(tmp_path: Path,
                                                                                     tiny_model: Path):
    """Attack: the issue's proof through another knob. A `GovernedTrainer` evaluates a contribution's admitted rows
    (no selection setting on) and its `on_evaluate` multiplies every LoRA layer's `scaling` by 1 + eval_loss; the
    next governed steps' forwards and gradients read it.
    Impact: as the issue's lr = 5·eval_loss: the released adapter depends on the evaluated rows, the spend is the
    same and the run is recorded (today `train()` completes and writes the run entry).
    Expected: refused at the next governed forward (`ungoverned_batch`/`ungoverned_update`), no run entry."""
    corpus = _corpus(tmp_path, "trainer")
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 4), corpus.url, insecure_seed=1, **QUIET) as run:
        callback = _ScaleOnEvaluate(run, corpus.url)
        trainer = GovernedTrainer(run, args=_evaluating(tmp_path), eval_dataset=_admitted(run),
                                  processing_class=run.tokenizer, callbacks=[callback])
        refused = None
        try:
            trainer.train()
        except ConfigError as error:
            refused = error
        assert callback.set, "the callback never ran: the test proves nothing"
        assert refused is not None and refused.code in REFUSALS, (
            f"a LoRA scaling set from an evaluation of admitted rows was trained under and the run recorded "
            f"(adapter {run.result.adapter_sha256})")
    assert "run" not in verify_ledger(corpus.url).by_kind


# -- 3. the schedule: chosen again after a kill before the first checkpoint; recorded nowhere (LOW-MEDIUM) --------


def test_review_a_schedule_chosen_again_after_a_kill_before_the_first_checkpoint_is_refused(tmp_path: Path,
                                                                                          tiny_model: Path):
    """Attack: open, `set_schedule("constant")`, take step 0 and read its non-noised loss, then die (an exception
    leaves the block: the state stays the last checkpoint's, written with the epoch's spend ahead at step 0).
    Open the same config again and choose the schedule from that loss: `Run.prepare` keeps a state's schedule only
    when `state["step"]` is non-zero (`self.schedule = state["schedule"] if state["step"] else None`), so the run
    takes it. The re-run draws the same rows under the spend already written (never written again).
    Impact: exactly what commit 930dea4 says it closes ("a schedule chosen again after seeing the first steps'
    loss would follow the data"): the released adapter follows step 0's loss on admitted rows; the spend is the
    same. (`checkpoint_every` defaults to 10: every kill in the first 10 steps reopens the choice.)
    Expected: once an epoch's spend is written ahead (the state has a pending epoch), the state's schedule is
    kept, and `set_schedule` with another is `ungoverned_update`, nothing changed."""
    corpus = _corpus(tmp_path, "killed")
    config = _config(corpus, tiny_model, 4)
    with pytest.raises(RuntimeError, match="killed"):
        with govtrain.GovernedRun.open(config, corpus.url, insecure_seed=1, **QUIET) as run:
            run.set_schedule("constant")
            _step_once(run, corpus)
            seen = run.result.losses[-1]  # step 0's non-noised training loss
            raise RuntimeError("killed")
    with govtrain.GovernedRun.open(config, corpus.url, insecure_seed=1, **QUIET) as run:
        assert run.steps == 0  # the last checkpoint: the write-ahead, step 0
        kind = "cosine" if seen > 0 else "linear"  # a schedule chosen from the loss it saw
        ledger = snapshot(corpus.url)
        with pytest.raises(ConfigError) as refused:
            run.set_schedule(kind, warmup_steps=1)
        assert refused.value.code is Code.UNGOVERNED_UPDATE, refused.value
        assert run.schedule.kind == "constant" and snapshot(corpus.url) == ledger


def test_review_the_release_records_the_schedule_its_rates_followed(tmp_path: Path, tiny_model: Path):
    """Attack (on the audit): the schedule is the one hyperparameter of the update that is not RUN.toml's (whose
    hash the run entry records): `set_schedule` or the Trainer's `lr_scheduler_type`/`warmup_*` choose it in user
    code, after the user could read `run.admitted_rows`. The run cannot know what the choice read; but today the
    ledger's run entry, the adapter's govtrain.json and its card record nothing of it, so two releases under
    the same config hash and spend may follow different rates, and no auditor or re-run can tell which.
    Impact: the promise "every hyperparameter is RUN.toml's on the run's schedule" is unverifiable after the fact;
    a data-chosen kind/warm-up (log2 of 4·steps choices) is invisible.
    Expected: the release records the schedule (kind and warm-up) where the verifier reads it: the run entry or
    the adapter's hashed govtrain.json (or the schedule moves into RUN.toml)."""
    corpus = _corpus(tmp_path, "recorded")
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 3), corpus.url, insecure_seed=1, **QUIET) as run:
        run.set_schedule("cosine", warmup_steps=1)
        _loop(run)
        run.save()
    output = corpus.dir / "adapter"
    texts = {p.name: p.read_text() for p in output.iterdir() if p.suffix in (".json", ".md")}
    with Ledger.open(corpus.url) as ledger:
        entry = json.dumps(recorded_entry(ledger, "test-run"), default=str)  # the run entry as checkpoints sign it
    said = [name for name, text in texts.items() if "cosine" in text] + (["the run entry"] if "cosine" in entry else [])
    assert said, f"the schedule (cosine, 1 warm-up step) is recorded in none of {sorted(texts)} nor the run entry"
