"""`govtrain train`: governed DP-LoRA on admitted contributions only (DESIGN §5-7).

Per ledger epoch, before any of its steps: the noise schedule is fixed from public metadata
(s_g, sigma_eff, retirement), the epoch's spend is written ahead to the ledger with its signed
checkpoint, and only then do the steps run. Each step Poisson-samples the eligible examples
(admitted, not withdrawn as of this step, not retired), privatizes the gradient through the
routing layer and steps the mechanism's update (`mechanisms/update.py`: the run's optimizer for
dpsgd; PRISM's retraction or DP-Muon's orthogonalized momentum for the matrices they own). At the
end the peft adapter is saved and a `run` entry records the mechanism, config, base model and adapter
hashes. When no contribution is eligible any more
the run stops with exit 5 (`BudgetExhausted`), after saving what it has.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from govtrain import units
from govtrain.errors import Code, ConfigError, GovtrainError
from govtrain.ledger.ledger import Ledger
from govtrain.train.config import RunConfig

LOG = Callable[[str], None]


class BudgetExhausted(GovtrainError):
    """No contribution is eligible any more: every one is withdrawn or has spent its budget (exit 5)."""

    exit_code = 5


@dataclass
class RunResult:
    run_id: str
    steps: int
    epochs: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    eps_by_class: dict[str, list[float]] = field(default_factory=dict)  # max cumulative eps per class, per epoch
    adapter_sha256: bytes | None = None
    exhausted: bool = False


STATE_FILE = "run-state.pt"


def _save_state(path: Path, state: dict) -> None:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    torch.save(state, temporary)
    os.replace(temporary, path)


def _load_state(path: Path, config: RunConfig) -> dict | None:
    import torch

    if not path.exists():
        return None
    state = torch.load(path, weights_only=False, map_location="cpu")
    if state.get("config_sha256") != config.sha256:
        raise ConfigError(Code.RUN_CONFIG_INVALID, f"{path} holds the state of a run with another config; restore "
                                                   "that config to resume it, or move the file away to start afresh")
    return state


def _write_ahead(ledger: Ledger, pending: dict, run_id: str, q_u: int, gone, now: Callable[[], int], log: LOG) -> bool:
    """Make sure this run's spend for the pending ledger epoch is in the ledger before its steps run
    (DESIGN §5). True when it is: written now, or written by this same run before a kill. False when
    another run holds the epoch (its write-ahead charged its own steps, not ours): that epoch is then
    closed, if it is still open, and the caller plans the next one. Any spend that is not this run's
    never lets this run's steps go uncharged."""
    epoch = pending["epoch"]
    holder = ledger.spend_book().holder(epoch)
    if holder is None and ledger.epoch() == epoch:
        records = [r for r in pending["spend"] if r[0] not in gone]  # withdrawn after the plan was saved
        try:
            ledger.record_spend(epoch, q_u, records, run_id=run_id, epoch_steps=pending["steps"], now=now())
            return True
        except GovtrainError as e:  # a concurrent run got the epoch first, or closed it
            holder = ledger.spend_book().holder(epoch)
            if e.code is not Code.EPOCH_HELD and ledger.epoch() == epoch:
                raise
    if holder == run_id:
        return True
    log(f"ledger epoch {epoch} is held by {holder or 'a closed epoch'}: planning the next epoch")
    ledger.close_epoch(now=now(), epoch=epoch)
    return False


def tree_sha256(folder: Path) -> bytes:
    """SHA-256 over (relative path, SHA-256 of bytes) of every file under `folder`, sorted (a run's
    resumable state, which is deleted when the run ends, is not part of the adapter)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in (STATE_FILE, STATE_FILE + ".tmp")):
        digest.update(str(path.relative_to(folder)).encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return digest.digest()


def wrap_lora(base, lora, adapters: list[str]):
    """`base` with the run's LoRA: a default adapter holding the classifier (peft's modules_to_save copy)
    and one LoRA-only adapter per `adapter` class, all active, every LoRA factor and head copy trainable."""
    from peft import LoraConfig, get_peft_model

    settings = dict(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules))
    # peft can have a modules_to_save copy active for one adapter at a time, so the head belongs to the
    # default adapter (and to the classes with head = true); a class's own adapter holds LoRA factors only.
    model = get_peft_model(base, LoraConfig(modules_to_save=["classifier", "score"], **settings))
    for name in adapters:
        model.add_adapter(name, LoraConfig(**settings))
    model.base_model.set_adapter(["default", *adapters])  # every adapter in the forward pass
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" in name or ".modules_to_save." in name)
    return model


def _model(config: RunConfig, adapters: list[str]):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from govtrain.resolver.load import model_path

    os.environ["HF_HUB_OFFLINE"] = "1"
    path = model_path(config.model_spec)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    base = AutoModelForSequenceClassification.from_pretrained(path, num_labels=config.file.model.num_labels,
                                                              local_files_only=True, dtype=torch.float32)
    model = wrap_lora(base, config.file.lora, adapters)
    model.eval()  # no dropout: the per-example loss must not depend on other examples or hidden randomness
    return model, tokenizer, tree_sha256(path)


def resolve_device(spec: str):
    """The torch device `training.device` names: auto is CUDA when available, else the CPU. A CUDA device this
    machine does not have is refused here, before anything is loaded or written."""
    import torch

    if spec == "auto":
        return torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")
    if spec == "cpu":
        return torch.device("cpu")
    index = int(spec.partition(":")[2] or 0)
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index >= available:
        raise ConfigError(Code.RUN_CONFIG_INVALID, f"training.device = {spec!r}, but this machine has "
                                                   f"{available or 'no'} CUDA device{'s' if available != 1 else ''}: "
                                                   "use cpu or auto")
    return torch.device("cuda", index)


def check_weight_decay(resolution, weight_decay: float) -> None:
    """Weight decay moves every coordinate of a parameter it is given, so a parameter that a class reaches
    only in part (attention-head rows or columns) would have its other coordinates shrunk without any
    gradient: refuse that combination instead of moving coordinates no class may reach."""
    partial = sorted({part.name for parts in resolution.reach.values() for part in parts if part.dim is not None})
    if weight_decay > 0 and partial:
        raise ConfigError(Code.RUN_CONFIG_INVALID, f"optimizer.weight_decay: {len(partial)} parameter(s) are reached "
                                                   f"only in part by a heads profile (e.g. {partial[0]}); weight decay "
                                                   "would move their unreached coordinates: set weight_decay = 0")


def train(config: RunConfig, ledger_url: str, *, key: str | None = None, insecure_seed: int | None = None,
          log: LOG = print, now: Callable[[], int] = lambda: int(time.time()), checkpoint_every: int = 10,
          interrupt_after_steps: int | None = None, progress: bool = False,
          observe: Callable[[int, list[str]], None] | None = None) -> RunResult:
    """Run (or resume) the training `config` describes against the ledger at `ledger_url`.

    The run state (trainable weights, optimizer, the epoch in progress and its plan) is saved to
    `<output>/run-state.pt` at each epoch's start and end and every `checkpoint_every` steps; a
    later call with the same config resumes from it. Steps lost to a kill are re-run inside the
    epoch whose spend already covers them, so nothing is under-counted; the lost steps' results
    were never saved. `interrupt_after_steps` is a test hook that simulates a kill; `observe(step, ids)`
    sees the contributions drawn at each step (for tests and audits of the sampler).
    """
    import numpy as np
    import torch
    import torch.nn.functional as F

    from govtrain.accounting.spend import SpendCalculator
    from govtrain.mechanisms.update import Update
    from govtrain.resolver.model import describe
    from govtrain.resolver.plan import read_corpus, sampling_rate_for
    from govtrain.resolver.profile import resolve
    from govtrain.resolver.schedule import Scheduler, cohorts_of
    from govtrain.routing.layout import probe_batches
    from govtrain.routing.router import Router
    from govtrain.routing.sampler import PoissonSampler
    from govtrain.train.data import load_examples

    if insecure_seed is not None:
        torch.manual_seed(insecure_seed)
    with Ledger.open(ledger_url, key=key) as ledger:
        policy = ledger.policy
        admitted, withdrawn, _ = read_corpus(ledger)
        admitted = {cid: a for cid, a in admitted.items() if cid not in withdrawn}
        examples = load_examples(config.data_dir, {a.data_sha256: cid for cid, a in admitted.items()},
                                 config.file.model.num_labels)
        if examples.unmatched_files:
            shown = [n for n in examples.unmatched_files if not n.endswith(".cose")][:5]
            others = len(examples.unmatched_files) - len(shown)
            log(f"note: {len(examples.unmatched_files)} file(s) match no admitted contribution and are not trained on"
                f" ({', '.join(shown)}{f' and {others} more' if others else ''})")
        for cid in examples.missing:
            log(f"note: no data file for admitted contribution {cid}; it is not eligible")
        present = set(examples.owner)
        if not present:
            raise ConfigError(Code.RUN_CONFIG_INVALID, f"training.data: no file in {config.data_dir} matches an "
                                                       "admitted, not withdrawn contribution")
        def corpus_now():
            """(cohorts, q_u, expected batch) from what the ledger says now: other runs may have charged these
            contributions, and some may have withdrawn or retired, since this run started."""
            recorded, withdrawn_now, _ = read_corpus(ledger)
            live = sorted(c for c in present if c not in withdrawn_now and c in recorded)
            q, batch = sampling_rate_for(policy, config.file.training.expected_batch_size,
                                         sum(recorded[c].records for c in live), option="training.expected_batch_size",
                                         code=Code.RUN_CONFIG_INVALID)
            return cohorts_of([recorded[c].member for c in live],
                              {c: (tuple(recorded[c].history), recorded[c].eps_u) for c in live},
                              [c for c in live if recorded[c].retired or c in retired_here]), q, batch

        retired_here: set[str] = set()  # retired by this run's plans (one that affords no step leaves no spend)

        records = sum(admitted[c].records for c in present)
        q_u, expected_batch = sampling_rate_for(policy, config.file.training.expected_batch_size, records,
                                                option="training.expected_batch_size", code=Code.RUN_CONFIG_INVALID)
        adapters = sorted({c.profile.adapter for c in policy.classes.values() if c.profile.kind == "adapter"})
        device = resolve_device(config.file.training.device)
        precision = config.file.training.precision
        chunk = config.file.training.physical_batch
        autocast = ((lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if precision == "bf16"
                    else contextlib.nullcontext)
        model, tokenizer, base_sha256 = _model(config, adapters)
        model.to(device)  # before the router: its noise generator lives on the parameters' device
        resolution = resolve(policy.classes, describe(model, name=config.model_spec))
        check_weight_decay(resolution, config.file.optimizer.weight_decay)
        router = Router(model, resolution, mechanism=config.file.training.mechanism, insecure_seed=insecure_seed)
        router.probe(probe_batches(tokenizer, config.file.model.max_length))  # before any spend: batch-first calls only
        update = Update.build(model, config.file)
        sampler = PoissonSampler(q_u / units.MICRO, insecure_seed=insecure_seed)  # q is set again per epoch
        calculator = SpendCalculator(policy.accountant, policy.delta_p)
        epoch_steps = config.file.training.epoch_steps or policy.steps_per_epoch
        if epoch_steps > policy.steps_per_epoch:
            raise ConfigError(Code.RUN_CONFIG_INVALID, f"training.epoch_steps: {epoch_steps} is more than the "
                                                       f"policy's steps_per_epoch ({policy.steps_per_epoch})")
        scheduler = Scheduler(calculator, resolution.class_groups(), sampling_rate_u=q_u, steps_per_epoch=epoch_steps)
        ids = sorted(present)
        position = {c: i for i, c in enumerate(ids)}
        members = [admitted[c].member for c in ids]
        owner = np.array([position[c] for c in examples.owner], dtype=np.int64)  # example -> index in ids
        signed_clip = {m.contribution_id: m.clip_norm_u / units.MICRO for m in members}
        classes = {m.contribution_id: m.data_class for m in members}
        run_id = config.file.training.run_id or f"run-{now()}-{os.urandom(4).hex()}"
        result = RunResult(run_id, 0)
        total = config.file.training.steps
        state_path = config.output_dir / STATE_FILE
        state = _load_state(state_path, config)
        pending = None  # the epoch in progress: (epoch, first_step, steps, allowed, group_std)
        if state is not None:
            run_id = result.run_id = state["run_id"]
            result.steps, result.losses = state["step"], state["losses"]
            result.epochs, result.eps_by_class = state["epochs"], state["eps_by_class"]
            with torch.no_grad():
                for name, value in state["trainable"].items():
                    model.get_parameter(name).copy_(value)
            update.load_state_dict(state["update"])
            pending = state["pending"]
            if pending is not None and ledger.epoch() > pending["epoch"]:
                pending = None  # the epoch was closed just before the kill
            log(f"resuming {run_id} at step {result.steps}")
        elif run_id in ledger.spend_book().runs:
            raise ConfigError(Code.RUN_CONFIG_INVALID, f"training.run_id: run {run_id!r} already wrote spend to this "
                                                       "ledger; resume it from its state file, or give this run another id")
        log(f"{run_id}: {total} {config.file.training.mechanism} steps, q = {q_u / units.MICRO:g} (expected batch {expected_batch:g} of {records} "
            f"examples from {len(present)} contributions), {policy.accountant} at delta = {policy.delta_p / 1e12:g}")

        def save(pending_epoch) -> None:
            _save_state(state_path, {
                "run_id": run_id, "config_sha256": config.sha256, "step": result.steps, "losses": result.losses,
                "epochs": result.epochs, "eps_by_class": result.eps_by_class, "pending": pending_epoch,
                "trainable": {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad},
                "update": update.state_dict()})

        from tqdm import tqdm

        bar = tqdm(total=total, initial=result.steps, unit="step", disable=not (progress and sys.stderr.isatty()),
                   dynamic_ncols=True, file=sys.stderr)
        done_here = 0
        while result.steps < total:
            gone = ledger.store.withdrawals()
            if pending is None:
                cohorts, q_u, expected_batch = corpus_now()
                if not any(c.eligible for c in cohorts):
                    result.exhausted = True
                    break
                epoch = ledger.epoch()
                steps = min(epoch_steps, total - result.steps)
                scheduler.sampling_rate_u = q_u
                plan = scheduler.plan_epoch(cohorts, epoch, result.steps, steps)
                retired_here |= {m for c in cohorts if c.retired_at is not None for m in c.members}
                pending = {"epoch": epoch, "first_step": result.steps, "steps": steps, "q_u": q_u,
                           "expected_batch": expected_batch,
                           "allowed": {m: s.steps for s in plan.spends for m in s.cohort.members},
                           "group_std": {tuple(sorted(g)): plan.group_std(g) for g in plan.group_noise_pu},
                           "spend": plan.spend_records(), "eps": {s.cohort.data_class: 0 for s in plan.spends}}
                for spend in plan.spends:
                    pending["eps"][spend.cohort.data_class] = max(pending["eps"][spend.cohort.data_class], spend.eps_u)
                save(pending)  # the plan first: a kill between here and the spend cannot lose it
            epoch, first, steps = pending["epoch"], pending["first_step"], pending["steps"]
            q_u, expected_batch = pending["q_u"], pending["expected_batch"]
            if pending["spend"] and not _write_ahead(ledger, pending, run_id, q_u, gone, now, log):
                pending = None  # another run holds this ledger epoch: plan the next one
                save(None)
                continue
            sampler.sampling_rate = q_u / units.MICRO
            allowed = np.array([pending["allowed"].get(c, 0) for c in ids], dtype=np.int64)  # steps per contribution
            group_std = {frozenset(k): v for k, v in pending["group_std"].items()}
            epsilons = " ".join(f"{n} ε {v / units.MICRO:.3f}" for n, v in sorted(pending["eps"].items()))
            while result.steps < first + steps:
                started = time.perf_counter()
                step = result.steps - first
                gone = ledger.store.withdrawals()
                live = np.array([allowed[i] > step and ids[i] not in gone for i in range(len(ids))], dtype=bool)
                chosen = sampler.sample(np.flatnonzero(live[owner]) if len(owner) else np.zeros(0, int))
                if observe is not None:
                    observe(result.steps, [examples.owner[i] for i in chosen])
                router.begin()
                loss_sum = 0.0
                for start in range(0, len(chosen), chunk or max(len(chosen), 1)):  # physical chunks, one step
                    part = chosen[start:start + chunk] if chunk else chosen
                    batch = tokenizer([examples.texts[i] for i in part], padding=True, truncation=True,
                                      max_length=config.file.model.max_length, return_tensors="pt").to(device)
                    labels = torch.tensor([examples.labels[i] for i in part], device=device)
                    with router.capture(), autocast():
                        logits = model(**batch).logits
                    losses = F.cross_entropy(logits.float(), labels, reduction="none")  # per example, fp32
                    who = [examples.owner[i] for i in part]
                    router.accumulate(losses, [classes[c] for c in who], [signed_clip[c] for c in who])
                    loss_sum += float(losses.detach().sum())
                    del batch, labels, logits, losses
                router.finish(group_std, expected_batch)  # noise once per logical step
                loss = loss_sum / len(chosen) if len(chosen) else float("nan")
                update.step(router.noise_std)
                update.zero_grad()
                result.steps += 1
                result.losses.append(loss)
                done_here += 1
                bar.update(1)
                bar.set_postfix_str(f"loss {loss:.3f} | {time.perf_counter() - started:.2f} s/step | {epsilons}")
                if result.steps % checkpoint_every == 0:
                    save(pending)
                if interrupt_after_steps is not None and done_here >= interrupt_after_steps:
                    raise KeyboardInterrupt(f"test hook: interrupted after {done_here} steps")
            ledger.close_epoch(now=now(), epoch=epoch)  # unless another run already closed it
            result.epochs.append(epoch)
            for name in policy.classes:
                result.eps_by_class.setdefault(name, []).append(pending["eps"].get(name, 0) / units.MICRO
                                                                 or max(result.eps_by_class[name][-1:], default=0.0))
            pending = None
            save(None)
            seen = [x for x in result.losses[-steps:] if x == x]  # empty batches have no loss
            log(f"epoch {epoch}: steps {result.steps}/{total}, "
                f"loss {sum(seen) / len(seen) if seen else float('nan'):.4f}, "
                + ", ".join(f"{n} eps {v[-1]:.3f}" for n, v in sorted(result.eps_by_class.items())))
        bar.close()
        router.close()
        output = config.output_dir
        output.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(output)
        result.adapter_sha256 = tree_sha256(output)
        ledger.record_run(run_id, config.file.training.mechanism, config.sha256, base_sha256, result.adapter_sha256,
                          device=device.type if device.type == "cpu" else str(device), precision=precision,
                          now=now())
        state_path.unlink(missing_ok=True)
    if result.exhausted:
        raise BudgetExhausted(Code.BUDGET_EXCEEDED, f"no contribution is eligible after {result.steps} steps: "
                                                    "every one is withdrawn or has spent its budget (adapter saved)")
    return result
