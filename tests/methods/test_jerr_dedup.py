"""JERR's de-duplication against references: SimHash against the `simhash` package, near-duplicate groups against
a brute-force comparison of every pair, and (property tests) the Bloom + trie set against a plain dict, a tiny
Bloom filter included, so that a false positive never merges two names."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodekv.methods.jerr.jerr_dedup import (BloomFilter, ExactSet, Trie, hamming, near_duplicate_groups, normalize,
                                       simhash64, unique_names)

simhash = pytest.importorskip("simhash")

NAMES = ["The Tr'en society", "the Tr'en Society.", "Korvin's cell door", "Korvin's cell doors", "Korvin",
         "the mental sciences", "mental science", "democracy", "Democracy!", "the ship's computer",
         "Pierre Curie", "Marie Curie", "Warsaw", "", "a", "Ünïcödé name", "中文名字"]


@pytest.mark.parametrize("text", NAMES)
def test_simhash_equals_the_simhash_package(text):
    assert simhash64(text) == simhash.Simhash(text).value


@given(st.text(max_size=60))
@settings(max_examples=200, deadline=None)
def test_simhash_equals_the_package_on_any_text(text):
    assert simhash64(text) == simhash.Simhash(text).value


def _brute_force_groups(names, threshold):
    prints = [simhash.Simhash(n).value for n in names]
    group = list(range(len(names)))
    for i in range(len(names)):
        for j in range(i):
            if simhash.Simhash(prints[i]).distance(simhash.Simhash(prints[j])) <= threshold:
                old, new = max(group[i], group[j]), min(group[i], group[j])
                group = [new if g == old else g for g in group]
    out: dict[int, list[int]] = {}
    for i, g in enumerate(group):
        out.setdefault(g, []).append(i)
    return list(out.values())


@pytest.mark.parametrize("threshold", [0, 3, 8])
def test_near_duplicate_groups_match_every_pair_compared(threshold):
    names = NAMES + [n + " " + s for n in NAMES[:6] for s in ("ii", "(again)")]
    assert near_duplicate_groups(names, threshold) == _brute_force_groups(names, threshold)


def test_crafted_near_duplicates_merge_and_distinct_names_do_not():
    groups = near_duplicate_groups(["Korvin's cell door", "Korvins cell door", "Warsaw", "Korvin's cell doors"], 3)
    assert hamming(simhash64("Korvin's cell door"), simhash64("Korvins cell door")) == 0  # same word characters
    assert [0, 1] == groups[0][:2] and [2] in groups
    with pytest.raises(ValueError, match="Hamming threshold"):
        near_duplicate_groups(["a"], 64)


@given(st.lists(st.text(alphabet="aAbB .!c", max_size=6), max_size=40), st.sampled_from([8, 64, 1 << 12]))
@settings(max_examples=300, deadline=None)
def test_bloom_and_trie_keep_exactly_the_first_of_each_normalized_name(names, bits):
    seen, expected = set(), []
    for n in names:
        key = normalize(n)
        if key and key not in seen:
            seen.add(key)
            expected.append(n)
    exact = ExactSet(bits=bits, hashes=3)
    got = [n for n in names if normalize(n) and exact.add(n)]
    assert got == expected == unique_names(names)


def test_bloom_filter_and_trie_basics():
    bloom, trie = BloomFilter(bits=64, hashes=3), Trie()
    for word in ("cat", "car", "ca"):
        bloom.add(word)
        assert trie.add(word)
    assert all(w in bloom for w in ("cat", "car", "ca"))  # no false negatives
    assert "ca" in trie and "c" not in trie and "cart" not in trie and not trie.add("cat")
    assert normalize("  The  Tr'en society. ") == "the tr'en society"
    with pytest.raises(ValueError, match="at least 8 bits"):
        BloomFilter(bits=4)
