"""The run state is authenticated (issue 34, review of item 3): `govtrain/train/state_key.py`.

Adversary: someone who can write the run's output folder as the run's user, between a kill and the resume, holding
no key (tests/test_attacks_run_state_review.py proves what an unauthenticated state let them do). The state carries
HMAC-SHA256 under a key derived from the ledger's signing key and identity, checked before anything in it is used:
a state they write, with govtrain's own writer and any key of theirs, is `run_state_invalid` and nothing changes.

Behind the MAC, defence in depth, tested with states sealed under the test ledger's own key (what only a defect of
govtrain's could write): a plan that allows steps with no spend, a held epoch's plan that lists none (the ledger's
is trained), a place or count no run saves, an optimizer state of no update of this run's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from govtrain.errors import GovtrainError  # noqa: E402
from tests import run_state_keys  # noqa: E402
from tests.conftest import Corpus, snapshot  # noqa: E402
from tests.test_attacks_run_state import QUIET, _files, _killed, _refused  # noqa: E402
from tests.test_attacks_run_state_review import (  # noqa: E402
    CHARGED_STD,
    CHARGED_STEPS,
    TAKEN,
    _resume_recording_steps,
    _spend_of,
)
from tests.test_train import _config, tiny_model  # noqa: E402,F401


def _sealed(corpus: Corpus, config, edit, key=None) -> None:  # type: ignore[no-untyped-def]
    """The killed run's state, `edit`ed, written back under `key` (default: the test ledger's own)."""
    from govtrain.train import state_file

    path = config.output_dir / state_file.STATE_FILE
    state = run_state_keys.read(path, corpus)
    edit(state)
    run_state_keys.write_unchecked(path, state, key or run_state_keys.ledger_key(corpus))


def test_a_state_written_without_the_ledger_key_is_refused_and_resealed_it_resumes(corpus: Corpus,
                                                                                   tiny_model: Path):
    """The run's own state, unchanged, written again by the folder's writer with govtrain's writer and a key of
    their own: refused in one line before anything in it is used, nothing changed. The same bytes sealed under the
    ledger's key resume the run to its end (so the refusal is the MAC's alone)."""
    from govtrain.train.loop import train

    from govtrain.train import state_file

    config = _killed(corpus, tiny_model)
    path = config.output_dir / state_file.STATE_FILE
    saved = run_state_keys.read(path, corpus)
    state_file.write(path, saved, run_state_keys.attacker_key(corpus))
    refused = _refused(corpus, config, "run_state_invalid")
    assert "not a run state written by this ledger's key" in refused.detail
    run_state_keys.write(path, saved, corpus)
    assert train(config, corpus.url, insecure_seed=1, **QUIET).steps == CHARGED_STEPS


def test_a_plan_that_allows_steps_without_spend_is_refused_even_under_the_ledger_key(corpus: Corpus,
                                                                                     tiny_model: Path):
    """Behind the MAC: a plan that lets units be drawn with no spend to charge them is no plan a run saves."""
    config = _killed(corpus, tiny_model)
    _sealed(corpus, config, lambda state: state["pending"].update(spend=[]))
    assert "no spend" in _refused(corpus, config, "run_state_invalid").detail


def test_a_held_epoch_is_trained_as_the_ledger_charged_it_even_when_the_state_lists_no_spend(
        corpus: Corpus, tiny_model: Path, monkeypatch):
    """Behind the MAC: a plan with no spend and nothing allowed, but noise 1e-9, for an epoch the ledger holds under
    the run's lease. The ledger's written plan replaces it: no step releases less noise than charged, and no more
    steps run than the epoch charged."""
    config = _killed(corpus, tiny_model)

    def edit(state: dict) -> None:
        pending = state["pending"]
        pending.update(spend=[], allowed={c: 0 for c in pending["allowed"]},
                       group_std={g: 1e-9 for g in pending["group_std"]})

    _sealed(corpus, config, edit)
    moved, refused = _resume_recording_steps(corpus, config, monkeypatch)
    assert refused is None, refused
    assert moved and all(min(std.values()) >= CHARGED_STD for _, std in moved), moved
    assert TAKEN + len(moved) <= CHARGED_STEPS
    assert len(_spend_of(corpus, "test-run")) == 1  # the epoch's one spend, as written before the kill


@pytest.mark.parametrize("field, value", [
    ("step", -40), ("nonfinite", -10**9), ("step", 100), ("update", {}), ("pending", {}),
    ("pending", "first_step past step"), ("pending", "steps past the run")])
def test_a_state_of_what_no_run_saves_is_refused_in_one_line_even_under_the_ledger_key(
        corpus: Corpus, tiny_model: Path, field: str, value):
    """Behind the MAC: negative counts, a step past the run's, an optimizer state of no update, a plan without its
    keys, a plan whose steps miss the state's step or leave the run: one line, nothing changed."""
    config = _killed(corpus, tiny_model)

    def edit(state: dict) -> None:
        if value == "first_step past step":
            state["pending"]["first_step"] = state["step"] + 1
        elif value == "steps past the run":
            state["pending"]["steps"] = 40
        else:
            state[field] = value

    _sealed(corpus, config, edit)
    _refused(corpus, config, "run_state_invalid")


def test_a_fresh_cyclic_run_whose_part_rate_exceeds_one_is_refused_in_one_line(tmp_path: Path, tiny_model: Path):
    """banded-MF with bands 4 at q = 16/48: cycle·q = 4/3 > 1. A fresh run is refused with `run_config_invalid`
    before anything is written (it raised a bare ValueError from the sampler)."""
    from govtrain.train.config import load_run_config
    from govtrain.train.loop import train
    from tests.conftest import TEST_POLICY, make_corpus
    from tests.test_attacks_identity_sampling import NOISE, STEPS
    from tests.test_train import _admit

    folder = tmp_path / "run"
    folder.mkdir()
    corpus = make_corpus(folder, f"sqlite:///{folder / 'ledger.db'}",
                         TEST_POLICY.replace("sampling_rate = 0.01\n", "expected_batch_size = 16\n"))
    for name in [f"c{i}" for i in range(8)]:
        _admit(corpus, name, records=6, noise_multiplier_u=2_000_000, eps_budget_u=8_000_000)
    config = load_run_config(_config(corpus, tiny_model, STEPS, extra=NOISE["banded-mf"]))
    before = snapshot(corpus.url)
    with pytest.raises(GovtrainError) as refused:
        train(config, corpus.url, insecure_seed=5, **QUIET)
    assert refused.value.code.value == "run_config_invalid" and "\n" not in refused.value.line()
    assert "cycle·q" in refused.value.detail
    assert snapshot(corpus.url) == before and not config.output_dir.exists() or not _files(config.output_dir)


def test_an_older_state_of_the_same_run_is_accepted_and_trains_the_held_epoch_as_charged(corpus: Corpus,
                                                                                         tiny_model: Path):
    """A rollback (a backup, a copy of the folder) to an older state the run itself wrote: its MAC verifies, as it
    should (it is the run's own). It brings its own older weights and step and redoes steps the ledger already
    charged, under the same spend: nothing is charged twice, nothing goes uncharged (docs/threat-model.md)."""
    from govtrain.train import state_file
    from govtrain.train.config import load_run_config
    from govtrain.train.loop import train
    from tests.test_train import _admit

    _admit(corpus, "pub")
    config = load_run_config(_config(corpus, tiny_model, 4))
    path = config.output_dir / state_file.STATE_FILE
    with pytest.raises(KeyboardInterrupt):
        train(config, corpus.url, insecure_seed=1, checkpoint_every=1, interrupt_after_steps=1, **QUIET)
    older = path.read_bytes()
    assert run_state_keys.read(path, corpus)["step"] == 1
    with pytest.raises(KeyboardInterrupt):
        train(config, corpus.url, insecure_seed=1, checkpoint_every=1, interrupt_after_steps=2, **QUIET)
    assert run_state_keys.read(path, corpus)["step"] == 3
    spend = _spend_of(corpus, "test-run")
    path.write_bytes(older)  # the writer puts the older state back (0600, theirs: the run's user)
    assert train(config, corpus.url, insecure_seed=1, **QUIET).steps == CHARGED_STEPS
    assert _spend_of(corpus, "test-run") == spend  # the held epoch's one spend, as written before the kills
