"""What leaves govtrain: the adapter folder a run releases, readable without govtrain's config or this machine.

    artifact.py   the folder's own record (govtrain.json), its portable adapter configs, its hash
    export.py     writing the folder at the end of a run, and reading it back before it is recorded
    card.py       the model card (README.md): the run's privacy, from the ledger, and how to check it
    load.py       `govtrain.load`: the trained model as a standard transformers/peft model, as training built it
    verify.py     `verify_adapter`: a folder against its run entry in the ledger (never imports torch)
"""

from typing import TYPE_CHECKING, Any

__all__ = ["verify_adapter"]

if TYPE_CHECKING:
    from govtrain.release.verify import verify_adapter


def __getattr__(name: str) -> Any:
    if name == "verify_adapter":
        from govtrain.release.verify import verify_adapter

        return verify_adapter
    raise AttributeError(f"module 'govtrain.release' has no attribute {name!r}")
