"""Canaries: m of them, each included with probability ½ by a draw the auditor keeps until scoring, admitted
through the gate like any data (docs/auditing.md).

White-box gradient canaries (Steinke, Nasr & Jagielski 2023, §6 "white-box": Dirac canary gradients). Canary i
owns one coordinate, inside parameters that only the audit class reaches (`world.py`): the only things that
move it are canary i's gradient and the mechanism's noise. Its per-sample gradient is a Dirac of norm
`scale`·C (above the clipping norm C, so clipping matters) on that coordinate and zero elsewhere; the model's
own gradient for it is zero (its loss is weighted by zero). `DiracCanaries` hands the Dirac to the router's
per-sample clipping (`Router.inject_audit_canaries`): the router adds its square to the canary's squared norm,
clips it with the canary's own coefficient, sums it, noises the group and divides by the expected batch size,
exactly as it does a real example's gradient. On the materialized path (the noise families) the Dirac joins the
unit's per-sample vector itself (`diracs`), before its L1 or L2 norm, clipping and quantisation.

Only `govtrain.audit` builds a `DiracCanaries`, and the router accepts no other object: it checks the exact type
against this module's class, read from the loaded module (routing sits below the audit and never imports it). No
RUN.toml field, policy entry or command-line option reaches it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from govtrain import units


@dataclass(frozen=True, kw_only=True)
class Canaries:
    """m canaries and which of them the run includes (the auditor's secret until scoring)."""

    ids: tuple[str, ...]
    included: np.ndarray  # bool [m]

    @property
    def m(self) -> int:
        return len(self.ids)


def draw_canaries(m: int, rng: np.random.Generator, *, prefix: str = "canary") -> Canaries:
    """m canaries, each included independently with probability ½ (`rng` is the auditor's)."""
    if m < 1:
        raise ValueError("an audit needs at least one canary")
    return Canaries(ids=tuple(f"{prefix}-{i:05d}" for i in range(m)), included=rng.random(m) < 0.5)


def admit(world, items: Mapping[str, list[dict]], *, data_class: str, clip_norm: float, sigma: float,
          budget: float, now: int) -> None:
    """Attest and admit each contribution id -> rows through the gate (`gate.admission.admit_many`), as an
    attester and the gate do for any data; raises the first refusal."""
    from govtrain.attest.cose import sign_attestation
    from govtrain.attest.descriptor import Descriptor
    from govtrain.attest.keys import load_private_key
    from govtrain.audit.world import write_rows
    from govtrain.gate.admission import admit_many
    from govtrain.ledger.ledger import Ledger

    key = load_private_key(world.attester_key)
    batch = []
    for cid, rows in items.items():
        path = write_rows(world, cid, rows)
        raw = path.read_bytes()
        descriptor = Descriptor(v=1, contribution_id=cid, contributor="auditor@audit.invalid", data_class=data_class,
                                data_sha256=hashlib.sha256(raw).digest(), records=len(rows),
                                clip_norm_u=units.clip_norm_u(clip_norm),
                                noise_multiplier_u=units.noise_multiplier_u(sigma),
                                eps_budget_u=units.eps_budget_u(budget), not_before=now - 60,
                                not_after=now + 7 * 86_400, issued_at=now - 60,
                                salt=hashlib.sha256(b"audit salt " + cid.encode()).digest()[:16])
        batch.append((cid, sign_attestation(descriptor, key), path))
    with Ledger.open(world.url, key=world.ledger_key) as ledger:
        for outcome in admit_many(ledger, batch, now=now):
            if outcome.error is not None:
                raise outcome.error


@dataclass(frozen=True, kw_only=True)
class Coordinate:
    """Where a canary's Dirac sits: a parameter and a flat index into it."""

    name: str
    index: int


class DiracCanaries:
    """The router's extension point for white-box canaries (audit only; see the module).

    `coordinates` maps each canary's contribution id to its coordinate; `clip_norm` is the audit class's C and
    `scale` the Dirac's norm in units of C. Before each chunk's `Run.accumulate`, the audit calls `select` with
    the contribution of each clipping unit of the chunk (`units_of`); the router then asks `inject` for the
    chunk's Diracs and `add_clipped` adds them, clipped, to the sums. A unit that is no canary gets nothing:
    the rows it is given are exactly the selected canaries'."""

    def __init__(self, coordinates: Mapping[str, Coordinate], *, data_class: str, clip_norm: float,
                 scale: float = 10.0) -> None:
        if not scale > 1:
            raise ValueError("a Dirac canary's norm must exceed the clipping norm (scale > 1), or clipping is not audited")
        self.coordinates = dict(coordinates)
        self.data_class, self.clip_norm = data_class, clip_norm
        self.value = -scale * clip_norm  # descent raises the coordinate
        self._selected: list[str] | None = None
        self._pending: dict[str, tuple[Tensor, Tensor, Tensor]] | None = None

    @property
    def names(self) -> set[str]:
        return {c.name for c in self.coordinates.values()}

    def select(self, owners: Sequence[str]) -> None:
        """The contribution of each clipping unit of the chunk about to be accumulated."""
        self._selected = list(owners)

    def check(self, classes: Sequence[str]) -> None:
        """Refuse a chunk before the router forms anything from it: `select` must have named one contribution per
        clipping unit, and a canary must be clipped as the canaries' class. A misuse of the audit's own driver, so
        a ValueError, as the router's other checks of its arguments."""
        owners = self._selected
        if owners is None or len(owners) != len(classes):
            raise ValueError("DiracCanaries.select(owners) with one owner per clipping unit must precede each chunk")
        for owner, data_class in zip(owners, classes):
            if owner in self.coordinates and data_class != self.data_class:
                raise ValueError(f"canary {owner} is clipped as class {data_class!r}, not {self.data_class!r}")

    def inject(self, squares: dict[str, Tensor], classes: Sequence[str], batch: int, dtype: torch.dtype,
               device: torch.device) -> None:
        """Add each selected canary's Dirac to its unit's squared norm (its model gradient is zero there: its
        loss is weighted by zero), before the router forms the clipping coefficients."""
        self.check(classes)
        owners, self._selected = self._selected, None
        found: dict[str, tuple[list[int], list[int]]] = {}
        for row, owner in enumerate(owners):
            coordinate = self.coordinates.get(owner)
            if coordinate is None:
                continue
            rows, flat = found.setdefault(coordinate.name, ([], []))
            rows.append(row)
            flat.append(coordinate.index)
        self._pending = {}
        for name, (rows, flat) in found.items():
            index = torch.tensor(rows, dtype=torch.long, device=device)
            values = torch.full((len(rows),), self.value, dtype=dtype, device=device)
            square = squares.setdefault(name, torch.zeros(batch, dtype=dtype, device=device))
            square.index_add_(0, index, values * values)
            self._pending[name] = (index, torch.tensor(flat, dtype=torch.long, device=device), values)

    def diracs(self, classes: Sequence[str]) -> list[tuple[int, Coordinate, float]]:
        """The materialized path's form (the noise families: `routing/materialized.py`): each selected canary's
        (clipping unit's row, coordinate, value), which the path adds to that unit's per-sample vector before its
        norm (L1 or L2), clipping and quantisation, exactly as a real unit's gradient. Consumes the selection."""
        self.check(classes)
        owners, self._selected = self._selected, None
        return [(row, self.coordinates[owner], self.value) for row, owner in enumerate(owners)
                if owner in self.coordinates]

    def add_clipped(self, totals: dict[str, Tensor], coefficients: Mapping[str, Tensor]) -> None:
        """Add each injected Dirac, times its unit's clipping coefficient for that parameter, to the sums."""
        pending, self._pending = self._pending or {}, None
        for name, (rows, flat, values) in pending.items():
            totals[name].view(-1).index_add_(0, flat, coefficients[name].index_select(0, rows) * values)




def units_of(owners: Sequence[str], chunk_units: Sequence[int] | None) -> list[str]:
    """The contribution of each clipping unit of a chunk: each example's own, or each unit's (whose examples
    are all of one contribution)."""
    if chunk_units is None:
        return list(owners)
    first: dict[int, str] = {}
    for owner, unit in zip(owners, chunk_units):
        first.setdefault(unit, owner)
    return [first[u] for u in range(len(first))]


def coordinates_for(ids: Sequence[str], params: Mapping[str, Tensor], names: Sequence[str]) -> dict[str, Coordinate]:
    """Canary k (of `ids`, in order) gets the k-th coordinate of `names`' parameters laid end to end."""
    places = [(name, i) for name in names for i in range(params[name].numel())]
    if len(places) < len(ids):
        raise ValueError(f"{len(ids)} canaries need as many coordinates; the audit class owns {len(places)}: "
                         "widen the head (more labels) or the adapter (larger r)")
    return {cid: Coordinate(name=name, index=i) for cid, (name, i) in zip(ids, places)}
