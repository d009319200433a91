"""The prefix rule of a causal LM's selection check (`govtrain.data.rows.PrefixIndex`, review 3, F7): its cost on
an admitted corpus and an evaluation set of realistic size.

    .venv/bin/python bench/selection_prefix.py [--admitted 12000] [--eval 2000] [--repeats 5] [--seed 0]

The rows are token ids, as the check sees them once a tokenizer has run (tokenizing is the check's other cost
and is not measured here). Admitted rows are 16 to 512 tokens from a 32,000-token vocabulary; a third of them
open with one shared 24-token "system prompt" and a third with one of 50 shared 6-token openings (each followed
by 16 tokens or more of its own), so that the searches walk long common prefixes as chat and instruction data
make them. The evaluation set is one quarter each: held-out rows with the same openings, admitted rows with one
token appended, admitted rows cut to their first 8 to 40 tokens ("is" where that is the whole row), and
held-out rows of 4 to 7 tokens that are admitted openings (below `MIN_PREFIX`, accepted).

Prints, medians over --repeats (wall-clock on this shared 2-core VM varies by tens of percent):
  1. building the index (sorting the admitted rows);
  2. matching every evaluation row, in total and per row, and how many were refused by which rule;
  3. the same verdicts checked against a brute-force oracle on a sample of 200 evaluation rows.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from govtrain.data.rows import MIN_PREFIX, PrefixIndex

VOCAB = 32_000


def corpus(rng: random.Random, admitted: int, evaluated: int) -> tuple[dict[tuple[int, ...], str], list[tuple]]:
    system = tuple(rng.randrange(VOCAB) for _ in range(24))
    openings = [tuple(rng.randrange(VOCAB) for _ in range(6)) for _ in range(50)]

    def text() -> tuple[int, ...]:
        kind = rng.randrange(3)
        head = system if kind == 0 else rng.choice(openings) if kind == 1 else ()
        return head + tuple(rng.randrange(VOCAB) for _ in range(rng.randint(16, 512 - len(head))))

    rows = {text(): f"c{i % 40}" for i in range(admitted)}
    listed = list(rows)
    quarter = evaluated // 4
    held = [text() for _ in range(quarter)]
    appended = [rng.choice(listed) + (rng.randrange(VOCAB),) for _ in range(quarter)]
    cut = [row[:rng.randint(MIN_PREFIX, 40)] for row in rng.sample(listed, quarter)]
    short = [row[:rng.randint(4, MIN_PREFIX - 1)] for row in rng.sample(listed, evaluated - 3 * quarter)]
    return rows, held + appended + cut + short


def oracle(rows: dict[tuple[int, ...], str], row: tuple[int, ...]) -> str | None:
    """The rule read literally: every admitted row against `row`, both ways."""
    if any(row[:len(a)] == a for a in rows):
        return "starts with"
    if len(row) >= MIN_PREFIX and any(a[:len(row)] == row for a in rows):
        return "is the start of"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--admitted", type=int, default=12_000)
    parser.add_argument("--eval", type=int, default=2_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    rows, evaluated = corpus(rng, args.admitted, args.eval)
    tokens = sum(map(len, rows))
    print(f"admitted: {len(rows)} rows, {tokens} tokens (mean {tokens / len(rows):.0f}); "
          f"evaluation: {len(evaluated)} rows, {sum(map(len, evaluated))} tokens")

    builds, matches = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        index = PrefixIndex.of(rows)
        builds.append(time.perf_counter() - start)
        start = time.perf_counter()
        verdicts = [index.match(row) for row in evaluated]
        matches.append(time.perf_counter() - start)
    build, match = statistics.median(builds), statistics.median(matches)
    counts: dict[str, int] = {}
    for verdict in verdicts:
        how = "accepted" if verdict is None else verdict[0]
        counts[how] = counts.get(how, 0) + 1
    print(f"1. build the index: {build * 1e3:.1f} ms")
    print(f"2. match {len(evaluated)} rows: {match * 1e3:.1f} ms ({match / len(evaluated) * 1e6:.1f} us/row); "
          + ", ".join(f"{how}: {n}" for how, n in sorted(counts.items())))

    sample = random.Random(args.seed + 1).sample(range(len(evaluated)), min(200, len(evaluated)))
    start = time.perf_counter()
    expected = {i: oracle(rows, evaluated[i]) for i in sample}
    brute = (time.perf_counter() - start) / len(sample)
    agree = sum((verdicts[i] is None) == (expected[i] is None) and
                (verdicts[i] is None or verdicts[i][0] in ("is", expected[i])) for i in sample)
    print(f"3. brute-force oracle on {len(sample)} rows: {agree} of {len(sample)} verdicts agree "
          f"(oracle {brute * 1e3:.1f} ms/row, {brute * len(evaluated):.1f} s for all {len(evaluated)})")
    if agree != len(sample):
        raise SystemExit("the index and the oracle disagree")


if __name__ == "__main__":
    main()
