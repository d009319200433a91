"""What a resumed run trusts of its folder and its ledger (`govtrain/train/resume.py`): a file's temporary is made
anew, never written through a link or a folder planted there; a run recorded before a kill is finished only from a
signed run entry of this very config and base model, its card from the govtrain.json that was hashed.
(The proof tests of the review that found these defects: tests/test_attacks_crash_review.py.)"""

from __future__ import annotations

import shutil
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from govtrain.errors import Code, GovtrainError  # noqa: E402
from tests import run_state_keys  # noqa: E402
from govtrain.train.resume import write_whole  # noqa: E402
from govtrain.train.state_file import STATE_FILE  # noqa: E402
from govtrain.train.tune import TRIAL_CONFIG, _write_trial_config, check_tune_output  # noqa: E402
from tests.conftest import Corpus, snapshot  # noqa: E402
from tests.test_train import _admit, _config, tiny_model  # noqa: E402,F401

OUTSIDE = b"a file of the run's user, outside its folder\n"


def _write(data: bytes):  # type: ignore[no-untyped-def]
    return lambda handle: handle.write(data)


def test_a_link_at_the_temporary_is_replaced_never_written_through(tmp_path: Path):
    target = tmp_path / "elsewhere.txt"
    target.write_bytes(OUTSIDE)
    target.chmod(0o644)
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "run-state.safetensors.tmp").symlink_to(target)
    write_whole(folder / "run-state.safetensors", _write(b"state"))
    assert target.read_bytes() == OUTSIDE and stat.S_IMODE(target.stat().st_mode) == 0o644  # no chmod through it
    path = folder / "run-state.safetensors"
    assert not path.is_symlink() and path.read_bytes() == b"state" and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not (folder / "run-state.safetensors.tmp").exists()


def test_a_loose_leftover_temporary_is_made_anew_at_0600(tmp_path: Path):
    leftover = tmp_path / "run-state.safetensors.tmp"
    leftover.write_bytes(b"half a state")
    leftover.chmod(0o666)
    write_whole(tmp_path / "run-state.safetensors", _write(b"state"))
    assert stat.S_IMODE((tmp_path / "run-state.safetensors").stat().st_mode) == 0o600
    assert (tmp_path / "run-state.safetensors").read_bytes() == b"state"


def test_a_folder_at_the_temporary_is_a_coded_error_and_changes_nothing(tmp_path: Path):
    (tmp_path / "run-state.safetensors").write_bytes(b"the last checkpoint")
    (tmp_path / "run-state.safetensors.tmp").mkdir()
    (tmp_path / "run-state.safetensors.tmp" / "kept").write_bytes(b"x")
    with pytest.raises(GovtrainError) as info:
        write_whole(tmp_path / "run-state.safetensors", _write(b"state"))
    assert info.value.code is Code.OUTPUT_TAKEN
    assert (tmp_path / "run-state.safetensors").read_bytes() == b"the last checkpoint"
    assert (tmp_path / "run-state.safetensors.tmp" / "kept").read_bytes() == b"x"


def test_a_trial_config_is_not_written_through_a_link_and_a_folder_there_is_refused(tmp_path: Path):
    target = tmp_path / "elsewhere.txt"
    target.write_bytes(OUTSIDE)
    folder = tmp_path / "search"
    folder.mkdir()
    path = folder / TRIAL_CONFIG.format(k=0)
    (folder / (path.name + ".tmp")).symlink_to(target)
    _write_trial_config(path, b'{"trial": 0}')
    assert target.read_bytes() == OUTSIDE and not path.is_symlink() and path.read_bytes() == b'{"trial": 0}'

    trials = [SimpleNamespace(index=0, document=b'{"trial": 0}'), SimpleNamespace(index=1, document=b'{"trial": 1}')]
    (folder / "trial-1.json.tmp").mkdir()
    with pytest.raises(GovtrainError) as info:  # before any trial trains: the search's folder is not its own
        check_tune_output(folder, trials)  # type: ignore[arg-type]
    assert info.value.code is Code.OUTPUT_TAKEN and "trial-1.json.tmp/" in info.value.detail
    with pytest.raises(GovtrainError) as info:  # and, were it made after that check, when the trial's config is written
        _write_trial_config(folder / "trial-1.json", b'{"trial": 1}')
    assert info.value.code is Code.OUTPUT_TAKEN and not (folder / "trial-1.json").exists()


# -- a run recorded before a kill: finished only as this config's, on this base model ------------------------------

def test_a_recorded_run_is_finished_only_under_its_own_config_and_base_model(corpus: Corpus, tiny_model: Path,
                                                                              tmp_path: Path):
    from govtrain.train.config import load_run_config
    from govtrain.train.loop import train

    quiet = dict(log=lambda line: None)
    model = tmp_path / "base"
    shutil.copytree(tiny_model, model)  # its bytes change below: a copy of the module's model
    _admit(corpus, "pub")
    path_x = _config(corpus, model, 4)
    config_x = load_run_config(path_x)
    with pytest.raises(KeyboardInterrupt):
        train(config_x, corpus.url, insecure_seed=1, checkpoint_every=1, interrupt_after_steps=4, **quiet)
    adapter = corpus.dir / "adapter"
    stolen = run_state_keys.read(adapter / STATE_FILE, corpus)  # every step taken: as a kill after the entry
    train(config_x, corpus.url, insecure_seed=1, **quiet)
    card = (adapter / "README.md").read_bytes()

    # Another config under the same run id (the state's id matches it): the signed entry records X's config.
    path_c = corpus.dir / "run-c.toml"
    path_c.write_text(path_x.read_text().replace('output = "adapter"', 'output = "adapter-c"')
                      .replace("lr = 0.01", "lr = 0.02"))
    config_c = load_run_config(path_c)
    folder_c = corpus.dir / "adapter-c"
    shutil.copytree(adapter, folder_c, ignore=shutil.ignore_patterns("README.md"))
    run_state_keys.write(folder_c / STATE_FILE, {**stolen, "config_sha256": config_c.sha256}, corpus)
    before, files = snapshot(corpus.url), sorted(p.name for p in folder_c.iterdir())
    with pytest.raises(GovtrainError) as info:
        train(config_c, corpus.url, insecure_seed=1, **quiet)
    assert info.value.code is Code.OUTPUT_TAKEN and "records another config" in info.value.detail
    assert snapshot(corpus.url) == before and sorted(p.name for p in folder_c.iterdir()) == files

    # X's own state put back (a kill after its run entry, as it looks), on a base model that changed since.
    run_state_keys.write(adapter / STATE_FILE, stolen, corpus)
    (model / "notes.txt").write_text("a file more: another base model\n")
    with pytest.raises(GovtrainError) as info:
        train(config_x, corpus.url, insecure_seed=1, **quiet)
    assert info.value.code is Code.BASE_MODEL_MISMATCH
    assert snapshot(corpus.url) == before and (adapter / STATE_FILE).exists()

    # On its own base model it is finished: nothing trained or recorded, the card from the folder's govtrain.json.
    (model / "notes.txt").unlink()
    (adapter / "README.md").unlink()
    train(config_x, corpus.url, insecure_seed=1, **quiet)
    assert snapshot(corpus.url) == before and not (adapter / STATE_FILE).exists()
    assert (adapter / "README.md").read_bytes() == card
