"""Privacy accounting (no torch): epsilon of a contribution's history of (q, sigma, steps) buckets."""

from govtrain.accounting.accountants import (
    ACCOUNTANTS,
    Bucket,
    EpsilonResult,
    PLDAccountant,
    PRVAccountant,
    RDPAccountant,
    get_accountant,
)
from govtrain.accounting.spend import spend_epsilon_u

__all__ = ["ACCOUNTANTS", "Bucket", "EpsilonResult", "PLDAccountant", "PRVAccountant", "RDPAccountant",
           "get_accountant", "spend_epsilon_u"]
