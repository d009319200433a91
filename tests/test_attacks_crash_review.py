"""Adversarial review of crash safety (issue 23 item 2, branch i23-crash): proof tests, each failing on the code
reviewed and passing once its defect is fixed. Each names its adversary and the defect.

The runs are in-process `train()` calls on the tiny BERT of tests/test_train.py; a kill is `interrupt_after_steps`
(the run state is left as a SIGKILL leaves it at its last checkpoint) or an exception raised at the point named.
"""

from __future__ import annotations

import hashlib
import shutil
import sqlite3
from pathlib import Path

import pytest

import ledger_store

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from govtrain.errors import GovtrainError  # noqa: E402
from govtrain.ledger.ledger import Ledger  # noqa: E402
from govtrain.train import state_file  # noqa: E402
from tests import run_state_keys  # noqa: E402
from tests.conftest import Corpus, snapshot  # noqa: E402
from tests.test_signed_ledger import _db, _sql  # noqa: E402
from tests.test_train import _admit, _config, tiny_model  # noqa: E402,F401

STATE = state_file.STATE_FILE
QUIET = dict(log=lambda line: None)


def _nonce(url: str, run_id: str) -> bytes:
    """A run's lease nonce, as anyone who can read the ledger reads it from its spend entries."""
    from govtrain.ledger.entries import decode_stored

    with Ledger.open(url) as ledger:
        return next(decode_stored(s)["run_nonce"] for s in ledger.store.entries(kinds=("spend",))
                    if decode_stored(s)["run_id"] == run_id)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# -- 1. the "recorded and done" path accepts a state file of another run, under another config --------------------

def test_a_state_file_of_another_finished_run_does_not_finish_this_config_without_training(corpus: Corpus,
                                                                                            tiny_model: Path):
    """Adversary: someone who can write the output folder of a run not yet started (config C), and who holds a run
    state of a finished run X (a backup, a copy read mid-run; its lease nonce is public in the ledger anyway).

    Defect: the new recorded path (`Run.prepare`: `book.finished[run_id] == state's nonce`) trusts the state's
    run_id and lease, and `_check_recorded` compares only the folder's hash with X's run entry: it never checks that
    X's run entry records *this* config (`config_sha256`) and base model. With X's state (its config hash set to
    C's) and X's adapter files copied into C's folder, `train(C)` ends "finished" (exit 0): no step trained, no
    spend charged under C, nothing recorded for C, and a model card written from C's config (its govtrain record)
    for X's adapter and X's run entry. Fix: on the recorded path, refuse unless the run entry's config_sha256 and
    base_model_sha256 are this run's (and the state names this config's training.run_id)."""
    from govtrain.train.config import load_run_config
    from govtrain.train.loop import train

    _admit(corpus, "pub")
    path_x = _config(corpus, tiny_model, 6)
    config_x = load_run_config(path_x)
    with pytest.raises(KeyboardInterrupt):
        train(config_x, corpus.url, insecure_seed=1, checkpoint_every=1, interrupt_after_steps=2, **QUIET)
    stolen = run_state_keys.read(corpus.dir / "adapter" / STATE, corpus)  # X's state, read mid-run
    train(config_x, corpus.url, insecure_seed=1, **QUIET)  # X finishes: run entry, card, state removed

    # config C: another run (id, folder, learning rate), never started
    path_c = corpus.dir / "run-c.toml"
    path_c.write_text(path_x.read_text().replace('output = "adapter"', 'output = "adapter-c"')
                      .replace('run_id = "test-run"', 'run_id = "run-c"').replace("lr = 0.01", "lr = 0.02"))
    config_c = load_run_config(path_c)
    folder = corpus.dir / "adapter-c"
    shutil.copytree(corpus.dir / "adapter", folder, ignore=shutil.ignore_patterns("README.md"))
    run_state_keys.write(folder / STATE, {**stolen, "config_sha256": config_c.sha256}, corpus)
    before, files = snapshot(corpus.url), _files(folder)

    with pytest.raises(GovtrainError) as info:
        train(config_c, corpus.url, insecure_seed=1, **QUIET)
    assert info.value.exit_code != 5  # refused, not "finished" as a run whose budgets ran out
    assert snapshot(corpus.url) == before and _files(folder) == files  # nothing changed: no card, state kept


# -- 2. a database writer without keys satisfies "the state's lease recorded the run entry" ------------------------

def test_an_unsigned_run_entry_forged_in_the_database_does_not_finish_a_killed_run(corpus: Corpus, tiny_model: Path):
    """Adversary: a database writer without ledger keys, between a kill and the resume.

    Defect: `Run.prepare` sets `recorded` from `spend_book().finished`, and `_check_recorded` reads the adapter
    hash from `run_facts`: both read every stored entry, the unsigned tail past the last checkpoint included (what
    only a forger writes: the ledger signs every state it reaches). A run entry row inserted with the killed run's
    public lease nonce and the hash of the folder as the kill left it (no adapter file: the hash of nothing) makes
    the resumed run skip its remaining steps, "finish" it (a card for the forged entry), and delete its run state:
    its weights and sampling key are gone, and the real run can never be resumed or recorded. The recorded path
    writes nothing, so the signer's fork check never runs. Fix: accept only a run entry covered by a checkpoint that
    verifies (`ledger.signed.read_log`), or refuse (fork) where the stored entries run past the latest checkpoint."""
    from govtrain.ledger.entries import run_entry
    from govtrain.release.artifact import adapter_sha256
    from govtrain.train.config import load_run_config
    from govtrain.train.loop import train

    _admit(corpus, "pub")
    config = load_run_config(_config(corpus, tiny_model, 8))
    with pytest.raises(KeyboardInterrupt):
        train(config, corpus.url, insecure_seed=1, checkpoint_every=1, interrupt_after_steps=3, **QUIET)
    folder = corpus.dir / "adapter"
    state = (folder / STATE).read_bytes()

    db = _db(corpus.url)
    connection = sqlite3.connect(db)
    seq, last = connection.execute("SELECT max(seq) + 1, max(time) FROM entries").fetchone()
    connection.close()
    body = run_entry(seq, last, run_id="test-run", run_nonce=_nonce(corpus.url, "test-run"), mechanism="dpsgd",
                     config_sha256=config.sha256, base_model_sha256=hashlib.sha256(b"any").digest(),
                     adapter_sha256=adapter_sha256(folder), device="cpu", precision="fp32")
    _sql(db, "INSERT INTO entries (seq, kind, time, leaf_hash, body) VALUES (?, ?, ?, ?, ?)",
         params=(seq, "run", last, ledger_store.leaf_hash(body), body))

    with pytest.raises(GovtrainError) as info:
        train(config, corpus.url, insecure_seed=1, **QUIET)
    assert info.value.exit_code != 5  # not "finished, budgets ran out": a forged entry is an integrity failure
    assert (folder / STATE).read_bytes() == state and not (folder / "README.md").exists()


# -- 3. a link planted at the state's temporary: the run state (its sampling key) is written through it ------------

def test_a_link_planted_at_the_state_temporary_is_not_written_through(corpus: Corpus, tiny_model: Path,
                                                                       tmp_path: Path):
    """Adversary: someone who can write the output folder between a kill and the resume (a kill leaves
    `run-state.safetensors.tmp` behind routinely, so a file there is expected).

    Defect: `_save_state` opened `run-state.pt.tmp` with O_CREAT|O_TRUNC and no O_NOFOLLOW (and `os.chmod`
    follows links): a symbolic link planted there makes the resumed run write its state, sampling key included,
    into the link's target (any file the run's user can write, truncated), and `os.replace` then installs the link
    itself as `run-state.pt`, so later reads follow it too. `write_card` already unlinks a planted README.md link;
    the state's temporary is not. Fix: unlink the temporary first and open it with O_EXCL|O_NOFOLLOW."""
    from govtrain.train.config import load_run_config
    from govtrain.train.loop import train

    _admit(corpus, "pub")
    config = load_run_config(_config(corpus, tiny_model, 6))
    with pytest.raises(KeyboardInterrupt):
        train(config, corpus.url, insecure_seed=1, checkpoint_every=1, interrupt_after_steps=2, **QUIET)
    folder = corpus.dir / "adapter"
    target = tmp_path / "elsewhere.txt"
    target.write_bytes(b"a file of the run's user, outside its folder\n")
    (folder / (STATE + ".tmp")).unlink(missing_ok=True)
    (folder / (STATE + ".tmp")).symlink_to(target)

    try:
        train(config, corpus.url, insecure_seed=1, interrupt_after_steps=1, **QUIET)  # resumes, saves, is killed
    except (KeyboardInterrupt, GovtrainError):
        pass
    assert target.read_bytes() == b"a file of the run's user, outside its folder\n"
    assert not (folder / STATE).is_symlink()
