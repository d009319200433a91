"""Split inference and the inference gate, measured on the demo's release (issue 22, item 4: seed 002's "zero quality
degradation", measured rather than assumed).

    make demo                                  # demo-out/: adapter/, release.dsse, data/heldout.jsonl, ledger.db
    python bench/inference.py                  # every held-out snippet; 4-5 min on the (shared) 2-core machine
    python bench/inference.py --rows 200 --draws 3 --reps 3          # quicker
    python bench/inference.py --requests 1000 --reps 9               # steadier throughput figures
    python bench/inference.py --epsilons 8 16 64 inf --policy P      # other ε: P's split bounds must admit them

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
   httpx.Client each, one snippet a request, the same headers) drives both; repetitions alternate; medians. Then
   what the gate's own checks cost a request (`Gate.admit`), timed in process. The servers: inference_servers.py.

δ per request is the inference policy's `split.max_delta`, C its `split.clip_norm`; the ε asked for must lie in its
bounds. The gate's session store is a temporary file: the demo's own is never written.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from inference_servers import Deployment, released_classes, rights, servers  # noqa: E402

EPSILONS = (0.5, 1.0, 4.0, 8.0, math.inf)


@dataclass(frozen=True, kw_only=True)
class Accuracy:
    setting: str
    epsilon: float  # math.inf: no noise
    path: str  # how it was measured
    accuracy: float
    spread: float | None = None  # standard deviation over noise draws
    sigma: float | None = None  # the noise's standard deviation per coordinate
    n: int


@dataclass(frozen=True, kw_only=True)
class Measured:
    """The accuracy rows, the norms of the held-out pooled states (`NormReport`), and for a two-label head the median
    distance of the clipped states from its decision boundary: the signal along the only direction the head reads,
    where the noise has standard deviation sigma (None for more labels)."""

    rows: list[Accuracy]
    norms: Any
    margin: float | None


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
                     epsilons: Sequence[float], draws: int) -> Measured:
    """The accuracy rows (see the module's docstring), the norms and the head's margin."""
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
            release = release_for(epsilon, delta, c)
            rows.append(Accuracy(setting=f"ε = {epsilon:g}", epsilon=epsilon, accuracy=accuracy(answered), n=n,
                                 sigma=release.sigma, path="SplitClient → gate POST /v1/split, a session per snippet"))
            if draws:
                scores = [accuracy(head.logits(np.stack([add_noise(row, release, rng) for row in clipped])).argmax(1))
                          for _ in range(draws)]
                rows.append(Accuracy(setting=f"ε = {epsilon:g}", epsilon=epsilon, accuracy=statistics.mean(scores),
                                     spread=statistics.pstdev(scores), n=n, sigma=release.sigma,
                                     path=f"SplitHead in process, mean of {draws} noise draws"))
    norms = measure_norms(SimpleNamespace(pooled=lambda _: pooled), texts, epsilon=1.0, delta=1e-5, clip_norm=1.0)
    return Measured(rows=rows, norms=norms, margin=boundary_margin(head, clipped))


def boundary_margin(head: Any, vectors: np.ndarray) -> float | None:
    """For a two-label linear head: the median of |logit difference| / ||w1 - w0|| over `vectors`, the distance from
    its decision boundary (the head's weights read off its answers on the origin and the unit vectors)."""
    origin = head.logits(np.zeros((1, head.dimension)))[0]
    if origin.shape[0] != 2:
        return None
    weights = head.logits(np.eye(head.dimension)) - origin  # [d, 2]: row i is W[:, i]
    normal = weights[:, 1] - weights[:, 0]
    logits = head.logits(vectors)
    return float(np.median(np.abs(logits[:, 1] - logits[:, 0]) / np.linalg.norm(normal)))


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
    for rep in range(reps):
        for kind, url in list(urls.items())[::-1 if rep % 2 else 1]:  # each goes first in every other repetition
            runs[kind].append(drive(url, headers, texts, requests=requests, concurrency=concurrency))
    return runs


def admission_cost(deployment: Deployment, headers: dict, workdir: Path, *, calls: int = 2000) -> float:
    """Seconds per `Gate.admit`, what the gate adds to a request before the model runs (the envelope verified, the
    taint reading checked, the adapters decided), timed in process: the median of 5 batches of calls/5."""
    from govtrain.serve.rights import HEADER
    from govtrain.serve.service import Gate

    policy = dataclasses.replace(deployment.inference_policy(), session_store=workdir / "admit-sessions.db")
    gate = Gate.start(deployment.release, deployment.adapter, policy, base=deployment.base)
    try:
        header, batch, times = headers[HEADER], max(1, calls // 5), []
        for _ in range(5):
            began = time.perf_counter()
            for _ in range(batch):
                gate.admit(header)
            times.append((time.perf_counter() - began) / batch)
        return statistics.median(times)
    finally:
        gate.close()


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
        concurrency: int, reps: int, threads: int) -> tuple[Measured, dict[str, list[Load]], float]:
    """Everything the module's docstring lists, printed; returns the accuracy figures, the throughput runs and the
    seconds one `Gate.admit` takes."""
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
        measured = measure_accuracy(deployment, texts, labels, url=urls["gate"], workdir=Path(tmp),
                                           epsilons=epsilons, draws=draws)
        norms = measured.norms
        report_seed_claim(norms.dimension)
        print(f"  measured on {norms.texts} held-out pooled states: norm {norms.raw_norm_mean:.2f} "
              f"({norms.raw_norm_min:.2f} to {norms.raw_norm_max:.2f}) before clipping, {norms.clipped_norm_mean:.2f} "
              f"after; noise norm {norms.noise_norm_mean:.1f}; signal/noise {norms.snr:.4f}; "
              f"cos(sent, clipped) {norms.cosine_mean:.3f}")
        print(f"\nheld-out accuracy ({time.perf_counter() - started:.0f} s)")
        for row in measured.rows:
            spread = f" ± {row.spread:.3f}" if row.spread is not None else ""
            sigma = f"σ {row.sigma:6.2f}" if row.sigma is not None else ""
            print(f"  {row.setting:<40} {row.accuracy:.3f}{spread:<8} {sigma:<8}  n {row.n}  [{row.path}]")
        if measured.margin is not None:
            print(f"  the clipped states lie a median {measured.margin:.3f} from the head's decision boundary; the "
                  f"noise along its normal has standard deviation σ")
        headers = rights(deployment, policy, released_classes(deployment, policy))
        runs = measure_throughput(urls, headers, texts, requests=requests, concurrency=concurrency, reps=reps)
        admit = admission_cost(deployment, headers, Path(tmp))
    print(f"\nPOST /v1/classify, one snippet a request, {concurrency} concurrent clients, {requests} requests a "
          f"repetition, median of {reps}; {threads} torch threads per server")
    medians = {kind: median(loads) for kind, loads in runs.items()}
    for kind, m in medians.items():
        print(f"  {kind:<5} {m.requests_per_s:7.1f} requests/s  p50 {m.p50_ms:7.1f} ms  p99 {m.p99_ms:7.1f} ms  "
              f"(requests/s of each: {', '.join(f'{r.requests_per_s:.1f}' for r in runs[kind])})")
    gate, bare = medians["gate"], medians["bare"]
    print(f"  gate / bare: throughput {gate.requests_per_s / bare.requests_per_s:.3f}, p50 "
          f"{gate.p50_ms / bare.p50_ms:.3f}, p99 {gate.p99_ms / bare.p99_ms:.3f}")
    print(f"  the gate's own checks (Gate.admit: envelope, taint reading, adapters), in process: {admit * 1e6:.0f} µs "
          f"a request")
    return measured, runs, admit


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
    args = parser.parse_args(argv)
    deployment = Deployment(release=args.release or args.demo / "release.dsse", adapter=args.adapter or
                            args.demo / "adapter", policy=args.policy, base=args.base,
                            issuer_key=args.issuer_key or args.demo / "keys" / "issuer.key")
    run(deployment, args.heldout or args.demo / "data" / "heldout.jsonl", rows=args.rows, epsilons=args.epsilons,
        draws=args.draws, requests=args.requests, concurrency=args.concurrency, reps=args.reps, threads=args.threads)


if __name__ == "__main__":
    main()
