"""govtrain: governed differentially private training.

The pipeline, one stage per subpackage: `attest` (descriptors, COSE attestations, keys) →
`policy` (the corpus policy, the trust store) → `gate` (admissibility and admission) →
`ledger` (entries, the ledger) → `verify` (the auditor's verifier) → `train` (governed training; its
library API is `govtrain.GovernedRun`) → `release` (the adapter folder a run writes; `govtrain.load` reads it
back for inference). `cli` is the command line. Importing govtrain imports no torch: `GovernedRun`,
`GovernedBatch` and `load` are loaded on first use.
"""

from typing import TYPE_CHECKING, Any

from govtrain.version import __version__
__all__ = ["GovernedBatch", "GovernedRun", "load", "__version__"]

if TYPE_CHECKING:
    from govtrain.release.load import load
    from govtrain.train.governed import GovernedBatch, GovernedRun


def __getattr__(name: str) -> Any:
    if name in ("GovernedRun", "GovernedBatch"):
        from govtrain.train import governed

        return getattr(governed, name)
    if name == "load":
        from govtrain.release.load import load

        return load
    raise AttributeError(f"module 'govtrain' has no attribute {name!r}")
