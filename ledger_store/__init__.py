"""Storage for govtrain ledgers: an append-only table of canonical CBOR entries."""

from ledger_store.store import (
    PERSISTED_NODE_HEIGHT,
    AccessDenied,
    AdmissionRow,
    Appender,
    Conflict,
    LedgerExists,
    LedgerMissing,
    LedgerStore,
    NodeCache,
    NotADatabase,
    StoredCheckpoint,
    StoredEntry,
    StoreError,
    TamperedRow,
    Unavailable,
    UnsupportedURL,
    access_denied,
    checked,
    leaf_hash,
    normalize_url,
    redacted_url,
)

__all__ = [
    "PERSISTED_NODE_HEIGHT", "AccessDenied", "access_denied", "NodeCache", "NotADatabase", "StoredCheckpoint", "AdmissionRow", "Appender", "Conflict", "LedgerExists", "LedgerMissing", "LedgerStore", "StoredEntry",
    "StoreError", "TamperedRow", "checked", "Unavailable", "UnsupportedURL", "leaf_hash", "normalize_url", "redacted_url",
]
