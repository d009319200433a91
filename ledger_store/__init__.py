"""Storage for govtrain ledgers: an append-only table of canonical CBOR entries."""

from ledger_store.appender import Appender, NodeCache
from ledger_store.engines import normalize_url, redacted_url
from ledger_store.errors import (
    AccessDenied,
    Conflict,
    LedgerExists,
    LedgerMissing,
    NotADatabase,
    StoreError,
    TamperedRow,
    Unavailable,
    UnsupportedURL,
    access_denied,
)
from ledger_store.rows import PERSISTED_NODE_HEIGHT, AdmissionRow, StoredCheckpoint, StoredEntry, checked, leaf_hash
from ledger_store.store import LedgerStore

__all__ = [
    "PERSISTED_NODE_HEIGHT", "AccessDenied", "access_denied", "NodeCache", "NotADatabase", "StoredCheckpoint", "AdmissionRow", "Appender", "Conflict", "LedgerExists", "LedgerMissing", "LedgerStore", "StoredEntry",
    "StoreError", "TamperedRow", "checked", "Unavailable", "UnsupportedURL", "leaf_hash", "normalize_url", "redacted_url",
]
