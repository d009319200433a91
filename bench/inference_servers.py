"""The two servers bench/inference.py compares, each run in a uvicorn process of its own on 127.0.0.1: the inference
gate (`create_app(Gate.start(...))`, as `govtrain serve` builds it) and a bare FastAPI endpoint serving the same
model with the same load and predict code; and what both sides need: the deployment measured, rights envelopes.

`python bench/inference_servers.py gate|bare --release … --adapter … --policy … --issuer-key … --workdir DIR` is one
server process (`servers` starts them): it prints its URL and serves until its stdin closes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from fastapi import FastAPI, Request  # the serve extra: `pip install 'govtrain[serve]'`
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

KINDS = ("gate", "bare")


@dataclass(frozen=True, kw_only=True)
class Deployment:
    """What is measured: a release, its adapter folder, the inference policy that serves it, a rights issuer's key."""

    release: Path
    adapter: Path
    policy: Path
    issuer_key: Path
    base: str | None = None

    def inference_policy(self) -> Any:
        from govtrain.serve.policy import load_inference_policy

        return load_inference_policy(self.policy)


def released_classes(deployment: Deployment, policy: Any) -> list[str]:
    """The classes the release states, read from the manifest verified offline under the policy's pinned keys."""
    from govtrain.release.verification import verify_release

    report = verify_release(deployment.release.read_bytes(), release_key=policy.release_key,
                            ledger_keys=list(policy.ledger_keys))
    return sorted(report.classes)


def rights(deployment: Deployment, policy: Any, classes: Sequence[str], sessions: Sequence[str] = ()) -> dict:
    """Headers carrying a rights envelope from the deployment's issuer: every class, these sessions, one hour."""
    from govtrain.attest.keys import load_private_key
    from govtrain.serve.rights import HEADER, issue_rights, to_header

    envelope, _ = issue_rights(load_private_key(deployment.issuer_key), subject="bench", audience=policy.audience,
                               classes=sorted(classes), sessions=sorted(sessions), valid_seconds=3600,
                               now=int(time.time()))
    return {HEADER: to_header(envelope)}


def bare_app(adapter: Path, base: str | None) -> Any:
    """The released model behind FastAPI and nothing else: no envelope, taint or decision; `govtrain.load` and the
    `logits` call the gate makes, one forward at a time (the gate's model lock), the gate's answer's shape."""
    import govtrain

    loaded = govtrain.load(adapter, base=base)
    names, lock = loaded.record.id2label, threading.Lock()
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    def classify(texts: list[str]) -> dict:
        with lock:
            logits = loaded.logits(texts)
        rows = logits.double().cpu().tolist()
        return {"ok": True, "results": [{"label": names[str(i)], "label_id": i, "logits": row}
                                        for row in rows for i in (max(range(len(row)), key=row.__getitem__),)]}

    @app.post("/v1/classify")
    async def route(request: Request) -> JSONResponse:
        return JSONResponse(await run_in_threadpool(classify, list(json.loads(await request.body())["texts"])))

    return app


def build_app(kind: str, deployment: Deployment, sessions: Path) -> tuple[Any, Callable[[], None]]:
    """(the app, what closes it): the gate as `govtrain serve` builds it, its session store moved to `sessions`."""
    if kind == "bare":
        return bare_app(deployment.adapter, deployment.base), lambda: None
    from govtrain.serve.app import create_app
    from govtrain.serve.service import Gate

    policy = dataclasses.replace(deployment.inference_policy(), session_store=sessions / "gate-sessions.db")
    gate = Gate.start(deployment.release, deployment.adapter, policy, base=deployment.base)
    return create_app(gate), gate.close


def serve_forever(kind: str, deployment: Deployment, sessions: Path, threads: int) -> None:
    """The child process: serve on a free port of 127.0.0.1, print the URL, stop when stdin closes."""
    import torch

    from govtrain.serve.app import running

    torch.set_num_threads(threads)
    app, close = build_app(kind, deployment, sessions)
    try:
        with running(app) as url:
            print(url, flush=True)
            sys.stdin.read()
    finally:
        close()


@contextlib.contextmanager
def servers(deployment: Deployment, workdir: Path, threads: int) -> Iterator[dict[str, str]]:
    """The gate and the bare endpoint, each in a uvicorn process of its own (started together); their URLs."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    children: dict[str, subprocess.Popen] = {}
    try:
        for kind in KINDS:
            argv = [sys.executable, str(Path(__file__).resolve()), kind, "--release", str(deployment.release),
                    "--adapter", str(deployment.adapter), "--policy", str(deployment.policy),
                    "--issuer-key", str(deployment.issuer_key), "--workdir", str(workdir), "--threads", str(threads),
                    *(["--base", deployment.base] if deployment.base else [])]
            children[kind] = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        urls = {}
        for kind, child in children.items():
            assert child.stdout is not None
            urls[kind] = child.stdout.readline().strip()
            if not urls[kind].startswith("http://"):
                raise RuntimeError(f"the {kind} server did not start (exit {child.wait()}); its error is above")
        yield urls
    finally:
        for child in children.values():
            with contextlib.suppress(OSError):
                child.stdin.close()  # type: ignore[union-attr]
            try:
                child.wait(60)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one server process of bench/inference.py")
    parser.add_argument("kind", choices=KINDS)
    for name in ("--release", "--adapter", "--policy", "--issuer-key", "--workdir"):
        parser.add_argument(name, type=Path, required=True)
    parser.add_argument("--base")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    deployment = Deployment(release=args.release, adapter=args.adapter, policy=args.policy, issuer_key=args.issuer_key,
                            base=args.base)
    serve_forever(args.kind, deployment, args.workdir, args.threads)


if __name__ == "__main__":
    main()
