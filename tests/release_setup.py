"""A trained run to release, for tests/test_release_manifest.py and tests/test_attacks_release.py: a tiny BERT trained
for a few steps on a ledger whose policy names a release key, with one contribution of each class (public: upper
layers and the head; sensitive: a band inside them; restricted: its own LoRA adapter).

Training takes seconds, so one run is trained per test session and each test gets its own copy (`Released.copy`):
the ledger, its keys (whose signer records travel with them, `ledger/signer.py`) and the adapter folder."""

from __future__ import annotations

import json
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

from govtrain.attest.keys import generate_key_pair, load_private_key, load_public_key
from govtrain.ledger.checkpoint import NoteKey
from govtrain.ledger.ledger import Ledger
from tests.conftest import Corpus, make_corpus

RUN_ID = "release-run"
ORIGIN = "test.invalid/govtrain/1"


def release_policy(policy: str) -> str:
    """`policy` with the release key `release.pub` (in the corpus folder) among its release keys."""
    return policy + '\n[[release_keys]]\nname = "release"\npublic_key_file = "release.pub"\n'


@dataclass
class Released:
    """A ledger with run RUN_ID's adapter in `adapter`, the release key and the pinned public keys."""

    root: Path  # the folder holding keys/ and ledger.db
    base: Path  # the tiny base model

    @property
    def keys(self) -> Path:
        return self.root / "keys"

    @property
    def url(self) -> str:
        return f"sqlite:///{self.root / 'ledger.db'}"

    @property
    def adapter(self) -> Path:
        return self.keys / "adapter"

    @property
    def release_key_path(self) -> Path:
        return self.keys / "release.key"

    @property
    def release_key(self):  # type: ignore[no-untyped-def]
        return load_private_key(self.release_key_path)

    @property
    def release_pub(self) -> bytes:
        return load_public_key(self.keys / "release.pub")

    @property
    def ledger_pub(self) -> bytes:
        return load_public_key(self.keys / "ledger.pub")

    @property
    def ledger_note_key(self) -> NoteKey:
        return NoteKey(ORIGIN, self.ledger_pub)

    def open(self) -> Ledger:
        return Ledger.open(self.url, key=self.keys / "ledger.key")

    def copy(self, target: Path) -> "Released":
        shutil.copytree(self.root, target)
        return Released(target, self.base)

    def build(self, **options) -> bytes:  # type: ignore[no-untyped-def]
        """The release manifest of RUN_ID's adapter, signed by the release key (`build_release`'s options)."""
        from govtrain.release.manifest import build_release

        options.setdefault("key", self.release_key)
        with self.open() as ledger:
            return build_release(ledger, RUN_ID, options.pop("folder", self.adapter), base=self.base,
                                 **options).to_json()

    def verify(self, envelope: bytes, **options):  # type: ignore[no-untyped-def]
        """`verify_release` under this ledger's pinned release and ledger keys."""
        from govtrain.release.verification import verify_release

        options.setdefault("release_key", self.release_pub)
        options.setdefault("ledger_keys", [self.ledger_pub])
        return verify_release(envelope, **options)


_TRAINED: dict[str, Released] = {}


def trained_release(tmp_path_factory) -> Released:
    """The session's trained run (trained on first use), as a `Released` to copy, never to change."""
    if "run" not in _TRAINED:
        import govtrain
        from tests.test_api import BATCH_POLICY, QUIET
        from tests.test_release import _run_toml
        from tests.test_train import _admit, save_tiny_bert

        base = save_tiny_bert(tmp_path_factory.mktemp("release-base"))
        root = tmp_path_factory.mktemp("released")
        keys = root / "keys"
        keys.mkdir()
        generate_key_pair(keys, "release")
        corpus: Corpus = make_corpus(root, f"sqlite:///{root / 'ledger.db'}", release_policy(BATCH_POLICY))
        _admit(corpus, "pub")
        _admit(corpus, "sens", data_class="sensitive", clip_norm_u=500_000, eps_budget_u=3_000_000)
        _admit(corpus, "restr", data_class="restricted", clip_norm_u=500_000, noise_multiplier_u=1_500_000,
               eps_budget_u=2_000_000)
        config = _run_toml(corpus, str(base))
        with govtrain.GovernedRun.open(config, corpus.url, insecure_seed=3, **QUIET) as run:
            for batch in run.batches():
                run.step(run.per_example_loss(run.model(**batch.inputs), batch))
            run.save()
        _TRAINED["run"] = Released(root, base)
    return _TRAINED["run"]


def negate_tensor(path: Path, name: str) -> None:
    """Flip the sign bit of every float32 of tensor `name` in the safetensors file, in place (same inode, size)."""
    raw = path.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    entry = json.loads(raw[8:8 + size])[name]
    assert entry["dtype"] == "F32"
    start, end = (8 + size + offset for offset in entry["data_offsets"])
    data = bytearray(raw[start:end])
    for at in range(3, len(data), 4):
        data[at] ^= 0x80
    with path.open("r+b") as handle:
        handle.seek(start)
        handle.write(data)
