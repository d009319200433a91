"""The empirical audit runs each new privatizer (issue 24; docs/auditing.md, "Privatizers").

An honest white-box audit per privatizer, through the governed path: its one-run bound, valid for any mechanism,
stays at or below what the ledger claims. For the Gaussian-family privatizers the f-DP test runs against the
mechanism the ledger's charge claims (banded MF: a subsampled Gaussian at min(1, b·q) over ⌈T/b⌉ rounds; BLT: an
unamplified Gaussian at σ/√m) and does not reject it. A noise family has no such curve: the one-run bound only.

On the materialized path (the noise families) the canaries' Diracs join each unit's per-sample vector before its
norm, clipping and quantisation; the oracle test shows they add exactly nothing to any real coordinate.

m = 1000 canaries, 5 steps at q = 0.5, as the Gaussian's CI audit (tests/test_audit.py); one audit takes ~8-20 s
on 2 shared cores, so all but banded MF and one family are marked slow (CI runs them all).
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from govtrain.audit import world as worlds  # noqa: E402
from govtrain.audit.audit import AuditConfig, attach_canaries, close_run, open_run, prepare, run_audit  # noqa: E402
from govtrain.audit.canaries import units_of  # noqa: E402

BASE = AuditConfig(mechanism="dpsgd", epsilon=8.0, m=1000, steps=5, q=0.5, seed=0)
CASES = {
    "banded-mf": dict(privatizer="banded-mf", bands=2),
    "blt": dict(privatizer="blt", buffers=2, min_separation=2),
    "laplace": dict(privatizer="laplace"),
    "discrete-gaussian": dict(privatizer="discrete-gaussian"),
    "skellam": dict(privatizer="skellam"),
}
SLOW = {"blt", "discrete-gaussian", "skellam"}


def _spend_privatizers(folder: Path) -> set[str]:
    from govtrain.ledger.entries import decode_entry
    from govtrain.ledger.ledger import Ledger

    with Ledger.open(f"sqlite:///{folder / 'ledger.db'}") as ledger:
        return {decode_entry(e.body, seq=e.seq, kind=e.kind)["privatizer"]["name"]
                for e in ledger.store.entries(kinds=("spend",))}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in CASES])
def test_an_honest_audit_of_each_privatizer_stays_at_or_below_the_claim(tmp_path: Path, name: str):
    config = replace(BASE, **CASES[name])
    result = run_audit(config, tmp_path / "audit")
    assert _spend_privatizers(tmp_path / "audit") == {name}  # the audited run noised with that privatizer
    bound = result.bound
    assert bound.canaries == config.m and result.delta < 1 / (2 * config.m)
    assert bound.epsilon_one_run <= result.claimed and not result.failed
    assert bound.epsilon_one_run > 0.5  # not vacuous: the canaries' clipped Diracs are seen through the noise
    mechanism = result.mechanism
    if name == "banded-mf":  # the charge: DP-SGD at min(1, b·q) over ⌈T/b⌉ rounds
        assert (mechanism.sampling_rate, mechanism.steps) == (min(1.0, 2 * config.q), math.ceil(config.steps / 2))
    elif name == "blt":  # unamplified, at the charged multiplier σ/√m
        assert (mechanism.sampling_rate, mechanism.steps) == (1.0, math.ceil(config.steps / 2))
    if mechanism is None:  # a noise family: no claimed curve, the one-run bound only
        assert name in ("laplace", "discrete-gaussian", "skellam") and bound.fdp is None
    else:
        assert 6.0 < result.claimed <= config.epsilon * 1.001  # calibrated to the target through the charge
        assert bound.fdp is not None and not bound.fdp.claim_rejected and bound.fdp.epsilon <= result.claimed


def _step(run, canary_ids, dirac):  # type: ignore[no-untyped-def]
    """One logical step of `run`'s current draw, its rounding and noise generators reseeded: the `.grad` written."""
    router = run.router
    router.generator.manual_seed(1234)  # the randomised rounding's
    router.privatizer._updates = 0  # the family's noise stream is seeded by (insecure seed, its update count)
    router.begin(run._group_std)
    for chunk in run._audit_chunks:
        batch = run.encode(chunk)
        with run.forward(chunk):
            output = run.model(**batch.inputs)
        losses = run.task.per_example_loss(output, batch)
        losses = losses * torch.tensor([o not in canary_ids for o in chunk.owners], dtype=losses.dtype)
        if dirac is not None:
            dirac.select(units_of(chunk.owners, chunk.units))
        router.accumulate(losses, chunk.classes, chunk.clips, units=chunk.units)
    router.finish(run._group_std, run.pending["expected_batch"])
    grads = {n: p.grad.detach().clone() for n, p in router.params.items() if p.grad is not None}
    for p in router.params.values():
        p.grad = None
    return grads


@pytest.mark.parametrize("privatizer", ["laplace", "discrete-gaussian"])
def test_canaries_on_the_materialized_path_add_exactly_nothing_to_real_gradients(tmp_path: Path, privatizer: str):
    """Oracle: the same step (same draw, same rounding and noise draws) with and without the canaries. Every
    coordinate but the drawn canaries' is bit-for-bit equal; each drawn canary's coordinate moves by its clipped,
    quantised Dirac, -C over the expected batch to within one lattice step."""
    config = AuditConfig(mechanism="dpsgd", epsilon=4.0, m=40, steps=1, q=1.0, seed=3, privatizer=privatizer)
    setup = prepare(config, tmp_path / "audit")
    ledger, run = open_run(config, setup.world)
    try:
        assert run.router.materialized is not None
        assert run.plan_epoch() and run.write_ahead()
        run._audit_chunks = run.draw()
        drawn = {o for chunk in run._audit_chunks for o in chunk.owners}
        canary_ids = set(setup.canaries.ids)
        assert drawn & canary_ids and drawn - canary_ids  # the step has both canaries and real examples
        without = _step(run, canary_ids, None)
        dirac = attach_canaries(run, setup.canaries, config.scale)
        with_canaries = _step(run, canary_ids, dirac)
        spacing = run.router.privatizer.spacing(run._group_std[frozenset({worlds.AUDIT_CLASS})])
    finally:
        close_run(ledger, run)
    assert without.keys() == with_canaries.keys()
    batch = run.pending["expected_batch"]
    moved = 0
    for name in without:
        difference = (with_canaries[name] - without[name]).view(-1)
        at = torch.zeros_like(difference, dtype=torch.bool)
        for cid in drawn & canary_ids:
            coordinate = dirac.coordinates[cid]
            if coordinate.name == name:
                at[coordinate.index] = True
        assert torch.equal(with_canaries[name].view(-1)[~at], without[name].view(-1)[~at]), name
        if at.any():
            # the Dirac, -10 C, clipped to C (a hair under) and rounded to a neighbouring lattice point
            assert bool(((difference[at] + 1.0 / batch).abs() <= 1.01 * spacing / batch).all()), name
            moved += int(at.sum())
    assert moved == len(drawn & canary_ids)
