"""A contribution's data: the digest an attestation binds, and the rows a run trains on.

    data = read_data(path)                    # a file or a save_to_disk directory, read once
    data.sha256                               # file SHA-256, or the tree hash of a directory (digest.py)
    for where, row in data_rows(data): …      # plain dicts; `where` is "file.csv:12" or "dir:row 12"
    inspect_data(path)                        # digest, record count, first bad record: attest and the gate
    require_columns(row, ("text", "label"), where)   # a task's check: names the missing column

Formats by suffix: JSON Lines (.jsonl .ndjson .json), CSV (.csv), Parquet (.parquet), and a directory
written by `datasets`' `save_to_disk` (formats.py, dataset.py).
"""

from govtrain.data.columns import require_columns
from govtrain.data.contribution import DataBytes, DataSummary, data_rows, inspect_data, read_data
from govtrain.data.digest import TREE_DOMAIN, tree_sha256
from govtrain.data.formats import BadData

__all__ = ["BadData", "DataBytes", "DataSummary", "TREE_DOMAIN", "data_rows", "inspect_data", "read_data",
           "require_columns", "tree_sha256"]
