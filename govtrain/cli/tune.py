"""`govtrain tune --config RUN.toml --grid GRID.toml --ledger URL`: a charged hyperparameter search (exit 0, 2,
3, 5)."""

from __future__ import annotations

import click

from govtrain.cli.output import CONTEXT_SETTINGS, Command, emit_json, json_option, ledger_option, reports_errors
from govtrain.cli.output import signing_key_option


@click.command("tune", cls=Command, context_settings=CONTEXT_SETTINGS)
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False),
              help="Base run config (TOML).")
@click.option("--grid", "grid_path", required=True, type=click.Path(dir_okay=False),
              help="Grid (TOML): [grid] RUN.toml keys to lists of values, [select] data and metric.")
@ledger_option
@signing_key_option
@click.option("--id", "tune_id", default=None, help="Tune id (default: generated); rerun with the same id to "
                                                      "resume a search that was interrupted.")
@click.option("--yes", "confirm", is_flag=True,
              help="Charge contributions that runs outside this search already charged (refused without it).")
@click.option("--insecure-seed", type=int, default=None,
              help="INSECURE, for tests only: a fixed seed for sampling and noise (default: OS entropy).")
@json_option
@reports_errors
def tune_command(config_path: str, grid_path: str, ledger_url: str, key_path: str | None, tune_id: str | None,
                 confirm: bool, insecure_seed: int | None, as_json: bool) -> None:
    """Search hyperparameters with every trial charged: each grid point is a governed training run
    (its spend written ahead like any run's), each adapter is scored on a held-out selection file
    that no contribution admitted, the best is selected, and one tune entry records the trials, the
    selection and the total ε their spend charged (plain composition)."""
    import time

    from govtrain.train.config import load_run_config
    from govtrain.train.tune import load_grid, new_tune_id, tune

    if insecure_seed is not None:
        click.echo("warning: --insecure-seed makes sampling and noise predictable; never use it for real data",
                   err=True)
    config = load_run_config(config_path)
    grid = load_grid(grid_path)
    tune_id = tune_id or new_tune_id(int(time.time()))
    result = tune(config, config_path, grid, ledger_url, tune_id=tune_id, key=key_path, insecure_seed=insecure_seed,
                  log=(lambda line: click.echo(line, err=True)) if as_json else click.echo,
                  train_options={"progress": True}, confirm=confirm)
    if as_json:
        emit_json({"ok": True, **result.as_json()})
        return
    click.echo(f"{'trial':<7}{'run':<32}{result.metric:>10}{'ε':>12}")
    for outcome in result.outcomes:
        click.echo(f"{outcome.trial.index:<7}{outcome.trial.run_id:<32}{outcome.score:>10.4f}{outcome.eps_u / 1e6:>12.6f}")
    assert result.selected is not None
    by_class = ", ".join(f"{name} {eps / 1e6:.6f}" for name, eps in sorted(result.eps_by_class.items()))
    click.echo(f"{tune_id}: selected trial {result.selected.trial.index} ({result.selected.trial.config.output_dir}); "
               f"total ε including tuning {result.eps_u / 1e6:.6f} ({by_class}), plain composition; "
               f"tune entry {result.seq}")
