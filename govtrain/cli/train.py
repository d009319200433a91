"""`govtrain train --config RUN.toml --ledger URL [--check] [--yes]`: governed DP-LoRA training (exit 0, 2, 3, 5)."""

from __future__ import annotations

import os
from pathlib import Path

import click

from govtrain.cli.output import CONTEXT_SETTINGS, Command, emit_json, json_option, ledger_option, reports_errors
from govtrain.cli.output import signing_key_option
from govtrain.errors import Code, ConfigError


@click.command("train", cls=Command, context_settings=CONTEXT_SETTINGS)
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False), help="Run config (TOML).")
@ledger_option
@signing_key_option
@click.option("--check", is_flag=True,
              help="Run everything up to the first spend (the rehearsal included), print the plan and stop: "
                   "nothing is spent or written.")
@click.option("--yes", "confirm", is_flag=True,
              help="Charge contributions that other runs on this ledger already charged (refused without it).")
@click.option("--insecure-seed", type=int, default=None,
              help="INSECURE, for tests only: a fixed seed for sampling and noise (default: OS entropy).")
@click.option("--nproc", type=click.IntRange(1, 1024), default=1, show_default=True,
              help="Train as this many processes on this machine (gloo on CPU, NCCL on GPUs; docs/distributed.md). "
                   "Under torchrun, leave it out.")
@json_option
@reports_errors
def train_command(config_path: str, ledger_url: str, key_path: str | None, check: bool, confirm: bool,
                  insecure_seed: int | None, nproc: int, as_json: bool) -> None:
    """Train a LoRA adapter on admitted contributions: spend written ahead per ledger epoch, every
    per-sample gradient restricted to its class's profile, clipped to its own bound and noised by the
    run's mechanism (dpsgd, prism or dp-muon). A rehearsal of synthetic rows runs first and spends nothing."""
    from govtrain.distributed.world import in_launch
    from govtrain.train.config import load_run_config
    from govtrain.train.loop import train

    if nproc > 1 and not in_launch():  # this process launches the ranks, each of which runs this command
        from govtrain.distributed.launch import launch

        load_run_config(config_path)  # a bad config is refused here, once, before any rank starts
        arguments = ["train", "--config", str(Path(config_path).resolve()), "--ledger", ledger_url]
        arguments += ["--key", str(Path(key_path).resolve())] if key_path else []
        arguments += ["--check"] * check + ["--yes"] * confirm + ["--json"] * as_json
        arguments += ["--insecure-seed", str(insecure_seed)] if insecure_seed is not None else []
        raise SystemExit(launch(arguments, nproc))
    if nproc > 1 and int(os.environ.get("WORLD_SIZE", "1")) != nproc:
        raise ConfigError(Code.USAGE, f"--nproc {nproc} under a launcher of WORLD_SIZE={os.environ.get('WORLD_SIZE')}"
                                      ": leave --nproc out under torchrun")
    lead = int(os.environ.get("RANK", "0") or 0) == 0
    if insecure_seed is not None:
        click.echo("warning: --insecure-seed makes sampling and noise predictable; never use it for real data",
                   err=True)
    config = load_run_config(config_path)
    result = train(config, ledger_url, key=key_path, insecure_seed=insecure_seed,
                   log=(lambda line: click.echo(line, err=True)) if as_json else click.echo, progress=True,
                   confirm=confirm, check=check)
    if not lead:  # the lead reports the run; the other ranks' results are its own
        return
    if check:
        assert result.plan is not None
        if as_json:
            emit_json({"ok": True, "check": True, "run_id": result.run_id, "plan": result.plan.as_json()})
        return
    if as_json:
        emit_json({"ok": True, "run_id": result.run_id, "steps": result.steps, "epochs": result.epochs,
                   "eps_by_class": result.eps_by_class, "adapter_sha256": result.adapter_sha256.hex()})
    else:
        click.echo(f"{result.run_id}: {result.steps} steps; adapter saved to {config.output_dir}")
