"""Training mechanisms: what a privatized gradient is measured in and how it moves the weights.

- `dpsgd`: per-sample Euclidean clipping and coordinate noise (the routing layer alone), then the run's
  optimizer (SGD, Adam, AdamW);
- `prism` (`prism.py`): clipping and noise in the tangent space of the rank-r manifold for each LoRA
  pair (`tangent_space.py`), a DP-aware r × r preconditioner and a truncated-SVD retraction (`retraction.py`);
- `dp-muon` (`muon.py`): per-matrix clipping, heavy-ball momentum and Newton–Schulz orthogonalization.

`update.py` builds the optimizer side of each for a model; the routing layer does the privacy side.
`stacking.py` groups the parameters of one shape so that PRISM and DP-Muon move each group as one batch.
`hyperparameters.py` holds the schedule and the values RUN.toml configured, which the update is checked against.
"""

from govtrain.ledger.entries import MECHANISMS  # noqa: F401  (the names a run entry may record)
