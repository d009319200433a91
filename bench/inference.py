"""Split inference and the inference gate, measured on the demo's release (issue 22, item 4: seed 002's "zero quality
degradation", measured rather than assumed).

    make demo                                  # demo-out/: adapter/, release.dsse, data/heldout.jsonl, ledger.db
    python bench/inference.py                  # every held-out snippet; ~3 min on the 2-core machine
    python bench/inference.py --rows 200 --draws 3 --reps 3          # quicker
    python bench/inference.py --requests 1000 --reps 9               # steadier throughput figures

It prints, after the machine and the date:

1. seed 002's signal-to-noise figures for the model's hidden size (`seed_002_claim`), and the norms of the real
   pooled states of the held-out snippets (`measure_norms`) at the seed's ε 1, δ 1e-5 and C 1;
2. held-out accuracy: the majority label; the full released model (`govtrain.load`); the released head on the base
   model's pooled states, unclipped and clipped to C (ε = ∞: no noise and no request); then, at each finite
   per-request ε, the split path through the **real gate**: each snippet is one request of a session of its own,
   pooled by the public base model, clipped to C, noised and sent by `SplitClient` to `POST /v1/split`, which checks
   and charges the session and applies the head; beside it, the mean and standard deviation over `--draws` more
   noise draws through the same head in process (the same mechanism without HTTP);
3. `POST /v1/classify` throughput and latency of the gate (`create_app(Gate.start(...))`, a valid rights envelope on
   every request) against a bare FastAPI endpoint serving the same model with the same load and predict code
   (`govtrain.load`, `LoadedModel.logits`, one forward at a time as the gate) and nothing else. Each runs in its own
   uvicorn process on 127.0.0.1 with `--threads` torch threads; the same client (`--concurrency` threads, one
   httpx.Client each, one snippet a request, the same headers) drives both; repetitions alternate; medians.

δ per request is the inference policy's `split.max_delta`, C its `split.clip_norm`; the ε asked for must lie in its
bounds. The gate's session store is a temporary file: the demo's own is never written.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Sequence

import numpy as np
from fastapi import FastAPI, Request  # the serve extra: `pip install 'govtrain[serve]'`
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

EPSILONS = (0.5, 1.0, 4.0, 8.0, math.inf)
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


@dataclass(frozen=True, kw_only=True)
class Accuracy:
    setting: str
    epsilon: float  # math.inf: no noise
    path: str  # how it was measured
    accuracy: float
    spread: float | None = None  # standard deviation over noise draws
    n: int


@dataclass(frozen=True, kw_only=True)
class Load:
    requests_per_s: float
    p50_ms: float
    p99_ms: float


def read_heldout(path: Path, rows: int = 0) -> tuple[list[str], list[int]]:
    """The first `rows` held-out snippets (all where 0) and their labels."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    records = records[:rows] if rows else records
    return [r["text"] for r in records], [int(r["label"]) for r in records]


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


# -- the two servers ------------------------------------------------------------------------------------------------

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
            argv = [sys.executable, str(Path(__file__).resolve()), "--serve", kind, "--release", str(deployment.release),
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


# -- accuracy -------------------------------------------------------------------------------------------------------

def through_gate(url: str, headers_for: Callable[[list[str]], dict], encoder: Any, store: Any, budget: Any,
                 pooled: np.ndarray, *, epsilon: float, delta: float, clip_norm: float) -> list[int]:
    """Each pooled state one `SplitClient` request to the gate, in a session of its own (an envelope names at most
    64 sessions: one is issued per 64 requests); the labels the gate answers."""
    import httpx

    from govtrain.inference import SplitClient, new_session_id

    labels = []
    with httpx.Client(base_url=url, timeout=60) as http:
        for start in range(0, len(pooled), 64):
            chunk = pooled[start:start + 64]
            sessions = [new_session_id() for _ in chunk]
            http.headers.update(headers_for(sessions))
            for session, row in zip(sessions, chunk):
                client = SplitClient(encoder, http, store, session_id=session, budget=budget, owner="bench")
                labels.append(client.send(client.prepare(row, epsilon=epsilon, delta=delta, clip_norm=clip_norm)).label)
    return labels


def measure_accuracy(deployment: Deployment, texts: list[str], labels: list[int], *, url: str, workdir: Path,
                     epsilons: Sequence[float], draws: int) -> tuple[list[Accuracy], Any]:
    """The accuracy rows (see the module's docstring) and the norms of the held-out pooled states."""
    import govtrain
    from govtrain import units
    from govtrain.inference import PooledEncoder, SessionStore, SplitHead, release_for
    from govtrain.inference.mechanism import SessionBudget, add_noise, clip, noise_rng
    from govtrain.inference.snr import measure_norms

    policy = deployment.inference_policy()
    c, delta = policy.clip_norm_u / units.MICRO, policy.max_delta_p / units.PICO
    y, n = np.asarray(labels), len(labels)

    def accuracy(predicted: Any) -> float:
        return float(np.mean(np.asarray(predicted) == y))

    loaded = govtrain.load(deployment.adapter, base=deployment.base)
    head = SplitHead(loaded)
    encoder = PooledEncoder.from_release(deployment.adapter, base=deployment.base)
    pooled = encoder.pooled(texts)
    clipped = np.stack([clip(row, c) for row in pooled])
    majority = max(np.mean(y == label) for label in set(labels))
    rows = [Accuracy(setting="always the majority label", epsilon=math.inf, path="held-out labels", accuracy=majority,
                     n=n),
            Accuracy(setting="full released model", epsilon=math.inf, path="govtrain.load, adapted pooled state",
                     accuracy=accuracy(loaded.predict(texts)), n=n),
            Accuracy(setting="head on base states, unclipped", epsilon=math.inf, path="SplitHead in process",
                     accuracy=accuracy(head.logits(pooled).argmax(1)), n=n),
            Accuracy(setting=f"ε = ∞: base states clipped to C = {c:g}", epsilon=math.inf, path="SplitHead in process",
                     accuracy=accuracy(head.logits(clipped).argmax(1)), n=n)]
    classes = released_classes(deployment, policy)
    budget = SessionBudget(epsilon_u=policy.session_epsilon_u, delta_p=policy.session_delta_p)
    rng = noise_rng()
    with SessionStore(workdir / "client-sessions.db") as store:
        for epsilon in (e for e in epsilons if math.isfinite(e)):
            answered = through_gate(url, lambda s: rights(deployment, policy, classes, s), encoder, store, budget,
                                    pooled, epsilon=epsilon, delta=delta, clip_norm=c)
            rows.append(Accuracy(setting=f"ε = {epsilon:g}", epsilon=epsilon, accuracy=accuracy(answered), n=n,
                                 path="SplitClient → gate POST /v1/split, a session per snippet"))
            if draws:
                release = release_for(epsilon, delta, c)
                scores = [accuracy(head.logits(np.stack([add_noise(row, release, rng) for row in clipped])).argmax(1))
                          for _ in range(draws)]
                rows.append(Accuracy(setting=f"ε = {epsilon:g}", epsilon=epsilon, accuracy=statistics.mean(scores),
                                     spread=statistics.pstdev(scores), n=n,
                                     path=f"SplitHead in process, mean of {draws} noise draws"))
    norms = measure_norms(SimpleNamespace(pooled=lambda _: pooled), texts, epsilon=1.0, delta=1e-5, clip_norm=1.0)
    return rows, norms


# -- throughput -----------------------------------------------------------------------------------------------------

def drive(url: str, headers: dict, texts: Sequence[str], *, requests: int, concurrency: int) -> Load:
    """`requests` POSTs of one snippet each to /v1/classify from `concurrency` threads; throughput and latency."""
    import httpx

    counter, latencies, failures, lock = itertools.count(), [], [], threading.Lock()

    def worker() -> None:
        mine = []
        with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
            while (i := next(counter)) < requests:
                began = time.perf_counter()
                response = http.post("/v1/classify", json={"texts": [texts[i % len(texts)]]})
                mine.append(time.perf_counter() - began)
                if response.status_code != 200:
                    failures.append(f"{response.status_code} {response.text[:200]}")
                    break
        with lock:
            latencies.extend(mine)

    workers = [threading.Thread(target=worker) for _ in range(concurrency)]
    began = time.perf_counter()
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    wall = time.perf_counter() - began
    if failures:
        raise RuntimeError(f"{url}: {failures[0]}")
    return Load(requests_per_s=requests / wall, p50_ms=float(np.percentile(latencies, 50)) * 1e3,
                p99_ms=float(np.percentile(latencies, 99)) * 1e3)


def same_model(urls: dict[str, str], headers: dict, texts: Sequence[str]) -> None:
    """Both endpoints answer the same logits for the same snippets, or the comparison means nothing."""
    import httpx

    answers = {kind: httpx.post(f"{url}/v1/classify", json={"texts": list(texts)}, headers=headers, timeout=60)
               for kind, url in urls.items()}
    for kind, answer in answers.items():
        if answer.status_code != 200:
            raise RuntimeError(f"the {kind} endpoint answered {answer.status_code}: {answer.text[:300]}")
    logits = {kind: [r["logits"] for r in answer.json()["results"]] for kind, answer in answers.items()}
    if not np.allclose(logits["gate"], logits["bare"], atol=1e-5):
        raise RuntimeError("the gate and the bare endpoint do not serve the same model")


def measure_throughput(urls: dict[str, str], headers: dict, texts: Sequence[str], *, requests: int, concurrency: int,
                       reps: int) -> dict[str, list[Load]]:
    """`reps` repetitions per server, alternating, after one warm-up each; every repetition's figures."""
    same_model(urls, headers, texts[:8])
    for url in urls.values():
        drive(url, headers, texts, requests=max(concurrency, requests // 10), concurrency=concurrency)
    runs: dict[str, list[Load]] = {kind: [] for kind in urls}
    for _ in range(reps):
        for kind, url in urls.items():
            runs[kind].append(drive(url, headers, texts, requests=requests, concurrency=concurrency))
    return runs


def median(runs: list[Load]) -> Load:
    return Load(**{f.name: statistics.median(getattr(r, f.name) for r in runs) for f in dataclasses.fields(Load)})


# -- the report -----------------------------------------------------------------------------------------------------

def report_seed_claim(dimension: int) -> None:
    from govtrain.inference.snr import seed_002_claim

    claim = seed_002_claim(dimension)
    print(f"\nseed 002 at ε {claim.epsilon:g}, δ {claim.delta:g}, C {claim.clip_norm:g}, d = {dimension}: the signal "
          f"sent has norm ≤ C")
    for name, sigma, noise, snr in claim.rows():
        print(f"  {name:<30} σ {sigma:8.4f}  noise norm σ√d {noise:7.1f}  signal/noise {snr:.4f}")
    print(f"  the seed's σ against any two queries (Δ = 2C): ε {claim.seed_true_epsilon:.2f}")


def run(deployment: Deployment, heldout: Path, *, rows: int, epsilons: Sequence[float], draws: int, requests: int,
        concurrency: int, reps: int, threads: int) -> tuple[list[Accuracy], dict[str, list[Load]]]:
    """Everything the module's docstring lists, printed; returns the accuracy rows and the throughput runs."""
    import torch

    from harness import machine
    from govtrain import units

    torch.set_num_threads(threads)
    policy = deployment.inference_policy()
    for epsilon in (e for e in epsilons if math.isfinite(e)):
        if not policy.min_epsilon_u <= round(epsilon * units.MICRO) <= policy.max_epsilon_u:
            raise SystemExit(f"ε {epsilon:g} is outside {deployment.policy}'s split bounds")
    texts, labels = read_heldout(heldout, rows)
    print(f"{datetime.date.today().isoformat()}; {machine('cpu')}")
    print(f"release {deployment.release}, {len(texts)} held-out snippets of {heldout}; per request δ "
          f"{policy.max_delta_p / units.PICO:g}, C {policy.clip_norm_u / units.MICRO:g} (sensitivity 2C)")
    with tempfile.TemporaryDirectory(prefix="govtrain-bench-") as tmp, \
            servers(deployment, Path(tmp), threads) as urls:
        started = time.perf_counter()
        accuracy, norms = measure_accuracy(deployment, texts, labels, url=urls["gate"], workdir=Path(tmp),
                                           epsilons=epsilons, draws=draws)
        report_seed_claim(norms.dimension)
        print(f"  measured on {norms.texts} held-out pooled states: norm {norms.raw_norm_mean:.2f} "
              f"({norms.raw_norm_min:.2f} to {norms.raw_norm_max:.2f}) before clipping, {norms.clipped_norm_mean:.2f} "
              f"after; noise norm {norms.noise_norm_mean:.1f}; signal/noise {norms.snr:.4f}; "
              f"cos(sent, clipped) {norms.cosine_mean:.3f}")
        print(f"\nheld-out accuracy ({time.perf_counter() - started:.0f} s)")
        for row in accuracy:
            spread = f" ± {row.spread:.3f}" if row.spread is not None else ""
            print(f"  {row.setting:<40} {row.accuracy:.3f}{spread:<8}  n {row.n}  [{row.path}]")
        classes = released_classes(deployment, policy)
        runs = measure_throughput(urls, rights(deployment, policy, classes), texts, requests=requests,
                                  concurrency=concurrency, reps=reps)
    print(f"\nPOST /v1/classify, one snippet a request, {concurrency} concurrent clients, {requests} requests a "
          f"repetition, median of {reps}; {threads} torch threads per server")
    medians = {kind: median(loads) for kind, loads in runs.items()}
    for kind, m in medians.items():
        print(f"  {kind:<5} {m.requests_per_s:7.1f} requests/s  p50 {m.p50_ms:7.1f} ms  p99 {m.p99_ms:7.1f} ms  "
              f"(requests/s of each: {', '.join(f'{r.requests_per_s:.1f}' for r in runs[kind])})")
    gate, bare = medians["gate"], medians["bare"]
    print(f"  gate / bare: throughput {gate.requests_per_s / bare.requests_per_s:.3f}, p50 "
          f"{gate.p50_ms / bare.p50_ms:.3f}, p99 {gate.p99_ms / bare.p99_ms:.3f}")
    return accuracy, runs


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--demo", type=Path, default=REPO / "demo-out", help="the demo's output folder")
    parser.add_argument("--policy", type=Path, default=REPO / "examples" / "inference.toml")
    parser.add_argument("--release", type=Path, help="default: DEMO/release.dsse")
    parser.add_argument("--adapter", type=Path, help="default: DEMO/adapter")
    parser.add_argument("--heldout", type=Path, help="default: DEMO/data/heldout.jsonl")
    parser.add_argument("--issuer-key", type=Path, help="default: DEMO/keys/issuer.key")
    parser.add_argument("--base", help="the base model, where the adapter's govtrain.json cannot find it")
    parser.add_argument("--rows", type=int, default=0, help="the first N held-out snippets (0: all)")
    parser.add_argument("--epsilons", type=float, nargs="+", default=list(EPSILONS), help="per request; inf: none")
    parser.add_argument("--draws", type=int, default=10, help="noise draws through the head in process")
    parser.add_argument("--requests", type=int, default=300, help="requests per throughput repetition")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="torch threads, here and in each server")
    parser.add_argument("--serve", choices=KINDS, help=argparse.SUPPRESS)  # the server processes
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    deployment = Deployment(release=args.release or args.demo / "release.dsse", adapter=args.adapter or
                            args.demo / "adapter", policy=args.policy, base=args.base,
                            issuer_key=args.issuer_key or args.demo / "keys" / "issuer.key")
    if args.serve:
        serve_forever(args.serve, deployment, args.workdir, args.threads)
        return
    run(deployment, args.heldout or args.demo / "data" / "heldout.jsonl", rows=args.rows, epsilons=args.epsilons,
        draws=args.draws, requests=args.requests, concurrency=args.concurrency, reps=args.reps, threads=args.threads)


if __name__ == "__main__":
    main()
