"""What every fuzz harness shares: the contract, the hypothesis profiles, byte mutations and the atheris runner.

The contract (issue 23 item 4): a parser of untrusted input returns, or raises a `GovtrainError` carrying a `Code`.
A crash, a hang, or any other exception is a failure. `check` applies it to one call; each `Target` names the entry
point an attacker's bytes reach, its seeds (valid documents to mutate) and the modules it exercises.

A module of tests/fuzz is run three ways:
  pytest tests/fuzz                                  hypothesis at the "ci" profile (HYPOTHESIS_PROFILE=fuzz: longer)
  python -m tests.fuzz.<module> [--target=NAME] [-atheris_runs=N] [CORPUS_DIR]   coverage-guided (atheris)
  python -m tests.fuzz.<module> --replay --target=NAME CORPUS_DIR               the corpus once (line coverage)
Without --target, atheris fuzzes every target of the module, the first input byte choosing one.
"""

from __future__ import annotations

import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from govtrain.errors import Code, GovtrainError

# -- hypothesis profiles: chosen per test by HYPOTHESIS_PROFILE, never loaded globally (other tests keep theirs) -----

settings.register_profile("ci", max_examples=120, deadline=None, derandomize=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                 HealthCheck.function_scoped_fixture])
settings.register_profile("fuzz", max_examples=1000, deadline=None, derandomize=False, database=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                 HealthCheck.function_scoped_fixture])
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")


def fuzz_settings(scale: float = 1.0) -> settings:
    """The profile's settings, `scale` times its example budget (a slow target runs fewer)."""
    profile = settings.get_profile(PROFILE if PROFILE in ("ci", "fuzz") else "ci")
    return settings(profile, max_examples=max(10, int(profile.max_examples * scale)))


class ContractViolation(AssertionError):
    """A parser raised something other than a coded `GovtrainError`: a finding."""


def check(call: Callable[[], object]) -> GovtrainError | None:
    """Run `call`; None if it returned, the error if it raised a coded `GovtrainError`; anything else fails."""
    try:
        call()
    except GovtrainError as e:
        if not isinstance(e.code, Code):
            raise ContractViolation(f"GovtrainError without a Code: {e!r}") from e
        if not e.line().startswith(f"error[{e.code.value}]: ") or "\n" in e.line():
            raise ContractViolation(f"not a one-line error: {e.line()!r}") from e
        return e
    return None


# -- mutations of valid documents ---------------------------------------------------------------------------------

INTERESTING = (b"\x00", b"\xff", b"\x7f", b"\x80", b"\x18", b"\x19\xff\xff", b"\x1b" + b"\xff" * 8, b"\x9f", b"\xbf",
               b"\xf9", b"\xfb", b"\xc0", b"\xd8\x12", b"\n", b"\n\n", b"=", b"[", b"{", b'"', b"\\", b"\xe2\x80\x94",
               b"9" * 5000, b"[" * 3000, b"{" * 3000, b"\x81" * 200)


def mutate(data: bytes, rng: random.Random, rounds: int = 1) -> bytes:
    """`data` after `rounds` random edits: flip, truncate, insert, delete, duplicate or splice an interesting token."""
    out = bytearray(data)
    for _ in range(rounds):
        choice = rng.randrange(6)
        at = rng.randrange(len(out) + 1)
        if choice == 0 and out:
            at = min(at, len(out) - 1)
            out[at] ^= 1 << rng.randrange(8)
        elif choice == 1:
            del out[at:]
        elif choice == 2:
            out[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 5)))
        elif choice == 3:
            del out[at:at + rng.randrange(1, 9)]
        elif choice == 4 and out:
            start = rng.randrange(len(out))
            out[at:at] = out[start:start + rng.randrange(1, 17)]
        else:
            out[at:at] = rng.choice(INTERESTING)
    return bytes(out)


def mutated(seeds: Sequence[bytes]) -> st.SearchStrategy[bytes]:
    """A seed after 1-8 edits, or one truncation: byte flips and truncations of valid vectors."""
    return st.one_of(
        st.builds(lambda seed, r, n: mutate(seed, random.Random(r), n), st.sampled_from(list(seeds)),
                  st.integers(0, 2**32), st.integers(1, 8)),
        st.sampled_from(list(seeds)).flatmap(lambda s: st.integers(0, len(s)).map(lambda n: s[:n])),
    )


# -- targets and the atheris runner -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """One parser: `run` feeds it one input (bytes) through its public entry point; `seeds` gives valid inputs."""

    name: str
    run: Callable[[bytes], object]
    seeds: Callable[[], list[bytes]]
    modules: tuple[str, ...]  # the source files it exercises, for line coverage (paths under the repository)
    setup: Callable[[], None] = field(default=lambda: None)


def _write_seeds(corpus: Path, targets: Sequence[Target], tagged: bool) -> None:
    import hashlib

    corpus.mkdir(parents=True, exist_ok=True)
    if any(corpus.iterdir()):
        return
    for index, target in enumerate(targets):
        for seed in target.seeds():
            data = bytes((index,)) + seed if tagged else seed
            (corpus / hashlib.sha1(data).hexdigest()).write_bytes(data)


def main(targets: Sequence[Target], argv: list[str] | None = None) -> None:
    """The command line of a fuzz module: atheris over one or all targets, or a replay of a corpus."""
    argv = list(sys.argv if argv is None else argv)
    chosen = [a.split("=", 1)[1] for a in argv if a.startswith("--target=")]
    replay = "--replay" in argv
    argv = [a for a in argv if not a.startswith("--target=") and a != "--replay"]
    by_name = {t.name: t for t in targets}
    unknown = [n for n in chosen if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown target(s) {unknown}; this module has {sorted(by_name)}")
    selected = [by_name[n] for n in chosen] if chosen else list(targets)
    for target in selected:
        target.setup()
    tagged = len(selected) > 1
    corpora = [Path(a) for a in argv[1:] if not a.startswith("-")]

    def one_input(data: bytes) -> None:
        if tagged:
            if not data:
                return
            target, data = selected[data[0] % len(selected)], data[1:]
        else:
            target = selected[0]
        check(lambda: target.run(data))

    if replay:
        count = 0
        for corpus in corpora:
            for path in sorted(corpus.iterdir()) if corpus.is_dir() else [corpus]:
                one_input(path.read_bytes())
                count += 1
        print(f"replayed {count} inputs")
        return
    for corpus in corpora[:1]:
        _write_seeds(corpus, selected, tagged)
    import atheris

    _instrument(atheris)
    atheris.Setup(argv, one_input)
    atheris.Fuzz()


INSTRUMENTED = ("govtrain", "ledger_store", "tomllib")  # coverage feedback from these packages only (fast start)


def _instrument(atheris) -> None:  # type: ignore[no-untyped-def]
    """atheris.instrument_all, restricted to the project's own code and the pure-Python parsers it calls (all code
    takes minutes to instrument; this takes a second)."""
    import gc
    import types

    for obj in gc.get_objects():
        if type(obj) is types.FunctionType and (obj.__module__ or "").split(".")[0] in INSTRUMENTED:
            try:
                atheris.instrument_func(obj)
            except Exception as e:  # noqa: BLE001 -- a function atheris cannot patch is left as it is
                print(f"INFO: not instrumented: {obj.__qualname__} ({e})", file=sys.stderr)
