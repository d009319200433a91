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

`Update.step` refuses (`stale_parameters`) a privatized gradient that would not move the model: the
router writes `.grad` to the parameter objects the model held when the router was built, the optimizers
move the objects the model held when the update was built, and replacing a parameter in between
(`module.weight = nn.Parameter(...)`, `load_state_dict(..., assign=True)`) would otherwise train a tensor the
model no longer uses, or leave the model's tensor where it was, without a word. Before anything moves it
checks identities (every model parameter with a gradient is one the update moves, every tensor the update
would move with a gradient is one the model holds); after the step it checks that each of them was written
in place (its autograd version counter moved), which also catches an optimizer that skips a parameter.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import torch
from torch import Tensor, nn

from govtrain.errors import Code, ConfigError

from govtrain.mechanisms.hyperparameters import RATE_KEYS, RATES, Hyperparameters
from govtrain.mechanisms.muon import DPMuon
from govtrain.mechanisms.prism import Prism
from govtrain.resolver.model import role
from govtrain.resolver.reach import lora_pairs


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


def saved_params(saved: Mapping, optimizer: torch.optim.Optimizer) -> dict[int, Tensor] | None:
    """The parameter each index of a saved optimizer state (`optimizer.state_dict()`, as a run state keeps it) stands
    for in `optimizer`, by the order of their groups; None when they hold other numbers of parameters."""
    held = [p for group in optimizer.param_groups for p in group["params"]]
    indices = [i for group in saved.get("param_groups", []) for i in group.get("params", [])]
    return dict(zip(indices, held)) if len(indices) == len(held) else None


def privatized_norm(grads: Iterable[Tensor]) -> Tensor:
    """The L2 norm over every tensor of a privatized gradient (clipped sum plus noise, over the expected batch
    size: what the router wrote to `.grad` and the update consumes), as a 0-dim tensor on its device, so that a
    log reads it (`.item()`) only when it shows it. Post-processing: it says nothing the noised gradient does not."""
    norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())


class Update:
    def __init__(self, mechanism: str, *, optimizer: torch.optim.Optimizer | None = None, prism: Prism | None = None,
                 muon: DPMuon | None = None, model: nn.Module | None = None) -> None:
        """`model`, when given, is the model whose parameters this update must move: each step checks that
        every gradient on them reaches them (`stale_parameters`)."""
        self.mechanism, self.optimizer, self.prism, self.muon = mechanism, optimizer, prism, muon
        self.model = model
        # what RUN.toml configured, before any state is loaded: the only hyperparameters an update may meet, scaled
        # by the run's schedule (`hyperparameters.py`)
        self.hyperparameters = Hyperparameters.of(optimizer, prism, muon)
        self.grad_norm: Tensor | None = None  # the last step's privatized gradient's L2 norm (`step`)
        # names of the tensors moved, as the model called them when the update was built (for messages about
        # a tensor the model no longer holds)
        self._names = {} if model is None else {id(p): n for n, p in model.named_parameters()}

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
            return cls(mechanism, optimizer=make_optimizer(run.optimizer, rest), prism=prism, model=model)
        if mechanism == "dp-muon":
            matrices = {n: p for n, p in trainable.items() if p.dim() == 2 and role(n).layer is not None}
            settings = run.muon
            muon = DPMuon(matrices, lr=settings.lr, momentum=settings.momentum, kappa=settings.kappa,
                          steps=settings.steps, iteration=settings.iteration)
            rest = {n: p for n, p in trainable.items() if n not in matrices}
            return cls(mechanism, optimizer=make_optimizer(run.optimizer, rest), muon=muon, model=model)
        return cls(mechanism, optimizer=make_optimizer(run.optimizer, trainable), model=model)

    def step(self, noise_std: Mapping[str, float]) -> None:
        """One step from the privatized `.grad`s; `noise_std` (per parameter, the noise standard deviation
        of the averaged gradient, `Router.noise_std`) sets PRISM's preconditioner floor.

        Raises `stale_parameters` before anything moves when a gradient would not reach the model, and after
        the step when a tensor with a gradient was not written (module docstring)."""
        due = self._check_held()
        self.grad_norm = privatized_norm(p.grad for p in self._moved() if p.grad is not None)
        if not bool(torch.isfinite(self.grad_norm)):  # before any optimizer state or weight changes
            raise ConfigError(Code.NONFINITE_RELEASE,
                              "the privatized gradient the update would apply is not finite: nothing moved; the "
                              "router zeroes a unit with a non-finite gradient, so this is a defect in govtrain or a "
                              "gradient written outside the router: report it")
        versions = [(p, p._version) for p in due]
        if self.prism is not None:
            self.prism.step(noise_std)
        if self.muon is not None:
            self.muon.step()
        if self.optimizer is not None:
            self.optimizer.step()
        unmoved = [p for p, version in versions if p._version == version]
        if unmoved:
            raise ConfigError(Code.STALE_PARAMETERS,
                              f"{self._named(unmoved)} had a privatized gradient but the step did not move "
                              f"{'it' if len(unmoved) == 1 else 'them'} (the other parameters moved): the optimizer "
                              "skips them; use an optimizer that updates every parameter with a gradient in place")

    def _moved(self) -> Iterable[Tensor]:
        """Every tensor this update moves when it has a gradient."""
        if self.prism is not None:
            for pair in self.prism.pairs.values():
                yield from pair
        if self.muon is not None:
            yield from self.muon.params.values()
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                yield from group["params"]

    def _check_held(self) -> list[Tensor]:
        """The tensors with a gradient whose version the step must move. Refuses, before anything moves, a
        model parameter with a gradient that the update does not hold, and a tensor the update would move with
        a gradient that the model no longer holds. A fused optimizer's kernels (`fused=True`) write without
        bumping the version counter, so its tensors are checked by identity only."""
        unversioned = {id(p) for group in (self.optimizer.param_groups if self.optimizer is not None else [])
                       if group.get("fused") for p in group["params"]}
        moved = {id(p): p for p in self._moved()}
        if self.model is not None:
            model = {id(p): (n, p) for n, p in self.model.named_parameters()}
            orphans = [n for n, p in model.values() if p.grad is not None and id(p) not in moved]
            lost = [p for key, p in moved.items() if p.grad is not None and key not in model]
            if orphans or lost:
                what = []
                if orphans:
                    listed = ", ".join(orphans[:3]) + (f" and {len(orphans) - 3} more" if len(orphans) > 3 else "")
                    what.append(f"the model's {listed} {'has a gradient' if len(orphans) == 1 else 'have gradients'} "
                                "no optimizer applies")
                if lost:
                    what.append(f"the optimizer would move {self._named(lost)}, which the model no longer holds")
                raise ConfigError(Code.STALE_PARAMETERS,
                                  f"{'; '.join(what)}: the optimizer holds other tensors than the model. Build the "
                                  "router and the update after moving, replacing or loading the model's parameters "
                                  "(load_state_dict(..., assign=True) replaces them); nothing moved")
        return [p for key, p in moved.items() if p.grad is not None and key not in unversioned]

    def _named(self, tensors: list[Tensor]) -> str:
        names = [self._names.get(id(p), f"a tensor of shape {tuple(p.shape)}") for p in tensors]
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    def zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        for part in (self.prism, self.muon):
            if part is not None:
                part.zero_grad()

    def state_dict(self) -> dict:
        return {"mechanism": self.mechanism,
                "optimizer": None if self.optimizer is None else _plain_rates(self.optimizer.state_dict()),
                "prism": None if self.prism is None else self.prism.state_dict(),
                "muon": None if self.muon is None else self.muon.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("mechanism") != self.mechanism:
            raise ValueError(f"the saved state is of mechanism {state.get('mechanism')!r}, not {self.mechanism!r}")
        for name in ("optimizer", "prism", "muon"):
            part = getattr(self, name)
            if part is not None:
                part.load_state_dict(state[name])


def _plain_rates(state: dict) -> dict:
    """An optimizer's state_dict with its groups' learning rates as plain floats: a scheduler of one's own may write
    numpy's (accepted when they are the schedule's, `hyperparameters.py`), which a run state does not hold; the
    run writes each step's rates itself anyway (`Hyperparameters.apply`)."""
    groups = [{k: float(v) if k in RATE_KEYS and type(v) in RATES else v for k, v in group.items()}
              for group in state.get("param_groups", [])]
    return {**state, "param_groups": groups}
