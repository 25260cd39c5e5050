"""JERR's entity de-duplication (jerr.txt §3.3): exact duplicates through a Bloom filter confirmed by a trie, then
near-duplicates merged by 64-bit SimHash within a Hamming threshold.

- Names are compared after `normalize` (case-folded, inner whitespace collapsed, surrounding punctuation stripped).
- `ExactSet`: a Bloom filter answers "new" for most new names without touching the trie; a "maybe seen" is settled by
  the trie, so a Bloom false positive never merges two distinct names.
- `simhash64`: the `simhash` package's fingerprint (Charikar's SimHash over character 4-grams of the name's word
  characters, md5 per feature, each bit set when more than half the features' weight sets it), written out here so
  the package is only a test reference.
- `near_duplicate_groups`: names whose fingerprints differ in at most `threshold` bits end in one group (transitively,
  by union-find). Candidate pairs come from (threshold + 1) bands of the fingerprint: by pigeonhole two fingerprints
  within the threshold agree on at least one band, so no pair is missed and most are never compared.
"""
from __future__ import annotations

import hashlib
import re
from collections import Counter
from typing import Iterable

import numpy as np

_WORD = re.compile(r"[\w\u4e00-\u9fcc]+")
_EDGE_PUNCT = re.compile(r"^[\W_]+|[\W_]+$")


def normalize(name: str) -> str:
    """The form names are compared in: case-folded, whitespace collapsed, leading and trailing punctuation removed."""
    return _EDGE_PUNCT.sub("", " ".join(name.casefold().split()))


class BloomFilter:
    """`bits` bits and `hashes` hash functions (double hashing over one BLAKE2b digest); no false negatives."""

    def __init__(self, bits: int = 1 << 16, hashes: int = 4):
        if bits < 8 or hashes < 1:
            raise ValueError(f"a Bloom filter needs at least 8 bits and 1 hash, got {bits} and {hashes}")
        self.bits, self.hashes = bits, hashes
        self._array = np.zeros(bits, dtype=bool)

    def _positions(self, key: str) -> list[int]:
        digest = hashlib.blake2b(key.encode(), digest_size=16).digest()
        a, b = int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:], "little") | 1
        return [(a + i * b) % self.bits for i in range(self.hashes)]

    def add(self, key: str) -> None:
        self._array[self._positions(key)] = True

    def __contains__(self, key: str) -> bool:
        return bool(self._array[self._positions(key)].all())


class Trie:
    """A character trie of exact strings."""

    def __init__(self):
        self._root: dict = {}

    def add(self, key: str) -> bool:
        """Insert `key`; True if it was not there."""
        node = self._root
        for ch in key:
            node = node.setdefault(ch, {})
        new = "" not in node  # "" marks the end of a stored key (no character is "")
        node[""] = True
        return new

    def __contains__(self, key: str) -> bool:
        node = self._root
        for ch in key:
            node = node.get(ch)
            if node is None:
                return False
        return "" in node


class ExactSet:
    """Exact membership of normalized names: Bloom filter first, trie to confirm."""

    def __init__(self, bits: int = 1 << 16, hashes: int = 4):
        self.bloom, self.trie = BloomFilter(bits, hashes), Trie()

    def add(self, name: str) -> bool:
        """True if `name` (normalized) is new, and remember it."""
        key = normalize(name)
        if key not in self.bloom:
            self.bloom.add(key)
            self.trie.add(key)
            return True
        return self.trie.add(key)


def unique_names(names: Iterable[str]) -> list[str]:
    """The first occurrence of each name up to `normalize`, in order."""
    seen = ExactSet()
    return [n for n in names if normalize(n) and seen.add(n)]


def simhash64(text: str) -> int:
    """64-bit SimHash of `text` (the `simhash` package's `Simhash(text).value`)."""
    content = "".join(_WORD.findall(text.lower()))
    shingles = Counter(content[i:i + 4] for i in range(max(len(content) - 3, 1)))
    total = sum(shingles.values())
    weights = np.zeros(64)
    for shingle, weight in shingles.items():
        digest = hashlib.md5(shingle.encode()).digest()[-8:]
        weights += weight * np.unpackbits(np.frombuffer(digest, dtype=np.uint8))
    return int.from_bytes(np.packbits(weights > total / 2).tobytes(), "big")


def hamming(a: int, b: int) -> int:
    return (a ^ b).bit_count()


def near_duplicate_groups(names: list[str], threshold: int = 3) -> list[list[int]]:
    """Indices of `names` grouped so that fingerprints within `threshold` bits share a group (transitively); groups
    in order of their first member, members in order."""
    if not 0 <= threshold < 64:
        raise ValueError(f"the Hamming threshold must be in [0, 64), got {threshold}")
    prints = [simhash64(n) for n in names]
    parent = list(range(len(names)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    bands = threshold + 1
    edges = [round(64 * b / bands) for b in range(bands + 1)]
    for lo, hi in zip(edges, edges[1:]):
        buckets: dict[int, list[int]] = {}
        for i, p in enumerate(prints):
            buckets.setdefault((p >> lo) & ((1 << (hi - lo)) - 1), []).append(i)
        for members in buckets.values():
            for x, i in enumerate(members):
                for j in members[x + 1:]:
                    a, b = root(i), root(j)
                    if a != b and hamming(prints[i], prints[j]) <= threshold:
                        parent[max(a, b)] = min(a, b)  # a group's root is its first member
    groups: dict[int, list[int]] = {}
    for i in range(len(names)):
        groups.setdefault(root(i), []).append(i)
    return list(groups.values())
