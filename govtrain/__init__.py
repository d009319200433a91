"""govtrain: governed differentially private training.

The pipeline, one stage per subpackage: `attest` (descriptors, COSE attestations, keys) →
`policy` (the corpus policy, the trust store) → `gate` (admissibility and admission) →
`ledger` (entries, the ledger) → `verify` (the auditor's verifier). `cli` is the command line.
Importing govtrain imports no torch.
"""

__version__ = "0.1.0"
