"""JERR's entity DAG from scripted LLM replies: parsing with graceful degradation (a log line per case), exact and
near-duplicate merging, edges dropped for each stated reason, and (property test) acyclic for any proposals."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from nodekv.methods.jerr.jerr_graph import EntityGraph, Entity, add_edges, merge_entities, parse_atoms, parse_elements


def test_atoms_are_one_per_line_without_markers_and_fall_back_to_the_synopsis():
    log = []
    reply = "Information atoms:\n1. Korvin is a prisoner.\n- The Tr'en rule the planet.\n\n* Korvin escapes."
    assert parse_atoms(reply, "unused", 0, log) == ["Korvin is a prisoner.", "The Tr'en rule the planet.",
                                                     "Korvin escapes."] and log == []
    assert parse_atoms("  \n", "Korvin waits. The door opens!", 3, log) == ["Korvin waits.", "The door opens!"]
    assert log == ["chunk 3: no information atoms in the reply; its synopsis' sentences stand in"]


def test_elements_take_three_and_note_what_they_drop():
    log = []
    assert parse_elements("Core components: Korvin, the Tr'en, democracy", 0, log) == ["Korvin", "the Tr'en",
                                                                                       "democracy"]
    assert parse_elements("1. Korvin\n2. the door\n3. KORVIN\n4. the weapon", 1, log) == ["Korvin", "the door",
                                                                                           "the weapon"]
    long = "a very long element that rambles on past any sensible name length"
    assert parse_elements(f"- {long}\n- ship", 2, log) == ["ship"]
    assert parse_elements("", 4, log) == [] and parse_elements("None.", 6, log) == []
    assert log == ["chunk 2: dropped 1 malformed element(s) (empty or over 8 words)",
                   "chunk 4: no core elements in the reply; the chunk adds no entity",
                   "chunk 6: no core elements in the reply; the chunk adds no entity"]
    assert parse_elements("a\nb\nc\nd", 5, log) == ["a", "b", "c"]
    assert log[-1] == "chunk 5: 4 elements, kept the first 3"


def test_elements_survive_what_qwen_0_5b_actually_replies():
    log = []
    labelled = ("The fundamental nouns are: Korvin, Tr'en, and the Tr'en's side. The verbs are: communicate, assume. "
                "The adjectives are: ritual, captive")
    assert parse_elements(labelled, 0, log) == ["Korvin", "Tr'en", "the Tr'en's side"]
    echo = ("The fundamental nouns are people, moments, occurrences, settings, quantities, and adjectives. The verbs "
            "are activities, and the adjectives are conditions, emotions.")
    assert parse_elements(echo, 1, log) == []
    assert log[-2:] == ["chunk 1: the reply repeats the prompt's examples (people, moments, occurrences, settings, "
                        "quantities, adjectives, activities, conditions, emotions); left out",
                        "chunk 1: no core elements in the reply; the chunk adds no entity"]
    assert parse_elements("- Korvin\n- Tr'en\n- Lie-detector\n- Tr'en", 2, log) == ["Korvin", "Tr'en", "Lie-detector"]
    assert parse_elements("The core components of the story's progression:\n1. Ruler\n2. Korvin", 4, log) == [
        "Ruler", "Korvin"]
    assert parse_atoms("1. Korvin is held. He plans to escape.\n2. The Ruler asks.", "", 3, log) == [
        "Korvin is held.", "He plans to escape.", "The Ruler asks."]


def test_exact_and_near_duplicates_become_one_entity_with_every_chunk():
    log = []
    entities, per_chunk = merge_entities([["Korvin", "Korvin's cell door"], ["korvin.", "Korvins cell door"],
                                          ["democracy"]], threshold=3, log=log)
    assert [e.name for e in entities] == ["Korvin", "Korvin's cell door", "democracy"]
    assert entities[1].aliases == ["Korvins cell door"] and entities[0].chunks == [0, 1]
    assert per_chunk == [[0, 1], [0, 1], [2]]
    assert log == ["merged near-duplicates: Korvin's cell door | Korvins cell door"]


def test_each_bad_edge_is_dropped_with_its_reason():
    graph = EntityGraph([Entity(n) for n in "abcd"])
    add_edges(graph, [(0, 1, "rules"), (1, 2, "owns."), (2, 0, "fears"), (2, 2, "is"), (0, 1, "again"),
                      (3, 0, "None."), (0, 9, "meets"), (2, 3, "no relation"), (0, 2, "  guards   the  gate ")])
    assert graph.edges == {(0, 1): "rules", (1, 2): "owns", (0, 2): "guards the gate"}
    assert graph.log == ["edge c -> a ('fears') dropped: it would close a cycle",
                         "edge c -> c ('is') dropped: a self-loop",
                         "edge a -> b ('again') dropped: it repeats an edge",
                         "edge d -> a ('None') dropped: it names no relation",
                         "edge a -> #9 ('meets') dropped: an end is not an entity",
                         "edge c -> d ('no relation') dropped: it names no relation"]
    assert graph.successors(0) == [1, 2] and graph.successors(3) == []


def _acyclic(n, edges):
    indegree = [0] * n
    for _, b in edges:
        indegree[b] += 1
    ready, seen = [i for i in range(n) if indegree[i] == 0], 0
    while ready:
        node = ready.pop()
        seen += 1
        for a, b in edges:
            if a == node:
                indegree[b] -= 1
                if indegree[b] == 0:
                    ready.append(b)
    return seen == n  # Kahn: every node ordered iff no cycle


@given(st.integers(1, 8).flatmap(lambda n: st.tuples(st.just(n), st.lists(
    st.tuples(st.integers(0, n - 1), st.integers(0, n - 1), st.sampled_from(["x", "y", "none"])), max_size=40))))
@settings(max_examples=300, deadline=None)
def test_the_graph_is_acyclic_for_any_proposals(case):
    n, proposals = case
    graph = EntityGraph([Entity(str(i)) for i in range(n)])
    add_edges(graph, proposals)
    assert _acyclic(n, list(graph.edges))
    kept = [(a, b) for a, b, attr in proposals if attr != "none" and a != b]
    assert set(graph.edges) <= set(kept)


def test_the_exports_place_entities_by_depth_and_label_edges():
    import re
    import xml.etree.ElementTree as ET

    from nodekv.methods import graph_view
    from nodekv.methods.jerr.jerr_graph import depths, view

    graph = EntityGraph([Entity("Korvin", ["Korvins"], [0, 2]), Entity("Tr'en <rulers>", [], [0]),
                         Entity("door", [], [2]), Entity("ship", [], [1])])
    add_edges(graph, [(0, 1, "held by"), (1, 2, "locks"), (0, 2, "opens")])
    assert depths(graph) == [0, 1, 2, 0]  # the door is two hops from Korvin by the longest path
    page = graph_view.to_html(view(graph))
    svg = ET.fromstring(re.search(r"<svg.*</svg>", page, re.S).group(0))
    ns = "{http://www.w3.org/2000/svg}"
    texts = ["".join(t.itertext()) for t in svg.iter(ns + "text")]
    assert {"depth 0: 2 entities", "depth 1: 1 entity", "depth 2: 1 entity", "held by", "locks", "opens"} <= set(texts)
    titles = [g.find(ns + "title").text for g in svg.iter(ns + "g")]
    assert titles[0] == "Korvin / Korvins (chunks 0, 2)" and titles[1] == "Tr'en <rulers> (chunks 0)"
    assert sorted(line.find(ns + "title").text for line in svg.iter(ns + "line")) == [
        "#0 → #1: held by", "#0 → #2: opens", "#1 → #2: locks"]
    graphml = ET.fromstring(graph_view.to_graphml(view(graph)))
    labels = [d.text for d in graphml.iter("{http://graphml.graphdrawing.org/xmlns}data") if d.get("key") == "label"]
    assert labels == ["held by", "locks", "opens"]
