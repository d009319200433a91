"""Attack class: hostile bytes the fuzzing found (docs/fuzzing.md#findings), each through the public entry point a
user or an attacker reaches, refused with its one-line coded error and leaving the ledger as it was.

Before the fixes each of these raised an uncoded exception (ValueError, RecursionError, TypeError,
UnicodeDecodeError) or, for the Arrow shard with an offset past its values, crashed the process. The inputs are
tests/fuzz/findings.py's, numbered as there."""

from __future__ import annotations

import base64
import shutil
from pathlib import Path

import pytest

from govtrain.attest.keys import load_private_key, load_public_key
from govtrain.data import inspect_data, read_data
from govtrain.errors import Code, GovtrainError
from govtrain.gate.admission import admit
from govtrain.ledger.checkpoint import NoteKey, sign_note
from govtrain.ledger.proof import verify_proof
from govtrain.policy.config import load_policy
from govtrain.serve.policy import load_inference_policy
from govtrain.train.config import load_run_config
from govtrain.train.data import rows_of
from govtrain.train.tune import load_grid, tune
from govtrain.verify.verifier import inspect_ledger
from tests.conftest import REPO, Corpus, snapshot
from tests.fuzz.findings import JSON_DEEP, LONG_DIGITS, PARQUET_ROWS_DECLARED, STATE, TOML_DEEP, TOML_LONG_INT, \
    arrow_column_not_utf8, arrow_offsets_past_values, proof_with_long_index

ORIGIN = "test.invalid/govtrain/1"


def _raises(code: Code, call) -> GovtrainError:  # type: ignore[no-untyped-def]
    with pytest.raises(GovtrainError) as caught:
        call()
    assert caught.value.code is code, caught.value.line()
    assert "\n" not in caught.value.line()
    return caught.value


def _latest_checkpoint(corpus: Corpus) -> str:
    with corpus.open() as ledger:
        return ledger.store.latest_checkpoint().note


def _note_key(corpus: Corpus) -> NoteKey:
    return NoteKey(ORIGIN, load_public_key(corpus.dir / "ledger.pub"))


def test_proof_index_past_the_digit_limit(corpus: Corpus) -> None:
    """Finding 1: `index 999…` (5000 digits) in a proof file is bad_proof, not a ValueError."""
    before = snapshot(corpus.url)
    text = proof_with_long_index(_latest_checkpoint(corpus)).decode()
    _raises(Code.BAD_PROOF, lambda: verify_proof(text, [_note_key(corpus)], origin=ORIGIN))
    assert snapshot(corpus.url) == before


def test_trusted_checkpoint_size_past_the_digit_limit(corpus: Corpus) -> None:
    """Finding 2: a checkpoint the ledger key signed whose size has 5000 digits, given to the verifier as trusted,
    is refused as the verifier refuses any trusted checkpoint it cannot read (fork: not this ledger's), naming the
    size line, and the ledger is untouched."""
    before = snapshot(corpus.url)
    text = f"{ORIGIN}\n{LONG_DIGITS.decode()}\n{base64.b64encode(bytes(32)).decode()}\n"
    note = sign_note(text, load_private_key(corpus.dir / "ledger.key"), ORIGIN)
    report = inspect_ledger(corpus.url, trusted_checkpoints=[note], accountant=None)
    assert report.error is not None and report.error.code is Code.FORK, report.error
    assert "at most 19 digits" in report.error.detail
    assert snapshot(corpus.url) == before


@pytest.mark.parametrize("text", [TOML_DEEP, TOML_LONG_INT, b"a = " + b"{b = " * 2000])
def test_hostile_toml_files(corpus: Corpus, tmp_path: Path, text: bytes) -> None:
    """Findings 3-6: TOML nested past the recursion limit or holding a 5000-digit integer is each loader's
    unreadable code (a run config's one code), not a RecursionError or ValueError."""
    before = snapshot(corpus.url)
    path = corpus.dir / "hostile.toml"
    path.write_bytes(text)
    _raises(Code.POLICY_UNREADABLE, lambda: load_policy(path))
    _raises(Code.RUN_CONFIG_INVALID, lambda: load_run_config(path))
    _raises(Code.GRID_INVALID, lambda: load_grid(path))
    _raises(Code.INFERENCE_POLICY_UNREADABLE, lambda: load_inference_policy(path))
    assert snapshot(corpus.url) == before


@pytest.mark.parametrize("text", [b'"\\n" = 0\n', b'[classes."a\\u001b[2Jb"]\nclip_norm = 1.0\n'])
def test_toml_key_with_a_control_character(corpus: Corpus, text: bytes) -> None:
    """Findings 14 and 15: a quoted TOML key holding a newline (or a terminal escape) is named escaped in the
    policy_invalid line: the error stays one line, and no control character reaches the terminal."""
    before = snapshot(corpus.url)
    path = corpus.dir / "keys.toml"
    path.write_bytes(text)
    error = _raises(Code.POLICY_INVALID, lambda: load_policy(path))
    assert error.line().isprintable()
    assert snapshot(corpus.url) == before


@pytest.mark.parametrize("value", ["2000-01-01", "07:32:00", "1979-05-27T07:32:00Z", "nan", "inf"])
def test_grid_value_without_a_json_form(corpus: Corpus, value: str) -> None:
    """Finding 7: a grid value that is a TOML date or time (or NaN, infinity) is grid_invalid before any trial is
    charged, not a TypeError from hashing the trial's config."""
    before = snapshot(corpus.url)
    run = corpus.dir / "run.toml"
    shutil.copy(REPO / "examples" / "run.toml", run)
    grid = corpus.dir / "grid.toml"
    grid.write_text(f'[grid]\n"optimizer.lr" = [{value}]\n[select]\ndata = "held-out.jsonl"\n')
    _raises(Code.GRID_INVALID, lambda: tune(load_run_config(run), run, load_grid(grid), corpus.url,
                                            tune_id="tune-fuzz", log=lambda _: None))
    assert snapshot(corpus.url) == before


def _dataset(folder: Path, state: bytes, shard: bytes | None) -> Path:
    folder.mkdir()
    (folder / "state.json").write_bytes(state)
    if shard is not None:
        (folder / "data-00000-of-00001.arrow").write_bytes(shard)
    return folder


@pytest.mark.parametrize("case", ["jsonl-deep", "state-deep", "column-not-utf8", "offsets-past-values",
                                  "parquet-rows-declared"])
def test_admission_of_hostile_data(corpus: Corpus, case: str) -> None:
    """Findings 8, 10, 11, 12 and 13: a contribution whose data is a JSON line nested 100000 deep, a dataset whose
    state.json is, an Arrow shard whose column name is not UTF-8, one whose string offsets point past its values, or
    a Parquet file of 3 rows whose row group declares 55 billion, signed as it is: admission refuses it with bad_data
    and records nothing."""
    if case == "parquet-rows-declared":
        data = corpus.dir / "rows.parquet"
        data.write_bytes(PARQUET_ROWS_DECLARED)
    elif case == "jsonl-deep":
        data = corpus.dir / "deep.jsonl"
        data.write_bytes(b'{"text": "x", "label": 1}\n' + JSON_DEEP + b"\n")
    elif case == "state-deep":
        data = _dataset(corpus.dir / "deep", JSON_DEEP, None)
    elif case == "column-not-utf8":
        data = _dataset(corpus.dir / "names", STATE, arrow_column_not_utf8())
    else:
        data = _dataset(corpus.dir / "offsets", STATE, arrow_offsets_past_values())
    summary = inspect_data(data)
    assert summary.problem is not None
    raw = corpus.attestation(corpus.data("placeholder.jsonl"), contribution_id=case, data_sha256=summary.sha256,
                             records=summary.records + 1)
    before = snapshot(corpus.url)
    _raises(Code.BAD_DATA, lambda: admit(corpus.open(), raw, data, now=corpus.now))
    assert snapshot(corpus.url) == before


def test_training_rows_with_an_integer_past_the_digit_limit(corpus: Corpus) -> None:
    """Finding 9: a CSV label of 5000 digits is bad_data where training reads integer labels (not a ValueError);
    the gate, which counts rows without converting them, admits nothing different."""
    data = corpus.dir / "long.csv"
    data.write_bytes(b"text,label\nx," + LONG_DIGITS + b"\n")
    before = snapshot(corpus.url)
    assert inspect_data(data).records == 1
    _raises(Code.BAD_DATA, lambda: rows_of(read_data(data), ("label",)))
    assert snapshot(corpus.url) == before
