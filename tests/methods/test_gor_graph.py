"""GoR's graph of records: query simulation bounded and seeded (a repeating LLM, a one-chunk document), each round's
retrieval over chunks and earlier responses against a brute-force recomputation, and on SmolLM2 the same graph
twice under one seed."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nodekv.methods.gor.gor_graph import (RecordGraph, build_records, engine_responder, engine_sampler,
                                      simulate_queries)


def test_an_llm_that_repeats_itself_ends_after_max_attempts():
    graph = RecordGraph(["alpha", "beta", "gamma"])
    calls = []

    def sample(draws):
        calls.append(len(draws))
        return ["What is it about?"] * len(draws)

    simulate_queries(graph, sample, n=30, seed=0, max_attempts=10, batch=4)
    assert graph.queries == ["What is it about?"] and graph.draws == 10 and calls == [4, 4, 2]


def test_a_query_is_its_first_line_without_a_question_label():
    graph = RecordGraph(["alpha"])
    replies = iter(["Question: Why A?", "Summary question: why a?\nmore", "  Why B?  ", "The question: Why C?"])
    simulate_queries(graph, lambda draws: [next(replies) for _ in draws], n=4, seed=0, max_attempts=4, batch=1)
    assert graph.queries == ["Why A?", "Why B?", "Why C?"]  # the second repeats the first up to case


def test_a_one_chunk_document_and_a_seed_give_the_same_queries_and_sources():
    def sample(draws):  # a deterministic stand-in: the query depends on the chunk and the seed
        return [f"Q{seed % 7} on {chunk}?" for chunk, seed in draws]

    one = RecordGraph(["only chunk"])
    simulate_queries(one, sample, n=5, seed=3, max_attempts=40)
    assert len(one.queries) == 5 and set(one.sources) == {0}
    a, b, c = RecordGraph(list("abcdef")), RecordGraph(list("abcdef")), RecordGraph(list("abcdef"))
    for g, seed in ((a, 1), (b, 1), (c, 2)):
        simulate_queries(g, sample, n=6, seed=seed, max_attempts=60)
    assert (a.queries, a.sources) == (b.queries, b.sources) != (c.queries, c.sources)
    assert all(q.endswith(f"on {a.chunks[s]}?") for q, s in zip(a.queries, a.sources))


def embed(texts):
    """Letters a-e counted: a text's vector says which letters it holds."""
    return F.normalize(torch.tensor([[t.count(ch) + 1e-3 for ch in "abcde"] for t in texts]), dim=1)


def test_each_round_retrieves_over_chunks_and_earlier_responses_and_links_them():
    graph = RecordGraph(["aa", "bb", "cc", "dd", "ee"], queries=["aab", "bba", "c"], sources=[0, 1, 2])
    seen = []

    def respond(question, materials):
        seen.append(list(materials))
        return {"aab": "ab", "bba": "bbc"}.get(question, "cc c")

    build_records(graph, respond, embed, k=2)
    texts = graph.chunks
    for i, q in enumerate(graph.queries):  # brute force: cosine of the query with every node so far
        scores = [float(embed([q])[0] @ embed([t])[0]) for t in texts]
        top = sorted(range(len(texts)), key=lambda j: -scores[j])[:2]
        assert seen[i] == [texts[j] for j in top]
        assert graph.edges[2 * i:2 * i + 2] == [(j, len(graph.chunks) + i) for j in top]
        texts = texts + [graph.responses[i]]
    assert "ab" in seen[1]  # the second round retrieved the first response
    assert graph.texts == graph.chunks + ["ab", "bbc", "cc c"]
    linked = {j for e in graph.edges for j in e}
    assert {3, 4} - linked == {3, 4}  # "dd", "ee" were never retrieved: isolated
    assert graph.edge_index().shape == (2, 2 * len(graph.edges))
    assert graph.edge_index(both_ways=False).T.tolist() == [list(e) for e in graph.edges]


@pytest.mark.model
def test_the_same_seed_builds_the_same_graph_on_smollm2():
    import nodekv

    eng = nodekv.load_engine("smollm2-135m")
    chunks = ["The lighthouse of Port Ellen was kept by Agnes Morrow from 1890 to 1921.",
              "Agnes Morrow wrote a diary about the storms and the ships that passed the island."]
    graphs = []
    for _ in range(2):
        g = RecordGraph(list(chunks))
        simulate_queries(g, engine_sampler(eng, max_tokens=24), n=3, seed=5, max_attempts=6, batch=3)
        build_records(g, engine_responder(eng, max_tokens=16), embed, k=1)
        graphs.append(g)
    assert graphs[0] == graphs[1] and 1 <= len(graphs[0].queries) <= 3 and graphs[0].draws <= 6
    assert len(graphs[0].responses) == len(graphs[0].queries) and all(graphs[0].responses)
