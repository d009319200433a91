"""RFC 9162 §2.1 Merkle trees: roots, inclusion and consistency proofs, and their verification.

Leaves are hashed SHA-256(0x00 ‖ entry), interior nodes SHA-256(0x01 ‖ left ‖ right), and an
unbalanced tree splits at the largest power of two below its size: no last node is ever
duplicated (§2.1.1).

`MerkleTree` reads leaf hashes from any source and memoises the hashes of *perfect aligned
subtrees* (size 2^h, starting at a multiple of 2^h). Those never change once their leaves
exist, and every range a proof needs decomposes into O(log n) of them plus a right edge, so
repeated proofs and roots over a large log cost O(log n) hash lookups, not a rehash of the world.

Verification follows the RFC's algorithms step by step (§2.1.3.2, §2.1.4.2), and raises.
"""

from __future__ import annotations

import hashlib
from typing import Callable, MutableMapping, Sequence

from govtrain.errors import Code, IntegrityError

HASH_BYTES = 32
EMPTY_ROOT = hashlib.sha256(b"").digest()

LeafSource = Callable[[int, int], Sequence[bytes]]  # leaf hashes of [start, stop)


class ProofError(IntegrityError):
    """A Merkle proof or root does not verify."""

    def __init__(self, detail: str) -> None:
        super().__init__(Code.BAD_PROOF, detail)


def leaf_hash(entry: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + entry).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def split_point(n: int) -> int:
    """k, the largest power of two smaller than n (n > 1)."""
    return 1 << ((n - 1).bit_length() - 1)


def fold_right(subtrees: Sequence[bytes]) -> bytes:
    """The root over perfect subtrees listed left to right, largest first (RFC 9162's split)."""
    root = subtrees[-1]
    for left in reversed(subtrees[:-1]):
        root = node_hash(left, root)
    return root


class CompactRange:
    """Roots of every prefix of a log, one leaf at a time: a stack of perfect subtrees."""

    def __init__(self) -> None:
        self.stack: list[bytes] = []
        self.size = 0

    def append(self, leaf: bytes) -> None:
        self.stack.append(leaf)
        self.size += 1
        # Leaf number `size` completes one perfect subtree per trailing zero bit of `size`.
        for _ in range((self.size & -self.size).bit_length() - 1):
            right = self.stack.pop()
            self.stack[-1] = node_hash(self.stack[-1], right)

    def root(self) -> bytes:
        return fold_right(self.stack) if self.stack else EMPTY_ROOT

    def copy(self) -> "CompactRange":
        twin = CompactRange()
        twin.stack, twin.size = list(self.stack), self.size
        return twin


def root_of(leaf_hashes: Sequence[bytes]) -> bytes:
    """MTH over a list of leaf hashes, in one left-to-right pass with a stack of perfect subtrees."""
    if not leaf_hashes:
        return EMPTY_ROOT
    stack: list[bytes] = []
    for count, leaf in enumerate(leaf_hashes, start=1):
        stack.append(leaf)
        # Leaf number `count` completes one perfect subtree per trailing zero bit of `count`.
        merges = (count & -count).bit_length() - 1
        for _ in range(merges):
            right = stack.pop()
            stack[-1] = node_hash(stack[-1], right)
    return fold_right(stack)


class MerkleTree:
    """A tree over `size` leaves whose hashes come from `leaves(start, stop)`.

    `cache` maps (height, index) of perfect aligned subtrees to their hashes; pass a persistent
    mapping to keep them between instances. Heights below `min_cached_height` are recomputed
    from leaves (cheap) rather than stored.
    """

    def __init__(self, leaves: LeafSource | Sequence[bytes], size: int, *,
                 cache: MutableMapping[tuple[int, int], bytes] | None = None,
                 min_cached_height: int = 4) -> None:
        if callable(leaves):
            self._leaves: LeafSource = leaves
        else:
            sequence = leaves
            self._leaves = lambda start, stop: sequence[start:stop]
        self.size = size
        self.cache: MutableMapping[tuple[int, int], bytes] = {} if cache is None else cache
        self.min_cached_height = min_cached_height
        self._blocks: dict[int, Sequence[bytes]] = {}  # leaf blocks of 2^min_cached_height, read once

    # -- hashes -----------------------------------------------------------------------------

    def _perfect(self, height: int, index: int) -> bytes:
        """Hash of the perfect subtree of 2^height leaves starting at index · 2^height."""
        key = (height, index)
        found = self.cache.get(key)
        if found is not None:
            return found
        if height <= self.min_cached_height:
            start = index << height
            value = root_of(self._block_leaves(start, start + (1 << height)))
            if height == self.min_cached_height:
                self.cache[key] = value
            return value
        value = node_hash(self._perfect(height - 1, 2 * index), self._perfect(height - 1, 2 * index + 1))
        self.cache[key] = value
        return value

    def _block_leaves(self, start: int, stop: int) -> Sequence[bytes]:
        """Leaves [start, stop) of one aligned block, reading the whole block once (proofs need several
        subtrees of the same block)."""
        width = 1 << self.min_cached_height
        block = start // width
        if block != (stop - 1) // width:
            return self._leaves(start, stop)
        leaves = self._blocks.get(block)
        if leaves is None:
            if len(self._blocks) > 64:
                self._blocks.clear()
            # The last block may be partial: read what exists of it.
            leaves = self._blocks[block] = self._leaves(block * width, min((block + 1) * width, self.size))
        return leaves[start - block * width : stop - block * width]

    def range_hash(self, start: int, end: int) -> bytes:
        """MTH(D[start:end]) for a range that RFC 9162's recursion produces (start aligned to the
        largest power of two not exceeding end - start, or the range is the whole prefix)."""
        if not 0 <= start < end <= self.size:
            raise ValueError(f"range [{start}, {end}) outside a tree of {self.size}")
        n = end - start
        if n & (n - 1) == 0 and start % n == 0:
            return self._perfect(n.bit_length() - 1, start // n)
        k = split_point(n)
        return node_hash(self.range_hash(start, start + k), self.range_hash(start + k, end))

    def root(self, size: int | None = None) -> bytes:
        size = self.size if size is None else size
        if not 0 <= size <= self.size:
            raise ValueError(f"no prefix of size {size} in a tree of {self.size}")
        return EMPTY_ROOT if size == 0 else self.range_hash(0, size)

    # -- proofs (§2.1.3.1, §2.1.4.1) -----------------------------------------------------

    def inclusion_proof(self, index: int, size: int | None = None) -> list[bytes]:
        """PATH(index, D[0:size]): sibling hashes from the leaf's up to the root's child."""
        size = self.size if size is None else size
        if not 0 <= index < size <= self.size:
            raise ValueError(f"no leaf {index} in a tree of size {size}")
        ranges: list[tuple[int, int]] = []
        start, end = 0, size
        while end - start > 1:
            k = split_point(end - start)
            if index - start < k:
                ranges.append((start + k, end))
                end = start + k
            else:
                ranges.append((start, start + k))
                start += k
        self._prefetch(ranges)
        return [self.range_hash(a, b) for a, b in reversed(ranges)]

    def _prefetch(self, ranges: list[tuple[int, int]]) -> None:
        """Tell a cache that can load many hashes at once which perfect subtrees these ranges need."""
        prefetch = getattr(self.cache, "prefetch", None)
        if prefetch is None:
            return
        keys: list[tuple[int, int]] = []
        stack = list(ranges)
        while stack:
            a, b = stack.pop()
            n = b - a
            if n & (n - 1) == 0 and a % n == 0:
                if n.bit_length() - 1 >= self.min_cached_height:
                    keys.append((n.bit_length() - 1, a // n))
            elif n > 1:
                k = split_point(n)
                stack += [(a, a + k), (a + k, b)]
        prefetch(keys)

    def consistency_proof(self, first: int, second: int | None = None) -> list[bytes]:
        """PROOF(first, D[0:second]); empty when first is 0 or equals second."""
        second = self.size if second is None else second
        if not 0 <= first <= second <= self.size:
            raise ValueError(f"no consistency proof from {first} to {second} in a tree of {self.size}")
        if first == 0 or first == second:
            return []
        path: list[bytes] = []
        start, end, complete = 0, second, True
        m = first
        while m != end - start:
            k = split_point(end - start)
            if m <= k:
                path.append(self.range_hash(start + k, end))
                end = start + k
            else:
                path.append(self.range_hash(start, start + k))
                start += k
                m -= k
                complete = False
        if not complete:
            path.append(self.range_hash(start, end))
        path.reverse()
        return path


# ---------------------------------------------------------------------------------------
# Verification
# ---------------------------------------------------------------------------------------


def _check_hash(value: bytes, what: str) -> None:
    if not isinstance(value, (bytes, bytearray)) or len(value) != HASH_BYTES:
        raise ProofError(f"{what} is not a {HASH_BYTES}-byte hash")


def _shift_until_odd_or_zero(fn: int, sn: int) -> tuple[int, int]:
    while fn & 1 == 0 and fn != 0:
        fn >>= 1
        sn >>= 1
    return fn, sn


def root_from_inclusion(index: int, size: int, leaf: bytes, proof: Sequence[bytes]) -> bytes:
    """The root that `proof` implies for `leaf` at `index` (RFC 9162 §2.1.3.2, steps 1-4)."""
    _check_hash(leaf, "leaf hash")
    # 1. The index must lie in the tree.
    if not 0 <= index < size:
        raise ProofError(f"leaf index {index} is outside a tree of size {size}")
    # 2-3.
    fn, sn, r = index, size - 1, bytes(leaf)
    # 4.
    for p in proof:
        _check_hash(p, "proof element")
        if sn == 0:  # a. the proof is too long
            raise ProofError("inclusion proof has more elements than the tree has levels")
        if fn & 1 or fn == sn:  # b.
            r = node_hash(p, r)
            if not fn & 1:
                fn, sn = _shift_until_odd_or_zero(fn, sn)
        else:  # c.
            r = node_hash(r, p)
        fn >>= 1  # d.
        sn >>= 1
    # 5. (first half) every level consumed.
    if sn != 0:
        raise ProofError("inclusion proof is too short for the tree size")
    return r


def verify_inclusion(index: int, size: int, leaf: bytes, proof: Sequence[bytes], root: bytes) -> None:
    """Raise `ProofError` unless `proof` shows `leaf` at `index` in the tree of `size` with `root`."""
    _check_hash(root, "root")
    if root_from_inclusion(index, size, leaf, proof) != root:
        raise ProofError(f"inclusion proof for leaf {index} does not lead to the root of size {size}")


def verify_consistency(first: int, second: int, first_root: bytes, second_root: bytes,
                       proof: Sequence[bytes]) -> None:
    """Raise `ProofError` unless `proof` shows the tree of `second` extends the tree of `first`."""
    _check_hash(first_root, "first root")
    _check_hash(second_root, "second root")
    for p in proof:
        _check_hash(p, "proof element")
    if not 0 <= first <= second:
        raise ProofError(f"first size {first} exceeds second size {second}: the log would have shrunk")
    if first == second:
        if proof:
            raise ProofError("equal sizes need an empty consistency proof")
        if first_root != second_root:
            raise ProofError(f"two different roots for the same size {first}: a fork")
        return
    if first == 0:
        if proof:
            raise ProofError("a consistency proof from the empty tree must be empty")
        return
    # 1. A non-trivial proof is never empty.
    if not proof:
        raise ProofError("empty consistency proof")
    # 2. A power-of-two first tree is itself the first node of the path.
    path = list(proof)
    if first & (first - 1) == 0:
        path.insert(0, first_root)
    # 3-4.
    fn, sn = first - 1, second - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    # 5.
    fr = sr = path[0]
    # 6.
    for c in path[1:]:
        if sn == 0:  # a.
            raise ProofError("consistency proof has more elements than the tree has levels")
        if fn & 1 or fn == sn:  # b.
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
            if not fn & 1:
                fn, sn = _shift_until_odd_or_zero(fn, sn)
        else:  # c.
            sr = node_hash(sr, c)
        fn >>= 1  # d.
        sn >>= 1
    # 7.
    if sn != 0:
        raise ProofError("consistency proof is too short")
    if fr != first_root:
        raise ProofError(f"consistency proof does not reproduce the root of size {first}")
    if sr != second_root:
        raise ProofError(f"consistency proof does not reproduce the root of size {second}")


def verify_subtree_inclusion(index: int, start: int, end: int, leaf: bytes, proof: Sequence[bytes],
                             subtree_root: bytes) -> None:
    """Inclusion of leaf `index` in the subtree of leaves [start, end) with hash `subtree_root`.

    A subtree is valid when `start` is a multiple of the smallest power of two not below end - start
    (it is then a node, or the right edge, of every tree that contains it); inside it, the proof is an
    RFC 9162 §2.1.3 inclusion proof with indices counted from `start`."""
    if not 0 <= start < end:
        raise ProofError(f"[{start}, {end}) is not a subtree")
    width = 1 << (end - start - 1).bit_length()
    if start % width:
        raise ProofError(f"[{start}, {end}) is not an aligned subtree")
    if not start <= index < end:
        raise ProofError(f"leaf {index} is outside the subtree [{start}, {end})")
    verify_inclusion(index - start, end - start, leaf, proof, subtree_root)
