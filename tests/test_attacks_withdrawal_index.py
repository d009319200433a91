"""A database writer without keys against training's view of withdrawals (govtrain/train/withdrawals.py).

Training used to learn each step's withdrawals from the `withdrawals` index table: deleting a row there hid a
withdrawal from every later step, while `govtrain-verify` still saw the withdraw entry. A step now reads the
withdraw entries' bodies; an edited, relabelled or deleted entry stops the run with its code.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import govtrain
from govtrain.errors import IntegrityError
from govtrain.ledger.ledger import Ledger
from govtrain.train.withdrawals import Withdrawn
from tests.test_api import QUIET, _config, _corpus
from tests.test_train import tiny_model  # noqa: F401 (a fixture)
from tests.test_signed_ledger import _db, _sql

pytest.importorskip("transformers")


def _train_withdrawing(tmp_path: Path, tiny_model: Path, name: str, *tamper: str):
    """A user's loop of 8 steps; after step 3 another process withdraws "sens" and a database writer runs `tamper`.
    Returns (the ids drawn at each step, the exception that ended the loop, or None)."""
    corpus = _corpus(tmp_path, name)
    drawn: dict[int, set[str]] = {}
    config = _config(corpus, tiny_model, 8, extra="expected_batch_size = 16")
    ended = None
    try:
        with govtrain.GovernedRun.open(config, corpus.url, insecure_seed=4, observe=lambda step, ids: drawn.update(
                {step: set(ids)}), **QUIET) as run:
            for batch in run.batches():
                if run.step(run.per_example_loss(run.model(**batch.inputs), batch)) is not None and run.steps == 3:
                    with Ledger.open(corpus.url) as other:
                        other.withdraw("sens", "consent withdrawn", now=corpus.now)
                    if tamper:
                        _sql(_db(corpus.url), *tamper)
            run.save()
    except IntegrityError as e:
        ended = e
    return drawn, ended


def test_a_deleted_withdrawals_row_does_not_bring_a_withdrawn_contribution_back_into_training(tmp_path, tiny_model):
    """The writer deletes the index row of the withdrawal that has just been written: no later step draws "sens"."""
    drawn, ended = _train_withdrawing(tmp_path, tiny_model, "deleted", "DELETE FROM withdrawals WHERE contribution_id = 'sens'")
    assert ended is None
    assert any("sens" in drawn[step] for step in range(3))
    assert all("sens" not in drawn[step] for step in range(3, 8)) and all(drawn[step] for step in range(3, 8))


def test_a_withdraw_entry_relabelled_in_its_kind_column_stops_the_run(tmp_path, tiny_model):
    """The writer relabels the withdraw entry's kind column (and deletes the index row): the next step refuses
    with bad_entry, and "sens" is drawn at no step after the withdrawal."""
    drawn, ended = _train_withdrawing(
        tmp_path, tiny_model, "relabelled",
        "UPDATE entries SET kind = 'epoch' WHERE kind = 'withdraw'", "DELETE FROM withdrawals")
    assert ended is not None and ended.code.value == "bad_entry"
    assert all("sens" not in drawn.get(step, set()) for step in range(3, 8))


def test_the_reader_refuses_a_deleted_entry_and_reads_only_what_is_new(corpus):
    """Unit: a gap in the sequence numbers is sequence_gap; later reads see a later withdrawal."""
    from tests.test_train import _admit as admit_data

    admit_data(corpus, "pub")
    admit_data(corpus, "other")
    with Ledger.open(corpus.url) as ledger:
        seen = Withdrawn(ledger.store)
        assert seen.read() == frozenset()
        ledger.withdraw("pub", "gone", now=corpus.now)
        assert seen.read() == {"pub"}
        assert seen.read() == {"pub"}  # nothing new
        ledger.withdraw("other", "gone", now=corpus.now)
        assert seen.read() == {"pub", "other"}
        size = ledger.store.next_seq()
    _sql(_db(corpus.url), f"DELETE FROM entries WHERE seq = {size - 2}")
    with Ledger.open(corpus.url) as ledger:
        with pytest.raises(IntegrityError) as e:
            Withdrawn(ledger.store).read()
    assert e.value.code.value == "sequence_gap"
