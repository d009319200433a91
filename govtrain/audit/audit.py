"""One audit: m canaries, one governed training run, one bound (docs/auditing.md).

    result = run_audit(AuditConfig(mechanism="dpsgd", epsilon=4.0, m=1000), folder)
    result.claimed, result.bound.epsilon_one_run, result.bound.fdp.claim_rejected, result.bound.fdp.epsilon

The run is the real one: the canaries are attested and admitted through the gate into the audit's own ledger
(`world.py`), `Run` prepares, plans each ledger epoch and writes its spend ahead, the run's Poisson sampler draws
every step, the router clips, sums, noises per group and divides by the expected batch size, and the update
moves the parameters. The audit drives `Run`'s phases as `GovernedRun.batches()` does, with two differences that
only concern the canaries: a canary's loss is weighted by zero, and (white-box) its Dirac gradient is handed to
the router's clipping (`canaries.DiracCanaries`). It never calls `Run.finish`: nothing is saved or released and
no run entry is recorded, so a canary never reaches a release or a model card.

The claim is what the ledger says: the largest cumulative ε of the canaries' contributions in its spend book,
read back after the run, at the policy's δ; and the mechanism the run claims for each canary, the subsampled
Gaussian at the run's q, the canaries' signed noise multiplier and its steps (`AuditResult.mechanism`). The bound
is `bounds.audit_scores` at that δ, which must be far below 1/(2m) (the one-run test pays 2mδ, so a δ near 1/(2m)
certifies nothing), with the f-DP test against that claimed mechanism's curve. The audit fails the run when
`AuditResult.failed`: the one-run bound, valid for any mechanism, is above the ledger's claim, or the f-DP test
rejects the claimed curve.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

import numpy as np

from govtrain import units
from govtrain.audit import world as worlds
from govtrain.audit.bounds import AuditBound, audit_scores
from govtrain.audit.canaries import Canaries, DiracCanaries, admit, coordinates_for, draw_canaries, units_of
from govtrain.audit.scores import displacement_scores, step_likelihood_scores
from govtrain.audit.tradeoff import SubsampledGaussian
from govtrain.privatizers.base import FIELDS

REAL_CONTRIBUTIONS, REAL_RECORDS = 4, 5  # the real data: a few small contributions of the real class


@dataclass(frozen=True, kw_only=True)
class AuditConfig:
    """What to audit. `epsilon` is the target the canaries' noise is calibrated to (`noise_multiplier_for` at the
    run's q, steps and δ); the claim reported is what the ledger then charges."""

    mechanism: Literal["dpsgd", "prism", "dp-muon"] = "dpsgd"
    kind: Literal["white-box", "black-box"] = "white-box"
    unit: Literal["example", "contribution"] = "example"
    profile: worlds.Profile = "head"
    epsilon: float = 4.0
    # canaries: 10000 catches half the charged noise in nearly every run at ε ≈ 2 and 4, where 1000 caught about
    # half (docs/auditing.md, "Power"); about 20 CPU s an audit at 10 steps
    m: int = 10000
    steps: int = 20
    q: float = 0.5
    delta: float = 1e-5
    scale: float = 10.0  # a white-box canary's gradient norm, in units of C
    # white-box: how each canary is scored from the values its coordinate released at each step (`scores.py`):
    # "steps", the log-likelihood ratio under the claimed mechanism, summed over steps; "displacement", their sum
    # (the last iterate's displacement)
    score: Literal["steps", "displacement"] = "steps"
    lr: float = 0.1
    seed: int = 0
    # the run's RUN.toml [noise] (docs/privatizers.md): the privatizer and its fields, None where unset
    privatizer: str = "gaussian"
    bands: int | None = None
    buffers: int | None = None
    min_separation: int | None = None
    granularity_bits: int | None = None
    beta_exp: int | None = None

    def describe(self) -> str:
        noise = "" if self.privatizer == "gaussian" else f", {self.privatizer} noise"
        return f"{self.mechanism} {self.kind} {self.unit} unit, {self.profile} profile{noise}"

    def noise(self):  # type: ignore[no-untyped-def]
        """Its RUN.toml [noise] section (`train.config.NoiseSection`)."""
        from govtrain.train.config import NoiseSection

        return NoiseSection(privatizer=self.privatizer, **{k: getattr(self, k) for k in FIELDS
                                                            if getattr(self, k) is not None})


@dataclass(frozen=True, kw_only=True)
class AuditResult:
    config: AuditConfig
    claimed: float  # the canaries' largest cumulative ε in the ledger, at `delta`
    delta: float
    # each canary's mechanism, as the ledger's charge claims it: a subsampled Gaussian (the i.i.d. Gaussian's at
    # (q, σ, steps); banded MF's at (min(1, b·q), σ, ⌈T/b⌉); BLT's unamplified at (1, σ/√m, ⌈T/b⌉)), or None for a
    # noise family, whose mechanism has no such curve: then only the one-run bound, valid for any mechanism
    mechanism: SubsampledGaussian | None
    bound: AuditBound  # its `fdp` is the f-DP test against `mechanism` (None without one)
    seconds: float
    scores: np.ndarray = field(repr=False)  # what the bound ranked (`config.score`)
    included: np.ndarray = field(repr=False)
    # white-box: each canary's released value at each step [m, steps], in units of C (`scores.py`); None for
    # black-box canaries. Any other score of it (`scores.py`) bounds this run just as validly.
    released: np.ndarray | None = field(default=None, repr=False)

    @property
    def failed(self) -> bool:
        """The audit shows the claim wrong: the one-run bound (any mechanism) exceeds the ledger's ε, or the f-DP
        test rejects the claimed curve. `bound.fdp.epsilon` above the claim says the same for a mechanism of the
        claimed family (a subsampled Gaussian), which the rejection already covers. A noise family's audit has no
        claimed curve: the one-run bound alone."""
        if self.mechanism is not None:
            assert self.bound.fdp is not None
        rejected = self.bound.fdp is not None and self.bound.fdp.claim_rejected
        return self.bound.epsilon_one_run > self.claimed or rejected


@dataclass(frozen=True, kw_only=True)
class Setup:
    """An audit's world with its canaries admitted (the included ones), before the run."""

    world: worlds.World
    canaries: Canaries
    rows: list[dict]  # each canary's row, admitted or not
    sigma: float  # the canaries' signed noise multiplier


def run_audit(config: AuditConfig, folder: Path, *, log: Callable[[str], None] = lambda _: None,
              now: Callable[[], int] = lambda: int(time.time())) -> AuditResult:
    """Build the audit's world in the empty `folder`, train once with the canaries, score them, bound ε."""
    started = time.perf_counter()
    setup = prepare(config, folder, now=now)
    log(f"{config.describe()}: {config.m} canaries, {int(setup.canaries.included.sum())} admitted; "
        f"σ = {setup.sigma:g}")
    released, scores = _train(config, setup, now, log)
    if released is not None:
        scores = score(config, setup.sigma, released)
    claimed = _claimed(setup.world, setup.canaries)
    mechanism = _claimed_mechanism(setup.world, setup.canaries)
    bound = audit_scores(scores, setup.canaries.included, delta=config.delta, claim=mechanism)
    return AuditResult(config=config, claimed=claimed, delta=config.delta, mechanism=mechanism, bound=bound,
                       seconds=time.perf_counter() - started, scores=scores, included=setup.canaries.included,
                       released=released)


def score(config: AuditConfig, sigma: float, released: np.ndarray) -> np.ndarray:
    """White-box canaries' scores from their released values [m, steps] by `config.score` (`scores.py`): the
    step likelihood ratio at the canaries' signed noise multiplier `sigma` and the run's q, or the displacement.
    Neither reads which canaries were included."""
    if config.score == "displacement":
        return displacement_scores(released)
    return step_likelihood_scores(released, noise_multiplier=sigma, sampling_rate=config.q)


def prepare(config: AuditConfig, folder: Path, *, now: Callable[[], int] = lambda: int(time.time())) -> Setup:
    """The audit's world in `folder` (keys, policy, tiny model, ledger, RUN.toml), the real data admitted, and
    each included canary attested and admitted through the gate. The canaries' noise multiplier is calibrated
    to `config.epsilon` at the run's q, steps and δ."""
    from govtrain.accounting.calibrate import noise_multiplier_for

    if not config.delta < 1 / (2 * config.m):
        raise ValueError(f"the audit's δ = {config.delta:g} must be far below 1/(2m) = {1 / (2 * config.m):g}")
    rng = np.random.default_rng(config.seed)
    canaries = draw_canaries(config.m, rng)
    # RDP is cheap and never tighter than the ledger's PRV: the claim the ledger then charges is at most the target
    sigma, budget = _calibrate(config)
    white = config.kind == "white-box"
    labels = max(2, -(-config.m // worlds.HIDDEN)) if white and config.profile == "head" else 16
    model = worlds.save_tiny_bert(folder / "model", labels, seed=config.seed)
    world = worlds.build(folder, policy=worlds.policy_text(
        profile=config.profile, unit=config.unit, q=config.q, delta=config.delta, epoch_steps=config.steps,
        audit_sigma=sigma, audit_budget=budget, real_sigma=1.0 if white else sigma),
        model=model, run=worlds.run_toml(model=model, profile=config.profile, mechanism=config.mechanism,
                                         steps=config.steps, lr=config.lr, lora_r=8 if config.profile == "adapter" else 2,
                                         noise=config.noise()))
    clock = now()
    real = {f"real-{k}": [{"text": f"{worlds.WORDS[(k + i) % 9]} movie {worlds.WORDS[9 + (i % 8)]}", "label": i % 2}
                          for i in range(REAL_RECORDS)] for k in range(REAL_CONTRIBUTIONS)}
    canary_class = worlds.AUDIT_CLASS if white else worlds.REAL_CLASS
    admit(world, real, data_class=worlds.REAL_CLASS, clip_norm=1.0, sigma=1.0 if white else sigma, budget=1000.0,
          now=clock)
    rows = _canary_rows(canaries, labels, rng, white)
    admit(world, {cid: [rows[i]] for i, cid in enumerate(canaries.ids) if canaries.included[i]},
          data_class=canary_class, clip_norm=1.0, sigma=sigma, budget=budget, now=clock)
    return Setup(world=world, canaries=canaries, rows=rows, sigma=sigma)


def _calibrate(config: AuditConfig) -> tuple[float, float]:
    """(the canaries' signed σ, their ε budget). A Gaussian-family charge (the i.i.d. Gaussian, banded MF, BLT) is
    (rate, σ·k, rounds) with rate, rounds and k = charged multiplier over σ fixed by the privatizer: σ is the
    multiplier calibrated to `epsilon` at that rate and rounds, over k. A noise family's accountant has no such
    inverse here: σ is the i.i.d. Gaussian's at (q, steps), and the ledger charges what that family's accountant
    says (the claim is read back), with the budget wide enough for every step."""
    from govtrain.accounting.calibrate import noise_multiplier_for
    from govtrain.privatizers import build

    privatizer = build(config.noise(), horizon=config.steps)
    if privatizer.quantized or privatizer.family != "gaussian":
        sigma = noise_multiplier_for(config.epsilon, config.delta, config.q, config.steps, "rdp").noise_multiplier
        return sigma, config.epsilon * 10
    charge = privatizer.charge(sampling_rate_u=round(config.q * units.MICRO), noise_multiplier_u=units.MICRO,
                               steps=config.steps)
    calibrated = noise_multiplier_for(config.epsilon, config.delta, charge.sampling_rate_u / units.MICRO, charge.rounds,
                                      "rdp").noise_multiplier
    # k ≤ 1 (BLT: 1/√m); a hair more noise so that the charged multiplier, rounded down, still meets the calibration
    return calibrated * units.MICRO / charge.noise_multiplier_u * (1 + 1e-5), config.epsilon * 1.5


def _claimed_mechanism(world: worlds.World, canaries: Canaries) -> SubsampledGaussian | None:
    """The mechanism the ledger charges a canary for, from its spend entries' records (`charges.spend_item`): one
    subsampled Gaussian where every spend is a Gaussian bucket of one (rate, σ), None for another family."""
    from govtrain.ledger.entries import decode_entry
    from govtrain.ledger.ledger import Ledger
    from govtrain.privatizers.charges import spend_item

    charged = [cid for cid, inside in zip(canaries.ids, canaries.included) if inside]
    with Ledger.open(world.url) as ledger:
        spends = [decode_entry(e.body, seq=e.seq, kind=e.kind) for e in ledger.store.entries(kinds=("spend",))]
    items = [spend_item(s) for s in spends if s["contribution_id"] == charged[0]]
    if not items or any(not isinstance(item, tuple) for item in items) or len({i[:2] for i in items}) != 1:
        return None
    rate_u, sigma_u, _ = items[0]
    return SubsampledGaussian(noise_multiplier=sigma_u / units.MICRO, sampling_rate=rate_u / units.MICRO,
                              steps=sum(item[2] for item in items))


def open_run(config: AuditConfig, world: worlds.World, *, now: Callable[[], int] = lambda: int(time.time()),
             log: Callable[[str], None] = lambda _: None):  # type: ignore[no-untyped-def]
    """(ledger, prepared `Run`) of the audit's world: the caller closes both (`close_run`)."""
    from govtrain.ledger.ledger import Ledger
    from govtrain.train.config import run_config
    from govtrain.train.run import Run

    ledger = Ledger.open(world.url, key=world.ledger_key)
    run = Run(run_config(world.run_toml), ledger, insecure_seed=config.seed, log=log, now=now,
              checkpoint_every=10**9)
    try:
        run.prepare()
    except BaseException:
        close_run(ledger, run)
        raise
    return ledger, run


def close_run(ledger, run) -> None:  # type: ignore[no-untyped-def]
    if getattr(run, "router", None) is not None:
        run.router.close()
    run.release()
    ledger.close()


def attach_canaries(run, canaries: Canaries, scale: float) -> DiracCanaries:  # type: ignore[no-untyped-def]
    """Give each canary a coordinate of the parameters the audit class alone reaches whole (outside LoRA pairs
    under prism; the head's weight before its bias) and hand their Diracs to the run's router."""
    router = run.router
    owned = sorted(n for n in router.params if {c for c, masks in router.masks.items() if n in masks}
                   == {worlds.AUDIT_CLASS} and router.masks[worlds.AUDIT_CLASS][n] is None
                   and n not in router._paired)
    owned = [n for n in owned if n.endswith("weight")] + [n for n in owned if not n.endswith("weight")]
    dirac = DiracCanaries(coordinates_for(canaries.ids, router.params, owned), data_class=worlds.AUDIT_CLASS,
                          clip_norm=1.0, scale=scale)
    router.inject_audit_canaries(dirac)
    return dirac


def _canary_rows(canaries: Canaries, labels: int, rng: np.random.Generator, white: bool) -> list[dict]:
    """One row per canary. White-box: any text (its loss is weighted by zero). Black-box: random words with a
    random label, which only memorising it fits."""
    rows = []
    for i in range(canaries.m):
        words = rng.choice(worlds.WORDS, size=6)
        rows.append({"text": f"{' '.join(words)} {i}", "label": int(rng.integers(labels)) if not white else 0})
    return rows


class _Released:
    """What each step released at each white-box canary's coordinate, in units of C: under plain SGD the step
    moves the coordinate by lr/B times its noised, clipped sum, so (its move) · B / (lr · C) is that sum over C,
    the canary's clipped Dirac when it was drawn plus the group's noise (`scores.py`). Read from the parameters
    after each update, as any observer of the iterates can."""

    def __init__(self, canaries: Canaries, dirac: DiracCanaries, run) -> None:  # type: ignore[no-untyped-def]
        import torch

        self.params, self.m, self.clip = run.router.params, canaries.m, dirac.clip_norm
        places: dict[str, tuple[list[int], list[int]]] = {}
        for row, cid in enumerate(canaries.ids):
            c = dirac.coordinates[cid]
            rows, flat = places.setdefault(c.name, ([], []))
            rows.append(row)
            flat.append(c.index)
        self.places = {name: (np.array(rows), torch.tensor(flat, dtype=torch.long)) for name, (rows, flat) in
                       places.items()}
        self.lr = {name: _lr_of(run.update, self.params[name]) for name in self.places}
        self.last = {name: self._read(name) for name in self.places}
        self.steps: list[np.ndarray] = []

    def _read(self, name: str) -> np.ndarray:
        flat = self.places[name][1]
        return self.params[name].detach().reshape(-1).index_select(0, flat.to(self.params[name].device)) \
            .double().cpu().numpy()

    def step(self, expected_batch: float) -> None:
        """Record the step just applied, whose clipped sums were divided by `expected_batch`."""
        values = np.zeros(self.m)
        for name, (rows, _) in self.places.items():
            now = self._read(name)
            values[rows] = (now - self.last[name]) * expected_batch / (self.lr[name] * self.clip)
            self.last[name] = now
        self.steps.append(values)

    def matrix(self) -> np.ndarray:
        return np.stack(self.steps, axis=1) if self.steps else np.zeros((self.m, 0))


def _lr_of(update, param) -> float:  # type: ignore[no-untyped-def]
    """The learning rate of the optimizer group that moves `param` (the audited runs: plain SGD, no schedule)."""
    for group in update.optimizer.param_groups if update.optimizer is not None else []:
        if any(p is param for p in group["params"]):
            return float(group["lr"])
    raise RuntimeError("a canary coordinate's parameter is not moved by the run's [optimizer]: nothing to read")


def _train(config: AuditConfig, setup: Setup, now: Callable[[], int],
           log: Callable[[str], None]) -> tuple[np.ndarray | None, np.ndarray]:
    """Run the governed training with the canaries. White-box: (each canary's released value per step,
    [m, steps], its displacement score); black-box: (None, its loss score). Higher: guessed included."""
    import torch

    canaries, white = setup.canaries, config.kind == "white-box"
    ledger, run = open_run(config, setup.world, now=now, log=log)
    try:
        if white:
            dirac = attach_canaries(run, canaries, config.scale)
            released = _Released(canaries, dirac, run)
        canary_ids = set(canaries.ids)
        while not run.done:
            if run.pending is None and not run.plan_epoch():
                break
            if not run.write_ahead():
                continue
            while not run.epoch_done:
                for chunk in run.draw():
                    batch = run.encode(chunk)
                    with run.forward(chunk):
                        output = run.model(**batch.inputs)
                    losses = run.task.per_example_loss(output, batch)
                    if white:  # a white-box canary's own loss adds nothing: its gradient is its Dirac alone
                        keep = torch.tensor([o not in canary_ids for o in chunk.owners], dtype=losses.dtype,
                                            device=losses.device)
                        losses = losses * keep
                        dirac.select(units_of(chunk.owners, chunk.units))
                    run.accumulate(chunk, losses)
                expected_batch = float(run.pending["expected_batch"])
                run.apply()
                if white:
                    released.step(expected_batch)
            run.close_epoch()
        if white:
            matrix = released.matrix()
            return matrix, displacement_scores(matrix)
        return None, _loss_scores(run, setup.rows)
    finally:
        close_run(ledger, run)


def _loss_scores(run, rows: list[dict]) -> np.ndarray:  # type: ignore[no-untyped-def]
    """Black-box: minus each canary's loss under the final model at full rights (every adapter active, outside
    any capture), in batches."""
    import torch

    examples = [run.task.example(row, f"canary {i}") for i, row in enumerate(rows)]
    losses = []
    run.model.eval()
    with torch.no_grad():
        for start in range(0, len(examples), 256):
            batch = run.task.encode(examples[start:start + 256], run.tokenizer, run.config.file.model.max_length,
                                    run.device)
            losses.append(run.task.per_example_loss(run.model(**batch.inputs), batch).float().cpu())
    return -torch.cat(losses).numpy()


def _claimed(world: worlds.World, canaries: Canaries) -> float:
    """The canaries' largest cumulative ε, as the ledger's spend book reads it."""
    from govtrain.ledger.ledger import Ledger

    with Ledger.open(world.url) as ledger:
        charged = ledger.spend_book().charged
    spent = [charged[cid].eps_u for cid, inside in zip(canaries.ids, canaries.included) if inside and cid in charged]
    if not spent:
        raise RuntimeError("the ledger charged no canary: nothing was audited")
    return max(spent) / units.MICRO
