"""`govtrain-verify`: the auditor's entry point. It must never import torch."""

from __future__ import annotations

import click

from govtrain.cli.output import CONTEXT_SETTINGS, Command, emit_json, reports_errors


def verify_options(f):  # type: ignore[no-untyped-def]
    f = click.option("--json", "as_json", is_flag=True, help="Print the report as a JSON object on stdout.")(f)
    f = click.option("--ledger", "ledger_url", envvar="GOVTRAIN_LEDGER", required=True, metavar="URL",
                     help="Ledger URL (sqlite:///PATH or a file path); default $GOVTRAIN_LEDGER.")(f)
    return reports_errors(f)


def run_verify(ledger_url: str, as_json: bool) -> None:
    from govtrain.verify.verifier import inspect_ledger

    report = inspect_ledger(ledger_url)
    if as_json:
        emit_json(report.as_json())
    if report.error is not None:
        click.echo(report.error.line(), err=True)
        raise SystemExit(report.error.exit_code)
    if not as_json:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(report.by_kind.items()))
        click.echo(f"ok: {report.entries} entries verified ({kinds}); {report.admissions} admissions")


@click.command("govtrain-verify", cls=Command, context_settings=CONTEXT_SETTINGS)
@verify_options
def verify_cli(ledger_url: str, as_json: bool) -> None:
    """Audit a govtrain ledger without any training data. Exit 0 ok, 4 integrity failure (naming the
    first bad entry)."""
    run_verify(ledger_url, as_json)


def main() -> None:
    verify_cli.main(prog_name="govtrain-verify")
