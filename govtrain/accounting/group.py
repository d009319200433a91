"""What an example-level guarantee says about a group of examples (one contributor's K examples).

An (ε, δ)-DP mechanism is (Kε, K·e^{(K−1)ε}·δ)-DP for datasets that differ in K examples (group privacy;
Dwork & Roth 2014, the (ε, δ) form of Theorem 2.2). For a contribution of 120 examples at ε = 3 the δ is
astronomically larger than 1: the example-level ε says nothing about the contribution. That is the case for
`privacy_unit = "contribution"` (docs/design.md §5), whose ε is about the whole contribution directly.
"""

from __future__ import annotations

import math


def group_privacy(epsilon: float, delta: float, size: int) -> tuple[float, float]:
    """(ε, δ) for a group of `size` examples; δ is inf where it overflows (and vacuous long before)."""
    if size < 1:
        raise ValueError("a group has at least one member")
    exponent = (size - 1) * epsilon
    group_delta = size * delta * math.exp(exponent) if exponent < 700 else math.inf
    return size * epsilon, group_delta
