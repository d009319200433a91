"""The empirical privacy audit (docs/auditing.md): train once with canaries, each included with probability 1/2,
score them, and state a lower bound on epsilon that must never exceed what the ledger claims. No torch here.

    canaries.py  the canaries: white-box gradient canaries and black-box input canaries, and their scores
    audit.py     one audited run through the governed path, and the table of claims against bounds
    bounds.py    the statistics: from guesses (or scores) to lower bounds at a confidence level, by Steinke, Nasr
                 & Jagielski's one-run test and a Gaussian f-DP test (Mahloujifar, Melis & Chaudhuri)
"""
