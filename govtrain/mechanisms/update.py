"""The optimizer side of a mechanism: what moves the parameters once the routing layer has written `.grad`.

    update = Update.build(model, config.file)      # from RUN.toml's [training], [optimizer], [prism], [muon]
    router.privatize(...)                           # every reached parameter's .grad is privatized
    update.step(router.noise_std)
    update.zero_grad()

- `dpsgd`: the run's optimizer (SGD, Adam or AdamW) on every trainable parameter.
- `prism`: `Prism` retracts every LoRA pair; the run's optimizer moves the rest (classifier head, norms).
- `dp-muon`: `DPMuon` orthogonalizes every trainable matrix inside the layer stack (LoRA factors,
  whole weights); the run's optimizer moves the rest (classifier head, embeddings, biases, norms), as
  Muon is meant to be used.

PRISM and DP-Muon move their parameters in stacks of one shape (`stacking.py`): a step costs a handful
of batched kernels per shape, not a loop over every LoRA pair or matrix, and their `state_dict()` keeps
one entry per pair or matrix.

Everything here is post-processing of privatized gradients; nothing reads a per-sample value.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from govtrain.mechanisms.muon import DPMuon
from govtrain.mechanisms.prism import Prism, lora_pairs
from govtrain.resolver.model import role


def make_optimizer(settings, params: Mapping[str, nn.Parameter]) -> torch.optim.Optimizer | None:
    """The run's `[optimizer]` over the named `params` (None when there are none): those outside the layer
    stack (the classification head, what a profile's `head = true` reaches) at `head_lr` when it is set,
    the rest at `lr`."""
    if not params:
        return None
    head_lr = settings.lr if settings.head_lr is None else settings.head_lr
    head = [p for n, p in params.items() if role(n).layer is None]
    stack = [p for n, p in params.items() if role(n).layer is not None]
    groups = [g for g in ({"params": stack, "lr": settings.lr}, {"params": head, "lr": head_lr}) if g["params"]]
    if settings.name == "sgd":
        return torch.optim.SGD(groups, lr=settings.lr, momentum=settings.momentum, weight_decay=settings.weight_decay)
    if settings.name == "adam":
        return torch.optim.Adam(groups, lr=settings.lr, betas=settings.betas, weight_decay=settings.weight_decay)
    return torch.optim.AdamW(groups, lr=settings.lr, betas=settings.betas, weight_decay=settings.weight_decay)


class Update:
    def __init__(self, mechanism: str, *, optimizer: torch.optim.Optimizer | None = None, prism: Prism | None = None,
                 muon: DPMuon | None = None) -> None:
        self.mechanism, self.optimizer, self.prism, self.muon = mechanism, optimizer, prism, muon

    @classmethod
    def build(cls, model: nn.Module, run) -> "Update":
        """The update `run` (a `RunFile`) asks for, over `model`'s trainable parameters."""
        mechanism = run.training.mechanism
        trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
        if mechanism == "prism":
            pairs = lora_pairs(trainable)
            taken = set(pairs) | set(pairs.values())
            settings = run.prism
            prism = Prism({b: (trainable[a], trainable[b]) for b, a in pairs.items()}, lr=settings.lr,
                          betas=settings.betas, floor=settings.floor, max_condition=settings.max_condition)
            rest = {n: p for n, p in trainable.items() if n not in taken}
            return cls(mechanism, optimizer=make_optimizer(run.optimizer, rest), prism=prism)
        if mechanism == "dp-muon":
            matrices = {n: p for n, p in trainable.items() if p.dim() == 2 and role(n).layer is not None}
            settings = run.muon
            muon = DPMuon(matrices, lr=settings.lr, momentum=settings.momentum, kappa=settings.kappa,
                          steps=settings.steps, iteration=settings.iteration)
            rest = {n: p for n, p in trainable.items() if n not in matrices}
            return cls(mechanism, optimizer=make_optimizer(run.optimizer, rest), muon=muon)
        return cls(mechanism, optimizer=make_optimizer(run.optimizer, trainable))

    def step(self, noise_std: Mapping[str, float]) -> None:
        """One step from the privatized `.grad`s; `noise_std` (per parameter, the noise standard deviation
        of the averaged gradient, `Router.noise_std`) sets PRISM's preconditioner floor."""
        if self.prism is not None:
            self.prism.step(noise_std)
        if self.muon is not None:
            self.muon.step()
        if self.optimizer is not None:
            self.optimizer.step()

    def zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        for part in (self.prism, self.muon):
            if part is not None:
                part.zero_grad()

    def state_dict(self) -> dict:
        return {"mechanism": self.mechanism,
                "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
                "prism": None if self.prism is None else self.prism.state_dict(),
                "muon": None if self.muon is None else self.muon.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("mechanism") != self.mechanism:
            raise ValueError(f"the saved state is of mechanism {state.get('mechanism')!r}, not {self.mechanism!r}")
        for name in ("optimizer", "prism", "muon"):
            part = getattr(self, name)
            if part is not None:
                part.load_state_dict(state[name])
