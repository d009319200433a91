"""`govtrain ledger …`: checkpoints, proofs, retention, status and verification."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from govtrain.cli.output import (
    CONTEXT_SETTINGS,
    Command,
    Group,
    emit_json,
    json_option,
    ledger_option,
    read_input,
    reports_errors,
    signing_key_option,
)
from govtrain.cli.verify import run_verify, verify_options
from govtrain.errors import Code, ConfigError, IntegrityError

if TYPE_CHECKING:
    from govtrain.ledger.checkpoint import NoteKey


def _write_new(path: str, text: str) -> None:
    target = Path(path)
    if target.exists():
        raise ConfigError(Code.BAD_ARGUMENT, f"{target} already exists; choose another --out")
    target.write_text(text)


@click.group(cls=Group, context_settings=CONTEXT_SETTINGS)
def ledger() -> None:
    """Inspect, prove, compact and audit a ledger."""


@ledger.command("verify", cls=Command, context_settings=CONTEXT_SETTINGS)
@verify_options
def ledger_verify(ledger_url: str, trusted: tuple[str, ...], skip_attestations: bool, skip_spend: bool,
                  integrity_only: bool,
                  as_json: bool) -> None:
    """Audit the whole ledger (same as govtrain-verify). Exit 0 ok, 4 integrity failure."""
    run_verify(ledger_url, trusted, skip_attestations, skip_spend, integrity_only, as_json)


@ledger.command("checkpoint", cls=Command, context_settings=CONTEXT_SETTINGS)
@ledger_option
@signing_key_option
@click.option("--out", "out_path", type=click.Path(dir_okay=False), help="Also write the note to FILE.")
@reports_errors
def ledger_checkpoint(ledger_url: str, key_path: str | None, out_path: str | None) -> None:
    """Sign and store a checkpoint of the ledger now; print the signed note."""
    from govtrain.ledger.ledger import Ledger

    with Ledger.open(ledger_url, key=key_path) as opened:
        checkpoint = opened.checkpoint()
    if out_path:
        _write_new(out_path, checkpoint.note)
    click.echo(checkpoint.note, nl=False)


@ledger.command("prove", cls=Command, context_settings=CONTEXT_SETTINGS)
@click.argument("contribution_id")
@ledger_option
@click.option("--checkpoint", "checkpoint_path", type=click.Path(dir_okay=False),
              help="Prove against this checkpoint note instead of the latest.")
@click.option("--out", "out_path", type=click.Path(dir_okay=False), help="Also write the proof to FILE.")
@reports_errors
def ledger_prove(contribution_id: str, ledger_url: str, checkpoint_path: str | None, out_path: str | None) -> None:
    """Print an inclusion proof (c2sp.org/tlog-proof@v1) of a contribution's admit entry. Exit 3 if unknown."""
    from govtrain.ledger.ledger import Ledger

    note = read_input(checkpoint_path, "--checkpoint") if checkpoint_path else None
    with Ledger.open(ledger_url) as opened:
        text = opened.prove(contribution_id, note).text()
    if out_path:
        _write_new(out_path, text)
    click.echo(text, nl=False)


@ledger.command("verify-proof", cls=Command, context_settings=CONTEXT_SETTINGS)
@click.argument("proof_path", type=click.Path(dir_okay=False))
@click.option("--key", "key_path", type=click.Path(dir_okay=False),
              help="The ledger's public key (PEM); needs --origin.")
@click.option("--origin", default=None, metavar="ORIGIN",
              help="The origin of the ledger you expect (its checkpoints' first line, the policy's origin).")
@click.option("--name", "key_name", default=None, help="The key's name in checkpoints; default: the origin.")
@click.option("--vkey", default=None, metavar="NAME+ID+KEY",
              help="Instead of --key: the ledger's C2SP verifier key; its name is the origin unless --origin.")
@click.option("--attestation", "attestation_path", type=click.Path(dir_okay=False),
              help="Also check that the proven entry records this .cose file.")
@json_option
@reports_errors
def ledger_verify_proof(proof_path: str, key_path: str | None, origin: str | None, key_name: str | None,
                        vkey: str | None, attestation_path: str | None, as_json: bool) -> None:
    """Check an inclusion proof offline against the ledger you expect. Exit 0 ok, 4 if it does not verify."""
    from govtrain.ledger.proof import verify_proof

    key, origin = _proof_key(key_path, origin, key_name, vkey)
    try:
        text = Path(proof_path).read_text()
    except OSError as e:
        raise ConfigError(Code.BAD_ARGUMENT, f"cannot read proof {proof_path}: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise IntegrityError(Code.BAD_PROOF, f"proof {proof_path} is not text; a proof is the c2sp.org/tlog-proof "
                                             "file `govtrain ledger prove` wrote") from e
    attestation = read_input(attestation_path, "--attestation", text=False) if attestation_path else None
    verified = verify_proof(text, [key], origin=origin, attestation=attestation)
    entry = verified.entry
    if as_json:
        emit_json({"ok": True, "contribution_id": entry["contribution_id"], "data_class": entry["data_class"],
                   "index": verified.index, "checkpoint_size": verified.checkpoint.size,
                   "origin": verified.checkpoint.origin})
    else:
        click.echo(f"ok: {entry['contribution_id']} (class {entry['data_class']}) is entry {verified.index} of "
                   f"{verified.checkpoint.origin}, signed at size {verified.checkpoint.size}")


def _proof_key(key_path: str | None, origin: str | None, key_name: str | None,
               vkey: str | None) -> tuple["NoteKey", str]:
    """The verifier key and the origin a proof must be for, from the caller's arguments only: a proof
    names its own origin, and one ledger key may sign several ledgers."""
    from govtrain.attest.keys import load_public_key
    from govtrain.ledger.checkpoint import NoteError, NoteKey

    if vkey is not None:
        if key_path is not None or key_name is not None:
            raise ConfigError(Code.USAGE, "give either --vkey NAME+ID+KEY or --key FILE --origin ORIGIN [--name], "
                              "not both")
        try:
            key = NoteKey.from_vkey(vkey)
        except NoteError as e:
            raise ConfigError(Code.BAD_ARGUMENT, f"--vkey: {e.detail}") from e
        return key, origin if origin is not None else key.name
    if key_path is None:
        raise ConfigError(Code.USAGE, "give the ledger's public key and origin: --key FILE --origin ORIGIN "
                          "(or --vkey NAME+ID+KEY)")
    if origin is None:
        raise ConfigError(Code.USAGE, "--key needs --origin ORIGIN: the origin of the ledger you expect the proof "
                          "to come from (its policy's origin); the proof's own origin is not trusted")
    public_key = load_public_key(key_path)
    try:
        return NoteKey(key_name or origin, public_key), origin
    except ValueError as e:
        raise ConfigError(Code.BAD_ARGUMENT, f"key name {key_name or origin!r}: {e}; give --name") from e


@ledger.command("compact", cls=Command, context_settings=CONTEXT_SETTINGS)
@ledger_option
@click.option("--before-epoch", required=True, type=int, help="Summarize entries of epochs before N.")
@signing_key_option
@json_option
@reports_errors
def ledger_compact(ledger_url: str, before_epoch: int, key_path: str | None, as_json: bool) -> None:
    """Retention: one summary entry per class, then drop the summarized bodies (leaf hashes stay)."""
    from govtrain.ledger.ledger import Ledger

    with Ledger.open(ledger_url, key=key_path) as opened:
        summarized = opened.compact(before_epoch)
    if as_json:
        emit_json({"ok": True, "redacted": len(summarized), "first_seq": summarized[0].seq,
                   "last_seq": summarized[-1].seq})
    else:
        click.echo(f"summarized and redacted {len(summarized)} entries ({summarized[0].seq}..{summarized[-1].seq})")


@ledger.command("status", cls=Command, context_settings=CONTEXT_SETTINGS)
@ledger_option
@click.option("--contribution", "contribution_id", default=None, help="Show one contribution's history.")
@json_option
@reports_errors
def ledger_status_command(ledger_url: str, contribution_id: str | None, as_json: bool) -> None:
    """Entries, epochs, the last checkpoint, admissions and ε spent per class and per run, beside the
    budgets signed (or one contribution's history)."""
    from govtrain.ledger.ledger import Ledger
    from govtrain.ledger.status import contribution_status, ledger_status

    with Ledger.open(ledger_url) as opened:
        status = contribution_status(opened, contribution_id) if contribution_id else ledger_status(opened)
    if as_json:
        emit_json({"ok": True, **status})
    elif contribution_id:
        withdrawn = f"withdrawn at entry {status['withdrawn_seq']}" if status["withdrawn_seq"] is not None else "active"
        click.echo(f"{status['contribution_id']}: class {status['data_class']}, admitted at entry "
                   f"{status['admit_seq']}, {withdrawn}; ε spent {status['eps_u'] / 1e6:.6f} over "
                   f"{len(status['spend'])} epoch(s); in {status['checkpoints']['count']} checkpoint(s) from size "
                   f"{status['checkpoints']['first']}; {len(status['runs'])} run(s)")
        for t in status["tunes"]:
            click.echo(f"tuned by {t['tune_id']} (entry {t['seq']}): selected {t['selected_run_id'] or '-'}, total "
                       f"ε including tuning {t['class_eps_u'] / 1e6:.6f} for its class")
    else:
        _print_status(status)


def _eps_cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _print_status(status: dict) -> None:
    last = status["last_checkpoint"]
    click.echo(f"{status['origin']}: {status['entries']} entries, epoch {status['epoch']}, "
               f"{status['checkpoints']} checkpoints (last at size {last['size'] if last else '-'}), "
               f"{status['summaries']} summaries; ε per {status['privacy_unit']}")
    header = f"{'ε max':>9}{'ε median':>10}{'ε budget':>10}{'ε left':>9}"
    click.echo(f"{'class':<16}{'admitted':>10}{'withdrawn':>11}{'charged':>9}{header}")
    for name, row in sorted(status["classes"].items()):
        click.echo(f"{name:<16}{row['admitted']:>10}{row['withdrawn']:>11}{row['charged']:>9}"
                   f"{_eps_cell(row['eps_max']):>9}{_eps_cell(row['eps_median']):>10}"
                   f"{_eps_cell(row['eps_budget']):>10}{_eps_cell(row['eps_left_min']):>9}")
    if status["runs"]:
        click.echo(f"{'run':<26}{'epochs':>8}  {'class':<16}{'charged':>9}{header}")
    for run in status["runs"]:
        epochs = run["epochs"]
        span = f"{epochs[0]}" if len(epochs) == 1 else f"{epochs[0]}-{epochs[-1]}"
        for i, (name, row) in enumerate(run["classes"].items()):
            first = f"{run['run_id']:<26}{span:>8}" if i == 0 else " " * 34
            click.echo(f"{first}  {name:<16}{row['contributions']:>9}{_eps_cell(row['eps_max']):>9}"
                       f"{_eps_cell(row['eps_median']):>10}{_eps_cell(row['eps_budget']):>10}"
                       f"{_eps_cell(row['eps_left_min']):>9}")
    click.echo("ε: each contribution's cumulative ε as the ledger records it (a run's rows: as of its last spend)")
    click.echo("budget: the smallest budget its contributions signed; left: the least any of them has left")
    for t in status["tunes"]:
        by_class = ", ".join(f"{name} {eps / 1e6:.6f}" for name, eps in sorted(t["eps_by_class"].items()))
        click.echo(f"tune {t['tune_id']} (entry {t['seq']}): {len(t['trials'])} trials, selected "
                   f"{t['selected_run_id'] or '-'}; total ε including tuning {t['eps_u'] / 1e6:.6f} "
                   f"({by_class or 'none'}), {t['accounting']}")
