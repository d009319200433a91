"""`govtrain-verify`: the auditor's entry point. It must never import torch."""

from __future__ import annotations

import click

from govtrain.cli.output import CONTEXT_SETTINGS, Command, emit_json, reports_errors


def verify_options(f):  # type: ignore[no-untyped-def]
    f = click.option("--json", "as_json", is_flag=True, help="Print the report as a JSON object on stdout.")(f)
    f = click.option("--skip-attestations", is_flag=True,
                     help="Do not re-verify the attestations recorded in admit entries (faster).")(f)
    f = click.option("--skip-spend", is_flag=True,
                     help="Do not recompute each recorded spend with the recorded accountant (faster).")(f)
    f = click.option("--integrity-only", is_flag=True,
                     help="Only sequence, leaf hashes, kinds, roots and checkpoint signatures, in bulk: no "
                          "content rules, attestations, spend, redaction coverage or index tables.")(f)
    f = click.option("--trusted-checkpoint", "trusted", multiple=True, type=click.Path(dir_okay=False),
                     help="A checkpoint note you already trust (repeatable): detects rollback and forks.")(f)
    f = click.option("--ledger", "ledger_url", envvar="GOVTRAIN_LEDGER", required=True, metavar="URL",
                     help="Ledger URL (sqlite:///PATH or a file path); default $GOVTRAIN_LEDGER.")(f)
    return reports_errors(f)


def run_verify(ledger_url: str, trusted: tuple[str, ...], skip_attestations: bool, skip_spend: bool,
               integrity_only: bool, as_json: bool) -> None:
    from pathlib import Path

    from govtrain.errors import Code, ConfigError
    from govtrain.verify.verifier import inspect_ledger, recorded_accountant

    try:
        notes = [Path(p).read_text() for p in trusted]
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(Code.BAD_ARGUMENT, f"cannot read a --trusted-checkpoint file: {e}") from e
    report = inspect_ledger(ledger_url, trusted_checkpoints=notes, attestations=not skip_attestations,
                            accountant=None if skip_spend else recorded_accountant, integrity_only=integrity_only)
    if as_json:
        emit_json(report.as_json())
    if report.error is not None:
        where = (f" (entry {report.bad_seq})" if report.bad_seq is not None else "") + (
            f" (checkpoint {report.bad_checkpoint})" if report.bad_checkpoint is not None else "")
        click.echo(report.error.line() + where, err=True)
        raise SystemExit(report.error.exit_code)
    if not as_json and integrity_only:
        from govtrain.verify.integrity import NOT_CHECKED

        click.echo(f"ok: {report.entries} entries verified, integrity only (sequence, leaf hashes, each body's kind, "
                   f"roots and signatures of {report.checkpoints} checkpoints); {report.trusted_checkpoints} trusted "
                   "checkpoint(s) consistent")
        click.echo(f"not checked: {'; '.join(NOT_CHECKED)}. Run without --integrity-only to check them.")
    elif not as_json:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(report.by_kind.items()))
        click.echo(f"ok: {report.entries} entries verified ({kinds}); {report.checkpoints} checkpoints; "
                   f"{report.admissions} admissions, {report.withdrawals} withdrawn; "
                   f"{report.trusted_checkpoints} trusted checkpoint(s) consistent")


@click.command("govtrain-verify", cls=Command, context_settings=CONTEXT_SETTINGS)
@verify_options
def verify_cli(ledger_url: str, trusted: tuple[str, ...], skip_attestations: bool, skip_spend: bool,
               integrity_only: bool, as_json: bool) -> None:
    """Audit a govtrain ledger without any training data. Exit 0 ok, 4 integrity failure (naming the
    first bad entry)."""
    run_verify(ledger_url, trusted, skip_attestations, skip_spend, integrity_only, as_json)


def main() -> None:
    verify_cli.main(prog_name="govtrain-verify")
