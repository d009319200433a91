"""Storage for govtrain ledgers: an append-only table of canonical CBOR entries."""

from ledger_store.store import (
    AdmissionRow,
    Appender,
    Conflict,
    LedgerExists,
    LedgerMissing,
    LedgerStore,
    StoredEntry,
    StoreError,
    UnsupportedURL,
    leaf_hash,
    normalize_url,
)

__all__ = [
    "AdmissionRow", "Appender", "Conflict", "LedgerExists", "LedgerMissing", "LedgerStore", "StoredEntry",
    "StoreError", "UnsupportedURL", "leaf_hash", "normalize_url",
]
