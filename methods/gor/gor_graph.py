"""GoR's graph of records (gor.txt §2.2, App. A.4, D.1–D.2): simulated queries and the RAG rounds that link each
response to the nodes it was generated from.

Query simulation: a chunk drawn at random (seeded), the paper's D.1 prompt, temperature 0.5 sampling (the reply's
first line, a leading "Question:" label dropped), until `n` distinct queries exist or `max_attempts` draws are spent
(a short or repetitive document ends with fewer). Draws run `batch` at a time as batched decode steps, each with a
seed of its own.
Graph (Eq. 3): round i retrieves the top-K nodes for q_i from the chunks and the responses r_1..r_{i-1}, generates
r_i from them with the D.2 prompt (greedy), adds r_i as a node and an edge from each retrieved node to it. Chunks
never retrieved stay isolated (the GAT gives every node a self-loop, as App. A.4 does). The same seed gives the same
graph.

The LLM and the encoder come in as functions (`sample`, `respond`, `embed`), so the control flow is testable
without a model; `engine_sampler` and `engine_responder` are the engine's.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ...engine.engine import Engine
from ..chat_prompt import ChatPrompt
from ..text import normalize_answer

SIMULATION_PROMPT = (
    "You are a great questioner of any text, and are adept at asking valuable and insightful questions. Your goal is "
    "to generate 1 summary question for the text provided below. The generated summary question should try to "
    "simulate the tone of human questions as much as possible, and make sure that the generated question must be "
    "interrogative sentences and a summary question. Important! Please make sure this text must be a complete and "
    "non-redundant answer to the generated summary question. Please directly output the generated summary question, "
    "do not output irrelevant text.\n\nDOCUMENT:\n{}")
RAG_PROMPT = ("Refer to the following supporting materials and answer the question with brief but complete "
              "explanations.\n\nSUPPORTING MATERIALS:\n{}\n\nQUESTION:\n{}")

# a label small models put before the query ("Question:", "Summary question:")
_LABEL = re.compile(r"^\s*(?:[a-z]+ ){0,2}question\s*:\s*", re.IGNORECASE)
# sample([(chunk text, seed), ...]) -> one generated query per draw
Sampler = Callable[[Sequence[tuple[str, int]]], list[str]]
# respond(question, retrieved texts) -> the response
Responder = Callable[[str, Sequence[str]], str]
# embed(texts) -> [len(texts), d] L2-normalised
Embed = Callable[[list[str]], torch.Tensor]


@dataclass
class RecordGraph:
    """Nodes are the chunks (ids 0..C-1) then the responses (id C + i for round i); `edges` are (retrieved node,
    response node); `queries[i]` was drawn from chunk `sources[i]` and answered by response i."""

    chunks: list[str]
    queries: list[str] = field(default_factory=list)
    sources: list[int] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)
    edges: list[tuple[int, int]] = field(default_factory=list)
    draws: int = 0  # simulation draws spent

    @property
    def texts(self) -> list[str]:
        return self.chunks + self.responses

    def edge_index(self, both_ways: bool = True) -> torch.Tensor:
        """[2, 2E] long: every edge in both directions (messages flow between a response and its sources); [2, E]
        without `both_ways`: retrieved node -> response only, as the public code's graph has them."""
        if not self.edges:
            return torch.zeros(2, 0, dtype=torch.long)
        e = torch.tensor(self.edges, dtype=torch.long).T
        return torch.cat([e, e.flip(0)], dim=1) if both_ways else e


def simulate_queries(graph: RecordGraph, sample: Sampler, n: int, seed: int, max_attempts: int,
                     batch: int = 4) -> None:
    """Fill graph.queries / sources with up to `n` distinct queries, drawing at most `max_attempts` times."""
    if not graph.chunks:
        raise ValueError("the document has no chunks to simulate queries from")
    rng = random.Random(seed)
    seen = {normalize_answer(q) for q in graph.queries}
    while len(graph.queries) < n and graph.draws < max_attempts:
        draws = [rng.randrange(len(graph.chunks)) for _ in range(min(batch, max_attempts - graph.draws))]
        seeds = [seed * 1_000_003 + graph.draws + j for j in range(len(draws))]
        graph.draws += len(draws)
        for chunk, query in zip(draws, sample([(graph.chunks[c], s) for c, s in zip(draws, seeds)])):
            query = _LABEL.sub("", query.strip().split("\n")[0]).strip()
            key = normalize_answer(query)  # a repeat differs at most in case, punctuation and articles
            if key and key not in seen and len(graph.queries) < n:
                seen.add(key)
                graph.queries.append(query)
                graph.sources.append(chunk)


def build_records(graph: RecordGraph, respond: Responder, embed: Embed, k: int) -> None:
    """Eq. 3 for every simulated query, in order: retrieve top-k over chunks + earlier responses, respond, link."""
    vecs = embed(graph.chunks)
    queries = embed(graph.queries) if graph.queries else vecs[:0]
    for i, query in enumerate(graph.queries):
        scores = vecs @ queries[i]
        top = torch.argsort(-scores, stable=True)[:k].tolist()  # ties: the earlier node
        node = len(graph.chunks) + len(graph.responses)
        graph.responses.append(respond(query, [graph.texts[j] for j in top]))
        graph.edges += [(j, node) for j in top]
        vecs = torch.cat([vecs, embed([graph.responses[-1]])])


def engine_sampler(engine: Engine, max_tokens: int = 64, temperature: float = 0.5) -> Sampler:
    """Draws on the engine: the D.1 prompt's fixed part prefilled once (`Engine.prefixes`), the chunks appended in
    one batched forward, then decode steps for all draws together, each sampling with its own seed."""
    prompt = ChatPrompt(engine.tokenizer, [{"role": "user", "content": SIMULATION_PROMPT}])

    def sample(draws: Sequence[tuple[str, int]]) -> list[str]:
        sessions = [engine.prefixes.fork(prompt.head, node_id="gor-simulation") for _ in draws]
        try:
            engine.append_batch(sessions, [prompt.fill(0, text) for text, _ in draws])
            gens = engine.generate_batch(sessions, max_tokens, stop="\n", temperature=temperature,
                                         seed=[seed for _, seed in draws])
            return [g.text for g in gens]
        finally:
            for s in sessions:
                s.release()

    return sample


def engine_responder(engine: Engine, max_tokens: int = 128) -> Responder:
    """RAG responses on the engine (D.2 prompt, greedy, the retrieved texts in retrieval order)."""
    prompt = ChatPrompt(engine.tokenizer, [{"role": "user", "content": RAG_PROMPT}])

    def respond(question: str, materials: Sequence[str]) -> str:
        with engine.prefixes.fork(prompt.head, node_id="gor-rag") as s:
            s.append(prompt.fill(0, "\n\n".join(materials)) + prompt.fill(1, question))
            return s.generate(max_tokens).text.strip()

    return respond
