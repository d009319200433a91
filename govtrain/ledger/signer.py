"""The signer's own memory of what it signed, kept outside the database (review item 5).

A ledger key signs a checkpoint at every write. Before it does, it must know that the tree it is about
to sign extends the tree it signed last: otherwise anyone who can write the database file, without the
key, could rewrite an entry and let the next honest write sign the rewritten tree. The database cannot
be asked (it is what is being checked), so the signer keeps, next to its key and per ledger, the last
tree head it signed as a compact range: the O(log n) perfect-subtree hashes from which that head and
any extension of it follow. The next write extends that range with the new leaf hashes only; nothing
the database says about older entries, and no cached subtree hash, reaches the signed root.

    <key>.heads/<header leaf hash>.json      {"size": n, "root": hex, "stack": [hex, ...]}   (0600)

The folder may be moved with $GOVTRAIN_SIGNER_STATE. The file only ever grows: a write that would move
it back (two processes racing to record their heads) keeps the larger one, and a head that is behind
the database is caught up through the database's own signed checkpoints (`Ledger.append`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from govtrain.errors import Code, ConfigError, IntegrityError
from govtrain.ledger.merkle import CompactRange

STATE_ENV = "GOVTRAIN_SIGNER_STATE"


@dataclass(frozen=True)
class SignedHead:
    """Where one key keeps the head it last signed for one ledger (named by its header's leaf hash)."""

    path: Path

    @classmethod
    def of(cls, key_path: str | os.PathLike, header_leaf: bytes) -> "SignedHead":
        folder = os.environ.get(STATE_ENV)
        base = Path(folder) if folder else Path(key_path).resolve().with_name(Path(key_path).name + ".heads")
        return cls(base / f"{header_leaf.hex()}.json")

    def load(self) -> CompactRange | None:
        """The signed head as a compact range, or None where this key has not signed this ledger here."""
        try:
            raw = json.loads(self.path.read_text())
            tree = CompactRange()
            tree.size, tree.stack = int(raw["size"]), [bytes.fromhex(h) for h in raw["stack"]]
            if len(tree.stack) != bin(tree.size).count("1") or tree.root().hex() != raw["root"]:
                raise ValueError("its subtree hashes do not give its root")
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise IntegrityError(Code.FORK, f"the signer's record of its last signed head ({self.path}) is damaged: "
                                            f"{e}; restore it from a backup") from e
        return tree

    def prepare(self) -> None:
        """Make the folder before a write commits, so that a head can always be recorded after it."""
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(Code.KEY_UNREADABLE, f"cannot keep the signed head in {self.path.parent}: "
                                                   f"{e.strerror}; set {STATE_ENV} to a folder the signer owns") from e

    def save(self, tree: CompactRange, *, new_ledger: bool = False) -> None:
        """Record `tree` as the last signed head, unless a larger one is recorded already (`new_ledger`: this
        key just signed the header of a ledger created anew, which replaces any record of that name)."""
        try:
            current = None if new_ledger else self.load()
        except IntegrityError:
            current = None
        if current is not None and current.size >= tree.size:
            return
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(descriptor, "w") as out:
                json.dump({"size": tree.size, "root": tree.root().hex(), "stack": [h.hex() for h in tree.stack]}, out)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, self.path)
        except OSError as e:
            raise ConfigError(Code.KEY_UNREADABLE, f"cannot record the signed head in {self.path.parent}: "
                                                   f"{e.strerror}; set {STATE_ENV} to a folder the signer owns") from e
