"""JERR's MCTS against a hand computation of its first iterations (UCB choices, visits and rewards backpropagated),
a DAG whose answer lies three hops deep, seeded walks; PageRank against a plain power iteration."""
from __future__ import annotations

import math

import pytest

from nodekv.methods.jerr.jerr_search import MCTS, pagerank, pagerank_top

EDGES = {"A": ["C", "D"], "B": ["E"], "C": [], "D": ["F"], "E": [], "F": []}
SCORE = {"A": 0.2, "B": 0.5, "C": 0.9, "D": 0.1, "E": 0.3, "F": 1.0}


def _state(search):
    out, stack = {}, [search.root]
    while stack:
        t = stack.pop()
        stack.extend(t.children)
        out[t.node or "root"] = (t.visits, round(t.value, 9))
    return out


def test_first_iterations_match_a_hand_computation():
    calls = []

    def reward(paths):
        calls.append([p[0] for p in paths])
        return [SCORE[p[0]] for p in paths]

    search = MCTS(["A", "B"], EDGES.__getitem__, reward, c=1.0, depth=1)
    search.iterate()  # the root expands to A and B, both evaluated in one call
    assert calls == [["A", "B"]] and _state(search) == {"root": (2, 0.7), "A": (1, 0.2), "B": (1, 0.5)}
    # UCB: A 0.2 + sqrt(ln 2) = 1.033, B 0.5 + sqrt(ln 2) = 1.333 -> B, expanded to E (0.3)
    assert [round(t.ucb(1.0), 4) for t in search.root.children] == [round(0.2 + math.sqrt(math.log(2)), 4),
                                                                     round(0.5 + math.sqrt(math.log(2)), 4)]
    search.iterate()
    assert calls[-1] == ["E"] and _state(search)["B"] == (2, 0.8) and _state(search)["root"] == (3, 1.0)
    # A 0.2 + sqrt(ln 3) = 1.248, B 0.4 + sqrt(ln 3 / 2) = 1.141 -> A, expanded to C (0.9) and D (0.1)
    search.iterate()
    assert calls[-1] == ["C", "D"] and _state(search)["A"] == (3, 1.2) and _state(search)["root"] == (5, 2.0)
    # A 0.4 + sqrt(ln 5 / 3) = 1.132, B 0.4 + sqrt(ln 5 / 2) = 1.297 -> B -> E, a sink: E is evaluated again
    search.iterate()
    assert calls[-1] == ["E"] and _state(search)["E"] == (2, 0.6) and _state(search)["B"] == (3, 1.1)
    assert search.top(3) == ["C", "A", "B"]  # mean reward 0.9, 0.4, 0.367


@pytest.mark.parametrize("seed, c", [(0, 0.5), (1, 1.0), (2, 1.4)])
def test_the_node_three_hops_down_the_relevant_path_is_found(seed, c):
    # keyword reward along the walk: the question's keywords all sit on the path start -> mid -> answer
    edges = {"start": ["mid", "noise1"], "mid": ["answer", "noise2"], "noise1": ["noise3"], "noise2": [],
             "noise3": [], "answer": [], "other": ["noise1"]}
    words = {"start": {"ship"}, "mid": {"ship", "captain"}, "answer": {"captain", "signal"}, "noise1": set(),
             "noise2": set(), "noise3": set(), "other": set()}
    keywords = {"ship", "captain", "signal"}

    def reward(paths):
        return [len(keywords & set().union(*(words[n] for n in p))) / len(keywords) for p in paths]

    search = MCTS(["other", "start"], edges.__getitem__, reward, c=c, depth=3, seed=seed).run(30)
    assert search.top(3) == ["answer", "mid", "start"]  # the answer alone completes the keywords


def test_walks_follow_edges_within_the_depth_and_repeat_under_a_seed():
    paths = []

    def reward(ps):
        paths.extend(ps)
        return [0.0] * len(ps)

    edges = {"a": ["b", "c"], "b": ["d"], "c": ["d", "e"], "d": ["e"], "e": []}
    MCTS(["a"], edges.__getitem__, reward, depth=3, seed=7).run(6)
    assert all(1 <= len(p) <= 3 and all(q in edges[p_] for p_, q in zip(p, p[1:])) for p in paths)
    again = []
    MCTS(["a"], edges.__getitem__, lambda ps: again.extend(ps) or [0.0] * len(ps), depth=3, seed=7).run(6)
    assert again == paths
    with pytest.raises(ValueError, match="depth"):
        MCTS(["a"], edges.__getitem__, reward, depth=0)


@pytest.mark.parametrize("relevance", [{"a": 1.0, "e": 2.0}, {}, {"c": 0.5}])
def test_pagerank_matches_networkx_pure_python_reference(relevance):
    nx = pytest.importorskip("networkx")
    from networkx.algorithms.link_analysis.pagerank_alg import _pagerank_python

    nodes = ["a", "b", "c", "d", "e", "f"]
    edges = [("a", "b"), ("b", "c"), ("a", "c"), ("c", "d"), ("e", "d"), ("a", "b")]  # f isolated, d dangling
    graph = nx.DiGraph()
    graph.add_nodes_from(nodes)
    graph.add_edges_from(edges)
    personal = {v: relevance.get(v, 0.0) for v in nodes} if relevance else None
    want = _pagerank_python(graph, alpha=0.85, personalization=personal, tol=1e-12, max_iter=1000)
    got = pagerank(nodes, edges, relevance)
    assert got == pytest.approx(want, abs=1e-8)
    assert pagerank_top(nodes, edges, relevance, 3) == sorted(nodes, key=lambda v: -want[v])[:3]
