"""Model state the governed forward reads besides its parameters, and its randomness (issue 34, the review of
item 8): buffers, plain module settings and modes are refused when set between governed steps (the review's
proofs are in `test_attacks_hyperparameters_review.py`); these test what must keep working and the randomness.

- Dropout's masks come from the run's keyed generators: a loop that seeds torch's global generator from the data
  between steps changes nothing the step computes (in train mode from the start, so no mode is switched); the
  masks are a function of the run's lease and the step and chunk (so a resumed run draws them again).
- A mode switched between governed forwards is refused, and the Trainer's own switching around evaluations is not
  (`test_hf_trainer.py`, `test_attacks_selection.py` train with evaluations).
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import govtrain  # noqa: E402
from govtrain.errors import Code, ConfigError  # noqa: E402
from govtrain.verify.verifier import verify_ledger  # noqa: E402
from tests.conftest import snapshot  # noqa: E402
from tests.test_api import QUIET, _corpus, _same, _trainable  # noqa: E402
from tests.test_attacks_user_code import _loop, _step_once  # noqa: E402
from tests.test_train import _config, tiny_model  # noqa: E402,F401


def _trained(tmp_path: Path, model: Path, name: str, between, train: bool = True) -> dict:
    """Two steps in train mode (dropout 0.1 on from the first forward), `between(run, loss)` after step 0."""
    corpus = _corpus(tmp_path, name)
    with govtrain.GovernedRun.open(_config(corpus, model, 2), corpus.url, insecure_seed=1, **QUIET) as run:
        run.model.train(train)
        _step_once(run, corpus)
        between(run, run.result.losses[-1])
        _loop(run)
        return _trainable(run)


def test_dropout_masks_do_not_follow_a_seed_the_loop_sets_from_the_data(tmp_path: Path, tiny_model: Path):
    honest = _trained(tmp_path, tiny_model, "honest", lambda run, loss: torch.manual_seed(12345))
    steered = _trained(tmp_path, tiny_model, "steered", lambda run, loss: torch.manual_seed(int(loss * 1e6)))
    assert honest.keys() == steered.keys()
    moved = [n for n in honest if not torch.equal(honest[n], steered[n])]
    assert not moved, f"step 1 followed the seed the loop set from the data: {len(moved)} tensors differ"
    evaluated = _trained(tmp_path, tiny_model, "eval", lambda run, loss: None, train=False)
    assert any(not torch.equal(honest[n], evaluated[n]) for n in honest), "dropout was off: the test proves nothing"


def test_a_governed_forwards_randomness_is_the_runs_keyed_by_its_place(tmp_path: Path, tiny_model: Path):
    """The masks of a step's chunk are a function of the run's lease and the place alone (so a resumed run, which
    keeps its nonce, draws a step's masks again), differ between places, and torch's generator is put back."""
    from govtrain.train.governed_loop import keyed_random

    corpus = _corpus(tmp_path, "keyed")
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 2), corpus.url, **QUIET) as run:
        drawn = []
        for seed, place in ((1, (3, 0)), (2, (3, 0)), (1, (3, 1)), (1, (4, 0))):
            torch.manual_seed(seed)
            kept = torch.get_rng_state()
            with keyed_random(run._run, *place):
                drawn.append(torch.rand(8))
            assert torch.equal(torch.get_rng_state(), kept)
    assert torch.equal(drawn[0], drawn[1])
    assert not torch.equal(drawn[0], drawn[2]) and not torch.equal(drawn[0], drawn[3])


def test_a_mode_switched_between_governed_forwards_is_refused_and_nothing_moves(tmp_path: Path, tiny_model: Path):
    corpus = _corpus(tmp_path, "mode")
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 3), corpus.url, insecure_seed=1, **QUIET) as run:
        weights, ledger = _step_once(run, corpus)  # in eval mode, as the model loads
        run.model.train()
        with pytest.raises(ConfigError) as refused:
            _loop(run)
        assert refused.value.code is Code.UNGOVERNED_BATCH and "training mode" in refused.value.detail
        assert run.steps == 1 and _same(weights, run)
    assert snapshot(corpus.url) == ledger and "run" not in verify_ledger(corpus.url).by_kind


def test_a_buffer_put_back_as_it_was_lets_the_run_go_on(tmp_path: Path, tiny_model: Path):
    corpus = _corpus(tmp_path, "buffer")
    with govtrain.GovernedRun.open(_config(corpus, tiny_model, 3), corpus.url, insecure_seed=1, **QUIET) as run:
        weights, _ = _step_once(run, corpus)
        positions = run.model.base_model.model.bert.embeddings.position_ids
        kept = positions.clone()
        positions.fill_(3)
        with pytest.raises(ConfigError) as refused:
            _loop(run)
        assert refused.value.code is Code.UNGOVERNED_UPDATE and "position_ids" in refused.value.detail
        assert _same(weights, run)
        positions.copy_(kept)  # written back: its values as recorded (its version counter moved, harmlessly)
        _loop(run)
        assert run.save().steps == 3
    assert verify_ledger(corpus.url).by_kind["run"] == 1
