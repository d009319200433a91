"""Governed training (docs/design.md §1 stage 4): the run config, contribution data and the training loop."""
