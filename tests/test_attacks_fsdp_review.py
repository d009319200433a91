"""Adversarial review of the sharded run (`training.fsdp = true`; issue 25 item 2), 2 gloo ranks.

Each test starts real ranks through the documented loop (`GovernedRun` under RANK/WORLD_SIZE), one of which is the
attacker: the loop's own code on that rank does one thing the single process refuses or cannot do. A test named
`test_attack_*` is a finding (it fails on the code reviewed); one named `test_held_*` is an attack that the code
resisted, kept as a regression test.

This file is also the ranks' worker: `python -m tests.test_attacks_fsdp_review SPEC.json`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests import forkserver

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[1]
FSDP = "fsdp = true\n"


# -- the worker: one rank of the documented loop, with the attack of SPEC["attack"] on SPEC["rank"] ----------------

def _attack_weights(run, trainable: bool) -> str:  # type: ignore[no-untyped-def]
    """Write this rank's own shard of a (trainable or frozen) parameter in place through DTensor.to_local(), the
    sharded model's public view of the shard (what `p.detach()` is on a plain parameter)."""
    for name, p in run.model.named_parameters():
        if p.requires_grad == trainable and hasattr(p, "to_local") and p.to_local().numel():
            with torch.no_grad():
                p.to_local().add_(0.5)
            return name
    raise AssertionError("no sharded parameter to write")


def worker(spec_path: str) -> None:
    from govtrain.errors import GovtrainError
    from govtrain.train.governed import GovernedRun

    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ.get("RANK", "0"))
    attacker = rank == spec["rank"]
    attack = spec["attack"] if attacker else None
    report: dict = {"rank": rank, "fillers": 0, "attacked": None, "error": None}
    out = Path(spec["out"])
    grads: list[dict] = []
    if spec.get("record"):  # every step's privatized gradient as the update receives it, gathered (every rank)
        from govtrain.distributed.fsdp import full
        from govtrain.mechanisms import update as update_module

        step = update_module.Update.step

        def recording(self, noise_std):  # type: ignore[no-untyped-def]
            grads.append({n: full(p.grad.detach()) for n, p in self.model.named_parameters()
                          if p.requires_grad and p.grad is not None})
            return step(self, noise_std)

        update_module.Update.step = recording  # type: ignore[method-assign]
    try:
        with GovernedRun.open(spec["config"], spec["ledger"], insecure_seed=spec["seed"], log=lambda line: None) as run:
            stepped = 0
            for batch in run.batches():
                output = run.model(**batch.inputs)
                losses = run.per_example_loss(output, batch)
                waiting = run._guard.waiting  # only to tell a filler apart (its inputs are the same every time)
                filler = not batch.rehearsal and waiting is not None and waiting.chunk.filler
                report["fillers"] += filler
                if attack == "filler-nan" and filler:
                    losses = losses * float("nan")  # 0 * NaN = NaN: the filler's weight of zero does not hold
                    report["attacked"] = "filler"
                restore = None
                if attack == "trainable-restored" and not report["attacked"] and not batch.rehearsal \
                        and not batch.last:
                    # between this chunk's forward and its step (the backward): this rank's shard of a LoRA factor
                    # moved, and put back bitwise after the step, before the next check compares it
                    name, p = [(n, p) for n, p in run.model.named_parameters()  # the last block's: its backward
                               if "lora_B" in n and hasattr(p, "to_local") and p.to_local().numel()][-1]  # feeds all
                    restore = (p, p.to_local().detach().clone())
                    with torch.no_grad():
                        p.to_local().add_(0.5)
                    report["attacked"] = f"{name} at step {batch.step}"
                moved = run.step(losses)
                if restore is not None:
                    with torch.no_grad():
                        restore[0].to_local().copy_(restore[1])
                if moved is not None:
                    stepped += 1
                    if stepped == 1 and attack in ("frozen-shard", "trainable-shard"):
                        report["attacked"] = _attack_weights(run, attack == "trainable-shard")
                    if stepped == 1 and spec["attack"] == "pause":
                        break  # every rank leaves between steps: the lead keeps the run state
            if spec["attack"] != "pause":
                run.save()
    except GovtrainError as error:
        report["error"] = error.line()
        (out / f"report-rank{rank}.json").write_text(json.dumps(report))
        print(error.line(), file=sys.stderr)
        raise SystemExit(error.exit_code) from None
    (out / f"report-rank{rank}.json").write_text(json.dumps(report))
    torch.save(grads, out / f"grads-rank{rank}.pt")


# -- the harness ----------------------------------------------------------------------------------------------------

from tests.test_distributed import clean_env, make_world, run_entries, spends, tiny  # noqa: E402,F401
from govtrain.distributed.launch import free_port  # noqa: E402
from govtrain.train import state_file  # noqa: E402
from tests import run_state_keys  # noqa: E402


def start(corpus, config: Path, out: Path, attack: str, *, rank: int = 1, seed: int = 7,
          record: bool = False) -> list[forkserver.Child]:
    out.mkdir(parents=True, exist_ok=True)
    port, ranks = free_port(), []
    for r in range(2):
        spec = out / f"spec{r}.json"
        spec.write_text(json.dumps({"config": str(config), "ledger": corpus.url, "seed": seed, "out": str(out),
                                    "attack": attack, "rank": rank, "record": record}))
        env = clean_env()
        env.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   GOVTRAIN_DIST_TIMEOUT_S="60")
        ranks.append(forkserver.start(["-m", "tests.test_attacks_fsdp_review", str(spec)], cwd=ROOT, env=env))
    return ranks


def finish(ranks: list[forkserver.Child], timeout: float = 200) -> list[tuple[int, str]]:
    return [(p.wait(timeout=timeout), p.communicate()[1]) for p in ranks]


def reports(out: Path) -> list[dict]:
    return [json.loads((out / f"report-rank{r}.json").read_text()) if (out / f"report-rank{r}.json").exists() else {}
            for r in range(2)]


def adapter_tensors(corpus) -> dict:
    from safetensors.torch import load_file

    path = corpus.dir / "adapter" / "adapter_model.safetensors"
    return load_file(str(path)) if path.exists() else {}


# -- findings -------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_review_f1_a_frozen_shard_written_through_to_local_stops_every_rank_and_records_nothing(tmp_path, tiny):
    """A follower's loop writes its own shard of a frozen base weight in place through `DTensor.to_local()` after the
    first step. The single process refuses the same write through `p.detach()` (`Weights` compares each frozen
    parameter's version counter), but a DTensor's counter is its wrapper's, and `to_local()` returns the local
    tensor, whose counter is its own: nothing is seen, every later step's forward on every rank all-gathers the
    written base, and the run records an adapter trained on a base the run entry does not name."""
    corpus, config = make_world(tmp_path / "w", tiny, steps=3, extra=FSDP)
    done = finish(start(corpus, config, tmp_path / "out", "frozen-shard"))
    found = reports(tmp_path / "out")
    assert found[1].get("attacked"), f"the attack did not run: {found}, {[e[-1500:] for _, e in done]}"
    assert done[1][0] != 0 and "error[ungoverned_update]" in done[1][1], (
        f"the written frozen shard ({found[1]['attacked']}) went unseen: rank 1 exited {done[1][0]}")
    assert done[0][0] != 0, "the lead trained on after its follower stopped"
    assert run_entries(corpus.url) == 0, "a run trained on a written base was recorded"


@pytest.mark.slow
@pytest.mark.long
def test_held_trainable_shard_moved_for_a_backward_and_put_back_changes_no_released_gradient(tmp_path, tiny):
    """HELD. A follower's loop adds 0.5 to its own shard of the last block's LoRA B factor (`to_local()`) between a
    chunk's forward and its `run.step`, and copies the shard back bitwise after the step returns (a chunk that is not
    the step's last), so the value check before the update finds it as it was. FSDP re-gathers a block's weights for
    its backward (a plain FSDP2 model's input gradient does change under such a write), yet every step's released
    gradient equals the clean run's to 1e-6: the router's per-sample gradients do not read the re-gathered factor.
    Kept so that a change to how LoRA gradients are formed under FSDP cannot open it: the released gradient must be
    the clean run's, or the run must stop."""
    clean = make_world(tmp_path / "clean", tiny, steps=2, extra=FSDP)
    attacked = make_world(tmp_path / "attacked", tiny, steps=2, extra=FSDP)
    done = finish(start(*clean, tmp_path / "out-clean", "none", record=True))
    assert [code for code, _ in done] == [0, 0], [e[-1500:] for _, e in done]
    done = finish(start(*attacked, tmp_path / "out", "trainable-restored", record=True))
    found = reports(tmp_path / "out")
    assert found[1].get("attacked"), f"rank 1 had no step of two chunks: {found}"
    if any(code != 0 for code, _ in done):  # refused: the fix this proof asks for
        assert run_entries(attacked[0].url) == 0
        return
    reference = torch.load(tmp_path / "out-clean" / "grads-rank0.pt")
    got = torch.load(tmp_path / "out" / "grads-rank0.pt")
    differ = sorted({f"step {s}: {n}" for s, (a, b) in enumerate(zip(reference, got)) for n in a
                     if not torch.allclose(a[n], b[n], rtol=0, atol=1e-6)})
    assert not differ, (f"after moving {found[1]['attacked']} for one backward, the released gradient differs from the "
                        f"clean run's ({len(differ)} tensors, e.g. {differ[:2]}), and the run recorded it")


@pytest.mark.slow
def test_review_f2_a_run_state_of_wrong_shapes_is_refused_with_one_line_and_nothing_changes(tmp_path, tiny):
    """A sharded run's state (the lead's `run-state.safetensors`) with one trainable weight of the wrong shape (hand-edited,
    or another LoRA rank's). Resuming puts it back as shards (`fsdp.load_whole` -> `local`), which raises a bare
    RuntimeError outside `world.together`: each rank dies with a traceback instead of one `error[output_taken]` line
    (docs/design.md's error contract). Nothing may change: no spend, the state as it was."""
    corpus, config = make_world(tmp_path / "w", tiny, steps=3, extra=FSDP)
    done = finish(start(corpus, config, tmp_path / "out-pause", "pause"))
    assert [code for code, _ in done] == [0, 0], [e[-1500:] for _, e in done]
    path = corpus.dir / "adapter" / state_file.STATE_FILE
    state = run_state_keys.read(path, corpus)
    name = next(iter(state["trainable"]))
    state["trainable"][name] = state["trainable"][name].t().contiguous()  # (r, d) as (d, r)
    run_state_keys.write(path, state, corpus)
    before, state_bytes = spends(corpus.url), path.read_bytes()
    done = finish(start(corpus, config, tmp_path / "out", "none"))
    assert all(code != 0 for code, _ in done), "a state of the wrong shapes was resumed"
    assert spends(corpus.url) == before and path.read_bytes() == state_bytes and run_entries(corpus.url) == 0
    for code, err in done:
        assert "Traceback" not in err and "error[output_taken]" in err, f"exit {code}: {err[-1200:]}"


# -- held: attacks the code resisted (regression tests) -------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.long
def test_held_nan_loss_on_a_filler_stops_every_rank_and_records_nothing(tmp_path, tiny):
    """HELD, by accident. A loop hands `run.step` a NaN loss for a filler chunk (its inputs are the same public row
    every time, so a loop can tell it). `accumulate` weights a filler's losses by 0.0, but 0 * NaN = NaN: the output
    gradients are NaN, the per-sample norm is NaN, `clip_factor` keeps it (NaN > C is false: factor 1), the NaN sum is
    all-reduced and every rank's update writes NaN. What stops the run is `Weights.changed()` at the next check:
    `torch.equal(NaN, NaN)` is false, so it reports a LoRA factor as "written ... outside a governed step" (a wrong
    diagnosis), on every rank. Nothing is recorded; the epoch's spend stays as written ahead."""
    corpus, config = make_world(tmp_path / "w", tiny, steps=8, rate=0.05, extra=FSDP)
    done = finish(start(corpus, config, tmp_path / "out", "filler-nan"))
    found = reports(tmp_path / "out")
    assert found[1].get("attacked") == "filler", f"rank 1 drew no filler: {found}, {[e[-1500:] for _, e in done]}"
    assert all(code != 0 and "error[" in err for code, err in done), [e[-1500:] for _, e in done]
    assert run_entries(corpus.url) == 0 and not adapter_tensors(corpus)
    assert spends(corpus.url) and all(e == 0 for _, e, *_ in spends(corpus.url))  # only epoch 0, written ahead


@pytest.mark.slow
@pytest.mark.long
def test_held_trainable_shard_written_stops_both_ranks_and_records_nothing(tmp_path, tiny):
    """HELD. A follower writes its own shard of a LoRA factor through `to_local()` after the first step: it is
    compared by value on that rank (`same_shard`), so the follower refuses (`ungoverned_update`) before its next
    draw, and the lead, waiting in the draw's broadcast, stops too (`rank_lost`) instead of training on or hanging:
    no run entry, no adapter, and the spend is only what the epoch wrote ahead."""
    corpus, config = make_world(tmp_path / "w", tiny, steps=3, extra=FSDP)
    done = finish(start(corpus, config, tmp_path / "out", "trainable-shard"))
    found = reports(tmp_path / "out")
    assert found[1].get("attacked"), found
    assert done[1][0] != 0 and "error[ungoverned_update]" in done[1][1], done[1][1][-1500:]
    assert done[0][0] != 0 and "error[rank_lost]" in done[0][1], done[0][1][-1500:]
    assert run_entries(corpus.url) == 0 and not adapter_tensors(corpus)


@pytest.mark.slow
@pytest.mark.long
def test_held_a_sharded_run_state_is_refused_by_the_unsharded_config_and_nothing_changes(tmp_path, tiny):
    """HELD. A sharded run paused after a step keeps the lead's run state (gathered weights). Opening it with
    `fsdp = false` (the same run otherwise) is refused (`output_taken`: the config's hash differs), before any spend,
    and the state and the ledger are unchanged."""
    from govtrain.errors import Code, ConfigError
    from govtrain.train.governed import GovernedRun

    corpus, config = make_world(tmp_path / "w", tiny, steps=3, extra=FSDP)
    done = finish(start(corpus, config, tmp_path / "out", "pause"))
    assert [code for code, _ in done] == [0, 0], [e[-1500:] for _, e in done]
    state = corpus.dir / "adapter" / state_file.STATE_FILE
    assert state.exists()
    saved = run_state_keys.read(state, corpus)
    assert saved["step"] == 1 and saved["trainable"] and not any(hasattr(v, "to_local") for v in
                                                                  saved["trainable"].values())
    before, state_bytes = spends(corpus.url), state.read_bytes()
    config.write_text(config.read_text().replace(FSDP, ""))
    with pytest.raises(ConfigError) as refused:
        GovernedRun.open(config, corpus.url, insecure_seed=7, log=lambda line: None)
    assert refused.value.code is Code.OUTPUT_TAKEN
    assert spends(corpus.url) == before and state.read_bytes() == state_bytes and run_entries(corpus.url) == 0


if __name__ == "__main__":
    worker(sys.argv[1])


@pytest.mark.parametrize("edit", ["weight", "moment"])
def test_review_f2_in_one_process_a_run_state_of_wrong_shapes_is_refused_too(tmp_path, tiny, edit):
    """The same refusal where nothing is sharded: a transposed trainable weight used to fail inside `copy_` with a
    traceback, and an optimizer moment of another shape reached `load_state_dict` unchecked."""
    from govtrain.errors import Code, ConfigError
    from govtrain.train.config import load_run_config
    from govtrain.train.loop import train

    corpus, config = make_world(tmp_path / "w", tiny, steps=12, rate=0.05)
    with pytest.raises(KeyboardInterrupt):
        train(load_run_config(config), corpus.url, insecure_seed=3, log=lambda line: None, checkpoint_every=2,
              interrupt_after_steps=3)
    path = corpus.dir / "adapter" / state_file.STATE_FILE
    state = run_state_keys.read(path, corpus)
    if edit == "weight":
        name = next(iter(state["trainable"]))
        state["trainable"][name] = state["trainable"][name].t().contiguous()
    else:
        entries = next(iter(state["update"]["optimizer"]["state"].values()))
        entries["exp_avg"] = entries["exp_avg"].t().contiguous()
    run_state_keys.write(path, state, corpus)
    before, state_bytes = spends(corpus.url), path.read_bytes()
    with pytest.raises(ConfigError) as refused:
        train(load_run_config(config), corpus.url, insecure_seed=3, log=lambda line: None)
    assert refused.value.code is Code.OUTPUT_TAKEN and "shape" in str(refused.value)
    assert spends(corpus.url) == before and path.read_bytes() == state_bytes and run_entries(corpus.url) == 0
