"""`govtrain release` (sign a run's adapter folder) and `govtrain release verify` (check a release): thin over
`govtrain.release` (docs/release-manifest.md). Verification exits 0 ok, 4 integrity failure, 6 tainted."""

from __future__ import annotations

import os
from pathlib import Path

import click

from govtrain.cli.output import (CONTEXT_SETTINGS, EXIT_TAINTED, Command, Group, emit_json, json_option, read_input,
                                 reports_errors)
from govtrain.errors import Code, ConfigError


def _check_new(path: Path, folder: Path) -> None:
    """`path` names a new file outside the adapter `folder` (a file inside would be one more file than the release
    lists): checked before anything is written."""
    if path.resolve().is_relative_to(folder.resolve()):
        raise ConfigError(Code.BAD_ARGUMENT, f"{path} is inside the adapter folder {folder}: write it elsewhere")
    if path.exists() or path.is_symlink():
        raise ConfigError(Code.BAD_ARGUMENT, f"{path} already exists; choose another name")


def _write_new(path: Path, data: bytes) -> None:
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise ConfigError(Code.BAD_ARGUMENT, f"{path} already exists; choose another name") from None
    except OSError as e:
        raise ConfigError(Code.BAD_ARGUMENT, f"cannot write {path}: {e.strerror}") from None
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(data)


@click.group("release", cls=Group, invoke_without_command=True, context_settings=CONTEXT_SETTINGS)
@click.option("--run", "run_id", metavar="RUN_ID", help="The run whose adapter is released.")
@click.option("--adapter", "adapter", type=click.Path(file_okay=False), help="Its adapter folder, as the run wrote it.")
@click.option("--out", "out_path", type=click.Path(dir_okay=False), help="The release manifest to write (FILE.dsse).")
@click.option("--ledger", "ledger_url", envvar="GOVTRAIN_LEDGER", metavar="URL",
              help="Ledger URL (sqlite:///PATH or a file path); default $GOVTRAIN_LEDGER.")
@click.option("--key", "key_path", type=click.Path(dir_okay=False),
              help="Release signing key (Ed25519 PEM, 0600), one of the policy's release_keys.")
@click.option("--base", default=None,
              help="The base model (local folder, Hugging Face id or minilm) where govtrain.json cannot find it.")
@click.option("--model-signing", "ms_out", type=click.Path(dir_okay=False), default=None,
              help="Also write an OpenSSF model-signing bundle (FILE.sig) over the same files.")
@click.option("--ms-key", "ms_key", type=click.Path(dir_okay=False), default=None,
              help="The P-256 private key (PEM, 0600) that signs --model-signing.")
@click.option("--yes", "confirm", is_flag=True,
              help="Sign it even where the run trained on a contribution withdrawn since (a gate refuses it as "
                   "tainted).")
@json_option
@click.pass_context
@reports_errors
def release_group(ctx: click.Context, run_id: str | None, adapter: str | None, out_path: str | None,
                  ledger_url: str | None, key_path: str | None, base: str | None, ms_out: str | None,
                  ms_key: str | None, confirm: bool, as_json: bool) -> None:
    """Sign a release manifest of a run's adapter: every file by SHA-256, and what it carries in privacy (ε per
    class and per trained group, the run entry with its inclusion proof and signed checkpoint, withdrawals).

    govtrain release --run RUN_ID --adapter DIR --out FILE.dsse --ledger URL --key RELEASE.key; check one with
    govtrain release verify FILE.dsse.
    """
    if ctx.invoked_subcommand is not None:
        if confirm or any(v is not None for v in (run_id, adapter, out_path, key_path, base, ms_out, ms_key)):
            raise ConfigError(Code.USAGE, f"options before `{ctx.invoked_subcommand}` belong to govtrain release "
                                          f"itself: give them after `{ctx.invoked_subcommand}`")
        return
    missing = [flag for flag, value in (("--run", run_id), ("--adapter", adapter), ("--out", out_path),
                                        ("--ledger", ledger_url), ("--key", key_path)) if value is None]
    if missing:
        raise ConfigError(Code.USAGE, f"govtrain release needs {', '.join(missing)} (or: govtrain release verify "
                                      "FILE.dsse --key PUB --ledger-key PUB)")
    if (ms_out is None) != (ms_key is None):
        raise ConfigError(Code.USAGE, "--model-signing and --ms-key go together")
    from govtrain.attest.keys import load_private_key
    from govtrain.ledger.ledger import Ledger
    from govtrain.release import dsse
    from govtrain.release.manifest import release_statement
    from govtrain.release.openssf import load_p256_key, model_signing_bundle
    from govtrain.release.predicate import statement_bytes

    folder = Path(adapter)
    outputs = [Path(out_path)] + ([Path(ms_out)] if ms_out is not None else [])
    if len({p.resolve() for p in outputs}) != len(outputs):
        raise ConfigError(Code.USAGE, "--out and --model-signing name the same file")
    for path in outputs:
        _check_new(path, folder)
    key = load_private_key(key_path)
    p256 = load_p256_key(ms_key) if ms_key is not None else None
    with Ledger.open(ledger_url) as ledger:
        statement = release_statement(ledger, run_id, folder, key=key, base=base, confirm=confirm)
    withdrawn = statement.predicate.withdrawn
    if withdrawn:  # confirmed (else refused above): said every time, on stderr
        names = ", ".join(w.contribution_id for w in withdrawn[:5]) + (f" and {len(withdrawn) - 5} more"
                                                                        if len(withdrawn) > 5 else "")
        click.echo(f"warning: run {run_id} trained on {len(withdrawn)} contribution(s) withdrawn since ({names}): "
                   "an inference gate refuses this release as tainted; train a run without them", err=True)
    envelope = dsse.sign(statement_bytes(statement), key)
    bundle = model_signing_bundle(statement, folder.resolve().name, p256) if p256 is not None else None
    _write_new(Path(out_path), envelope.to_json())
    if bundle is not None:
        _write_new(Path(ms_out), bundle)
    p = statement.predicate
    if as_json:
        emit_json({"ok": True, "out": out_path, "model_signing": ms_out, "run_id": run_id,
                   "files": len(statement.subject),
                   "checkpoint_size": p.ledger.checkpoint_size, "withdrawn": len(p.withdrawn),
                   "classes": {c.data_class: {"eps_u": c.eps_u, "adapter": c.adapter} for c in p.classes}})
        return
    from govtrain.release.card import eps_text

    classes = "; ".join(f"{c.data_class} ε {eps_text(c.eps_u)}" + (f" (only its adapter {c.adapter!r})" if c.adapter
                                                                   else "") for c in p.classes if c.contributions)
    click.echo(f"wrote {out_path}: run {run_id}'s adapter, {len(statement.subject)} files, under checkpoint "
               f"{p.ledger.checkpoint_size} of {p.ledger.origin}; {classes or 'no class trained'}; "
               f"{len(p.withdrawn)} withdrawn at release")
    if ms_out is not None:
        click.echo(f"wrote {ms_out}: the same files as an OpenSSF model-signing bundle (P-256)")


@release_group.command("verify", cls=Command, context_settings=CONTEXT_SETTINGS)
@click.argument("release_path", metavar="FILE.dsse", type=click.Path(dir_okay=False))
@click.option("--key", "key_path", required=True, type=click.Path(dir_okay=False),
              help="The release key you trust (Ed25519 public key, PEM).")
@click.option("--ledger-key", "ledger_key_paths", required=True, multiple=True, type=click.Path(dir_okay=False),
              help="A ledger public key you trust (PEM or a note verifier key), repeatable: checks the checkpoint.")
@click.option("--adapter", "adapter", type=click.Path(file_okay=False), default=None,
              help="Also check this folder's files against the release.")
@click.option("--ledger", "ledger_url", metavar="URL", default=None,
              help="Also check against the live ledger: it extends the release, and what was withdrawn since.")
@json_option
@reports_errors
def verify_command(release_path: str, key_path: str, ledger_key_paths: tuple[str, ...], adapter: str | None,
                   ledger_url: str | None, as_json: bool) -> None:
    """Verify a release manifest offline (signature, schema, inclusion proof, checkpoint); with --ledger, also
    against the live ledger. Exit 0 ok, 4 integrity failure, 6 tainted (withdrawn since the release, or before
    it: an inference gate refuses both)."""
    from govtrain.attest.keys import load_public_key
    from govtrain.release.verification import verify_release

    envelope = read_input(release_path, "the release", text=False)
    report = verify_release(envelope, release_key=load_public_key(key_path),
                            ledger_keys=[_ledger_key(path) for path in ledger_key_paths], adapter=adapter,
                            ledger=ledger_url)
    if as_json:
        emit_json(report.as_json())
    else:
        click.echo(str(report))
    if report.tainted:
        raise SystemExit(EXIT_TAINTED)


def _ledger_key(path: str):  # type: ignore[no-untyped-def]
    """A pinned ledger key: a PEM (or base64) public key file, or a file holding a note verifier key."""
    from govtrain.attest.keys import parse_public_key
    from govtrain.errors import GovtrainError
    from govtrain.ledger.checkpoint import NoteKey

    text = str(read_input(path, "--ledger-key"))
    try:
        return parse_public_key(text, source=f"--ledger-key {path}")
    except GovtrainError as e:
        if text.lstrip().startswith("-----"):
            raise
        try:
            return NoteKey.from_vkey(text)
        except (GovtrainError, ValueError):
            raise ConfigError(Code.BAD_PUBLIC_KEY, f"{e.detail}, and not a note verifier key (name+keyid+key)"
                              ) from None
