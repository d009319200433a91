"""Issue 34, item 3: a planted run state ran code inside `govtrain train`.

Adversary: someone who can write the run's output folder between a kill and the resume (the crash review's), or
before a fresh run starts. `Run._load_state` called `torch.load(<output>/run-state.pt, weights_only=False)` whenever
the file existed, a fresh run included: a pickle whose `__reduce__` calls a function wrote a marker file from inside
the training process (it could as well read the ledger key, or skip charges), and the config-hash check refused only
afterwards.

Fixed: the run state is `run-state.safetensors` (tensors in safetensors, the rest in typed canonical JSON:
`govtrain/train/state_file.py`), read only if it is a regular file of this user's with mode 0600, and strictly. An
earlier govtrain's `run-state.pt` is refused unread (`run_state_unsafe`). In every case the marker is never
written, the ledger and the folder are unchanged, and the refusal is one line with its code. The format's own
vectors: tests/test_state_file.py."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from click.testing import CliRunner  # noqa: E402

from govtrain.cli.main import cli  # noqa: E402
from govtrain.errors import GovtrainError  # noqa: E402
from tests.conftest import Corpus, snapshot  # noqa: E402
from tests.test_train import _admit, _config, tiny_model  # noqa: E402,F401

LEGACY = "run-state.pt"  # an earlier govtrain's name (a pickle); today's: `state_file.STATE_FILE`
QUIET = dict(log=lambda line: None)


def _payload(marker: str) -> dict:
    """What the planted pickle calls when it is unpickled: a write of its own (it could be anything)."""
    Path(marker).write_text("code from the run state ran inside the training process\n")
    return {}


class _Planted:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return _payload, (self.marker,)


def _plant(path: Path, marker: Path) -> None:
    """A pickle with a `__reduce__` payload at `path`, in torch.save's own format, 0600 and owned by the run's user:
    everything about it but its contents is as a run state's."""
    path.unlink(missing_ok=True)
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as handle:
        torch.save(_Planted(marker), handle)


def _files(folder: Path) -> dict[str, tuple[str, bytes | str, int]]:
    """Every entry of `folder`: its kind, its bytes (a link: its target) and its mode."""
    found = {}
    for p in sorted(folder.rglob("*")):
        st = p.lstat()
        if p.is_symlink():
            found[p.name] = ("link", os.readlink(p), stat.S_IMODE(st.st_mode))
        elif p.is_file():
            found[p.name] = ("file", p.read_bytes(), stat.S_IMODE(st.st_mode))
        else:
            found[p.name] = ("other", "", stat.S_IMODE(st.st_mode))
    return found


def _killed(corpus: Corpus, model: Path):  # type: ignore[no-untyped-def]
    """A run stopped after two steps: its spend written, its state saved in `<output>`."""
    from govtrain.train.config import load_run_config
    from govtrain.train.loop import train

    _admit(corpus, "pub")
    config = load_run_config(_config(corpus, model, 4))
    with pytest.raises(KeyboardInterrupt):
        train(config, corpus.url, insecure_seed=1, checkpoint_every=1, interrupt_after_steps=2, **QUIET)
    return config


def _refused(corpus: Corpus, config, code: str,  # type: ignore[no-untyped-def]
             marker: Path | None = None) -> GovtrainError:
    """Train `config` again: refused with `code`, the marker never written, the ledger and the folder unchanged."""
    from govtrain.train.loop import train

    before, files = snapshot(corpus.url), _files(config.output_dir)
    with pytest.raises(GovtrainError) as refused:
        train(config, corpus.url, insecure_seed=1, **QUIET)
    assert marker is None or not marker.exists(), "the planted run state ran code inside the training process"
    assert refused.value.code.value == code, refused.value.line()
    assert "\n" not in refused.value.line()
    assert snapshot(corpus.url) == before and _files(config.output_dir) == files
    return refused.value


# -- 1. a pickle planted where an earlier govtrain kept its run state is never read --------------------------------

@pytest.mark.parametrize("via", ["train()", "govtrain train"])
def test_a_pickle_planted_in_a_fresh_runs_folder_is_refused_unread(corpus: Corpus, tiny_model: Path, tmp_path: Path,
                                                                   via: str):
    """The review's proof: a fresh run, its output folder holding only a planted `run-state.pt`."""
    from govtrain.train.config import load_run_config
    from govtrain.train.loop import train

    _admit(corpus, "pub")
    path = _config(corpus, tiny_model, 4)
    config = load_run_config(path)
    config.output_dir.mkdir()
    marker = tmp_path / "marker.txt"
    _plant(config.output_dir / LEGACY, marker)
    before, files = snapshot(corpus.url), _files(config.output_dir)
    if via == "train()":
        with pytest.raises(GovtrainError) as refused:
            train(config, corpus.url, insecure_seed=1, **QUIET)
        assert not marker.exists(), "the planted run state ran code inside the training process"
        line = refused.value.line()
    else:
        result = CliRunner().invoke(cli, ["train", "--config", str(path), "--ledger", corpus.url])
        assert not marker.exists(), "the planted run state ran code inside `govtrain train`"
        assert result.exit_code == 2, result.output
        line = result.stderr.strip()
    assert line.startswith("error[run_state_unsafe]: ") and "\n" not in line and LEGACY in line, line
    assert snapshot(corpus.url) == before and _files(config.output_dir) == files


def test_a_pickle_planted_over_a_killed_runs_state_is_refused_unread(corpus: Corpus, tiny_model: Path,
                                                                     tmp_path: Path):
    """Between a kill and the resume, the attacker writes `run-state.pt` (where an earlier govtrain kept the state:
    on main, over the killed run's own)."""
    config = _killed(corpus, tiny_model)
    marker = tmp_path / "marker.txt"
    _plant(config.output_dir / LEGACY, marker)
    _refused(corpus, config, "run_state_unsafe", marker)


def test_a_pickle_planted_as_todays_state_file_is_refused_unread(corpus: Corpus, tiny_model: Path, tmp_path: Path):
    """The same pickle over today's state file (0600, the run's user's): not a state file, and never unpickled."""
    from govtrain.train.state_file import STATE_FILE

    config = _killed(corpus, tiny_model)
    marker = tmp_path / "marker.txt"
    _plant(config.output_dir / STATE_FILE, marker)
    _refused(corpus, config, "run_state_invalid", marker)


# -- 2. a state file that is not the run's own 0600 file is refused before it is read ------------------------------

@pytest.mark.parametrize("how", ["a link", "a link to nowhere", "mode 0644", "mode 0400", "another owner", "a fifo",
                                 "a folder"])
def test_a_state_file_that_is_not_our_own_0600_file_is_refused_before_it_is_read(corpus: Corpus, tiny_model: Path,
                                                                                tmp_path: Path, how: str):
    """The killed run's own state, as it saved it, but reached through a link, of another mode, another owner, or
    replaced by a fifo or a folder: refused (`run_state_unsafe`) whatever it holds, and nothing is read from it
    (`state_file.decode` is never called)."""
    from govtrain.train import state_file

    config = _killed(corpus, tiny_model)
    path = config.output_dir / state_file.STATE_FILE
    if how == "a link":
        shutil.move(path, tmp_path / "elsewhere.safetensors")
        path.symlink_to(tmp_path / "elsewhere.safetensors")
    elif how == "a link to nowhere":
        path.unlink()
        path.symlink_to(tmp_path / "nowhere")
    elif how.startswith("mode"):
        path.chmod(int(how.split()[-1], 8))
    elif how == "another owner":
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(path, 65534, 65534)
    elif how == "a fifo":
        path.unlink()
        os.mkfifo(path, 0o600)
    else:
        path.unlink()
        path.mkdir(mode=0o700)
    decoded = []
    original = state_file.decode
    state_file.decode = lambda data, key: decoded.append(len(data)) or original(data, key)  # type: ignore[assignment]
    try:
        _refused(corpus, config, "run_state_unsafe")
    finally:
        state_file.decode = original
    assert decoded == []


def test_a_state_refused_for_its_mode_resumes_once_it_is_0600_again(corpus: Corpus, tiny_model: Path):
    """The refusal says what to do, and doing it resumes the run where it stopped."""
    from govtrain.train import state_file
    from govtrain.train.loop import train

    config = _killed(corpus, tiny_model)
    path = config.output_dir / state_file.STATE_FILE
    path.chmod(0o644)
    refused = _refused(corpus, config, "run_state_unsafe")
    assert "chmod 600" in refused.detail
    path.chmod(0o600)
    lines: list[str] = []
    assert train(config, corpus.url, insecure_seed=1, log=lines.append).steps == 4
    assert any(line.startswith("resuming test-run at step 2") for line in lines)


# -- 3. a state file edited by hand is refused ---------------------------------------------------------------------

def _edited(path: Path, how: str) -> None:
    """Rewrite the state file at `path` (0600, whole), its state's JSON edited `how`."""
    from safetensors.torch import load, save

    from govtrain.train.resume import write_whole
    from govtrain.train.state_file import FORMAT

    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    text = json.loads(data[8:8 + size])["__metadata__"]["state"]
    tree = json.loads(text)
    step = next(pair for pair in tree["map"] if pair[0] == "step")
    if how == "non-canonical JSON":
        text = json.dumps(tree, ensure_ascii=False, sort_keys=True, indent=1)
    else:
        if how == "an unknown field":
            tree["map"].append(["skip_charges", True])
        elif how == "a field of the wrong type":
            step[1] = str(step[1])
        elif how == "an unknown tag":
            step[1] = {"pickle": "80044b022e"}
        text = json.dumps(tree, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    edited = save(load(data), metadata={"format": FORMAT, "state": text})
    write_whole(path, lambda handle: handle.write(edited))


@pytest.mark.parametrize("how", ["non-canonical JSON", "an unknown field", "a field of the wrong type",
                                 "an unknown tag"])
def test_a_hand_edited_state_file_is_refused(corpus: Corpus, tiny_model: Path, how: str):
    from govtrain.train.state_file import STATE_FILE

    config = _killed(corpus, tiny_model)
    _edited(config.output_dir / STATE_FILE, how)
    _refused(corpus, config, "run_state_invalid")
