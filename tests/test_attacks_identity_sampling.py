"""Issue 34 item 1: per-unit randomness keyed by identity, across a kill, a withdrawal, an admission and a resume.

A resume rebuilds the run's corpus from the ledger: withdrawn contributions drop out and contributions admitted while
the run was down join. A unit's cyclic part and its Poisson uniform were keyed by its position in that corpus, so
every unit after a withdrawn one moved to another part mid-epoch, and banded-MF / BLT were charged for a participation
pattern that did not happen (the review measured ε 2.95 charged against ≥ 4.22 realised). Now every per-unit decision
is keyed by the unit's identity (routing/sampler.py, train/corpus.py), so:

- the resumed run draws, by identity, exactly what an uninterrupted run with the same withdrawal draws;
- no identity is drawn twice within b steps under a cyclic privatizer, and each one only in its part's steps;
- each unit's participations in the epoch are at most the rounds its spend charged;
- a resume whose surviving contributions read other rows than the state recorded is refused (`corpus_changed`) and
  changes nothing.

Each case is one setup: q = 0.25 (the policy's), σ = 2, 8 steps in one ledger epoch, killed after step 3.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from govtrain.errors import Code, ConfigError  # noqa: E402
from govtrain.ledger.entries import decode_entry  # noqa: E402
from govtrain.privatizers import from_record  # noqa: E402
from tests.conftest import TEST_POLICY, Corpus, make_corpus, snapshot  # noqa: E402
from tests.test_train import _admit, _config, tiny_model  # noqa: E402,F401

STEPS, KILLED_AFTER = 8, 3
UNIT_LINES = {"example": "sampling_rate = 0.25\n",
              "contribution": 'privacy_unit = "contribution"\nexamples_per_contribution = 4\nsampling_rate = 0.25\n'}
NOISE = {"gaussian": "", "banded-mf": '[noise]\nprivatizer = "banded-mf"\nbands = 4',
         "blt": '[noise]\nprivatizer = "blt"\nbuffers = 2\nmin_separation = 4'}
CYCLE = {"gaussian": 1, "banded-mf": 4, "blt": 4}
NAMES = [f"c{i}" for i in range(8)]  # c0 is withdrawn after the kill; c8 (sorted last) is admitted then
QUIET = dict(log=lambda line: None)


def _corpus(folder: Path, unit: str) -> Corpus:
    folder.mkdir()
    corpus = make_corpus(folder, f"sqlite:///{folder / 'ledger.db'}",
                         TEST_POLICY.replace("sampling_rate = 0.01\n", UNIT_LINES[unit]))
    for name in NAMES:
        _admit(corpus, name, records=6, noise_multiplier_u=2_000_000, eps_budget_u=8_000_000)
    return corpus


def _leave_and_join(corpus: Corpus) -> None:
    """While the run is down (or, for the uninterrupted run, after step 2's draw): the first contribution withdraws,
    and a new one, sorted after every other, is admitted with fewer rows (so no shift cancels another)."""
    with corpus.open() as ledger:
        ledger.withdraw("c0", "the contributor asked", now=corpus.now)
    _admit(corpus, "c8", records=3, noise_multiplier_u=2_000_000, eps_budget_u=8_000_000)


class Draws:
    """Each step's drawn units by stable identity, spied on `Run._draw` (the last draw of a step: a step drawn again
    after a kill is the one trained): the example unit as (contribution, row index), the contribution unit as
    (contribution, the row indices it brought)."""

    def __init__(self, patch: pytest.MonkeyPatch) -> None:
        from govtrain.train.run import Run

        self.by_step: dict[int, set[tuple]] = {}
        original = Run._draw

        def draw(run, live):  # type: ignore[no-untyped-def]
            drawn = original(run, live)
            owner, rank = run.examples.owner, run.rank
            self.by_step[run.result.steps] = {(owner[unit[0]], tuple(sorted(int(rank[i]) for i in unit)))
                                              for microbatch in drawn for unit in microbatch}
            return drawn

        patch.setattr(Run, "_draw", draw)

    def steps_of(self) -> dict[tuple, list[int]]:
        steps: dict[tuple, list[int]] = {}
        for step, units in sorted(self.by_step.items()):
            for unit in units:
                steps.setdefault(unit, []).append(step)
        return steps


def _spends(corpus: Corpus) -> list[dict]:
    with corpus.open() as ledger:
        return [decode_entry(e.body, seq=e.seq, kind=e.kind) for e in ledger.store.entries(kinds=("spend",))]


def _killed(corpus: Corpus, config, patch: pytest.MonkeyPatch) -> Draws:  # type: ignore[no-untyped-def]
    from govtrain.train.loop import train

    draws = Draws(patch)
    with pytest.raises(KeyboardInterrupt):
        train(config, corpus.url, insecure_seed=5, checkpoint_every=1, interrupt_after_steps=KILLED_AFTER, **QUIET)
    return draws


def _check_participation(name: str, corpus: Corpus, draws: Draws) -> None:
    """No identity twice within b steps, each only in its part's steps (one residue mod b), the withdrawn one not
    after its withdrawal and the admitted one not in an epoch that did not charge it, and each one's participations
    at most the rounds its spend charged for the epoch."""
    cycle = CYCLE[name]
    spends = {s["contribution_id"]: s for s in _spends(corpus)}
    assert set(spends) == set(NAMES)  # one epoch, charged before the kill; c8 was not charged
    steps_of = draws.steps_of()
    assert sorted(draws.by_step) == list(range(STEPS)) and steps_of
    for (cid, rows), steps in steps_of.items():
        assert cid != "c8" and (cid != "c0" or max(steps) < KILLED_AFTER), (cid, steps)
        assert all(b - a >= cycle for a, b in zip(steps, steps[1:])), (name, cid, rows, steps)
        assert len({s % cycle for s in steps}) == 1, (name, cid, rows, steps)  # its part's steps only
        spend = spends[cid]
        charge = from_record(spend["privatizer"]).charge(sampling_rate_u=spend["sampling_rate_u"],
                                                         noise_multiplier_u=spend["noise_multiplier_u"],
                                                         steps=spend["steps"])
        assert len(steps) <= charge.rounds, (name, cid, rows, steps, charge.rounds)
        if cycle > 1:
            assert charge.rounds == math.ceil(STEPS / cycle)


def test_the_issues_scenario_banded_mf_draws_no_unit_twice_within_its_bands_after_a_withdrawal_and_resume(
        tmp_path: Path, tiny_model: Path):
    """The review's proof, through `train()`: tiny BERT, q 0.25, bands 4, σ 2, 8 steps; killed after step 3, the
    first contribution withdrawn, resumed. Before the fix the survivors moved to other parts and some example was
    drawn at two steps less than 4 apart (the review saw [2, 3, 7])."""
    from govtrain.train.config import load_run_config
    from govtrain.train.loop import train

    corpus = _corpus(tmp_path / "run", "example")
    config = load_run_config(_config(corpus, tiny_model, STEPS, extra=NOISE["banded-mf"]))
    with pytest.MonkeyPatch.context() as patch:
        draws = _killed(corpus, config, patch)
        with corpus.open() as ledger:
            ledger.withdraw("c0", "the contributor asked", now=corpus.now)
        train(config, corpus.url, insecure_seed=5, **QUIET)
    steps_of = draws.steps_of()
    assert sorted(draws.by_step) == list(range(STEPS))
    assert all(b - a >= 4 for steps in steps_of.values() for a, b in zip(steps, steps[1:])), \
        {unit: steps for unit, steps in steps_of.items() if any(b - a < 4 for a, b in zip(steps, steps[1:]))}
    assert all(len(steps) <= 2 for steps in steps_of.values())  # ⌈8 / 4⌉ rounds charged


def _killed_withdrawn_admitted_resumed(tmp_path: Path, model: Path, name: str, unit: str, *,
                                       refusals: bool = False) -> None:
    from govtrain.train.config import load_run_config
    from govtrain.train.loop import STATE_FILE, train

    # the uninterrupted run: the same key, the same withdrawal, effective from step 3's draw
    whole = _corpus(tmp_path / "whole", unit)
    whole_config = load_run_config(_config(whole, model, STEPS, extra=NOISE[name]))

    def leave_after_step_two(step: int, owners: list[str]) -> None:
        if step == KILLED_AFTER - 1:
            _leave_and_join(whole)

    with pytest.MonkeyPatch.context() as patch:
        expected = Draws(patch)
        train(whole_config, whole.url, insecure_seed=5, observe=leave_after_step_two, **QUIET)

    killed = _corpus(tmp_path / "killed", unit)
    config = load_run_config(_config(killed, model, STEPS, extra=NOISE[name]))
    with pytest.MonkeyPatch.context() as patch:
        draws = _killed(killed, config, patch)
        _leave_and_join(killed)
        if refusals:
            _check_refusals(killed, config)
        train(config, killed.url, insecure_seed=5, **QUIET)
    assert not (killed.dir / "adapter" / STATE_FILE).exists()

    assert draws.by_step == expected.by_step  # by identity, the resumed run drew what the uninterrupted one drew
    _check_participation(name, killed, draws)


def _check_refusals(corpus: Corpus, config) -> None:  # type: ignore[no-untyped-def]
    """A resume whose surviving units would not keep their identities is refused with corpus_changed before anything
    is written: a contribution whose rows read in another order (its row indices would name other rows), and a state
    that records no corpus (an earlier govtrain's, which drew by position)."""
    import govtrain.train.data as data
    import govtrain.train.run as run_module
    from govtrain.train.loop import STATE_FILE, train

    state = corpus.dir / "adapter" / STATE_FILE
    before = (snapshot(corpus.url), state.read_bytes(), sorted(p.name for p in state.parent.iterdir()))
    loaded = data.load_examples

    def reordered(*args, **kwargs):  # type: ignore[no-untyped-def]
        examples = loaded(*args, **kwargs)
        mine = [i for i, cid in enumerate(examples.owner) if cid == "c3"]
        items = list(examples.items)
        for i, j in zip(mine, reversed(mine)):
            items[i] = examples.items[j]
        return type(examples)(items, examples.owner, examples.unmatched_files, examples.missing)

    load_state = run_module._load_state

    def without_corpus(*args, **kwargs):  # type: ignore[no-untyped-def]
        saved = load_state(*args, **kwargs)
        return {k: v for k, v in saved.items() if k != "corpus"}

    for target, name, replacement, fragment in ((data, "load_examples", reordered, "contribution c3"),
                                                (run_module, "_load_state", without_corpus, "no corpus identity")):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(target, name, replacement)
            with pytest.raises(ConfigError) as info:
                train(config, corpus.url, insecure_seed=5, **QUIET)
        assert info.value.code is Code.CORPUS_CHANGED and fragment in info.value.detail, info.value.detail
        assert (snapshot(corpus.url), state.read_bytes(), sorted(p.name for p in state.parent.iterdir())) == before


@pytest.mark.parametrize("name, unit", [("gaussian", "example"), ("blt", "contribution")])
def test_kill_withdraw_admit_resume_draws_by_identity_and_within_the_charge(tmp_path: Path, tiny_model: Path,
                                                                            name: str, unit: str):
    _killed_withdrawn_admitted_resumed(tmp_path, tiny_model, name, unit)


def test_banded_mf_kill_withdraw_admit_resume_and_a_changed_corpus_is_refused(tmp_path: Path, tiny_model: Path):
    _killed_withdrawn_admitted_resumed(tmp_path, tiny_model, "banded-mf", "example", refusals=True)


@pytest.mark.long
@pytest.mark.parametrize("name, unit", [("gaussian", "contribution"), ("banded-mf", "contribution"),
                                        ("blt", "example")])
def test_the_other_privatizer_unit_pairs_across_kill_withdraw_admit_resume(tmp_path: Path, tiny_model: Path,
                                                                          name: str, unit: str):
    _killed_withdrawn_admitted_resumed(tmp_path, tiny_model, name, unit)


def test_the_corpus_record_names_rows_by_identity_and_refuses_what_would_move_them(tmp_path: Path):
    """`train/corpus.py` without a run: equal rows of one contribution are two units; withdrawals and admissions
    pass and are merged; a survivor's rows read in another order or count, another data digest, another unit or no
    record at all are refused with corpus_changed. A causal-LM row's `where` (its file's name) is no part of it."""
    from govtrain.routing.microbatch import example_id
    from govtrain.routing.sampler import unit_identities
    from govtrain.tasks.causal_lm import Text
    from govtrain.tasks.classification import Labelled
    from govtrain.train import corpus

    items = [Labelled("same", 1), Labelled("same", 1), Labelled("other", 0), Labelled("b row", 1)]
    owner = ["a", "a", "a", "b"]
    digests = {"a": bytes(32), "b": bytes(range(32)), "c": b"\x01" * 32}
    start = corpus.record("example", ["a", "b"], items, owner, digests)
    assert len({tuple(row) for row in unit_identities([example_id("a", 0), example_id("a", 1)])}) == 2
    path = tmp_path / "run-state.pt"
    # b withdrawn, c admitted: nothing of a moved
    later = corpus.record("example", ["a", "c"], items[:3] + [Labelled("c row", 0)], ["a", "a", "a", "c"], digests)
    corpus.check(start, later, path)
    assert set(corpus.merge(start, later)["contributions"]) == {"a", "b", "c"}
    refused = {
        "order": corpus.record("example", ["a"], [items[2], items[0], items[1]], ["a"] * 3, digests),
        "count": corpus.record("example", ["a"], items[:2], ["a"] * 2, digests),
        "digest": corpus.record("example", ["a"], items[:3], ["a"] * 3, {"a": b"\x02" * 32}),
        "unit": corpus.record("contribution", ["a"], items[:3], ["a"] * 3, digests),
    }
    for why, current in refused.items():
        with pytest.raises(ConfigError) as info:
            corpus.check(start, current, path)
        assert info.value.code is Code.CORPUS_CHANGED and "\n" not in info.value.detail, why
    for missing in (None, {}, {"unit": "example"}, {"unit": "example", "contributions": []}):
        with pytest.raises(ConfigError) as info:
            corpus.check(missing, start, path)
        assert info.value.code is Code.CORPUS_CHANGED
    renamed = corpus.record("example", ["a"], [Text("t", where="x.jsonl:1")], ["a"], digests)
    assert renamed == corpus.record("example", ["a"], [Text("t", where="y.jsonl:1")], ["a"], digests)
