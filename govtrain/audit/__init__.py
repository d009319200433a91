"""The empirical privacy audit (docs/auditing.md): train once with canaries, each included with probability 1/2,
score them, and state a lower bound on epsilon that must never exceed what the ledger claims. Nothing here is
imported by a run: the package imports torch only where it trains (`audit.py`, `canaries.py`).

    world.py     the audit's own scratch world: keys, policy, tiny model, ledger, RUN.toml
    canaries.py  the canaries: drawn, attested and admitted; white-box Dirac gradients for the router
    audit.py     one audited run through the governed path, its scores and its bound
    bounds.py    the statistics: from guesses (or scores) to lower bounds at a confidence level, by Steinke, Nasr
                 & Jagielski's one-run test (any mechanism) and the f-DP one-run test of Mahloujifar, Melis &
                 Chaudhuri against the run's claimed curve
    tradeoff.py  trade-off curves: the claimed subsampled Gaussian's (dp_accounting's PLD), never above the truth
"""
