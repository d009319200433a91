"""`govtrain`: a thin command line over the public API (docs/design.md §7)."""

from __future__ import annotations

import datetime as _dt
import os
import time
from pathlib import Path

import click

from govtrain import __version__
from govtrain.cli.output import (
    CONTEXT_SETTINGS,
    EXIT_OK,
    EXIT_REJECTED,
    Command,
    Group,
    emit_json,
    fail,
    json_option,
    ledger_option,
    reports_errors,
    signing_key_option,
)
from govtrain.cli.eval import eval_command
from govtrain.cli.ledger import ledger as ledger_group
from govtrain.cli.privacy import plan_command
from govtrain.cli.privacy import privacy as privacy_group
from govtrain.cli.release import release_group
from govtrain.cli.serve import rights as rights_group
from govtrain.cli.serve import serve_command
from govtrain.cli.train import train_command
from govtrain.cli.tune import tune_command
from govtrain.errors import AttestationError, Code, ConfigError

# Each command imports what it uses when it runs: SQLAlchemy and pydantic cost half a second to
# import, and `keys`, `attest` and --help need neither.
DEFAULT_VALID_DAYS = 90

MAX_ATTESTATION_BYTES = 64 * 1024


@click.group(cls=Group, context_settings=CONTEXT_SETTINGS)
@click.version_option(__version__, prog_name="govtrain")
def cli() -> None:
    """Governed differentially private training: signed contributions, depth routing, a verifiable ledger.

    Exit codes: 0 ok, 1 unexpected error, 2 usage or configuration, 3 rejected, 4 integrity failure,
    5 budget exhausted, 6 a release tainted by a withdrawal. Errors print one line: error[CODE]: what is wrong
    and what to do.
    """


# -- keys ---------------------------------------------------------------------------------


@cli.group(cls=Group, context_settings=CONTEXT_SETTINGS)
def keys() -> None:
    """Create Ed25519 key pairs for attesters and ledgers."""


@keys.command("generate", cls=Command, context_settings=CONTEXT_SETTINGS)
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Directory to write into.")
@click.option("--name", required=True, help="Writes NAME.key (PKCS#8 PEM, mode 0600) and NAME.pub (PEM).")
@json_option
@reports_errors
def keys_generate(out_dir: str, name: str, as_json: bool) -> None:
    """Generate an Ed25519 key pair; never overwrites an existing file."""
    from govtrain.attest.keys import generate_key_pair, key_id, load_private_key, raw_public_key

    private_path, public_path = generate_key_pair(out_dir, name)
    kid = key_id(raw_public_key(load_private_key(private_path).public_key())).hex()
    if as_json:
        emit_json({"ok": True, "private_key": str(private_path), "public_key": str(public_path), "key_id": kid})
    else:
        click.echo(f"wrote {private_path} (private, mode 0600) and {public_path}")
        click.echo(f"key id {kid}")


# -- init ---------------------------------------------------------------------------------


@cli.command("init", cls=Command, context_settings=CONTEXT_SETTINGS)
@click.option("--policy", "policy_path", required=True, type=click.Path(dir_okay=False),
              help="Corpus policy (TOML).")
@ledger_option
@click.option("--key", "key_path", required=True, type=click.Path(dir_okay=False),
              help="The ledger's Ed25519 signing key; its path (never the key) is remembered.")
@json_option
@reports_errors
def init(policy_path: str, ledger_url: str, key_path: str, as_json: bool) -> None:
    """Create a ledger whose first entry records the policy."""
    from govtrain.ledger.ledger import Ledger
    from govtrain.policy.config import load_policy
    from ledger_store import redacted_url

    policy, source_sha256 = load_policy(policy_path)
    with Ledger.init(ledger_url, policy, source_sha256, key_path=Path(key_path)) as ledger:
        head = ledger.store.head()
        assert head is not None
        if as_json:
            emit_json({"ok": True, "ledger": redacted_url(ledger.store.url), "origin": policy.origin,
                       "classes": sorted(policy.classes), "seq": head.seq, "leaf_hash": head.leaf_hash.hex()})
        else:
            click.echo(f"initialised {redacted_url(ledger.store.url)} for {policy.origin}: classes "
                       f"{', '.join(sorted(policy.classes))}; {len(policy.attesters)} attester key(s)")
            click.echo(f"header entry {head.seq}, leaf hash {head.leaf_hash.hex()}")


# -- attest -------------------------------------------------------------------------------


@cli.command("attest", cls=Command, context_settings=CONTEXT_SETTINGS)
@click.argument("data", type=click.Path())
@click.option("--key", "key_path", required=True, type=click.Path(dir_okay=False), help="Attester private key.")
@click.option("--contributor", required=True, help="Contributor identity.")
@click.option("--class", "data_class", required=True, help="Admissibility class, as named by the policy.")
@click.option("--clip-norm", required=True, help="Per-sample clipping norm C (rounded down to 1e-6).")
@click.option("--noise-multiplier", required=True, help="Noise multiplier sigma (rounded up to 1e-6).")
@click.option("--eps-budget", required=True, help="Most ε this contribution may be charged (rounded down).")
@click.option("--valid-days", default=DEFAULT_VALID_DAYS, show_default=True, type=int, help="Validity window.")
@click.option("--id", "contribution_id", default=None,
              help="Contribution id [A-Za-z0-9._:-]{1,128}; default derived from the data's SHA-256.")
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False), help="Where to write FILE.cose.")
@json_option
@reports_errors
def attest_command(data: str, key_path: str, contributor: str, data_class: str, clip_norm: str,
                   noise_multiplier: str, eps_budget: str, valid_days: int, contribution_id: str | None,
                   out_path: str, as_json: bool) -> None:
    """Sign an attestation (COSE_Sign1) describing a contribution's data.

    DATA is a .jsonl, .csv or .parquet file, or a directory written by datasets' save_to_disk.
    """
    from govtrain.attest.attest import attest

    cose, descriptor = attest(data, key=key_path, contributor=contributor, data_class=data_class,
                              clip_norm=clip_norm, noise_multiplier=noise_multiplier, eps_budget=eps_budget,
                              valid_days=valid_days, contribution_id=contribution_id)
    out = Path(out_path)
    try:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise ConfigError(Code.BAD_ARGUMENT, f"{out} already exists; choose another --out") from None
    with os.fdopen(fd, "wb") as handle:
        handle.write(cose)
    until = _dt.datetime.fromtimestamp(descriptor.not_after, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if as_json:
        emit_json({"ok": True, "out": str(out), "contribution_id": descriptor.contribution_id,
                   "data_class": descriptor.data_class, "records": descriptor.records,
                   "descriptor_sha256": descriptor.sha256().hex(), "not_after": descriptor.not_after})
    else:
        click.echo(f"wrote {out}: contribution {descriptor.contribution_id} (class {descriptor.data_class}, "
                   f"{descriptor.records} records), valid until {until}")


# -- admit --------------------------------------------------------------------------------


def _read_attestation(path: Path) -> bytes:
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_ATTESTATION_BYTES + 1)
    except OSError as e:
        raise AttestationError(Code.ATTESTATION_UNREADABLE, f"cannot read attestation {path}: {e.strerror}") from e
    return raw


def _batch_items(directory: Path) -> list[tuple[str, bytes, Path]]:
    if not directory.is_dir():
        raise ConfigError(Code.BAD_ARGUMENT, f"--batch {directory} is not a directory")
    items = []
    for cose_path in sorted(directory.glob("*.cose")):
        items.append((cose_path.name, cose_path.read_bytes(), cose_path.with_suffix("")))
    if not items:
        raise ConfigError(Code.BAD_ARGUMENT, f"--batch {directory} holds no *.cose files")
    return items


@cli.command("admit", cls=Command, context_settings=CONTEXT_SETTINGS)
@click.argument("attestation", required=False, type=click.Path(dir_okay=False))
@click.option("--data", "data_path", type=click.Path(),
              help="The data file or dataset directory the attestation binds.")
@click.option("--batch", "batch_dir", type=click.Path(file_okay=False),
              help="Admit every DIR/X.cose with its data DIR/X, a file or dataset directory (batched commits).")
@ledger_option
@signing_key_option
@json_option
@reports_errors
def admit_command(attestation: str | None, data_path: str | None, batch_dir: str | None, ledger_url: str,
                  key_path: str | None, as_json: bool) -> None:
    """Verify an attestation and its data at the gate; on success append an admit entry.

    Exit 0 when admitted, 3 when rejected (nothing is written).
    """
    from govtrain.gate.admission import admit_many
    from govtrain.ledger.ledger import Ledger

    if batch_dir is not None:
        if attestation is not None or data_path is not None:
            raise ConfigError(Code.USAGE, "give either ATTESTATION --data DATA or --batch DIR, not both")
        items = _batch_items(Path(batch_dir))
    else:
        if attestation is None or data_path is None:
            raise ConfigError(Code.USAGE, "give ATTESTATION and --data DATA (or --batch DIR)")
        items = [(attestation, _read_attestation(Path(attestation)), Path(data_path))]
    with Ledger.open(ledger_url, key=key_path) as opened:
        outcomes = admit_many(opened, items, now=int(time.time()))
    rejected = [o for o in outcomes if o.error is not None]
    if batch_dir is None:
        (outcome,) = outcomes
        if outcome.error is not None:
            fail(outcome.error, as_json=as_json)
        assert outcome.receipt is not None
        r = outcome.receipt
        if as_json:
            emit_json(r.as_json())
        else:
            click.echo(f"admitted {r.contribution_id} (class {r.data_class}, {r.records} records) "
                       f"as ledger entry {r.seq}")
        return
    for o in rejected:
        assert o.error is not None
        click.echo(f"error[{o.error.code.value}]: {o.source}: {o.error.detail}", err=True)
    if as_json:
        emit_json({"ok": not rejected, "admitted": len(outcomes) - len(rejected), "rejected": len(rejected),
                   "results": [o.receipt.as_json() if o.receipt else {"source": o.source, **o.error.as_json()}
                               for o in outcomes]})  # type: ignore[union-attr]
    else:
        click.echo(f"admitted {len(outcomes) - len(rejected)} of {len(outcomes)}; {len(rejected)} rejected")
    if rejected:
        raise SystemExit(EXIT_REJECTED)


# -- withdraw -----------------------------------------------------------------------------


@cli.command("withdraw", cls=Command, context_settings=CONTEXT_SETTINGS)
@click.argument("contribution_id")
@ledger_option
@click.option("--reason", required=True, help="Why (recorded in the ledger).")
@signing_key_option
@json_option
@reports_errors
def withdraw_command(contribution_id: str, ledger_url: str, reason: str, key_path: str | None, as_json: bool) -> None:
    """Withdraw a contribution: excluded from the next step on; earlier entries and spend stay. Exit 3 if
    unknown or already withdrawn."""
    from govtrain.ledger.ledger import Ledger

    with Ledger.open(ledger_url, key=key_path) as opened:
        stored = opened.withdraw(contribution_id, reason)
    if as_json:
        emit_json({"ok": True, "contribution_id": contribution_id, "seq": stored.seq,
                   "leaf_hash": stored.leaf_hash.hex()})
    else:
        click.echo(f"withdrew {contribution_id} as ledger entry {stored.seq}")


cli.add_command(ledger_group)
cli.add_command(privacy_group)
cli.add_command(plan_command)
cli.add_command(train_command)
cli.add_command(tune_command)
cli.add_command(eval_command)
cli.add_command(release_group)
cli.add_command(serve_command)
cli.add_command(rights_group)


def main() -> None:
    cli.main(prog_name="govtrain")


if __name__ == "__main__":
    main()

__all__ = ["cli", "main", "EXIT_OK"]
