"""What leaves govtrain: the adapter folder a run releases, readable without govtrain's config or this machine, and
its signed release manifest.

    artifact.py      the folder's own record (govtrain.json), its portable adapter configs, its hash
    export.py        writing the folder at the end of a run, and reading it back before it is recorded
    card.py          the model card (README.md): the run's privacy, from the ledger, and how to check it
    load.py          `govtrain.load`: the trained model as a standard transformers/peft model, as training built it
    verify.py        `verify_adapter`: a folder against its run entry in the ledger (never imports torch)

    Release manifests (docs/release-manifest.md):
    manifest.py      `build_release`: the folder's files and the run's privacy, signed (`govtrain release`)
    facts.py         what the ledger records of the run: run entry and proof, ε per class, withdrawals
    groups.py        the parameter groups the run trained, resolved again on the model it trained
    predicate.py     the in-toto Statement v1 and its predicate (schemas/release.schema.json)
    dsse.py          the DSSE envelope: PAE, Ed25519
    verification.py  `verify_release`: offline, against a folder, against a live ledger (never imports torch)
    openssf.py       the same files as an OpenSSF model-signing bundle (P-256)
"""

from typing import TYPE_CHECKING, Any

__all__ = ["verify_adapter", "build_release", "release_statement", "verify_release", "ReleaseReport", "ClassRelease",
           "GroupRelease", "model_signing_bundle"]

_WHERE = {"verify_adapter": "verify", "build_release": "manifest", "release_statement": "manifest",
          "verify_release": "verification", "ReleaseReport": "verification", "ClassRelease": "verification",
          "GroupRelease": "verification", "model_signing_bundle": "openssf"}

if TYPE_CHECKING:
    from govtrain.release.manifest import build_release, release_statement
    from govtrain.release.openssf import model_signing_bundle
    from govtrain.release.verification import ClassRelease, GroupRelease, ReleaseReport, verify_release
    from govtrain.release.verify import verify_adapter


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(f"govtrain.release.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'govtrain.release' has no attribute {name!r}")
