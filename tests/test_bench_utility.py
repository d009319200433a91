"""bench/utility.py's core on a tiny random BERT and a few synthetic snippets: every row trains, is tuned on
the validation split alone and lands in the table (kept from rotting; the real run is the bench itself)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
utility = pytest.importorskip("utility")
runs = pytest.importorskip("utility_runs")

WORDS = "good bad movie film great awful plot acting fun dull the a is was and very not".split()


def _snippets(count: int, offset: int) -> tuple[list[str], list[int]]:
    good, bad = ["good", "great", "fun"], ["bad", "awful", "dull"]
    texts = [f"the {'film' if i % 3 else 'movie'} was very {(good if i % 2 else bad)[(i + offset) % 3]}"
             for i in range(count)]
    return texts, [i % 2 for i in range(count)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-bert")
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    tokenizer = transformers.BertTokenizerFast(vocab=str(folder / "vocab.txt"))
    config = transformers.BertConfig(hidden_size=16, num_hidden_layers=6, num_attention_heads=2, intermediate_size=24,
                                     vocab_size=len(WORDS) + 5, max_position_embeddings=32, num_labels=2,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)

    def load(seed: int):
        from govtrain.train.model import wrap_lora

        torch.manual_seed(seed)
        model = wrap_lora(transformers.BertForSequenceClassification(config), runs.run_file("dpsgd").lora, [])
        return model.eval(), tokenizer

    task = utility.Task(train=_snippets(16, 0), validation=_snippets(8, 1), heldout=_snippets(8, 2))
    return utility.Setup(task=task, load=load, band=(4, 5), max_length=8, steps=2, batch=4)


@pytest.fixture
def one_thread():
    """A model this small gains nothing from threads, and on a busy machine waiting for them costs seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_every_row_trains_and_is_tuned_on_validation_alone(tiny, one_thread):
    grids = {"non-private": (1e-3, 1e-2), "dpsgd": (1e-2,), "prism": (1e-2,), "dp-muon": (0.02,), "opacus": (1e-2,),
             "banded-mf": (1e-2,)}
    finished = []
    rows = utility.run_rows(tiny, utility.Performance(), utility.METHODS, [8.0], grids, log=lambda line: None,
                            done=finished.append, accountant="rdp")  # PLD takes seconds at such a small sigma
    methods = [m for m in utility.METHODS if m != "opacus" or importlib.util.find_spec("opacus") is not None]
    assert [row.method for row in rows] == methods and finished == rows
    private = [row for row in rows if row.epsilon is not None and row.method != "banded-mf"]
    assert {row.epsilon for row in private} == {8.0} and len({row.sigma for row in private}) == 1
    assert private[0].sigma > 0
    banded = next(row for row in rows if row.method == "banded-mf")  # its own σ, for its own charge
    assert banded.bands == 2 and (banded.bands, banded.sigma) == utility.choose_bands(8.0, 0.25, 2, "rdp")
    for row in rows:
        assert [t.lr for t in row.trials] == list(grids[row.method])
        assert row.chosen == max(row.trials, key=lambda t: t.validation)  # the first of equals: max keeps it
        assert 0 <= row.heldout <= 1 and row.chosen.seconds_per_step > 0
    assert all(row.bands is None for row in rows if row.method != "banded-mf")
    text = utility.table(rows, "memory")
    assert text.count("\n") == len(rows) + 1 and "| non-private | ∞ | - | 0.001, 0.01 |" in text


def test_sizes_and_grid_overrides():
    cpu = utility.parse([])
    assert (cpu.band, cpu.max_length, cpu.batch) == ((4, 5), 32, 128)
    cuda = utility.parse(["--device", "cuda", "--steps", "10", "--grid", "prism=0.1,0.2"])
    assert cuda.band == (0, 5) and cuda.steps == 10 and cuda.grids["prism"] == (0.1, 0.2)
    with pytest.raises(SystemExit):
        utility.parse(["--grid", "adam=0.1"])


def test_the_contribution_unit_draws_movies_and_clips_each_movie_once(tiny, one_thread):
    """--unit contribution: q is over the movies, a drawn movie brings at most per_contribution snippets, the
    private rows train through the router's units and Opacus (which has no such unit) is skipped."""
    from dataclasses import replace

    movies = tuple(i // 5 for i in range(16))  # movies of 5, 5, 5 and 1 snippets
    setup = replace(tiny, task=replace(tiny.task, movies=movies), unit="contribution", per_contribution=3, batch=2,
                    steps=6)
    assert [len(m) for m in setup.task.contributions()] == [5, 5, 5, 1] and setup.sampling_rate == 0.5
    for chosen, units in runs.draws("dpsgd", setup):
        assert len(chosen) == len(units) and units == sorted(units)
        owners = [movies[i] for i in chosen]
        for unit in set(units):
            mine = {owners[i] for i, u in enumerate(units) if u == unit}
            assert len(mine) == 1 and units.count(unit) <= 3  # one movie per unit, at most 3 of its snippets
    logged = []
    rows = utility.run_rows(setup, utility.Performance(), ["dpsgd", "opacus"], [8.0], {"dpsgd": (1e-2,)},
                            log=logged.append, accountant="rdp")
    assert [row.method for row in rows] == ["dpsgd"] and any("opacus has no contribution-level" in x for x in logged)
    assert utility.parse(["--unit", "contribution", "--per-contribution", "4"]).per_contribution == 4
