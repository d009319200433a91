"""The routing layer (docs/design.md §1 stage 3): per-sample masking, clipping and noise before any optimizer step."""
