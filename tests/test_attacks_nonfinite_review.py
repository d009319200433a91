"""Adversarial review of issue 34 item 2 (a non-finite unit contributes zero; `diverged`; `nonfinite_release`).

Each test here FAILS on the code under review and states the behaviour that would make it pass. They reuse the
helpers of tests/test_attacks_nonfinite.py (a tiny BERT, a public contribution "pub" and a contribution "example"
whose loss is made nan for its rows, as a crafted text whose loss overflows would be)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from govtrain.errors import Code, ConfigError  # noqa: E402
from govtrain.train import loop  # noqa: E402
from govtrain.train.config import load_run_config  # noqa: E402
from tests.test_attacks_nonfinite import _poisoned_task, tiny, world  # noqa: E402,F401
from tests.test_distributed import spends  # noqa: E402


def _outcome(folder: Path, model: Path, monkeypatch, *, poison: bool, limit: int | None, steps: int = 8):
    """One run of `world()` through `train()`: ((how it ended), the spend entries of the contribution "pub").
    `poison`: the contribution "example" holds text whose loss is nan (its gradient is not finite)."""
    corpus, config = world(folder, model, steps=steps, limit=limit)
    with monkeypatch.context() as patch:
        if poison:
            _poisoned_task(patch, (model / "vocab.txt").read_text().split("\n").index("example"))
        try:
            result = loop.train(load_run_config(config), corpus.url, insecure_seed=3, log=lambda line: None)
            ended: tuple = ("completed", result.steps)
        except ConfigError as error:
            ended = ("stopped", error.code)
    return ended, [entry for entry in spends(corpus.url) if entry[0] == "pub"]


def test_whether_one_contribution_s_gradient_is_finite_does_not_change_the_ledger_others_see(tmp_path, tiny,
                                                                                             monkeypatch):
    """Attack: a contributor admits text whose loss is nan or inf (or whose gradient overflows fp32). Under the
    default `training.max_nonfinite_units` (16), once enough of its rows are drawn the run stops with `diverged`,
    and from then on the ledger holds no spend entry, no epoch and no run entry for ANY contribution. Compare the
    neighbouring corpus in which only that contribution's content differs (same ids, classes, bounds: the public
    metadata docs/design.md §5 lets steer the mechanism): the run completes and the ledger holds every epoch.

    Impact: the ledger (published to auditors; each contributor reads its own spends) and the run's completion
    (its run entry, its release) are a deterministic function of private content: the count of non-finite units
    is released without noise and without a charge (sensitivity 1 per unit; a stop that happens with probability
    ≈1 on one corpus and 0 on its neighbour is ε = ∞). docs/design.md §5 "Predictable schedule": every quantity the
    accountant uses is fixed from public information before the step runs; here the horizon is not. The step
    released by a non-finite unit is (bit for bit) the one released by a zero contribution (tests/test_nonfinite.py),
    so the promise "a function of the unit alone" holds for the gradient but not for the run's public record.
    The count is also a sybil amplifier: K crafted contributions hold it at the limit, and the stop then reveals
    whether any other drawn unit's gradient was non-finite.

    Expected: what the ledger records for other contributions (and whether the run completes) does not depend on
    whether some unit's gradient was finite: either the count never stops the run (it is the operator's log, and
    the operator withdraws a contribution that keeps diverging), or the stop decision is itself a DP mechanism
    (a noised count against the threshold) charged on the ledger. Code: `train/run.py` `Run._count_nonfinite`."""
    poisoned = _outcome(tmp_path / "nan", tiny, monkeypatch, poison=True, limit=None)
    clean = _outcome(tmp_path / "finite", tiny, monkeypatch, poison=False, limit=None)
    assert clean[0] == ("completed", 8) and clean[1]
    assert poisoned[0] == clean[0], f"the run with a non-finite contribution {poisoned[0]}, its neighbour {clean[0]}"
    assert poisoned[1] == clean[1], "the public spend record of another contribution depends on private content"


def test_the_remedy_the_diverged_error_names_resumes_the_run(tmp_path, tiny, monkeypatch):
    """Attack (operator, low): a run stops with `diverged`; its one-line error says "lower the learning rate or fix
    the loss, then resume". Following the first half of that advice (the run's config with a lower `optimizer.lr`)
    cannot resume: the run state is pinned to the config's hash, and `train` refuses with `output_taken` ("holds
    the state of a run with another config"; once that folder holds an adapter: "holds another run's adapter"), a
    diagnosis that names neither the divergence nor the way out. Resuming with the same
    config and the same corpus draws the same units at the same step (the draw is keyed) and diverges again; what
    does work is withdrawing the contribution (or a loss that no longer overflows) and resuming with the same config.

    Impact: a misleading remedy on a stop that data can trigger; an operator who follows it ends in a second,
    unrelated error. Expected: the `diverged` line names a remedy that works (withdraw the contribution whose
    gradients are not finite, or fix the loss, then resume with the same config), or a lower learning rate resumes.
    Code: `train/run.py` `Run._count_nonfinite` (the message)."""
    corpus, config = world(tmp_path, tiny, steps=4, limit=0)
    with monkeypatch.context() as patch:
        _poisoned_task(patch, (tiny / "vocab.txt").read_text().split("\n").index("example"))
        with pytest.raises(ConfigError) as stopped:
            loop.train(load_run_config(config), corpus.url, insecure_seed=3, log=lambda line: None)
    assert stopped.value.code == Code.DIVERGED
    if "learning rate" in str(stopped.value):  # the advice, taken as written (and the loss no longer nan)
        config.write_text(config.read_text().replace("lr = 0.01", "lr = 0.001"))
        try:
            result = loop.train(load_run_config(config), corpus.url, insecure_seed=3, log=lambda line: None)
        except ConfigError as error:
            pytest.fail(f"the diverged error's remedy (a lower learning rate, then resume) is refused: {error}")
        assert result.steps == 4


@pytest.mark.parametrize("strategy,scale", [("auto", 1e17), ("materialize", 1e10)], ids=["auto", "materialize"])
def test_a_scaled_loss_whose_examples_cancel_moves_the_release_by_more_than_its_clip_norm(strategy, scale):
    """Attack (huge-but-finite, scaled losses): the documented loop computes its own per-example losses, here with
    a per-example weight read from the data (a common "sample weight" column), and the privacy unit is the
    contribution. The attacker's contribution holds the same text twice, weighted +H and -H (H = 1e10 to 1e17:
    finite, no overflow anywhere: the squared norms stay under 3e38), and a third example weighted 1. Its exact
    gradient is the third example's, but in fp32 what survives of ±H·g is a rounding residual: the unit's norm is
    finite (no `nonfinite` count), so it is clipped, and its coefficient C/‖·‖ is computed from ONE float evaluation
    of its gradient (the per-unit norm, `persample.Calls.sq_norms`: a ghost norm ⟨AAᵀ, GGᵀ⟩, or an einsum over the
    unit's tokens) while the released sum is ANOTHER (the weighted contraction over every unit's tokens at once,
    `Calls.weighted_sum`), whose residual differs and which also absorbs other units' terms next to the ±H ones.
    The measured norm is not the released vector's norm.

    Impact: removing that one contribution moves the (noise-free) clipped sum by 1.29 C under the router's default
    strategy (`per_sample = "auto"`, the one `train()` uses; H = 1e17), and by 1.24 C to 1.31 C under
    `"materialize"` (H from 1e10 to 1e14), while the ledger charges sensitivity C: ε is understated. The router's
    own safety margin is 8 ulp ("clip to a hair under C_i", `Router._clipped_sum`).

    Expected: a unit's released contribution is the very vector whose norm decided its coefficient (or the norm
    bounds every float evaluation of it, e.g. by a rounding allowance), so ‖release(D) - release(D without A)‖ ≤ C_A
    up to that margin. Code: `routing/persample.py` `Calls.sq_norms` / `Calls.weighted_sum`, `routing/router.py`
    `_clip`."""
    from tests.test_attacks_cancellation import _moved  # the same scenario, its fix's regression tests' own

    moved = _moved(strategy, scale)  # in units of C; every norm finite, nothing taken out or counted
    assert moved <= 1 + 1e-5, f"removing one contribution moved the clipped sum by {moved:.3f} C"


def _trainer_logs(folder: Path, model: Path, factor: float) -> list[dict]:
    """The training logs (those with a loss) of a GovernedTrainer over `world()`, its loss the task's with the rows
    of the contribution "example" multiplied by `factor` (the documented override point: `per_example_loss`)."""
    import math

    import transformers

    import govtrain
    from govtrain.integrations.hf import GovernedTrainer

    class Weighted(GovernedTrainer):
        def per_example_loss(self, outputs, batch):  # type: ignore[no-untyped-def]
            losses = super().per_example_loss(outputs, batch)
            hit = (batch.inputs["input_ids"] == token).any(1)
            return losses * torch.where(hit, factor, 1.0).to(losses.dtype)

    class Log(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.logs: list[dict] = []

        def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
            self.logs.append(dict(logs or {}))

    corpus, config = world(folder, model, steps=4, limit=1000)
    log = Log()
    arguments = transformers.TrainingArguments(output_dir=str(folder / "trainer"), use_cpu=True, logging_steps=1,
                                               save_strategy="no", lr_scheduler_type="constant", report_to=[],
                                               disable_tqdm=True)
    with govtrain.GovernedRun.open(str(config), corpus.url, insecure_seed=3, log=lambda line: None) as run:
        token = run.tokenizer.convert_tokens_to_ids("example")
        Weighted(run, args=arguments, callbacks=[log]).train()
    assert not math.isnan(factor) or run.nonfinite > 0  # the attack did happen
    return [entry for entry in log.logs if "loss" in entry]


def test_the_trainers_logs_carry_no_statistic_of_the_unnoised_gradients(tmp_path, tiny):
    """Attack (side channel): a contributor's text makes its loss nan (or its gradient overflow). The router then
    releases, bit for bit, what it releases when that contribution's loss is multiplied by 0
    (tests/test_nonfinite.py), so every privatized quantity a GovernedTrainer logs (`grad_norm`, `eps/<class>`,
    the learning rate) is the same on both. But each training log also carries `nonfinite_units`: the exact,
    un-noised count of drawn units whose per-sample gradient norm was not finite, a statistic of the un-noised
    per-sample gradients (sensitivity 1 per unit, no noise, no charge). Those logs are what `report_to` sends to
    TensorBoard, W&B or MLflow and what each checkpoint's `trainer_state.json` keeps: a place a third party
    reads.

    Impact: docs/monitoring.md promises the Trainer's logged gradient figure "is never a statistic of the un-noised
    gradients, which would leak"; this one is, and it counts, step by step, whether any drawn unit's gradient was
    finite. (The step's mean loss is logged as before; it is left out of this comparison.)

    Expected: the training logs of the two runs agree on every key but the loss: the count stays in the
    operator's own step log (`Run.log`) or is released only as a noised, charged figure. Code:
    `integrations/hf.py` `_Governed.log`."""
    import math

    nan, zero = _trainer_logs(tmp_path / "nan", tiny, math.nan), _trainer_logs(tmp_path / "zero", tiny, 0.0)
    assert len(nan) == len(zero) > 0
    for poisoned, plain in zip(nan, zero):
        released = {key: value for key, value in poisoned.items() if key != "loss"}
        assert released == {key: value for key, value in plain.items() if key != "loss"}, (poisoned, plain)
