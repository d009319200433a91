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

    note = Path(checkpoint_path).read_text() if checkpoint_path else None
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
    except (OSError, UnicodeDecodeError) as e:
        raise IntegrityError(Code.BAD_PROOF, f"cannot read proof {proof_path}") from e
    attestation = Path(attestation_path).read_bytes() if attestation_path else None
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
    """Entries, epochs, the last checkpoint and admissions per class (or one contribution's history)."""
    from govtrain.ledger.ledger import Ledger
    from govtrain.ledger.status import contribution_status, ledger_status

    with Ledger.open(ledger_url) as opened:
        status = contribution_status(opened, contribution_id) if contribution_id else ledger_status(opened)
    if as_json:
        emit_json({"ok": True, **status})
    elif contribution_id:
        withdrawn = f"withdrawn at entry {status['withdrawn_seq']}" if status["withdrawn_seq"] is not None else "active"
        click.echo(f"{status['contribution_id']}: class {status['data_class']}, admitted at entry "
                   f"{status['admit_seq']}, {withdrawn}; epsilon spent {status['eps_u'] / 1e6:.6f} over "
                   f"{len(status['spend'])} epoch(s); in {status['checkpoints']['count']} checkpoint(s) from size "
                   f"{status['checkpoints']['first']}; {len(status['runs'])} run(s)")
        for t in status["tunes"]:
            click.echo(f"tuned by {t['tune_id']} (entry {t['seq']}): selected {t['selected_run_id'] or '-'}, total "
                       f"epsilon including tuning {t['class_eps_u'] / 1e6:.6f} for its class")
    else:
        last = status["last_checkpoint"]
        click.echo(f"{status['origin']}: {status['entries']} entries, epoch {status['epoch']}, "
                   f"{status['checkpoints']} checkpoints (last at size {last['size'] if last else '-'}), "
                   f"{status['summaries']} summaries; epsilon per {status['privacy_unit']}")
        click.echo(f"{'class':<16}{'admitted':>10}{'withdrawn':>11}")
        for name, counts in sorted(status["classes"].items()):
            click.echo(f"{name:<16}{counts['admitted']:>10}{counts['withdrawn']:>11}")
        for t in status["tunes"]:
            by_class = ", ".join(f"{name} {eps / 1e6:.6f}" for name, eps in sorted(t["eps_by_class"].items()))
            click.echo(f"tune {t['tune_id']} (entry {t['seq']}): {len(t['trials'])} trials, selected "
                       f"{t['selected_run_id'] or '-'}; total epsilon including tuning {t['eps_u'] / 1e6:.6f} "
                       f"({by_class or 'none'}), {t['accounting']}")


@ledger.command("scratch", cls=Command, context_settings=CONTEXT_SETTINGS)
@click.option("--from", "source_url", envvar="GOVTRAIN_LEDGER", required=True, metavar="URL",
              help="The ledger to copy the policy and admissions of (read only); default $GOVTRAIN_LEDGER.")
@click.option("--data", "data_dir", required=True, type=click.Path(file_okay=False),
              help="The run's data folder (training.data): its files that URL admitted are admitted again.")
@click.option("--out", "out_dir", required=True, type=click.Path(), help="A new or empty folder to create it in.")
@json_option
@reports_errors
def ledger_scratch(source_url: str, data_dir: str, out_dir: str, as_json: bool) -> None:
    """Make a scratch ledger to develop against: the policy and admissions of --from, none of its spend, under
    an origin (scratch.invalid/...) and keys of its own. What a run charges there costs the real ledger nothing."""
    from govtrain.ledger.scratch import make_scratch

    scratch = make_scratch(out_dir, source_url=source_url, data=data_dir)
    if as_json:
        emit_json({"ok": True, "ledger": scratch.url, "origin": scratch.origin, "key": str(scratch.ledger_key),
                   "contributions": list(scratch.contributions), "unmatched": list(scratch.unmatched)})
        return
    click.echo(f"scratch ledger {scratch.url}: origin {scratch.origin}, its own keys in {scratch.folder / 'keys'}")
    click.echo(f"{len(scratch.contributions)} contribution(s) of {scratch.source_origin} admitted again with their "
               f"classes and bounds, no spend" + (f"; {len(scratch.unmatched)} file(s) of {data_dir} skipped (not "
                                                   "admitted there)" if scratch.unmatched else ""))
    click.echo(f"train against it: --ledger {scratch.url} --key {scratch.ledger_key} (and a training.output of "
               "its own)")
