"""Review of issue 34 item 1 (every per-unit decision keyed by the unit's stable identity; `corpus_changed`).

Each test here is a proof of a defect the review found: it fails on the code it was written against and passes once
the defect is fixed. The run state is unauthenticated (`train/run.py` `_load_state`: "the config hash it states is
not proof: it is no MAC"), and `train/lease.py` already treats "a crafted state file" and "a restored backup" as
adversaries: whoever can write the output folder between a kill and the resume. The tests read and write the state
through `train.run._load_state` / `_save_state`, so they follow the state's format (torch.save today, safetensors +
JSON once the format change lands).

The fix authenticates the run state (`govtrain/train/state_key.py`): the edits below are written under a key of the
editor's (`tests/run_state_keys.py`), who holds no ledger key, and are refused (`run_state_invalid`).

Setups reuse tests/test_attacks_identity_sampling.py: tiny BERT, q = 0.25, bands 4, σ 2, 8 steps in one epoch.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from govtrain.errors import Code, ConfigError, GovtrainError  # noqa: E402
from tests.conftest import snapshot  # noqa: E402
from tests.test_attacks_identity_sampling import KILLED_AFTER, NOISE, QUIET, STEPS, Draws, _corpus  # noqa: E402
from tests.test_train import _config, tiny_model  # noqa: E402,F401


def _state(corpus) -> Path:  # type: ignore[no-untyped-def]
    from govtrain.train.loop import STATE_FILE

    return corpus.dir / "adapter" / STATE_FILE


def _unchanged(corpus) -> tuple:  # type: ignore[no-untyped-def]
    """What a refused resume must leave as it was: the ledger (size, head, admissions) and the output folder."""
    folder = _state(corpus).parent
    return snapshot(corpus.url), {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_a_crafted_sampling_key_cannot_redraw_steps_already_drawn_before_a_kill(tmp_path: Path, tiny_model: Path):
    """Attack: the operator runs a DP-SGD run (any privatizer whose draw is random: a cyclic one below b·q = 1 too),
    watches which contributions steps 0-2 draw (`observe`, or the batches its own loop is handed), dislikes them
    and kills the run before the next checkpoint (the state then holds step 0). Between the kill and the resume it
    writes a fresh 32-byte `sampling_key` into the run state (no other field changes: the lease nonce, the ledger
    identity and the corpus record all still match) and resumes. The resumed run re-runs steps 0-2 under the new
    key: another Poisson draw of the same steps, under the spend already written for them.

    Impact: rejection sampling of the sampler. docs/privatizers.md and routing/sampler.py promise "a step that is
    run again (after a kill, ..., from a copy of the run state) draws exactly the same batch, so no process can re-draw
    a step until it likes the draw"; the key is the only thing that fixes a step's draw, and nothing binds it: the
    ledger's spend and lease carry the run id and the nonce, never a commitment to the key. Repeating kill/re-key/
    resume, a step's batch can be chosen (e.g. one that holds, or leaves out, a target contribution), which voids the
    amplification every spend of the epoch was charged with. A restored backup or a copied folder is harmless (same
    key, same draws); only the re-keyed state is.

    Expected: the key is bound when the run's first spend is written (e.g. the lease or the write-ahead spend carries
    SHA-256 of the sampling key, or the key is derived from something the ledger fixes), and a resume whose key does
    not match is refused with a documented code, changing nothing; or, equivalently for this test, the re-run steps
    draw exactly what they drew before the kill."""
    from govtrain.train import run as run_module
    from govtrain.train.config import load_run_config
    from govtrain.train.loop import train

    corpus = _corpus(tmp_path / "run", "example")
    # Poisson (DP-SGD): at these settings banded-MF's part rate b·q is 1: it draws the whole part, whatever the key
    config = load_run_config(_config(corpus, tiny_model, STEPS, extra=NOISE["gaussian"]))
    with pytest.MonkeyPatch.context() as patch:
        first = Draws(patch)
        with pytest.raises(KeyboardInterrupt):
            train(config, corpus.url, insecure_seed=5, checkpoint_every=10, interrupt_after_steps=KILLED_AFTER,
                  **QUIET)
    seen = dict(first.by_step)
    assert sorted(seen) == list(range(KILLED_AFTER))

    from tests.run_state_keys import attacker_key, ledger_key

    state = run_module._load_state(_state(corpus), config, ledger_key(corpus))
    assert state["step"] < KILLED_AFTER  # the resume re-runs steps that were drawn (and watched) before the kill
    assert state["sampling_key"] != (crafted := hashlib.sha256(b"the operator's next try").digest())
    state["sampling_key"] = crafted
    run_module._save_state(_state(corpus), state, attacker_key(corpus))  # the operator's edit: no ledger key's MAC
    before = _unchanged(corpus)

    with pytest.MonkeyPatch.context() as patch:
        again = Draws(patch)
        try:
            train(config, corpus.url, insecure_seed=5, **QUIET)
        except GovtrainError:  # refused: the key is not the one the run's spend was written under
            assert _unchanged(corpus) == before
            return
    redrawn = {step: again.by_step[step] for step in seen}
    assert redrawn == seen, {step: (sorted(seen[step] ^ redrawn[step])) for step in seen if seen[step] != redrawn[step]}


def test_a_crafted_corpus_record_does_not_let_a_resume_draw_rows_under_other_identities(tmp_path: Path,
                                                                                        tiny_model: Path):
    """Attack: between a kill and the resume, a surviving contribution (c3) reads its rows in another order (the
    stand-in tests/test_attacks_identity_sampling.py uses for "its rows read differently": another reader, another
    parser picked by a renamed suffix with the same record count, another config whose hash the state names). Alone,
    that resume is refused with `corpus_changed`. The attacker also drops c3's entry from the run state's corpus
    record (or writes the record of the new reading): `corpus.check` compares only contributions the state records,
    so the resume is accepted and trains.

    Impact: the check that the fix added is defeated by the one adversary it exists for (a resume whose state and
    data disagree is only possible when someone changed one of them). At the example unit, c3's identities (c3, i)
    now name other rows than the ones the epoch's draws and its banded-MF / BLT charge were made for: a row drawn
    at step 2 as (c3, 0) can be drawn at step 3 as (c3, 5), the participation pattern of issue 34 item 1 (two
    participations within b steps, charged for one).

    Expected: the corpus record the check compares against is one the folder's writer cannot forge: e.g. each
    contribution's rows digest (`train/corpus.py`'s `rows_sha256`) is carried by the run's signed write-ahead spend for
    that contribution (the ledger already binds the lease and the plan: `lease.written_plan`), and the resume
    compares the rows it reads with the ledger's record, refusing with `corpus_changed` and changing nothing."""
    import govtrain.train.data as data
    from govtrain.train import run as run_module
    from govtrain.train.config import load_run_config
    from govtrain.train.loop import train

    corpus = _corpus(tmp_path / "run", "example")
    config = load_run_config(_config(corpus, tiny_model, STEPS, extra=NOISE["banded-mf"]))
    with pytest.MonkeyPatch.context() as patch:
        Draws(patch)
        with pytest.raises(KeyboardInterrupt):
            train(config, corpus.url, insecure_seed=5, checkpoint_every=1, interrupt_after_steps=KILLED_AFTER,
                  **QUIET)

    loaded = data.load_examples

    def reordered(*args, **kwargs):  # type: ignore[no-untyped-def]
        examples = loaded(*args, **kwargs)
        mine = [i for i, cid in enumerate(examples.owner) if cid == "c3"]
        items = list(examples.items)
        for i, j in zip(mine, reversed(mine)):
            items[i] = examples.items[j]
        return type(examples)(items, examples.owner, examples.unmatched_files, examples.missing)

    from tests.run_state_keys import attacker_key, ledger_key

    state = run_module._load_state(_state(corpus), config, ledger_key(corpus))
    assert "c3" in state["corpus"]["contributions"]
    del state["corpus"]["contributions"]["c3"]  # the attacker's whole edit, written with govtrain's writer
    run_module._save_state(_state(corpus), state, attacker_key(corpus))  # under a key of theirs: they hold no other
    before = _unchanged(corpus)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(data, "load_examples", reordered)
        with pytest.raises(ConfigError) as info:
            train(config, corpus.url, insecure_seed=5, **QUIET)
    # the crafted record is refused as written by no ledger key (the run state's MAC), or the rows as changed
    assert info.value.code is Code.RUN_STATE_INVALID or \
        (info.value.code is Code.CORPUS_CHANGED and "c3" in info.value.detail), info.value.detail
    assert _unchanged(corpus) == before


def test_a_corpus_record_that_names_no_contribution_is_refused_like_no_record(tmp_path: Path):
    """Attack: a run state whose corpus record is `{"unit": <the unit>, "contributions": {}}`. `corpus.check` refuses a
    missing record, a non-dict one and a list of contributions ("records no corpus identity": a state of a govtrain
    that drew by position), but this one passes, and `merge` then records the current reading as if it were what the
    run drew: every later resume compares against it. A run never records an empty corpus (it refuses to start with
    no present contribution, and `merge` keeps every contribution it ever read), so this record only comes from an
    edit, or from a converter of an earlier state that had none.

    Impact: the one-line edit disables `corpus_changed` for every contribution, in this resume and every later one
    (the merged record is the current reading). LOW on its own (the record is unauthenticated anyway: see the test
    above), but it is the case `check` means to refuse and misses.

    Expected: `corpus.check` refuses a record whose contributions name none (`corpus_changed`, as for no record)."""
    from govtrain.tasks.classification import Labelled
    from govtrain.train import corpus

    current = corpus.record("example", ["a"], [Labelled("row", 1)], ["a"], {"a": bytes(32)})
    with pytest.raises(ConfigError) as info:
        corpus.check({"unit": "example", "contributions": {}}, current, tmp_path / "run-state.pt")
    assert info.value.code is Code.CORPUS_CHANGED


def test_a_withdrawal_while_a_banded_run_is_down_does_not_leave_it_unresumable(tmp_path: Path, tiny_model: Path):
    """Lifecycle: a banded-MF run (bands 4) under a policy that fixes the expected batch (12 of 48 examples: q = 0.25,
    b·q = 1) is killed after step 3; c0 (6 rows) withdraws; the run is resumed. The resume builds its cyclic sampler
    at the q of the corpus it reads now (12 / 42: b·q = 8/7 > 1), and `CyclicPoissonSampler` raises a bare
    ValueError ("cycle·q ... > 1 ... pass allow_rate_cap=True") out of `prepare`. The uninterrupted run, with the
    same withdrawal, goes on (the epoch draws at its charged q; a later epoch's higher q is capped at 1, and charged
    at min(1, b·q): checked with epoch_steps = 4, c0 withdrawn after step 2, both epochs run).

    Impact: availability, not privacy: one contributor's withdrawal while a run is down leaves a run whose spend is
    written unresumable, with a traceback rather than `error[code]` (the house rule), and nothing the operator can
    change (the q is the policy's expected batch over what the ledger holds). The same ValueError ends a fresh run
    whose b·q exceeds 1.

    Expected: the resume draws the pending epoch at the q its spend charged (the sampler's rate is set per epoch
    anyway: `Run._write_ahead`), and an epoch whose q makes b·q > 1 is either capped as the uninterrupted run caps it,
    or refused with a documented code before anything is written; never an exception that is not a govtrain error."""
    from govtrain.train.config import load_run_config
    from govtrain.train.loop import train
    from tests.conftest import TEST_POLICY, make_corpus
    from tests.test_train import _admit

    folder = tmp_path / "run"
    folder.mkdir()
    corpus = make_corpus(folder, f"sqlite:///{folder / 'ledger.db'}",
                         TEST_POLICY.replace("sampling_rate = 0.01\n", "expected_batch_size = 12\n"))
    for name in [f"c{i}" for i in range(8)]:
        _admit(corpus, name, records=6, noise_multiplier_u=2_000_000, eps_budget_u=8_000_000)
    config = load_run_config(_config(corpus, tiny_model, STEPS, extra=NOISE["banded-mf"]))
    with pytest.raises(KeyboardInterrupt):
        train(config, corpus.url, insecure_seed=5, checkpoint_every=1, interrupt_after_steps=KILLED_AFTER, **QUIET)
    with corpus.open() as ledger:
        ledger.withdraw("c0", "the contributor asked", now=corpus.now)
    before = _unchanged(corpus)
    try:
        train(config, corpus.url, insecure_seed=5, **QUIET)
    except GovtrainError:
        assert _unchanged(corpus) == before
        return
    assert not _state(corpus).exists()  # the resumed run finished
