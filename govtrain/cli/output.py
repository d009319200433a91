"""How the command line reports: one line per error, exit codes from one place (docs/design.md §7)."""

from __future__ import annotations

import functools
import json
import os
import sys
import traceback
from typing import Any, Callable

import click

from govtrain.errors import GovtrainError

CONTEXT_SETTINGS = {"max_content_width": 100, "terminal_width": 100, "help_option_names": ["-h", "--help"]}

EXIT_OK, EXIT_UNEXPECTED, EXIT_USAGE, EXIT_REJECTED, EXIT_INTEGRITY, EXIT_BUDGET = 0, 1, 2, 3, 4, 5
# Not an error: a release that verifies, one of whose contributions was withdrawn since (`govtrain release verify`).
EXIT_TAINTED = 6


def ledger_option(f):  # type: ignore[no-untyped-def]
    return click.option("--ledger", "ledger_url", envvar="GOVTRAIN_LEDGER", required=True, metavar="URL",
                        help="Ledger URL (sqlite:///PATH or a file path); default $GOVTRAIN_LEDGER.")(f)


def signing_key_option(f):  # type: ignore[no-untyped-def]
    return click.option("--key", "key_path", type=click.Path(dir_okay=False), default=None,
                        help="Ledger signing key; default $GOVTRAIN_LEDGER_KEY, then the path init recorded.")(f)


def json_option(f):  # type: ignore[no-untyped-def]
    return click.option("--json", "as_json", is_flag=True, help="Print a JSON object on stdout.")(f)


def read_input(path: str, what: str, *, text: bool = True) -> str | bytes:
    """The file a command argument names, or `bad_argument` saying which argument and why it cannot be read."""
    from pathlib import Path

    from govtrain.errors import Code, ConfigError

    try:
        return Path(path).read_text() if text else Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(Code.BAD_ARGUMENT, f"cannot read {what} {path}: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(Code.BAD_ARGUMENT, f"{what} {path} is not text ({e.reason} at byte {e.start})") from e


def emit_json(payload: dict) -> None:
    click.echo(json.dumps(payload, sort_keys=True))


def fail(error: GovtrainError, *, as_json: bool) -> None:
    """Print `error` (stderr line; JSON on stdout with --json) and exit with its family's code."""
    if as_json:
        emit_json(error.as_json())
    click.echo(error.line(), err=True)
    sys.exit(error.exit_code)


def reports_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a `GovtrainError` raised by a command into its one-line report and exit code."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except GovtrainError as error:
            fail(error, as_json=bool(kwargs.get("as_json")))

    return wrapper


class OneLineErrors:
    """Mixin for click commands: usage errors and crashes also print one `error[…]` line."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):  # type: ignore[no-untyped-def]
        try:
            result = super().main(  # type: ignore[misc]
                args=args, prog_name=prog_name, complete_var=complete_var, standalone_mode=False, **extra
            )
        except click.UsageError as e:
            where = e.ctx.command_path if e.ctx is not None else (prog_name or "govtrain")
            click.echo(f"error[usage]: {e.format_message()} (see: {where} --help)", err=True)
            sys.exit(EXIT_USAGE)
        except click.ClickException as e:
            click.echo(f"error[usage]: {e.format_message()}", err=True)
            sys.exit(e.exit_code)
        except click.Abort:
            click.echo("error[aborted]: interrupted", err=True)
            sys.exit(EXIT_UNEXPECTED)
        except GovtrainError as e:
            click.echo(e.line(), err=True)
            sys.exit(e.exit_code)
        except (SystemExit, KeyboardInterrupt):
            raise
        except Exception as e:  # a bug: say so in one line; GOVTRAIN_DEBUG=1 shows the traceback
            if os.environ.get("GOVTRAIN_DEBUG"):
                traceback.print_exc()
            click.echo(f"error[internal]: {type(e).__name__}: {e} (rerun with GOVTRAIN_DEBUG=1 for details)",
                       err=True)
            sys.exit(EXIT_UNEXPECTED)
        if not standalone_mode:
            return result
        sys.exit(result if isinstance(result, int) else EXIT_OK)


class Group(OneLineErrors, click.Group):
    pass


class Command(OneLineErrors, click.Command):
    pass
