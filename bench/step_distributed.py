"""`bench/step.py --nproc N`: the governed full-band DP-SGD step as 1 and as N processes on one machine
(docs/distributed.md), each process started again as `step.py` with the rank's environment (`distributed_rank`).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["HF_HUB_OFFLINE"] = "1"

import torch  # noqa: E402

from harness import Governed, data_class, run_file  # noqa: E402
from step_models import SETTINGS, autocast, batch, build, layers, sync  # noqa: E402

STEP = str(Path(__file__).with_name("step.py"))  # what each rank runs: the bench's own command line


def distributed(args) -> None:
    """The governed full-band DP-SGD step as 1 and as --nproc processes on one machine (docs/distributed.md): the
    same global batch of --batch examples, each rank clipping its share, the ranks' clipped sums summed, noise drawn
    once by the lead and shared. Each process runs with one thread. Prints wall seconds per step (median of the
    rounds, every rank synchronised by a barrier before and after each round), the speed-up, and the peak memory of
    each process (CPU: peak RSS; CUDA: peak allocated)."""
    import json
    import subprocess
    import tempfile

    from govtrain.distributed.launch import free_port

    if "RANK" in os.environ:
        return distributed_rank(args)
    counts = sorted({1, args.nproc})
    rows = {}
    for count in counts:
        with tempfile.TemporaryDirectory() as folder:
            port, out = free_port(), Path(folder) / "rank0.json"
            argv = [sys.executable, STEP, "--nproc", str(count), "--batch", str(args.batch), "--seq",
                    str(args.seq), "--repeats", str(args.repeats), "--steps", str(args.steps), "--model",
                    SETTINGS["model"], "--device", SETTINGS["device"], "--precision", SETTINGS["precision"]]
            ranks = [subprocess.Popen(argv, env=dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(count),
                                                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                                     GOVTRAIN_BENCH_OUT=str(out)))
                     for r in range(count)]
            if any(rank.wait() for rank in ranks):
                raise SystemExit(f"a rank of the {count}-process run failed")
            rows[count] = json.loads(out.read_text())
    backend = "nccl" if SETTINGS["device"].startswith("cuda") else "gloo"
    print(f"{SETTINGS['model']} on {SETTINGS['device']} ({SETTINGS['precision']}, {backend}), governed full band, "
          f"global batch {args.batch}, seq {args.seq}, 1 thread per process, median of {args.repeats} rounds x "
          f"{args.steps} steps (wall seconds per step)")
    one = rows[1]["step_s"]
    if rows[1]["grouped"]:
        print(f"  1 process, {backend} group of one: collectives cost {one / rows[1]['alone_s']:.3f}x the step without "
              f"them ({rows[1]['alone_s']:.4f} s)")
    for count, row in rows.items():
        print(f"  {count} process{'es' if count > 1 else ''}: {row['step_s']:.4f} s/step  speed-up {one / row['step_s']:.2f}x"
              f"  peak memory per process {', '.join(f'{m:.0f}' for m in row['memory_mb'])} MB ({row['memory']})")


def distributed_rank(args) -> None:
    import json
    import resource

    from govtrain.distributed.shares import bounds
    from govtrain.distributed.world import World

    cuda = SETTINGS["device"].startswith("cuda")
    if cuda and os.environ["WORLD_SIZE"] == "1":  # one GPU: a process group of one, so NCCL's collectives still run
        import datetime

        import torch.distributed as dist

        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1, timeout=datetime.timedelta(seconds=600))
        world = World(rank=0, size=1, device="cuda", owned=True, grouped=True)
    else:
        world = World.from_env("cuda" if cuda else "cpu")
    if cuda:
        SETTINGS["device"] = f"cuda:{torch.cuda.current_device()}"
    full = {"all": data_class("all", band=(0, layers() - 1), head=True)}
    variant = Governed(build(), full, run_file("dpsgd"), name="governed", autocast=autocast,
                       expected_batch=float(args.batch))
    variant.router.world = world
    start, stop = bounds(args.batch, world.size, world.rank)
    inputs, labels = batch(args.batch, args.seq, 0)
    inputs, labels = {k: v[start:stop] for k, v in inputs.items()}, labels[start:stop]
    variant.step(inputs, labels)  # warm up
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.repeats):
        world.barrier()
        sync()
        began = time.perf_counter()
        for _ in range(args.steps):
            variant.step(inputs, labels)
        sync()
        world.barrier()
        times.append((time.perf_counter() - began) / args.steps)
    memory = torch.cuda.max_memory_allocated() / 2**20 if cuda else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    memories = world.gather(memory)
    alone = None
    if world.size == 1:  # the same step with no collective: what summing and sharing cost on one rank
        variant.router.world = World.single()
        alone = []
        for _ in range(args.repeats):
            sync()
            began = time.perf_counter()
            for _ in range(args.steps):
                variant.step(inputs, labels)
            sync()
            alone.append((time.perf_counter() - began) / args.steps)
    if world.lead:
        Path(os.environ["GOVTRAIN_BENCH_OUT"]).write_text(json.dumps({
            "step_s": statistics.median(times), "memory_mb": memories, "grouped": world.many,
            "alone_s": statistics.median(alone) if alone else None,
            "memory": "peak allocated" if cuda else "peak RSS"}))
    world.close()
