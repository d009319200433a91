"""The empirical privacy audit (docs/auditing.md): canaries through the governed path, and a lower bound on ε
that must never exceed what the ledger claims."""
