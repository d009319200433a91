"""The router's released `.grad` bytes under fixed seeds, as SHA-256 per case: the golden values that
tests/test_privatizers_core.py holds the i.i.d. Gaussian privatizer to (byte-identity with the router before
privatizers existed).

tests/vectors/privatizer-golden.json was written by this script run on main at 1382b01 (before the router
delegated its noise), with `python -m tests.privatizer_golden --write`: never regenerate it from code that
routes noise through a privatizer, or the test compares the new code with itself. Without `--write` it prints
the hashes the current code gives.

One deliberate exception, issue 34: each unit's norm now carries a rounding allowance (`routing/rounding.py`; ghost
norms in float64), so a unit the clip binds gets a coefficient smaller by at most ~2e-5 relative, and the eight
cases whose units are clipped changed their bytes (the other eight, and the machine record, are 1382b01's still).
The byte-identity with the pre-privatizer router held until that change; from it on, these eight pin the current
release bytes.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

from govtrain.resolver.model import describe
from govtrain.resolver.profile import resolve
from govtrain.routing.router import Router
from tests.test_resolver import cls
from tests.test_routing import CLASSES, batch, losses_of, model

GOLDEN = Path(__file__).parent / "vectors" / "privatizer-golden.json"
WHOLE = {"public": CLASSES["public"], "sensitive": cls("sensitive", band=(1, 2))}  # prism: whole LoRA pairs
UNITS = [0, 0, 1, 2, 2, 2]  # contribution unit: three units over the six examples
CASES = {  # name -> (mechanism, classes, model dtype, privacy unit)
    "dpsgd-example-heads-f64": ("dpsgd", CLASSES, torch.float64, "example"),
    "dpsgd-example-heads-f32": ("dpsgd", CLASSES, torch.float32, "example"),
    "dpsgd-contribution-heads-f64": ("dpsgd", CLASSES, torch.float64, "contribution"),
    "prism-example-f64": ("prism", WHOLE, torch.float64, "example"),
    "prism-example-f32": ("prism", WHOLE, torch.float32, "example"),
    "prism-contribution-f64": ("prism", WHOLE, torch.float64, "contribution"),
    "dp-muon-example-heads-f64": ("dp-muon", CLASSES, torch.float64, "example"),
    "dp-muon-contribution-heads-f32": ("dp-muon", CLASSES, torch.float32, "contribution"),
}


def digest(net) -> str:
    """SHA-256 over (name, dtype, shape, bytes) of every trainable parameter's `.grad`, in order; None is
    recorded as such."""
    h = hashlib.sha256()
    for name, param in net.named_parameters():
        if not param.requires_grad:
            continue
        h.update(name.encode() + b"\0")
        if param.grad is None:
            h.update(b"none\0")
            continue
        grad = param.grad.detach().contiguous().cpu()
        h.update(f"{grad.dtype}{tuple(grad.shape)}\0".encode())
        h.update(grad.view(torch.uint8).numpy().tobytes() if grad.numel() else b"")
    return h.hexdigest()


def run_case(name: str, make_router=Router) -> list[str]:
    """Three steps on one router (a batch, an empty batch's noise alone, a second batch), each group with its
    own noise std; the hash of every `.grad` after each. `make_router(model, resolution, mechanism=, insecure_seed=)`."""
    mechanism, classes, dtype, unit = CASES[name]
    net = model(dtype)
    resolution = resolve(classes, describe(net))
    router = make_router(net, resolution, mechanism=mechanism, insecure_seed=7)
    stds = {group.classes: 0.25 + 0.5 * i for i, group in enumerate(g for g in resolution.groups if g.classes)}
    hashes = []
    for step in range(3):
        if step == 1:
            router.noise_only(stds, expected_batch_size=3.0)
        else:
            ids, attention, labels, example_classes, clip = batch(seed=1 + step)
            units = None
            if unit == "contribution":
                example_classes = [example_classes[UNITS.index(u)] for u in range(3)]
                clip = clip[:3]
                units = UNITS
            with router.capture(example_classes if units is None else None):
                losses = losses_of(net, ids, attention, labels)
            router.privatize(losses, example_classes, clip.to(torch.float64), stds, 3.0, units=units)
        hashes.append(digest(net))
    router.close()
    return hashes


def compute(make_router=Router) -> dict[str, list[str]]:
    return {name: run_case(name, make_router) for name in CASES}


if __name__ == "__main__":
    found = compute()
    if "--write" in sys.argv[1:]:
        import torch

        found["_machine"] = {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__}
        GOLDEN.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
    print(json.dumps(found, indent=1, sort_keys=True))
