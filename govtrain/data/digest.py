"""The digest an attestation binds (`data_sha256`): a file's SHA-256, or a dataset directory's tree hash.

A data file's digest is the SHA-256 of its exact bytes. A dataset directory's digest is its **tree hash**:

    tree_sha256 = SHA-256( TREE_DOMAIN ‖ E₁ ‖ E₂ ‖ … ‖ Eₙ )
    TREE_DOMAIN = "govtrain-tree-v1" ‖ 0x00                   (17 bytes)
    Eᵢ          = pathᵢ ‖ 0x00 ‖ SHA-256(bytes of file i)      (path bytes, one NUL, 32 bytes)

over every regular file under the directory, at any depth, hidden ones (`.DS_Store`, `cache-*.arrow`)
included: nothing is skipped, so no file can change without changing the digest. pathᵢ is the file's
path relative to the directory, components joined by "/", as UTF-8 bytes exactly as stored (no Unicode
normalisation); entries are sorted by those bytes (bytewise, shortest first on a common prefix). A path
holds no NUL and a digest is 32 bytes, so the encoding reads back one way only. Directories contribute
nothing of their own (an empty one is neither bound nor read). Refused, so that no digest is computed:
a symbolic link anywhere inside (it could point outside, or change after hashing), anything that is not
a regular file or a directory (FIFO, socket, device), a path that is not UTF-8, directories nested past
`MAX_DEPTH` levels, and a tree with no file. A file name in such an error is shown escaped (`!r`).

Domain separation: a data *file* whose bytes begin with TREE_DOMAIN is refused by every reader
(`govtrain.data.contribution`), so the preimages of file digests and tree hashes are disjoint and a file
digest equals a tree hash only through a SHA-256 collision.

Every byte hashed is read once, and the rows are parsed from those same bytes: no file is read again
after it was hashed, so what is admitted or trained on is exactly what was digested.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from govtrain.data.formats import BadData

TREE_DOMAIN = b"govtrain-tree-v1\x00"
MAX_DEPTH = 64  # directory levels under a dataset directory (save_to_disk writes none; a deeper tree is hostile)
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)


@dataclass(frozen=True, slots=True)
class Tree:
    """The files of a dataset directory, read once: relative POSIX path → bytes, sorted by path bytes."""

    files: dict[str, bytes]
    sha256: bytes


def file_sha256(raw: bytes) -> bytes:
    return hashlib.sha256(raw).digest()


def tree_sha256(files: dict[str, bytes]) -> bytes:
    """The tree hash of (relative POSIX path → bytes); the module docstring is its specification."""
    if not files:
        raise ValueError("a tree hash needs at least one file")
    digest = hashlib.sha256(TREE_DOMAIN)
    for path in sorted(files, key=lambda p: p.encode("utf-8")):
        encoded = path.encode("utf-8")
        if b"\x00" in encoded:
            raise ValueError(f"path {path!r} holds a NUL")
        digest.update(encoded + b"\x00" + hashlib.sha256(files[path]).digest())
    return digest.digest()


def read_tree(root: Path) -> Tree:
    """Every regular file under `root`, read once, and their tree hash. Raises `BadData` for what the tree
    hash refuses and `OSError` when a file cannot be read."""
    label = root.name or root.absolute().name
    files = _walk(root, label)
    if not files:
        raise BadData(label, "the directory holds no file")
    ordered = dict(sorted(files.items(), key=lambda item: item[0].encode("utf-8")))
    return Tree(ordered, tree_sha256(ordered))


def _walk(root: Path, label: str) -> dict[str, bytes]:
    """Relative path → bytes of every file under `root`. An explicit stack, not recursion, so that a deep tree
    meets `MAX_DEPTH` (a `BadData`) rather than Python's recursion limit. A name in an error is shown with `!r`:
    it is the contributor's, and may hold a newline that would forge a second error line."""
    files: dict[str, bytes] = {}
    pending: list[tuple[Path, str, int]] = [(root, "", 0)]
    while pending:
        directory, prefix, depth = pending.pop()
        with os.scandir(directory) as entries:
            listed = list(entries)
        for entry in listed:
            relative = prefix + entry.name
            try:
                relative.encode("utf-8")
            except UnicodeEncodeError:
                raise BadData(label, f"{relative.encode('utf-8', 'surrogateescape')!r}: file name is not UTF-8"
                              ) from None
            if entry.is_symlink():
                raise BadData(label, f"{relative!r} is a symbolic link; a dataset directory must hold its files "
                                     "(copy the target in)")
            if entry.is_dir(follow_symlinks=False):
                if depth + 1 > MAX_DEPTH:
                    raise BadData(label, f"{relative!r} nests directories past {MAX_DEPTH} levels, which no "
                                         "dataset directory does")
                pending.append((Path(entry.path), relative + "/", depth + 1))
            elif entry.is_file(follow_symlinks=False):
                files[relative] = _read_regular(Path(entry.path), relative, label)
            else:
                raise BadData(label, f"{relative!r} is not a regular file")
    return files


def _read_regular(path: Path, relative: str, label: str) -> bytes:
    """The file's bytes, refusing one that became a link or a FIFO since it was listed (no blocking open)."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as e:
        if getattr(os, "O_NOFOLLOW", 0) and path.is_symlink():
            raise BadData(label, f"{relative!r} is a symbolic link; a dataset directory must hold its files"
                          ) from None
        raise
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise BadData(label, f"{relative!r} is not a regular file")
        return handle.read()
