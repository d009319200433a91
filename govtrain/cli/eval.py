"""`govtrain eval --config RUN.toml --data FILE [--adapter DIR]`: held-out figures of a trained adapter (exit 0, 2)."""

from __future__ import annotations

from pathlib import Path

import click

from govtrain.cli.output import CONTEXT_SETTINGS, Command, emit_json, json_option, reports_errors


@click.command("eval", cls=Command, context_settings=CONTEXT_SETTINGS)
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False), help="Run config (TOML).")
@click.option("--data", "data_path", required=True, type=click.Path(dir_okay=False),
              help="Held-out rows in the run's task format (JSON Lines).")
@click.option("--adapter", "adapter_path", type=click.Path(file_okay=False), default=None,
              help="Adapter folder; default the config's training.output.")
@json_option
@reports_errors
def eval_command(config_path: str, data_path: str, adapter_path: str | None, as_json: bool) -> None:
    """Evaluate a trained adapter on held-out data: accuracy (classification) or per-token loss and
    perplexity (causal LM). Reads no ledger and writes nothing."""
    from govtrain.tasks import task_for
    from govtrain.train.config import load_run_config
    from govtrain.train.evaluate import evaluate, load_trained, read_examples
    from govtrain.train.model import resolve_device

    config = load_run_config(config_path)
    task = task_for(config.file)
    examples = read_examples(Path(data_path), task, (config.file.data.label_column,))  # refused before loading
    adapter = Path(adapter_path) if adapter_path is not None else config.output_dir
    model, tokenizer = load_trained(config, adapter)
    model.to(resolve_device(config.file.training.device))
    figures = evaluate(model, tokenizer, task, examples, config.file.model.max_length, on_batch=_progress(len(examples)))
    if as_json:
        emit_json({"ok": True, "adapter": str(adapter), "data": data_path, **figures})
    elif "accuracy" in figures:
        click.echo(f"{figures['examples']} examples: accuracy {figures['accuracy']:.4f} (always the majority "
                   f"label: {figures['majority']:.4f})")
    else:
        click.echo(f"{figures['examples']} examples, {figures['tokens']} target tokens: loss {figures['loss']:.4f} "
                   f"per token, perplexity {figures['perplexity']:.3f}")


def _progress(total: int):  # type: ignore[no-untyped-def]
    """Where stderr is not a terminal (a log, a pipe), a progress line on it at least every 30 s of batches."""
    import sys

    from govtrain.train.progress import ProgressLines

    if sys.stderr.isatty():
        return None
    lines = ProgressLines(lambda line: click.echo(line, err=True), total, what="example")
    return lines.update
