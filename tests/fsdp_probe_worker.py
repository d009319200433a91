"""One rank of tests/test_distributed_fsdp_probe.py: `python -m tests.fsdp_probe_worker RANK WORLD INIT OUT`.

It joins a gloo group of WORLD ranks (file:// rendezvous at INIT), shards a tiny float64 Llama with LoRA (r = 3,
so lora_A [3, 32] splits unevenly) with `fully_shard` on each decoder layer and the root, builds the Router on it,
and runs one governed step per case: this rank's share of six examples in as many chunks as the busiest rank (a
rank with fewer runs a zero-weight filler), its clipped sums summed over the ranks, the lead alone noising, the
release broadcast and written as each rank's shard. The oracle is the single-process router on the unsharded
model with every example, and, for dpsgd, plain autograd one example at a time. It writes OUT/rank{R}.json.
"""

from __future__ import annotations

import datetime
import json
import math
import sys
from pathlib import Path

CLASSES = ["top", "all", "top", "all", "top", "top"]  # top: layer 1 alone; all: both layers
CLIPS = [1e9, 0.3, 2.0, 0.3, 1e9, 0.3]  # per example: some clipped, some not
SHARES = {0: [[0, 1], [2, 3]], 1: [[4, 5]]}  # rank -> its chunks (rank 1 has one fewer)
CASES = [("dpsgd", "mixed"), ("prism", "mixed"), ("dp-muon", "mixed"), ("dpsgd", "top"), ("prism", "top")]


def _model():
    import torch

    from govtrain.train.config import LoraSection
    from govtrain.train.model import wrap_lora
    from tests import causal_models

    net = wrap_lora(causal_models.model("llama", layers=2, seed=0),
                    LoraSection(r=3, target_modules=causal_models.TARGETS["llama"]), [], heads=())
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in net.named_parameters():
            if ".lora_B." in name:  # random B factors: every factor gets a gradient
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return net.double().eval()


def _resolution(model, classes):
    from govtrain.resolver.model import describe
    from govtrain.resolver.profile import resolve
    from tests.test_resolver import cls

    profiles = {"top": cls("top", band=(1, 1)), "all": cls("all", band=(0, 1))}
    return resolve({c: profiles[c] for c in sorted(set(classes))}, describe(model))


def _encode(examples):
    from govtrain.tasks import CausalLM
    from tests.test_causal_lm import _tokenizer

    return CausalLM().encode(examples, _tokenizer(), 64, "cpu")


def _step(router, model, chunks, group_std, expected, reduce):
    """One governed step over `chunks` [(examples, classes, clips)]: per-sample norms, and the released `.grad`
    after `reduce(totals)` (the ranks' sum, the lead's noise, the broadcast)."""
    import torch

    from govtrain.tasks import CausalLM

    task, norms, clip = CausalLM(), [], router._clip

    def spied(calls, rows, c, classes):
        totals, found, clipped = clip(calls, rows, c, classes)
        norms.append(found.detach().clone())
        return totals, found, clipped

    router._clip = spied
    router.begin(group_std)
    for examples, classes, clips in chunks:
        filler = not examples  # this rank has fewer chunks: a public example at weight zero, same collectives
        if filler:
            examples, classes, clips = task.probe_examples()[:1], [sorted(router.masks)[0]], [1.0]
        batch = _encode(examples)
        with router.capture(classes):
            losses = task.per_example_loss(model(**batch.inputs), batch)
        router.accumulate(losses * 0 if filler else losses, classes, torch.tensor(clips, dtype=torch.float64))
    totals = router._totals if router._totals is not None else router._zeros()
    router._totals = None
    written = [n for n, p in router.params.items() if p.grad is not None]  # by anyone before the release
    summed = reduce(totals, router, group_std, expected)
    router._write(totals, expected)
    return torch.cat(norms) if norms else torch.zeros(0), summed, written


def _autograd_norms(model, examples, classes):
    """Each example's gradient norm over the parameters its class reaches (top: layer 1's), one example at a
    time through plain autograd."""
    import torch

    from govtrain.tasks import CausalLM

    out = []
    for example, data_class in zip(examples, classes):
        params = [p for n, p in model.named_parameters()
                  if p.requires_grad and (data_class == "all" or ".layers.1." in n)]
        batch = _encode([example])
        grads = torch.autograd.grad(CausalLM().per_example_loss(model(**batch.inputs), batch).sum(), params,
                                    allow_unused=True)
        out.append(math.sqrt(sum(float(g.pow(2).sum()) for g in grads if g is not None)))
    return torch.tensor(out, dtype=torch.float64)


def main(rank: int, world: int, init: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from govtrain.distributed import fsdp
    from govtrain.routing.layout import probe_batches
    from govtrain.routing.router import Router
    from tests.test_causal_lm import _examples, _tokenizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (world,))
    examples = _examples()
    report: dict = {"cases": {}}

    def nothing(totals, router, group_std, expected):
        router._noise(totals, group_std, expected)
        return None

    def flat(totals, op):  # one buffer in order: prism's released lora_A sums are transposed views, whose
        buffer = torch.cat([t.reshape(-1) for t in totals.values()])  # storage order a collective would ship
        op(buffer)
        offset = 0
        for total in totals.values():
            total.copy_(buffer[offset:offset + total.numel()].view_as(total))
            offset += total.numel()

    def over_ranks(totals, router, group_std, expected):
        flat(totals, dist.all_reduce)
        summed = {n: t.clone() for n, t in totals.items()}
        if rank == 0:  # the lead alone draws the noise
            router._noise(totals, group_std, expected)
        else:
            router.noise_std = {part.name: group_std[g.classes] / expected for g in router.resolution.groups
                                if g.classes for part in g.parts}
        flat(totals, lambda buffer: dist.broadcast(buffer, 0))
        return summed

    for mechanism, profile in CASES:
        classes = CLASSES if profile == "mixed" else ["top"] * len(CLASSES)
        # -- the oracle: one process, the unsharded model, every example in one chunk ------------------------
        single = _model()
        resolution = _resolution(single, classes)
        group_std = {g.classes: (0.7 if "all" in g.classes else 0.4) for g in resolution.groups if g.classes}
        reference = Router(single, resolution, mechanism=mechanism, insecure_seed=0)
        ref_norms, _, _ = _step(reference, single, [(examples, classes, CLIPS)], group_std, 6.0, nothing)
        ref_grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in reference.params.items()}
        reference.close()
        if mechanism == "dpsgd":  # the router's own oracle: plain autograd, one example at a time
            autograd = _autograd_norms(_model(), examples, classes)
        # -- FSDP: each decoder layer and the root sharded over the ranks --------------------------------------
        model = _model()
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        fsdp.prepare(model)
        router = Router(model, _resolution(model, classes), mechanism=mechanism, insecure_seed=0)
        router.probe(probe_batches(_tokenizer(), 16))
        mine = SHARES[rank] + [[]] * (fsdp.chunks(len(SHARES[rank])) - len(SHARES[rank]))
        chunks = [([examples[i] for i in c], [classes[i] for i in c], [CLIPS[i] for i in c]) for c in mine]
        norms, summed, written = _step(router, model, chunks, group_std, 6.0, over_ranks)
        own = [i for c in mine for i in c]
        fillers = norms[len(own):].tolist()
        shards, sharded, untouched = 0.0, True, []
        for name, param in router.params.items():
            if ref_grads[name] is None:
                untouched.append(name) if param.grad is None else None
                continue
            sharded &= type(param.grad).__name__ == "DTensor" and param.grad.to_local().shape == param.to_local().shape
            expected = ref_grads[name].chunk(world, 0)[rank]
            shards = max(shards, float((param.grad.to_local() - expected).abs().max()))
        torch.optim.SGD(list(router.params.values()), lr=0.1).step()  # the update runs on the shards
        report["cases"][f"{mechanism}/{profile}"] = {
            "norms": float((norms[:len(own)] - ref_norms[own]).abs().max()), "fillers": fillers,
            "autograd": float((norms[:len(own)] - autograd[own]).abs().max()) if mechanism == "dpsgd" else None,
            "chunks": len(mine), "written_before_release": written, "release": shards, "sharded": bool(sharded),
            "untouched": len(untouched), "reference_untouched": sum(g is None for g in ref_grads.values()),
            "min_norm": float(norms[:len(own)].min())}
        if mechanism == "prism" and profile == "top":  # an empty Poisson batch: the lead alone noises, and
            router.begin(group_std)  # needs the factors' geometry, which `begin` all-gathered on every rank
            totals = router._zeros()
            report["noise_only"] = float(over_ranks(totals, router, group_std, 6.0)[next(iter(totals))].abs().max())
            router._write(totals, 6.0)
            report["noise_only_grads"] = sum(p.grad is not None for p in router.params.values())
        router.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()  # both ranks done before either tears gloo down (destroy_process_group is no barrier)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
