"""`govtrain privacy epsilon|sigma` (what-if accounting) and `govtrain plan` (per-class projection)."""

from __future__ import annotations

import click

from govtrain.cli.output import CONTEXT_SETTINGS, Command, Group, emit_json, json_option, ledger_option, reports_errors
from govtrain.errors import Code, ConfigError

ACCOUNTANT_CHOICES = click.Choice(["pld", "prv", "rdp"])


def _probability(*, one: bool):  # type: ignore[no-untyped-def]
    """A click callback: values in (0, 1], or (0, 1) when `one` is False."""

    def check(ctx, param, value):  # type: ignore[no-untyped-def]
        if value is not None and not (0 < value <= 1 if one else 0 < value < 1):
            raise click.BadParameter(f"must be in (0, 1{']' if one else ')'}, got {value:g}")
        return value

    return check


def _positive(ctx, param, value):  # type: ignore[no-untyped-def]
    if value is not None and not 0 < value < float("inf"):
        raise click.BadParameter(f"must be a finite number greater than 0, got {value:g}")
    return value


@click.group(cls=Group, context_settings=CONTEXT_SETTINGS)
def privacy() -> None:
    """What-if accounting: ε for a noise multiplier, or the noise multiplier for an ε."""


@privacy.command("epsilon", cls=Command, context_settings=CONTEXT_SETTINGS)
@click.option("--q", "sampling_rate", type=float, required=True, callback=_probability(one=True),
              help="Poisson sampling rate per step.")
@click.option("--sigma", type=float, required=True, callback=_positive, help="Noise multiplier.")
@click.option("--steps", type=click.IntRange(min=1), required=True, help="Number of steps T.")
@click.option("--delta", type=float, required=True, callback=_probability(one=False), help="Target δ.")
@click.option("--accountant", type=ACCOUNTANT_CHOICES, default="pld", show_default=True)
@click.option("--unit", type=click.Choice(["example", "contribution"]), default="example", show_default=True,
              help="What q samples and ε protects: one example, or one whole contribution (the policy's "
                   "privacy_unit; the accounting is the same at that unit's q).")
@click.option("--group", "group", type=click.IntRange(min=2), default=None, metavar="K",
              help="With --unit example: also the group-privacy bound for K examples of one contributor "
                   "(K·ε at K·exp((K-1)·ε)·δ), what an example-level run says about a contribution.")
@json_option
@reports_errors
def privacy_epsilon(sampling_rate: float, sigma: float, steps: int, delta: float, accountant: str, unit: str,
                    group: int | None, as_json: bool) -> None:
    """ε (an upper bound, rounded up to 1e-6) of T steps of the Poisson-subsampled Gaussian."""
    from govtrain.accounting import Bucket, get_accountant
    from govtrain.accounting.group import group_privacy

    if group is not None and unit != "example":
        raise ConfigError(Code.BAD_ARGUMENT, "--group converts an example-level ε; with --unit contribution the "
                                             "ε already covers the whole contribution")
    result = get_accountant(accountant).epsilon([Bucket(sampling_rate, sigma, steps)], delta)
    grouped = group_privacy(result.epsilon, delta, group) if group is not None else None
    if as_json:
        emit_json({"ok": True, "accountant": accountant, "eps": result.epsilon, "eps_u": result.epsilon_u,
                   "estimate": result.estimate, "lower": result.lower, "fallback": result.fallback,
                   "q": sampling_rate, "sigma": sigma, "steps": steps, "delta": delta, "unit": unit,
                   "group": None if grouped is None else {"size": group, "eps": grouped[0], "delta": grouped[1]}})
        return
    line = f"ε <= {result.epsilon:.6f} at δ = {delta:g} per {unit} ({accountant}"
    if result.estimate is not None:
        line += f"; estimate {result.estimate:.6f}, lower bound {result.lower:.6f}"
    click.echo(line + ")")
    if grouped is not None:
        vacuous = "  (vacuous: δ >= 1)" if grouped[1] >= 1 else ""
        click.echo(f"a group of {group} examples: ε <= {grouped[0]:.6f} at δ = {grouped[1]:.6g}{vacuous}")
    if result.fallback:
        click.echo(f"note: answered by {result.fallback}")


@privacy.command("sigma", cls=Command, context_settings=CONTEXT_SETTINGS)
@click.option("--epsilon", type=float, required=True, callback=_positive, help="Target ε.")
@click.option("--delta", type=float, required=True, callback=_probability(one=False), help="Target δ.")
@click.option("--q", "sampling_rate", type=float, default=None, callback=_probability(one=True),
              help="Sampling rate; with --steps, calibrate T subsampled steps. Omit both for one release.")
@click.option("--steps", type=click.IntRange(min=1), default=None, help="Number of steps T.")
@click.option("--accountant", type=ACCOUNTANT_CHOICES, default="pld", show_default=True)
@click.option("--sensitivity", type=float, default=1.0, show_default=True, callback=_positive,
              help="L2 sensitivity of a single release.")
@json_option
@reports_errors
def privacy_sigma(epsilon: float, delta: float, sampling_rate: float | None, steps: int | None, accountant: str,
                  sensitivity: float, as_json: bool) -> None:
    """The smallest noise multiplier (rounded up) that meets ε at δ.

    With --q and --steps: bisection on the accountant over T steps of the Poisson-subsampled Gaussian.
    Without them: one Gaussian release, by the analytic Gaussian mechanism (Balle & Wang 2018) next to
    the classical sqrt(2 ln(1.25/δ))/ε, which only holds for ε < 1.
    """
    from govtrain.accounting import calibrate

    if (sampling_rate is None) != (steps is None):
        raise ConfigError(Code.BAD_ARGUMENT, "give --q and --steps together (or neither, for a single release)")
    if sampling_rate is not None:
        try:
            result = calibrate.noise_multiplier_for(epsilon, delta, sampling_rate, steps, accountant)
        except ValueError as e:  # a target no noise multiplier meets: say which and why
            raise ConfigError(Code.BAD_ARGUMENT, f"--epsilon {epsilon:g} over {steps} steps at q = {sampling_rate:g}: "
                                                 f"{e}") from e
        if as_json:
            emit_json({"ok": True, "accountant": accountant, "sigma": result.noise_multiplier,
                       "sigma_u": result.noise_multiplier_u, "eps_at_sigma": result.epsilon_u / 1e6,
                       "evaluations": result.evaluations, "fallback": result.fallback, "q": sampling_rate,
                       "steps": steps, "delta": delta, "target_eps": epsilon})
            return
        click.echo(f"sigma >= {result.noise_multiplier:.6f} for ε <= {epsilon:g} at δ = {delta:g} over "
                   f"{steps} steps at q = {sampling_rate:g} ({accountant}: ε {result.epsilon_u / 1e6:.6f} there)")
        return
    analytic = calibrate.analytic_gaussian_sigma(epsilon, delta, sensitivity)
    classical = calibrate.classical_gaussian_sigma(epsilon, delta, sensitivity)
    if as_json:
        emit_json({"ok": True, "analytic_sigma": analytic, "classical_sigma": classical,
                   "classical_valid": epsilon < 1, "eps": epsilon, "delta": delta, "sensitivity": sensitivity})
        return
    click.echo(f"one Gaussian release, sensitivity {sensitivity:g}, ε {epsilon:g}, δ {delta:g}:")
    click.echo(f"  analytic (Balle & Wang 2018)  sigma >= {analytic:.6f}")
    click.echo(f"  classical (Dwork & Roth A.1)  sigma >= {classical:.6f}"
               + ("" if epsilon < 1 else "  (not a guarantee: the theorem needs ε < 1)"))


@click.command("plan", cls=Command, context_settings=CONTEXT_SETTINGS)
@ledger_option
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="A run config (RUN.toml): its steps, batch size, epoch length, model and LoRA; flags override.")
@click.option("--steps", type=click.IntRange(min=1), default=None, help="Steps the run would take.")
@click.option("--expected-batch-size", type=click.IntRange(min=1), default=None,
              help="Expected batch size B; q = B / eligible units (examples, or contributions under "
                   "privacy_unit = contribution), rounded up. Default: the policy's.")
@click.option("--model", "model", default=None, metavar="DIR",
              help="A local Hugging Face model directory, or 'minilm', to resolve each profile's parameters.")
@json_option
@reports_errors
def plan_command(ledger_url: str, config_path: str | None, steps: int | None, expected_batch_size: int | None,
                 model: str | None, as_json: bool) -> None:
    """Project a run: per class and per contribution, sigma_eff, ε at the end and retirement."""
    from govtrain.ledger.ledger import Ledger
    from govtrain.resolver.plan import plan_run

    config = None
    if config_path is not None:
        from govtrain.train.config import load_run_config

        config = load_run_config(config_path)
        training = config.file.training
        steps = steps or training.steps
        expected_batch_size = expected_batch_size or training.expected_batch_size
    if steps is None:
        raise ConfigError(Code.BAD_ARGUMENT, "give --steps, or --config with a run config")
    with Ledger.open(ledger_url) as opened:
        layout = None
        if config is not None and model is None:  # the run's own model: LoRA factors and head, as trained
            from govtrain.resolver.load import load_layout
            from govtrain.train.model import for_run, quiet_loading

            adapters = sorted({c.profile.adapter for c in opened.policy.classes.values() if c.profile.kind == "adapter"})
            with quiet_loading():  # peft and transformers deprecation notices are not the operator's business
                layout = load_layout(config.model_spec, config.file.model.num_labels,
                                     wrap=lambda base: for_run(base, config.file, adapters),
                                     task=config.file.model.task)
        elif model is not None:
            from govtrain.resolver.load import load_layout

            layout = load_layout(model)
        plan = plan_run(opened, steps, expected_batch_size, layout,
                        epoch_steps=config.file.training.epoch_steps if config is not None else None,
                        mechanism=config.file.training.mechanism if config is not None else "dpsgd",
                        privatizer=_privatizer(config))
    if as_json:
        emit_json(plan)
        return
    _print_plan(plan)


def _privatizer(config):  # type: ignore[no-untyped-def]
    """The run config's privatizer (RUN.toml [noise]), whose charge the plan projects; None without a config."""
    if config is None:
        return None
    from govtrain.privatizers import build

    return build(config.file.noise)


def _print_plan(plan: dict) -> None:
    if plan["privacy_unit"] == "contribution":
        unit = (f"{plan['eligible_contributions']} eligible contributions, each using at most "
                f"{plan['examples_per_contribution']} of its examples per step; ε protects a whole contribution")
    else:
        unit = f"{plan['eligible_records']} eligible examples; ε protects one example"
    click.echo(f"{plan['steps']} steps from ledger epoch {plan['first_epoch']} ({plan['steps_per_epoch']} steps each), "
               f"q = {plan['sampling_rate']:g} (expected batch {plan['expected_batch_size']:g} of {unit}), "
               f"{plan['accountant']} at δ = {plan['delta']:g}")
    if plan["compacted"]:
        click.echo(f"note: {plan['compacted']} compacted admission(s) cannot be planned")
    if plan["model"] is None:
        click.echo("no --model: each class counted as reaching only its own parameters (a conservative sigma_eff)")
    for group in plan["groups"]:
        click.echo(f"group {'+'.join(group['classes'])}: noise std {group['noise_std']:.6f} (first epoch)")
    click.echo(f"{'class':<14}{'profile':<28}{'n':>6}{'sigma_eff':>14}{'max ε':>10}{'retire':>8}  reaches")
    for name, row in plan["classes"].items():
        sigmas = ",".join(f"{s:g}" for s in row["sigma_eff"]) or "-"
        if "reaches" in row:
            reach = row["reaches"]
        elif "layers" in row:
            reach = f"layers {row['layers'] or '-'}: {row['parameters']} tensors, {row['scalars']:,} values"
        else:
            reach = "-"
        click.echo(f"{name:<14}{row['profile']:<28}{row['contributions']:>6}{sigmas:>14}"
                   f"{row['eps_projected_max']:>10.4f}{row['retiring']:>8}  {reach}")
    if plan["contributions"]:
        click.echo(f"\n{'contribution':<24}{'class':<14}{'sigma_eff':>10}{'ε now':>10}{'ε end':>10}"
                   f"{'budget':>9}{'retires at':>12}")
    for row in plan["contributions"]:
        sigma = f"{row['sigma_eff']:g}" if row["sigma_eff"] is not None else "-"
        retire = "-" if row["retires_at_step"] is None else str(row["retires_at_step"])
        click.echo(f"{row['contribution_id']:<24}{row['data_class']:<14}{sigma:>10}{row['eps_now']:>10.4f}"
                   f"{row['eps_projected']:>10.4f}{row['eps_budget']:>9g}{retire:>12}")
