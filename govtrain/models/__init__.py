"""The base model, as every stage that needs one loads it: from its folder (`loading`), with the pooling a
sequence classifier was trained with (`pooling`). Below `train/` and `release/`, which both load it."""
