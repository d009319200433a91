"""Data formats and the digest an attestation binds: JSON Lines, CSV, Parquet and datasets directories.

The tree hash is checked against its written specification (docs/data.md), for stability under
the order files were written in, and for a change with any byte; every format is attested, admitted and
refused on a changed byte with the ledger untouched; training matches files and directories by digest and
reads RUN.toml's column names.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from govtrain.attest.attest import attest  # noqa: E402
from govtrain.cli.main import cli  # noqa: E402
from govtrain.data import (TREE_DOMAIN, BadData, data_rows, inspect_data, read_data,  # noqa: E402
                           require_columns, tree_sha256)
from govtrain.errors import AdmissionError, Code, ConfigError  # noqa: E402
from govtrain.gate.admission import admit  # noqa: E402
from govtrain.tasks import Classification  # noqa: E402
from govtrain.train.data import load_examples  # noqa: E402
from tests.conftest import Corpus, snapshot  # noqa: E402

REVIEWS = [("a fine film", 1), ("dull, and long", 0), ('he said "no"\nthen left', 0), ("great fun", 1)]


# -- builders ------------------------------------------------------------------------------


def _csv(path: Path, columns=("review", "stars"), rows=REVIEWS) -> Path:
    import csv

    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(columns)
        writer.writerows(rows)
    return path


def _parquet(path: Path, columns=("review", "stars"), rows=REVIEWS) -> Path:
    table = pa.table({columns[0]: [r[0] for r in rows], columns[1]: pa.array([r[1] for r in rows], pa.int64())})
    pq.write_table(table, path)
    return path


def _stream(table) -> bytes:  # type: ignore[no-untyped-def]
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def _hand_dataset(path: Path, shards: list[list[tuple[str, int]]], order: list[int] | None = None,
                  columns=("review", "stars")) -> Path:
    """The save_to_disk layout written by hand: Arrow IPC stream shards, state.json, dataset_info.json."""
    path.mkdir(parents=True)
    names = [f"data-{i:05d}-of-{len(shards):05d}.arrow" for i in range(len(shards))]
    for name, rows in zip(names, shards):
        table = pa.table({columns[0]: [r[0] for r in rows], columns[1]: pa.array([r[1] for r in rows], pa.int64())})
        (path / name).write_bytes(_stream(table))
    listed = [names[i] for i in (order if order is not None else range(len(names)))]
    (path / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in listed],
                                                 "_fingerprint": "0", "_split": None}, indent=2))
    (path / "dataset_info.json").write_text(json.dumps({"features": {}}))
    return path


@pytest.fixture(scope="module")
def saved_dataset(tmp_path_factory) -> Path:
    """A real `Dataset.save_to_disk` directory, three shards, built by `datasets` itself."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    datasets = pytest.importorskip("datasets")
    rows = [(f"review {i}", i % 2) for i in range(10)]
    folder = tmp_path_factory.mktemp("saved") / "reviews"
    datasets.Dataset.from_dict({"review": [r[0] for r in rows], "stars": [r[1] for r in rows]}).save_to_disk(
        str(folder), num_shards=3)
    return folder


def _attest(corpus: Corpus, data: Path, **kwargs) -> bytes:
    cose, _ = attest(data, key=corpus.attester_key, contributor="carol", data_class="public", clip_norm="1",
                     noise_multiplier="1", eps_budget="1", valid_days=7, now=corpus.now, **kwargs)
    return cose


def _spec_tree_hash(root: Path) -> bytes:
    """The tree hash of docs/data.md, written from the specification alone."""
    entries = []
    for dirpath, _, filenames in os.walk(root):
        for filename in filenames:
            full = Path(dirpath) / filename
            entries.append((full.relative_to(root).as_posix().encode(), hashlib.sha256(full.read_bytes()).digest()))
    body = b"".join(path + b"\x00" + digest for path, digest in sorted(entries))
    return hashlib.sha256(b"govtrain-tree-v1\x00" + body).digest()


# -- the tree hash -------------------------------------------------------------------------


def _tree(root: Path, files: dict[str, bytes], order: list[str]) -> Path:
    for name in order:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(files[name])
    return root


TREE_FILES = {"b.arrow": b"\x00\x01second", "a.arrow": b"first", "sub/z.bin": b"deep", ".hidden": b"",
              "a/b": b"slash sorts after dot", "a.b": b"dot"}


def test_tree_hash_is_stable_under_file_order_and_matches_its_specification(tmp_path: Path):
    one = _tree(tmp_path / "one", TREE_FILES, sorted(TREE_FILES))
    two = _tree(tmp_path / "two", TREE_FILES, sorted(TREE_FILES, reverse=True))
    digest = read_data(one).sha256
    assert digest == read_data(two).sha256 == _spec_tree_hash(one) == tree_sha256(TREE_FILES)
    # Pinned (recomputed with printf, sha256sum and xxd): a change to the specification must be deliberate.
    assert digest.hex() == "8b50bdf1d14798c36095f855da751fe15ef87572fd993b03215fc34a1213acc7"
    (two / "empty-dir").mkdir()  # a directory holds no bytes: neither bound nor read
    assert read_data(two).sha256 == digest


def test_tree_hash_changes_with_any_byte_any_name_and_any_added_file(tmp_path: Path):
    root = _tree(tmp_path / "t", TREE_FILES, list(TREE_FILES))
    base = read_data(root).sha256
    seen = {base}
    for name, content in TREE_FILES.items():
        for index in range(len(content)):
            changed = bytearray(content)
            changed[index] ^= 0x01
            (root / name).write_bytes(bytes(changed))
            seen.add(read_data(root).sha256)
            (root / name).write_bytes(content)
    flips = sum(len(c) for c in TREE_FILES.values())
    assert len(seen) == flips + 1 and read_data(root).sha256 == base
    (root / "a.arrow").rename(root / "c.arrow")
    assert read_data(root).sha256 not in seen
    (root / "c.arrow").rename(root / "a.arrow")
    (root / ".DS_Store").write_bytes(b"")  # hidden files are bound like any other
    assert read_data(root).sha256 not in seen


def test_a_file_can_never_carry_a_tree_hash(tmp_path: Path):
    root = _tree(tmp_path / "t", {"x.arrow": b"x"}, ["x.arrow"])
    encoding = TREE_DOMAIN + b"x.arrow\x00" + hashlib.sha256(b"x").digest()
    impostor = tmp_path / "impostor.csv"
    impostor.write_bytes(encoding)
    assert hashlib.sha256(encoding).digest() == read_data(root).sha256  # same digest: refused as data
    summary = inspect_data(impostor)
    assert summary.problem is not None and "tree-hash domain prefix" in summary.problem
    for suffix in (".jsonl", ".parquet"):
        assert "tree-hash domain prefix" in inspect_data(impostor.rename(impostor.with_suffix(suffix))).problem
        impostor = impostor.with_suffix(suffix)


def _plant_file_link(root: Path, outside: Path) -> None:
    (root / "link.arrow").symlink_to(outside)


def _plant_directory_link(root: Path, outside: Path) -> None:
    (root / "sub").mkdir()
    (root / "sub" / "up").symlink_to(outside.parent, target_is_directory=True)


def _plant_fifo(root: Path, outside: Path) -> None:
    os.mkfifo(root / "pipe")  # opened without blocking, then refused


def _plant_non_utf8_name(root: Path, outside: Path) -> None:
    with open(os.fsencode(root) + b"/\xff.arrow", "wb") as handle:
        handle.write(b"y")


@pytest.mark.parametrize("plant", [_plant_file_link, _plant_directory_link, _plant_fifo, _plant_non_utf8_name])
def test_links_special_files_and_odd_names_are_refused(tmp_path: Path, plant):
    root = _tree(tmp_path / "t", {"data.arrow": b"x"}, ["data.arrow"])
    outside = tmp_path / "outside.arrow"
    outside.write_bytes(b"secret")
    plant(root, outside)
    with pytest.raises(ConfigError) as e:
        read_data(root)
    assert e.value.code is Code.BAD_DATA and "nothing was digested" in e.value.detail
    with pytest.raises(AdmissionError) as e:
        inspect_data(root)
    assert e.value.code is Code.BAD_DATA


def test_a_tree_without_files_is_refused_and_data_itself_may_be_a_link(tmp_path: Path):
    root = _tree(tmp_path / "t", {"data.arrow": b"x"}, ["data.arrow"])
    (tmp_path / "alias").symlink_to(root, target_is_directory=True)
    assert read_data(tmp_path / "alias").sha256 == read_data(root).sha256 == tree_sha256({"data.arrow": b"x"})
    (root / "data.arrow").unlink()
    (root / "empty").mkdir()
    with pytest.raises(ConfigError) as e:
        read_data(root)
    assert e.value.code is Code.BAD_DATA and "no file" in e.value.detail


# -- formats -------------------------------------------------------------------------------


def test_csv_rows_where_and_integer_columns(tmp_path: Path):
    path = _csv(tmp_path / "r.csv")
    rows = list(data_rows(read_data(path), integer_columns=("stars",)))
    assert [r for _, r in rows] == [{"review": t, "stars": s} for t, s in REVIEWS]
    assert [w for w, _ in rows] == ["r.csv:2", "r.csv:3", "r.csv:4", "r.csv:6"]  # a record starts on its line
    assert {type(r["stars"]) for _, r in data_rows(read_data(path))} == {str}  # CSV cells are text otherwise
    path.write_bytes("\ufeffreview,stars\r\n\r\n12,-3\r\nx,+1\r\ny,1.0\r\n".encode())
    rows = list(data_rows(read_data(path), integer_columns=("stars",)))
    assert [r for _, r in rows] == [{"review": "12", "stars": -3}, {"review": "x", "stars": "+1"},
                                    {"review": "y", "stars": "1.0"}]
    assert inspect_data(path).records == 3


@pytest.mark.parametrize("content,problem", [
    (b"review,stars\na,1\nb,0,extra\n", "r.csv:3: 3 fields, the header has 2"),
    (b"review,review\na,1\n", "r.csv:1: the header row names a column twice"),
    (b"review,\na,1\n", "r.csv:1: the header row has an empty column name"),
    (b"review,stars\na,1\n\xff,0\n", "r.csv:3: not UTF-8"),
    (b'review,stars\n"a"x,1\n', "r.csv:2: not CSV"),
])
def test_bad_csv_names_its_first_bad_record(tmp_path: Path, content: bytes, problem: str):
    path = tmp_path / "r.csv"
    path.write_bytes(content)
    summary = inspect_data(path)
    assert summary.problem is not None and summary.problem.startswith(problem), summary.problem
    assert summary.sha256 == hashlib.sha256(content).digest()


def test_parquet_and_json_lines_suffixes(tmp_path: Path):
    path = _parquet(tmp_path / "r.parquet")
    rows = list(data_rows(read_data(path)))
    assert [r for _, r in rows] == [{"review": t, "stars": s} for t, s in REVIEWS]
    assert rows[0][0] == "r.parquet:row 1" and inspect_data(path).records == 4
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    assert inspect_data(path).problem.startswith("r.parquet: not a readable Parquet file")
    for suffix in (".json", ".ndjson", ".JSONL"):
        lines = tmp_path / f"r{suffix}"
        lines.write_text('{"a": 1}\n\n{"a": 2}\n')
        assert inspect_data(lines).records == 2 and inspect_data(lines).problem is None
    other = tmp_path / "r.txt"
    other.write_text('{"a": 1}\n')
    summary = inspect_data(other)
    assert summary.problem.startswith("r.txt: unknown data format '.txt'")
    assert summary.sha256 == hashlib.sha256(b'{"a": 1}\n').digest()


def test_a_saved_dataset_reads_in_state_json_order(saved_dataset: Path):
    rows = list(data_rows(read_data(saved_dataset)))
    assert [r for _, r in rows] == [{"review": f"review {i}", "stars": i % 2} for i in range(10)]
    assert [w for w, _ in rows][::9] == ["reviews:row 1", "reviews:row 10"]
    assert inspect_data(saved_dataset).records == 10


def test_hand_built_dataset_layout(tmp_path: Path):
    shards = [[("one", 1), ("two", 0)], [("three", 1)]]
    root = _hand_dataset(tmp_path / "ds", shards, order=[1, 0])
    rows = list(data_rows(read_data(root)))
    assert [r["review"] for _, r in rows] == ["three", "one", "two"]  # state.json's order, not the names'
    assert [w for w, _ in rows] == ["ds:row 1", "ds:row 2", "ds:row 3"]
    (root / "cache-0123.arrow").write_bytes(_stream(pa.table({"review": ["smuggled"], "stars": [1]})))
    assert [r["review"] for _, r in data_rows(read_data(root))] == ["three", "one", "two"]  # bound, never read


@pytest.mark.parametrize("state,problem", [
    ({"_data_files": [{"filename": "../outside.arrow"}]}, "not a file of the directory"),
    ({"_data_files": [{"filename": "/etc/passwd"}]}, "not a file of the directory"),
    ({"_data_files": [{"filename": "./data-00000-of-00001.arrow"}]}, "not a file of the directory"),
    ({"_data_files": [{"filename": "data-00000-of-00001.arrow"}] * 2}, "twice"),
    ({"_data_files": []}, "non-empty list"),
    ({"_data_files": ["data-00000-of-00001.arrow"]}, "{\"filename\": str}"),
    ([], "not a JSON object"),
])
def test_a_state_json_that_reaches_outside_or_repeats_is_refused(tmp_path: Path, state, problem: str):
    root = _hand_dataset(tmp_path / "ds", [[("one", 1)]])
    (tmp_path / "outside.arrow").write_bytes(_stream(pa.table({"review": ["outside"], "stars": [0]})))
    (root / "state.json").write_text(json.dumps(state))
    summary = inspect_data(root)
    assert summary.problem is not None and problem in summary.problem and summary.problem.startswith("ds/state.json")


def test_dataset_dict_and_plain_directories_are_refused(tmp_path: Path):
    split = _hand_dataset(tmp_path / "dd" / "train", [[("one", 1)]])
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    assert "a DatasetDict directory; attest one split's directory" in inspect_data(tmp_path / "dd").problem
    assert inspect_data(split).problem is None
    (split / "state.json").unlink()
    assert "not a datasets save_to_disk directory" in inspect_data(split).problem
    _hand_dataset(tmp_path / "broken", [[("one", 1)]])
    (tmp_path / "broken" / "data-00000-of-00001.arrow").write_bytes(b"not arrow")
    assert inspect_data(tmp_path / "broken").problem.startswith("broken/data-00000-of-00001.arrow: not a readable "
                                                                "Arrow stream")


# -- attest and the gate -------------------------------------------------------------------


def _flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


def _formats(tmp_path: Path, saved: Path) -> dict[str, Path]:
    dataset = tmp_path / "reviews"
    shutil.copytree(saved, dataset)
    return {"csv": _csv(tmp_path / "r.csv"), "parquet": _parquet(tmp_path / "r.parquet"), "dataset": dataset}


@pytest.mark.parametrize("kind,records", [("csv", 4), ("parquet", 4), ("dataset", 10)])
def test_every_format_is_attested_and_admitted_from_the_command_line(corpus: Corpus, saved_dataset: Path,
                                                                      tmp_path: Path, kind: str, records: int):
    data = _formats(tmp_path, saved_dataset)[kind]
    cose = tmp_path / f"{kind}.cose"
    result = CliRunner().invoke(cli, ["attest", str(data), "--key", str(corpus.attester_key), "--contributor", "c",
                                      "--class", "public", "--clip-norm", "1", "--noise-multiplier", "1",
                                      "--eps-budget", "1", "--valid-days", "7", "--out", str(cose), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["records"] == records
    result = CliRunner().invoke(cli, ["admit", str(cose), "--data", str(data), "--ledger", corpus.url, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["records"] == records and snapshot(corpus.url)[2] == 1


@pytest.mark.parametrize("kind,change", [
    ("csv", lambda p: p.write_bytes(p.read_bytes().replace(b"great fun", b"great fuN"))),  # one CSV cell
    ("parquet", lambda p: _flip(p, len(p.read_bytes()) // 2)),
    ("dataset", lambda p: _flip(p / "data-00001-of-00003.arrow", len((p / "data-00001-of-00003.arrow")
                                                                      .read_bytes()) - 40)),
    ("dataset", lambda p: _flip(p / "dataset_info.json", 3)),  # a file never read is bound all the same
    ("dataset", lambda p: (p / ".DS_Store").write_bytes(b"\0")),
    ("dataset", lambda p: (p / "data-00001-of-00003.arrow").rename(p / "data-00001-of-00003.arrow.moved")),
])
def test_a_changed_byte_is_digest_mismatch_and_the_ledger_is_unchanged(corpus: Corpus, saved_dataset: Path,
                                                                        tmp_path: Path, kind: str, change):
    data = _formats(tmp_path, saved_dataset)[kind]
    cose = _attest(corpus, data)
    before = snapshot(corpus.url)
    change(data)
    path = tmp_path / "a.cose"
    path.write_bytes(cose)
    result = CliRunner().invoke(cli, ["admit", str(path), "--data", str(data), "--ledger", corpus.url, "--json"])
    assert result.exit_code == 3 and json.loads(result.stdout)["code"] == "digest_mismatch", result.output
    assert result.stderr.startswith("error[digest_mismatch]: ") and result.stderr.count("\n") == 1
    assert snapshot(corpus.url) == before


def test_a_link_planted_in_an_attested_directory_is_refused_and_nothing_is_written(corpus: Corpus, tmp_path: Path):
    root = _hand_dataset(tmp_path / "ds", [[("one", 1), ("two", 0)]])
    cose = _attest(corpus, root)
    before = snapshot(corpus.url)
    (root / "extra.arrow").symlink_to(tmp_path / "elsewhere.arrow")
    with corpus.open() as ledger, pytest.raises(AdmissionError) as e:
        admit(ledger, cose, root, now=corpus.now)
    assert e.value.code is Code.BAD_DATA and "symbolic link" in e.value.detail
    assert snapshot(corpus.url) == before
    with pytest.raises(ConfigError) as e:
        _attest(corpus, root)
    assert e.value.code is Code.BAD_DATA


def test_batch_admit_takes_dataset_directories(corpus: Corpus, tmp_path: Path):
    batch = tmp_path / "batch"
    batch.mkdir()
    (batch / "one.cose").write_bytes(_attest(corpus, _hand_dataset(batch / "one", [[("a", 1)]]), contribution_id="one"))
    (batch / "two.csv.cose").write_bytes(_attest(corpus, _csv(batch / "two.csv"), contribution_id="two"))
    result = CliRunner().invoke(cli, ["admit", "--batch", str(batch), "--ledger", corpus.url, "--json"])
    assert result.exit_code == 0, result.output
    assert [r["records"] for r in json.loads(result.stdout)["results"]] == [1, 4]


# -- training: matched by digest, columns from RUN.toml ------------------------------------


def test_load_examples_matches_files_and_directories_and_reads_renamed_columns(saved_dataset: Path, tmp_path: Path):
    folder = tmp_path / "data"
    folder.mkdir()
    entries = _formats(folder, saved_dataset)
    _hand_dataset(folder / "stranger", [[("not admitted", 1)]])
    (folder / "linked").mkdir()
    (folder / "linked" / "state.json").symlink_to(saved_dataset / "state.json")
    digests = {read_data(p).sha256: name for name, p in entries.items()}
    task = Classification(num_labels=2, text_column="review", label_column="stars")
    examples = load_examples(folder, digests, task, records={"csv": 4, "parquet": 4, "dataset": 10},
                             integer_columns=("stars",))
    assert len(examples) == 18 and examples.missing == []
    assert examples.unmatched_files == ["linked/", "stranger/"]
    by_owner = {o: [e for e, owner in zip(examples.items, examples.owner) if owner == o] for o in digests.values()}
    assert [(e.text, e.label) for e in by_owner["csv"]] == REVIEWS == [(e.text, e.label) for e in by_owner["parquet"]]
    assert [(e.text, e.label) for e in by_owner["dataset"]] == [(f"review {i}", i % 2) for i in range(10)]
    with pytest.raises(ConfigError) as e:  # without the label column's integers, CSV labels stay text
        load_examples(folder, digests, task, records={"csv": 4, "parquet": 4, "dataset": 10})
    assert e.value.code is Code.BAD_DATA and e.value.detail.startswith("r.csv:2: ")


@pytest.mark.parametrize("kind,where", [("csv", "r.csv:2"), ("parquet", "r.parquet:row 1"),
                                        ("dataset", "reviews:row 1")])
def test_a_missing_column_is_one_bad_data_line_naming_the_row_and_column(saved_dataset: Path, tmp_path: Path,
                                                                         kind: str, where: str):
    folder = tmp_path / "data"
    folder.mkdir()
    entry = _formats(folder, saved_dataset)[kind]
    task = Classification(num_labels=2, text_column="review", label_column="rating")
    with pytest.raises(ConfigError) as e:
        load_examples(folder, {read_data(entry).sha256: "c"}, task, integer_columns=("rating",))
    assert e.value.code is Code.BAD_DATA and e.value.line().count("\n") == 0
    assert e.value.detail == (f"{where}: no column 'rating' (the row has 'review', 'stars'); [data] in RUN.toml "
                              "names the columns to read")


def test_bytes_read_as_another_format_than_attested_are_refused(tmp_path: Path):
    attested = tmp_path / "attested.jsonl"
    attested.write_bytes(b"{}\n{}\n{}\n")  # three empty objects; read as CSV, a header and two rows
    assert inspect_data(attested).records == 3
    folder = tmp_path / "data"
    folder.mkdir()
    shutil.copy(attested, folder / "renamed.csv")
    with pytest.raises(ConfigError) as e:
        load_examples(folder, {read_data(attested).sha256: "c"}, Classification(num_labels=2), records={"c": 3})
    assert e.value.code is Code.BAD_DATA and "2 records read, the attestation of c declares 3" in e.value.detail


def test_a_bad_record_found_in_training_is_bad_data(tmp_path: Path):
    folder = tmp_path / "data"
    folder.mkdir()
    path = folder / "r.csv"
    path.write_bytes(b"text,label\nfine,1\nragged\n")
    with pytest.raises(ConfigError) as e:
        load_examples(folder, {read_data(path).sha256: "c"}, Classification(num_labels=2), integer_columns=("label",))
    assert (e.value.code, e.value.detail) == (Code.BAD_DATA, "r.csv:3: 1 fields, the header has 2")
    with pytest.raises(BadData):
        list(data_rows(read_data(path)))


def test_require_columns_names_the_first_missing_column_and_what_the_row_has():
    require_columns({"a": 1, "b": 2}, ("b", "a"), "x.csv:2")
    wide = {f"c{i:02d}": i for i in range(10)}
    for row, detail in (({}, "x.csv:2: no column 'a' (the row has none)"),
                        ({"a": 1}, "x.csv:2: no column 'b' (the row has 'a')"),
                        (wide, "x.csv:2: no column 'a' (the row has 'c00', 'c01', 'c02', 'c03', 'c04', 'c05', 'c06', "
                               "'c07', …)")):
        with pytest.raises(ConfigError) as e:
            require_columns(row, ("a", "b"), "x.csv:2")
        assert e.value.code is Code.BAD_DATA and e.value.detail.startswith(detail), e.value.detail


def test_a_pretty_printed_json_array_is_told_the_format(tmp_path: Path):
    data = tmp_path / "reviews.json"
    data.write_text(json.dumps([{"text": "fine", "label": 1}], indent=2))
    summary = inspect_data(data)
    assert summary.problem.startswith("reviews.json:1: not JSON") and "one object per line" in summary.problem
