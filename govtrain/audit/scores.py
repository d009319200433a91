"""White-box canary scores from what each step released (docs/auditing.md, "Scores: the evidence of every step").

In a white-box audit of DP-SGD every step's noised gradient is released: the accountant composes the mechanism
over all of them, so the auditor may read each one (Steinke, Nasr & Jagielski 2023, §6; Nasr et al., "Tight
auditing of differentially private machine learning", 2023). At canary i's Dirac coordinate, step t releases

    y[i, t] = s · b[i, t] + σ · z[i, t]        (in units of the clipping norm C)

where b[i, t] is 1 when canary i was included *and* drawn by the step's Poisson sample (rate q), s its clipped
contribution (1 under the claim: the Dirac clipped to C), σ the claimed noise multiplier and z a standard normal.
For an excluded canary every y[i, t] is noise alone.

Two scores (higher: guessed included):

- `displacement_scores`: Σ_t y[i, t], the canary's displacement from its initial value over lr·C/B with plain
  SGD: what the audit scored before it read each step. It weighs a step the canary was drawn in and one it was
  not alike.
- `step_likelihood_scores`: the log-likelihood ratio of "included" against "excluded" under the claimed
  mechanism, Σ_t log(1 − q + q·exp((s·y[i, t] − s²/2) / σ²)): each step's evidence is the likelihood ratio of a
  Poisson-subsampled Gaussian, and independent steps multiply. By Neyman and Pearson it is the most powerful
  score against a mechanism that meets the claim; against a broken one (less noise, a larger clip) each drawn
  step stands out further, and the ratio's convexity weighs those steps more than the sum does.

Either score is a function of released values, the canary set and public parameters (the claimed σ and q) alone,
never of which canaries were included, so `bounds.audit_scores` stays valid for any mechanism whatever score is
used: a score only moves power, never validity. (The score's σ, q and s need not be right; wrong ones only cost
power.)
"""

from __future__ import annotations

import numpy as np


def _released(released) -> np.ndarray:  # type: ignore[no-untyped-def]
    values = np.asarray(released, dtype=float)
    if values.ndim != 2 or values.shape[0] < 1 or values.shape[1] < 1:
        raise ValueError(f"need the released values as [canaries, steps], not shape {values.shape}")
    if not np.all(np.isfinite(values)):
        raise ValueError("a released value is not finite")
    return values


def displacement_scores(released) -> np.ndarray:  # type: ignore[no-untyped-def]
    """Σ over steps of each canary's released value: its last-iterate displacement in units of lr·C/B."""
    return _released(released).sum(axis=1)


def step_likelihood_scores(released, *, noise_multiplier: float, sampling_rate: float,  # type: ignore[no-untyped-def]
                           signal: float = 1.0) -> np.ndarray:
    """Each canary's log-likelihood ratio, included against excluded, of its released values [canaries, steps]
    (units of C) under a Poisson-subsampled (rate `sampling_rate`) Gaussian with noise multiplier
    `noise_multiplier` and clipped contribution `signal` (module docstring)."""
    values = _released(released)
    if not (noise_multiplier > 0 and np.isfinite(noise_multiplier)):
        raise ValueError(f"the noise multiplier must be finite and > 0, not {noise_multiplier}")
    if not 0 < sampling_rate <= 1:
        raise ValueError(f"the sampling rate must be in (0, 1], not {sampling_rate}")
    if not (signal > 0 and np.isfinite(signal)):
        raise ValueError(f"the signal must be finite and > 0, not {signal}")
    shift = (signal * values - signal * signal / 2) / noise_multiplier ** 2  # log N(y; s, σ²) - log N(y; 0, σ²)
    if sampling_rate == 1:
        return shift.sum(axis=1)
    per_step = np.logaddexp(np.log1p(-sampling_rate), np.log(sampling_rate) + shift)
    return per_step.sum(axis=1)
