"""Run states under a ledger's key, for tests (`govtrain/train/state_key.py`).

A run state is authenticated by a MAC under a key derived from the ledger's signing key. A test that reads a state,
or edits one to reach a check that comes after the MAC (a plan, a field's range, the corpus record), uses the test
ledger's key (`ledger_key`): it plays the run, not an adversary. A test of an adversary who can write the folder but
holds no key writes with a key of its own (`attacker_key`): govtrain's own writer, any key but the ledger's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from govtrain.train import state_file
from govtrain.train.state_key import StateKey


def _url(ledger: Any) -> str:
    return ledger if isinstance(ledger, str) else ledger.url  # a ledger URL, or a tests.conftest.Corpus


def ledger_key(ledger: Any) -> StateKey:
    """The run state key of the ledger at `ledger` (a URL or a test corpus), from its signing key."""
    from govtrain.ledger.ledger import Ledger

    with Ledger.open(_url(ledger)) as opened:
        return StateKey.of(opened)


def attacker_key(ledger: Any) -> StateKey:
    """A run state key for the ledger at `ledger` derived from another Ed25519 key: what someone holding no ledger
    key can write with govtrain's own writer."""
    from govtrain.ledger.ledger import Ledger

    with Ledger.open(_url(ledger)) as opened:
        identity = opened.identity
    return StateKey.derive(Ed25519PrivateKey.generate(), identity)


def read(path: Path, ledger: Any) -> dict | None:
    """The run state at `path`, as the run reads it under `ledger`'s key."""
    return state_file.read(Path(path), ledger_key(ledger))


def write(path: Path, state: dict, ledger: Any) -> None:
    """Write `state` at `path` under `ledger`'s key: as the run would (a test that must reach a later check)."""
    state_file.write(Path(path), state, ledger_key(ledger))


def write_unchecked(path: Path, state: dict, key: StateKey) -> None:
    """Write `state` at `path` under `key` as a writer of one's own would: without `state_file`'s check of its fields
    (the writer refuses a state no run saves; a reader must refuse it too)."""
    checked = state_file._check_fields
    state_file._check_fields = lambda state, error: None  # type: ignore[assignment]
    try:
        state_file.write(Path(path), state, key)
    finally:
        state_file._check_fields = checked  # type: ignore[assignment]
