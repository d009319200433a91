"""A Hugging Face `datasets` directory written by `Dataset.save_to_disk`, read without importing `datasets`.

Such a directory holds `state.json`, `dataset_info.json` and the shards `data-XXXXX-of-YYYYY.arrow`, each an
Arrow IPC stream. `datasets.load_from_disk` reads exactly the shards that `state.json`'s `_data_files`
lists, in that order, so that list alone decides the rows here too: every listed shard must be a file of
the tree that was hashed (a plain relative path inside the directory: no `..`, no absolute path, no link,
since the tree refuses links), named once. Other files (`dataset_info.json`, a `cache-*.arrow` left by
`map`, `.DS_Store`) are bound by the tree hash and never read. A `DatasetDict` directory (`dataset_dict.json`
and one directory per split) is refused: attest the split you mean, so that no split is trained on by
accident.
"""

from __future__ import annotations

import json
from typing import Iterator

from govtrain.data.digest import Tree
from govtrain.data.formats import BadData, Row, arrow_stream_table, table_rows

STATE_FILE = "state.json"
DICT_FILE = "dataset_dict.json"


def dataset_rows(tree: Tree, name: str) -> Iterator[Row]:
    """Rows of every shard, in `_data_files` order, numbered `name:row N` across the whole dataset."""
    number = 1
    for shard in shard_names(tree, name):
        table = arrow_stream_table(tree.files[shard], f"{name}/{shard}")
        yield from table_rows(table, name, first=number)
        number += table.num_rows


def shard_names(tree: Tree, name: str) -> list[str]:
    """The shards `state.json` lists, each checked to be a distinct file of the hashed tree."""
    state = _state(tree, name)
    listed = state.get("_data_files")
    if not isinstance(listed, list) or not listed:
        raise BadData(f"{name}/{STATE_FILE}", "_data_files must be a non-empty list of {\"filename\": …}")
    shards: list[str] = []
    for item in listed:
        filename = item.get("filename") if isinstance(item, dict) else None
        if not isinstance(filename, str):
            raise BadData(f"{name}/{STATE_FILE}", "each _data_files item must be {\"filename\": str}")
        if filename not in tree.files:
            raise BadData(f"{name}/{STATE_FILE}", f"_data_files names {filename!r}, which is not a file of the "
                                                  "directory (a plain relative path, no link)")
        if filename in shards:
            raise BadData(f"{name}/{STATE_FILE}", f"_data_files names {filename!r} twice")
        shards.append(filename)
    return shards


def _state(tree: Tree, name: str) -> dict:
    raw = tree.files.get(STATE_FILE)
    if raw is None:
        if DICT_FILE in tree.files:
            raise BadData(name, "a DatasetDict directory; attest one split's directory (e.g. "
                                f"{name}/train), each is a dataset of its own")
        raise BadData(name, f"a directory that is not a datasets save_to_disk directory (no {STATE_FILE})")
    try:
        state = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise BadData(f"{name}/{STATE_FILE}", f"not JSON ({e.__class__.__name__})") from None
    if not isinstance(state, dict):
        raise BadData(f"{name}/{STATE_FILE}", "not a JSON object")
    return state
