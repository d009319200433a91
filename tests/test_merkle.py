"""RFC 9162 Merkle trees: published roots, every shared probe, and generated proofs for all (m, n) <= 64."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import pytest

from govtrain.ledger.merkle import (
    EMPTY_ROOT,
    MerkleTree,
    ProofError,
    leaf_hash,
    node_hash,
    root_from_inclusion,
    root_of,
    verify_consistency,
    verify_inclusion,
    verify_subtree_inclusion,
)

VECTORS = Path(__file__).parent / "vectors" / "merkle"

# RFC 6962 §2.1 test leaves and the roots of their first n (PROVENANCE.md).
LEAVES = [bytes.fromhex(h) for h in
          ["", "00", "10", "2021", "3031", "40414243", "5051525354555657", "606162636465666768696a6b6c6d6e6f"]]
ROOTS = [
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
    "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
    "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
    "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
    "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
    "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
    "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
]


def naive_root(hashes: list[bytes]) -> bytes:
    """MTH exactly as RFC 9162 §2.1.1 defines it, recursively: the oracle."""
    if not hashes:
        return EMPTY_ROOT
    if len(hashes) == 1:
        return hashes[0]
    k = 1
    while k * 2 < len(hashes):
        k *= 2
    return node_hash(naive_root(hashes[:k]), naive_root(hashes[k:]))


@pytest.mark.parametrize("n", range(len(ROOTS)))
def test_published_roots(n):
    hashes = [leaf_hash(leaf) for leaf in LEAVES[:n]]
    assert root_of(hashes).hex() == ROOTS[n]
    assert MerkleTree(hashes, n).root().hex() == ROOTS[n]


def _b64(value):
    if value is None:
        return None
    if isinstance(value, list):
        return [base64.b64decode(v) for v in value]
    return base64.b64decode(value)


def _probes(kind: str):
    files = sorted((VECTORS / kind).rglob("*.json"))
    assert files, f"no {kind} vectors found"
    return [pytest.param(json.loads(f.read_text()), id=str(f.relative_to(VECTORS))) for f in files]


@pytest.mark.parametrize("probe", _probes("inclusion"))
def test_inclusion_probe(probe):
    args = (probe["leafIdx"], probe["treeSize"], _b64(probe["leafHash"]), _b64(probe["proof"]) or [],
            _b64(probe["root"]))
    if probe["wantErr"] or _malformed(args[2], args[4], *args[3]):
        with pytest.raises(ProofError):
            verify_inclusion(*args)
    else:
        verify_inclusion(*args)


def _malformed(*hashes) -> bool:
    return any(h is not None and len(h) != 32 for h in hashes)


@pytest.mark.parametrize("probe", _probes("consistency"))
def test_consistency_probe(probe):
    args = (probe["size1"], probe["size2"], _b64(probe["root1"]), _b64(probe["root2"]), _b64(probe["proof"]) or [])
    # PROVENANCE.md: the Go reference accepts a root that is not 32 bytes when both sizes are equal;
    # a strict verifier rejects every hash that is not 32 bytes, so those probes must fail here.
    if probe["wantErr"] or _malformed(args[2], args[3], *args[4]):
        with pytest.raises(ProofError):
            verify_consistency(*args)
    else:
        verify_consistency(*args)


@pytest.mark.parametrize("probe", _probes("subtreeinclusion"))
def test_subtree_inclusion_probe(probe):
    leaf, root = _b64(probe["leafHash"]), _b64(probe["root"])
    proof = _b64(probe["proof"]) or []
    args = (probe["leafIdx"], probe["start"], probe["end"], leaf, proof, root)
    if probe["wantErr"] or _malformed(leaf, root, *proof):
        with pytest.raises(ProofError):
            verify_subtree_inclusion(*args)
    else:
        verify_subtree_inclusion(*args)


def test_subtree_inclusion_generated():
    tree = MerkleTree(HASHES, 64)
    for start, end in ((0, 8), (8, 16), (16, 20), (32, 64), (48, 51), (60, 61)):
        sub = MerkleTree(HASHES[start:end], end - start)
        for index in range(start, end):
            verify_subtree_inclusion(index, start, end, HASHES[index], sub.inclusion_proof(index - start),
                                     tree.range_hash(start, end))
    with pytest.raises(ProofError):
        verify_subtree_inclusion(5, 4, 10, HASHES[5], [], HASHES[5])  # [4, 10) is not aligned


def test_probe_counts():
    assert len(_probes("inclusion")) == 98 and len(_probes("consistency")) == 98
    assert len(_probes("subtreeinclusion")) == 204


def test_strictness_departs_from_the_reference_only_on_malformed_hashes():
    departures = []
    for kind, fields in (("inclusion", ("leafHash", "root")), ("consistency", ("root1", "root2"))):
        for param in _probes(kind):
            probe = param.values[0]
            hashes = [_b64(probe[f]) for f in fields] + (_b64(probe["proof"]) or [])
            if not probe["wantErr"] and _malformed(*hashes):
                departures.append(param.id)
    assert departures == ["consistency/additional/sizes-are-equal-one-and-proof-is-empty.json"]


HASHES = [leaf_hash(i.to_bytes(2, "big")) for i in range(64)]


def test_roots_match_the_recursive_definition_for_every_size():
    tree = MerkleTree(HASHES, 64, min_cached_height=1)
    for n in range(65):
        assert tree.root(n) == naive_root(HASHES[:n]) == root_of(HASHES[:n])


def test_every_inclusion_proof_up_to_64():
    tree = MerkleTree(HASHES, 64)
    for n in range(1, 65):
        root = naive_root(HASHES[:n])
        for m in range(n):
            proof = tree.inclusion_proof(m, n)
            verify_inclusion(m, n, HASHES[m], proof, root)
            assert root_from_inclusion(m, n, HASHES[m], proof) == root
            with pytest.raises(ProofError):
                verify_inclusion(m, n, HASHES[(m + 1) % 64], proof, root)
            if proof:
                with pytest.raises(ProofError):
                    verify_inclusion(m, n, HASHES[m], proof[:-1], root)
                with pytest.raises(ProofError):
                    verify_inclusion(m, n, HASHES[m], proof + [proof[0]], root)


def test_every_consistency_proof_up_to_64():
    tree = MerkleTree(HASHES, 64)
    roots = [naive_root(HASHES[:n]) for n in range(65)]
    for n in range(65):
        for m in range(n + 1):
            proof = tree.consistency_proof(m, n)
            verify_consistency(m, n, roots[m], roots[n], proof)
            if 0 < m < n:
                with pytest.raises(ProofError):
                    verify_consistency(m, n, roots[m], roots[n], proof[:-1])
                forked = hashlib.sha256(b"fork").digest()
                with pytest.raises(ProofError):
                    verify_consistency(m, n, roots[m], forked, proof)
                if m > 1:
                    with pytest.raises(ProofError):
                        verify_consistency(m, n, roots[m - 1], roots[n], proof)


def test_shrinking_and_forks_are_refused():
    with pytest.raises(ProofError, match="shrunk"):
        verify_consistency(5, 4, HASHES[0], HASHES[1], [HASHES[2]])
    with pytest.raises(ProofError, match="fork"):
        verify_consistency(4, 4, HASHES[0], HASHES[1], [])


def test_cache_serves_large_trees_with_few_leaf_reads():
    size = 1 << 14
    hashes = [leaf_hash(i.to_bytes(4, "big")) for i in range(size)]
    reads = []

    def source(start, stop):
        reads.append(stop - start)
        return hashes[start:stop]

    tree = MerkleTree(source, size)
    assert tree.root() == root_of(hashes)
    reads.clear()
    proof = tree.inclusion_proof(12345)
    verify_inclusion(12345, size, hashes[12345], proof, root_of(hashes))
    assert sum(reads) <= 3 * 16  # only the leaves below the cached height, near the leaf
