"""Per-contribution spend at corpus scale: every distinct history is accounted once.

A history is what the ledger records for a contribution: one (q_u, sigma_eff_u, steps) bucket
per ledger epoch, in micro-units, in epoch order. Its *canonical key* drops the free buckets
(q = 0 or no steps); for accountants whose answer does not depend on order (`prv`, `rdp`) it
also merges buckets with equal (q, sigma) and sorts them. Epsilon is a pure function of the key. `SpendCalculator` caches results by key, so a
corpus of 100,000 contributions that share a handful of parameter sets costs a handful of
accountant calls, and the verifier, which recomputes every recorded spend, gets the same
numbers from the same function.

A history may also hold the charge of a privatizer of another noise family (`accounting/records.py`): its key is
then its charges in epoch order, and `govtrain.accounting.families.epsilon_u` accounts it.

sigma_eff is only ever bucketed by rounding **down** (`bucket_sigma_u`): a smaller noise
multiplier yields a larger epsilon, so the coarser grid can only over-charge.
"""

from __future__ import annotations

import functools
import os
from multiprocessing import get_context
from typing import Iterable, Sequence

from govtrain import units
from govtrain.accounting.accountants import Accountant, Bucket, EpsilonResult, get_accountant
from govtrain.accounting.history import (  # noqa: F401 (the first four: spend's vocabulary)
    SIGMA_DIGITS, History, bucket_sigma_u, canonical, share_result, shared_result)
from govtrain.accounting.records import Bucketer, Charge, family_charges

def _serve(connection, name: str, delta: float) -> None:
    """A worker process: one accountant (and its caches) for its whole life."""
    accountant = get_accountant(name)
    while True:
        keys = connection.recv()
        if keys is None:
            return
        connection.send([accountant.epsilon([Bucket.from_micro(*b) for b in key], delta) for key in keys])


class _Workers:
    """Forked worker processes, each with its own accountant. Keys are routed by their first bucket, and
    a first bucket keeps its worker: a contribution's history grows by one bucket per epoch, so its
    prefixes (which the PLD accountant caches) stay in one process. New first buckets go to the
    least-loaded worker."""

    def __init__(self, name: str, delta: float, count: int) -> None:
        context = get_context("fork")
        self.connections, self.processes = [], []
        for _ in range(count):
            parent, child = context.Pipe()
            process = context.Process(target=_serve, args=(child, name, delta), daemon=True)
            process.start()
            child.close()
            self.connections.append(parent)
            self.processes.append(process)
        self.home: dict[tuple, int] = {}
        self.load = [0] * count

    def evaluate(self, keys: list[History]) -> list[EpsilonResult]:
        batches: list[list[int]] = [[] for _ in self.connections]
        for i, key in enumerate(keys):
            worker = self.home.get(key[:1])
            if worker is None:
                worker = self.home[key[:1]] = self.load.index(min(self.load))
            self.load[worker] += 1
            batches[worker].append(i)
        for worker, batch in enumerate(batches):
            if batch:
                self.connections[worker].send([keys[i] for i in batch])
        results: list[EpsilonResult | None] = [None] * len(keys)
        for worker, batch in enumerate(batches):
            if batch:
                for i, result in zip(batch, self.connections[worker].recv()):
                    results[i] = result
        return results  # type: ignore[return-value]

    def close(self) -> None:
        for connection, process in zip(self.connections, self.processes):
            try:
                connection.send(None)
            except OSError:
                pass
            process.join(timeout=5)
            connection.close()


class SpendCalculator:
    """Epsilon of recorded histories under one accountant at one delta, cached by canonical key.

    `workers` > 1 evaluates uncached keys in that many forked processes that live as long as the
    calculator (`close()` it, or use it as a context manager): the accountants are numpy and scipy
    code that holds the GIL, so threads would not help, and long-lived workers keep their caches.
    """

    def __init__(self, accountant: str, delta_p: int, *, workers: int = 1, max_cached: int = 1_000_000,
                 share: bool = True) -> None:
        self.name = accountant
        self.share = share  # take and give answers to the process's shared ones (`history.shared_result`)
        self.accountant: Accountant = get_accountant(accountant)
        self.delta_p = delta_p
        self.delta = delta_p / units.PICO
        self.ordered = self.accountant.ordered
        self.workers = max(1, workers)
        self.max_cached = max_cached
        self._cache: dict[History, EpsilonResult] = {}
        self._pool: _Workers | None = None
        self.calls = 0  # keys this calculator had to account (its misses; the answer may be a shared one)
        self.lookups = 0

    def __enter__(self) -> "SpendCalculator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def key(self, history: Iterable[tuple[int, int, int]]) -> History:
        history = tuple(history)
        if all(type(item) is tuple for item in history):
            return canonical(history, self.ordered)
        return family_charges(history)  # type: ignore[return-value]

    def result(self, history: Iterable[tuple[int, int, int]]) -> EpsilonResult:
        key = self.key(history)
        self.lookups += 1
        found = self._cache.get(key)
        if found is None:
            self._compute([key])
            found = self._cache[key]
        return found

    def epsilon_u(self, history: Iterable[tuple[int, int, int]]) -> int:
        return self.result(history).epsilon_u

    def epsilon_many(self, histories: Sequence[Iterable[tuple[int, int, int]]]) -> list[int]:
        keys = [self.key(h) for h in histories]
        self.prefetch(keys)
        self.lookups += len(keys)
        return [self._cache[k].epsilon_u for k in keys]

    def prefetch(self, histories: Iterable[Iterable[tuple[int, int, int]]]) -> None:
        """Evaluate every distinct uncached history, in parallel when `workers` > 1."""
        missing = {self.key(h) for h in histories} - self._cache.keys()
        family = [key for key in missing if key and type(key[0]) is Charge]  # Charges do not order: apart
        missing = sorted(missing.difference(family)) + sorted(family, key=repr)
        if missing:
            self._compute(missing)

    def _compute(self, keys: list[History]) -> None:
        families = [key for key in keys if key and type(key[0]) is Charge]
        if families:  # a history with a charge of another family: its own accountants, in this process
            self.calls += len(families)
            for key in families:
                self._store(key, EpsilonResult(epsilon_u=_families_epsilon_u(self.name, self.delta_p, key),
                                               accountant=self.name))
            keys = [key for key in keys if not (key and type(key[0]) is Charge)]
            if not keys:
                return
        self.calls += len(keys)
        if self.share:
            known = {key: found for key in keys if (found := shared_result(self.name, self.delta_p, key)) is not None}
            for key, found in known.items():
                self._store(key, found)
            keys = [key for key in keys if key not in known]
            if not keys:
                return
        if self.workers == 1:
            results = [self.accountant.epsilon([Bucket.from_micro(*b) for b in key], self.delta) for key in keys]
        else:
            if self._pool is None:
                self._pool = _Workers(self.name, self.delta, self.workers)
            results = self._pool.evaluate(keys)
        for key, result in zip(keys, results):
            self._store(key, result)
            if self.share:
                share_result(self.name, self.delta_p, key, result)

    def max_steps(self, history: History, sampling_rate_u: int, sigma_u: int, limit: int,
                  budget_u: int, *, bucket: Bucketer | None = None) -> tuple[int, int]:
        """The most steps k <= `limit` at (q, sigma) after `history` whose cumulative epsilon stays within
        `budget_u`, and that epsilon. `bucket(q, sigma, k)`: what k steps charge (`privatizers.charges.bucketer` of
        the run's privatizer; None: the i.i.d. Gaussian's (q, sigma, k)).

        Epsilon grows with k, so this keeps a bracket (lo within budget, hi over it) and shrinks it by
        interpolating the budget's position between the ends, probing one step past each landing to
        close the bracket early; a round that fails to halve the bracket bisects. Every answer is an
        evaluated point within budget, so a non-monotone accountant can only make k smaller.
        """

        def eps(k: int) -> int:
            item = (sampling_rate_u, sigma_u, k) if bucket is None else bucket(sampling_rate_u, sigma_u, k)
            return self.epsilon_u(history + (item,))

        top = eps(limit)
        if top <= budget_u:
            return limit, top
        low, high = 0, limit
        eps_low, eps_high = eps(0), top
        if eps_low > budget_u:
            return 0, eps_low
        bisect = False
        while high - low > 1:
            width = high - low
            if bisect:
                guess = (low + high) // 2
            else:
                guess = low + (budget_u - eps_low) * (high - low) // max(eps_high - eps_low, 1)
            guess = min(max(guess, low + 1), high - 1)
            value = eps(guess)
            if value <= budget_u:
                low, eps_low = guess, value
                if high - low > 1 and (beyond := eps(guess + 1)) > budget_u:
                    high, eps_high = guess + 1, beyond
            else:
                high, eps_high = guess, value
                if high - low > 1 and (before := eps(guess - 1)) <= budget_u:
                    low, eps_low = guess - 1, before
            bisect = high - low > width // 2
        return low, eps_low

    def _store(self, key: History, result: EpsilonResult) -> None:
        if len(self._cache) >= self.max_cached:
            self._cache.pop(next(iter(self._cache)))
        self._cache[key] = result


def _families_epsilon_u(accountant: str, delta_p: int, charges: tuple[Charge, ...]) -> int:
    """ε (micro, rounded up) of charges that include another family than the Gaussian: the families' accountants
    (`govtrain.accounting.families`)."""
    try:
        from govtrain.accounting import families
    except ModuleNotFoundError as e:
        if e.name != "govtrain.accounting.families":
            raise
        from govtrain.errors import Code, ConfigError

        names = sorted({c.family for c in charges} - {"gaussian"})
        raise ConfigError(Code.PRIVATIZER_UNKNOWN, f"a history charges the {', '.join(names)} family, and this "
                                                   "installation of govtrain has no accountant for it "
                                                   "(govtrain.accounting.families): upgrade govtrain") from e
    return int(families.epsilon_u(accountant, delta_p, charges))


@functools.lru_cache(maxsize=16)
def shared_calculator(accountant: str, delta_p: int) -> SpendCalculator:
    """One calculator per (accountant, delta) per process, so repeated audits reuse its cache."""
    return SpendCalculator(accountant, delta_p, max_cached=200_000)


def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def spend_epsilon_u(accountant: str, delta_p: int, history: Sequence[tuple[int, int, int]]) -> int:
    """The verifier's `SpendAccountant`: epsilon (micro-units, rounded up) of a recorded history of
    (sampling_rate_u, noise_multiplier_u, steps), in epoch order, under the named accountant at
    delta_p / 10^12. Shares one cached `SpendCalculator` per (accountant, delta)."""
    return shared_calculator(accountant, delta_p).epsilon_u(history)
