"""A govtrain ledger: the store plus the policy recorded in its header entry.

This is the boundary between `ledger_store` (storage, its own exceptions) and the
rest of govtrain (`GovtrainError` with stable codes).
"""

from __future__ import annotations

import time as _time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import ledger_store
from govtrain.errors import Code, ConfigError, IntegrityError
from govtrain.ledger.entries import decode_entry, header_entry
from govtrain.policy.model import Policy

LEDGER_KEY_SETTING = "ledger_key_path"


@contextmanager
def store_errors() -> Iterator[None]:
    try:
        yield
    except ledger_store.UnsupportedURL as e:
        raise ConfigError(Code.LEDGER_URL, str(e)) from e
    except ledger_store.LedgerMissing as e:
        raise ConfigError(Code.LEDGER_MISSING, str(e)) from e
    except ledger_store.LedgerExists as e:
        raise ConfigError(Code.LEDGER_EXISTS, f"{e}; a ledger is initialised once") from e


class Ledger:
    def __init__(self, store: ledger_store.LedgerStore, policy: Policy, header: dict) -> None:
        self.store = store
        self.policy = policy
        self.header = header

    @classmethod
    def open(cls, url: str) -> "Ledger":
        with store_errors():
            store = ledger_store.LedgerStore.open(url)
        try:
            first = store.entry(0)
            if first is None or first.kind != "header" or first.body is None:
                raise IntegrityError(Code.BAD_LEDGER_HEADER, "entry 0 is not a header; the ledger is damaged")
            header = decode_entry(first.body, seq=0, kind="header")
            policy = Policy.from_record(header["policy"])
        except Exception:
            store.close()
            raise
        return cls(store, policy, header)

    @classmethod
    def init(cls, url: str, policy: Policy, policy_source_sha256: bytes, *, key_path: Path | None = None,
             now: int | None = None) -> "Ledger":
        """Create a ledger whose first entry is the header recording `policy`."""
        now = int(_time.time()) if now is None else now
        with store_errors():
            store = ledger_store.LedgerStore.create(url)
        try:
            with store.append() as appender:
                if appender.next_seq != 0:
                    raise ConfigError(Code.LEDGER_EXISTS, f"{store.url} already holds a ledger")
                appender.add("header", now, lambda seq: header_entry(seq, now, policy, policy_source_sha256))
            if key_path is not None:
                store.set_setting(LEDGER_KEY_SETTING, str(Path(key_path).resolve()))
        except Exception:
            store.close()
            raise
        return cls.open(store.url)

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def epoch(self) -> int:
        """The current ledger epoch: how many `epoch` entries precede now."""
        return self.store.count_kind("epoch")

    def size(self) -> int:
        return self.store.size()

    def head_leaf_hash(self) -> bytes | None:
        head = self.store.head()
        return head.leaf_hash if head is not None else None

    def ledger_key_path(self) -> str | None:
        return self.store.setting(LEDGER_KEY_SETTING)
