"""`govtrain serve` (the inference gate) and `govtrain rights` (issuing and checking rights envelopes)."""

from __future__ import annotations

import datetime as _dt
import os
import time
from pathlib import Path

import click

from govtrain.cli.output import CONTEXT_SETTINGS, Command, Group, emit_json, json_option, read_input, reports_errors
from govtrain.errors import Code, ConfigError


@click.command("serve", cls=Command, context_settings=CONTEXT_SETTINGS)
@click.option("--release", "release_path", required=True, type=click.Path(dir_okay=False),
              help="The release manifest (release.dsse) `govtrain release` signed.")
@click.option("--adapter", "adapter_dir", required=True, type=click.Path(file_okay=False),
              help="The released adapter folder: exactly the manifest's subjects.")
@click.option("--policy", "policy_path", required=True, type=click.Path(dir_okay=False),
              help="The inference policy (inference.toml).")
@click.option("--base", default=None, help="The base model (a folder, a bundled name or a cached Hugging Face id); "
                                           "default: the one the adapter's govtrain.json names.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="Port to listen on.")
@click.option("--device", default="cpu", show_default=True, help="Where the model runs (cpu, cuda).")
@reports_errors
def serve_command(release_path: str, adapter_dir: str, policy_path: str, base: str | None, host: str, port: int,
                  device: str) -> None:
    """Serve a release behind the inference gate (FastAPI on uvicorn) until interrupted.

    Refuses to start (exit 2) unless the manifest verifies under the policy's pinned keys, the folder holds exactly
    its files, and the policy's ledger can be read.
    """
    from govtrain.serve.app import create_app, uvicorn_server
    from govtrain.serve.policy import load_inference_policy
    from govtrain.serve.service import Gate

    policy = load_inference_policy(policy_path)
    gate = Gate.start(release_path, adapter_dir, policy, base=base, device=device)
    try:
        info = gate.info()
        drawn = ", ".join(f"{name}{' (own adapter)' if c['adapter'] else ''}" for name, c in info["classes"].items()
                          if c["contributions"] or c["eps_u"])
        taint = info["taint"]
        at_release = ", ".join(w["contribution_id"] for w in info["withdrawn_at_release"])
        click.echo(f"serving release {info['release'][:16]}… (run {info['run_id']}, {info['task']}) for "
                   f"{policy.audience} on http://{host}:{port}: classes drawn on: {drawn or 'none'}; "
                   f"{'TAINTED' if taint.get('tainted') else 'not tainted'}"
                   f"{f' (withdrawn before the release: {at_release})' if at_release else ''}; "
                   f"routes {', '.join(info['routes'])}")
        try:
            uvicorn_server(create_app(gate), host=host, port=port).run()
        except KeyboardInterrupt:  # uvicorn shut down cleanly, then passed the interrupt on: the normal way out
            pass
        # Also when run() returns: a process started with SIGINT ignored (a script's background job, a test
        # runner's worker) gets uvicorn's clean shutdown, and then the interrupt it passes on is ignored.
        click.echo("stopped")
    finally:
        gate.close()


@click.group("rights", cls=Group, context_settings=CONTEXT_SETTINGS)
def rights() -> None:
    """Rights envelopes: what a caller of `govtrain serve` may draw on (issued by a key inference.toml names)."""


@rights.command("issue", cls=Command, context_settings=CONTEXT_SETTINGS)
@click.option("--key", "key_path", required=True, type=click.Path(dir_okay=False),
              help="The issuer's private key (mode 0600; `govtrain keys generate`).")
@click.option("--subject", required=True, help="The caller the envelope is for ([A-Za-z0-9._:@+-], 1-128).")
@click.option("--audience", required=True, help="The deployment: its inference.toml's audience.")
@click.option("--class", "classes", multiple=True, help="A class whose training the caller may draw on (repeat).")
@click.option("--session", "sessions", multiple=True, help="A split-inference session id it covers (repeat).")
@click.option("--valid-hours", default=24, show_default=True, type=click.IntRange(1, 24 * 36_500),
              help="How long the envelope is valid, from now.")
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False),
              help="Where to write the token (the Govtrain-Rights header's value; mode 0600).")
@json_option
@reports_errors
def rights_issue(key_path: str, subject: str, audience: str, classes: tuple[str, ...], sessions: tuple[str, ...],
                 valid_hours: int, out_path: str, as_json: bool) -> None:
    """Sign a rights envelope and write it as the token a request sends in its Govtrain-Rights header."""
    from govtrain.attest.keys import load_private_key
    from govtrain.serve.rights import issue_rights, to_header

    envelope, claims = issue_rights(load_private_key(key_path), subject=subject, audience=audience, classes=classes,
                            sessions=sessions, valid_seconds=valid_hours * 3600, now=int(time.time()))
    token = to_header(envelope)
    out = Path(out_path)
    try:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # a bearer credential: its holder's alone
    except FileExistsError:
        raise ConfigError(Code.BAD_ARGUMENT, f"{out} already exists; choose another --out") from None
    except OSError as e:
        raise ConfigError(Code.BAD_ARGUMENT, f"cannot write {out}: {e.strerror}") from None
    with os.fdopen(fd, "w") as handle:
        handle.write(token + "\n")
    if as_json:
        emit_json({"ok": True, "out": str(out), **_claims_json(claims)})
    else:
        click.echo(f"wrote {out}: rights for {claims.subject} at {claims.audience}, classes "
                   f"{', '.join(claims.classes) or 'none'}, {len(claims.sessions)} session(s), valid until "
                   f"{_utc(claims.not_after)}")


@rights.command("verify", cls=Command, context_settings=CONTEXT_SETTINGS)
@click.argument("token_path", metavar="TOKEN", type=click.Path(dir_okay=False))
@click.option("--policy", "policy_path", required=True, type=click.Path(dir_okay=False),
              help="The inference policy (inference.toml) whose issuers and audience it must meet.")
@json_option
@reports_errors
def rights_verify(token_path: str, policy_path: str, as_json: bool) -> None:
    """Check a rights token as the gate would now; print its claims. Exit 3 when the gate would refuse it."""
    from govtrain.serve.policy import load_inference_policy
    from govtrain.serve.rights import from_header, verify_rights

    policy = load_inference_policy(policy_path)
    token = str(read_input(token_path, "rights token"))
    verified = verify_rights(from_header(token), issuers=policy.issuers_by_kid(), audience=policy.audience,
                             now=int(time.time()), clock_skew_s=policy.clock_skew_s,
                             max_validity_s=policy.max_rights_s)
    if as_json:
        emit_json({"ok": True, "issuer": verified.issuer, "envelope_sha256": verified.envelope_sha256.hex(),
                   **_claims_json(verified.rights)})
    else:
        r = verified.rights
        click.echo(f"ok: rights for {r.subject} at {r.audience} from issuer {verified.issuer}; classes "
                   f"{', '.join(r.classes) or 'none'}; sessions {', '.join(r.sessions) or 'none'}; valid "
                   f"{_utc(r.not_before)} to {_utc(r.not_after)}")


def _claims_json(r) -> dict:  # type: ignore[no-untyped-def]
    return {"subject": r.subject, "audience": r.audience, "classes": list(r.classes), "sessions": list(r.sessions),
            "not_before": r.not_before, "not_after": r.not_after, "rights_id": r.rights_id.hex()}


def _utc(t: int) -> str:
    return _dt.datetime.fromtimestamp(t, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
