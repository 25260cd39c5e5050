"""GoR, graph of records (gor.txt), as a method: the graph is built by the engine, the GAT trained in plain PyTorch.

index(document): chunks of 256 LLM tokens overlapping by 32 (the paper's TokenTextSplitter setting, counted in the
engine's tokenizer); `queries` simulated queries (D.1, temperature 0.5, seeded, at most `attempts` draws); the graph
of records (Eq. 3: `graph_k` nodes retrieved per round over the chunks and earlier responses, a greedy D.2 response
linked to each); MiniLM vectors of every node and query; each query's nodes ranked by BERTScore F1 against its
source chunk (Eq. 4, idf over the graph's texts, precomputed as App. A.4 does). A GAT trained on this graph alone
(Eq. 8) answers when no fit has run; it is trained when first needed (31 s for a 42-node graph on a busy core) and
not saved.
fit(examples): the paper trains one GAT over many documents' graphs, in mini-batches whose other graphs give
in-batch negatives. `nodekv eval` deals the run's documents into 5 folds and calls fit with the other folds'
documents before answering a fold's questions, so no document's own graph or reference trains the model that
answers it (a fit is 150 epochs over a dozen graphs: one per fold, not one per document, keeps it cheap); with
`supervision=summary` (Table 3's "w/ sup") those other documents' questions and reference summaries replace the
simulated queries. Without a fit (`nodekv ask`), the document's own GAT answers; the trace says which model did.
answer(index, query): the query by MiniLM; the top `k` nodes by inner product with the learned node embeddings
(`train=none`: the MiniLM vectors); the dataset's prompt over them in that order; greedy. With `kv_reuse` (beyond the
paper) every node's KV is stored at indexing and the retrieved nodes are placed instead of prefilled.

The paper's Contriever (768-d), DGL and DeBERTa BERTScore are replaced by all-MiniLM-L6-v2 (384-d, also the GAT's
hidden size), plain PyTorch and MiniLM's own token embeddings.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

import torch

from ...engine.engine import Engine
from ..base import Answer, Method
from ..reader import KV_REUSE_OPTIONS, Repair, kv_index_key, store_kv_nodes
from .gor_graph import RecordGraph, build_records, engine_responder, engine_sampler, simulate_queries
from .gor_store import FORMAT, GorIndex, load, save
from .gor_train import GraphData, TrainConfig, bertscore_ranking, idf_weights, train_gat
from ..options import Option
from ..prompts import PromptSpec
from ..retrieval import BM25Index, chunk_tokens, fuse_with_bm25

# Table 6's α and dropout; GovReport and Multi-News are not in it: the nearest kind stands in (AcademicEval's long
# single documents, WCEP's multi-document news).
TABLE6 = {"qmsum": (0.9, 0.2), "qmsum_general": (0.9, 0.2), "gov_report_summ": (0.6, 0.0), "multi_news": (0.7, 0.1)}
GRAPH_OPTIONS = ("chunk_tokens", "chunk_overlap", "queries", "attempts", "temperature", "query_tokens",
                 "response_tokens", "graph_k", "seed")


class Gor(Method, name="gor", title="GoR"):
    """GoR: retrieval over a graph of the document's chunks and the LLM's responses to simulated queries, with node
    embeddings learned by a GAT (self-supervised by BERTScore).

    `embedder` replaces the packaged MiniLM; `sampler` and `responder` replace the engine's query simulation and
    RAG responses (tests script them)."""

    can_save, index_file_format = True, FORMAT
    learns_across_documents = True
    options = (
        Option("chunk_tokens", int, 256, "LLM tokens per chunk", low=1),
        Option("chunk_overlap", int, 32, "tokens a chunk shares with the previous one", low=0),
        Option("queries", int, 30, "distinct simulated queries per document", low=1),
        Option("attempts", int, 120, "simulation draws at most (a short or repetitive document ends early)", low=1),
        Option("temperature", float, 0.5, "query simulation sampling temperature", low=0.0),
        Option("query_tokens", int, 64, "tokens of a simulated query at most", low=1),
        Option("response_tokens", int, 128, "tokens of a RAG response at most", low=1),
        Option("graph_k", int, 6, "K: nodes retrieved per RAG round while the graph is built", low=1),
        Option("k", int, 6, "nodes retrieved for the answer", low=1),
        Option("order", str, "document", "the retrieved nodes in the prompt: document (chunks in document order, "
               "then responses in the order they were made, as the baselines show their chunks) or score",
               choices=("document", "score")),
        Option("rank", str, "gat", "gat: nodes by their GAT vectors' similarity to the query (the paper); fused "
               "(beyond the paper): that ranking fused by reciprocal rank with BM25's over the node texts",
               choices=("gat", "fused")),
        # each draw samples with seed * 1_000_003 + its number, which the engine takes in [0, 2**64)
        Option("seed", int, 0, "seed of the chunk draws, the sampling and the GAT's training", low=0, high=10**9),
        Option("train", str, "gat", "gat: learned node embeddings; none: the MiniLM vectors (Table 3's w/o train)",
               choices=("gat", "none")),
        Option("supervision", str, "self", "self: simulated queries ranked against their chunks; summary: other "
               "documents' reference summaries (Table 3's w/ sup; needs a fit)", choices=("self", "summary")),
        Option("cl", bool, True, "the contrastive loss L_CL (Eq. 6)"),
        Option("alpha", float, 0.9, "α, the weight of the pair-wise ranking loss L_RANK (Eq. 7)", low=0.0),
        Option("in_batch", bool, True, "other graphs' nodes as in-batch negatives"),
        Option("tau", float, 1.0, "τ of s(q, h) = exp(qᵀh / τ)", low=1e-6),
        Option("dropout", float, 0.2, "GAT dropout", low=0.0, high=1.0),  # torch refuses p > 1
        Option("epochs", int, 150, "training epochs", low=1),
        Option("batch", int, 32, "graphs per training step", low=1),
        Option("lr", float, 1e-3, "Adam's learning rate, decayed to 0", low=0.0),
        Option("recipe", str, "paper", "paper: Eq. 7 summed over ranked pairs, edges both ways, the GAT's first "
               "layer's heads concatenated (ELU) and its second's averaged; public (the authors' code): Eq. 7 "
               "averaged over pairs, edges from a retrieved node to its response only, each layer's heads "
               "averaged after batch norm and PReLU, the max over the layers", choices=("paper", "public"),
               before="paper"),
        *KV_REUSE_OPTIONS,
    )

    def __init__(self, engine: Engine, prompt: PromptSpec | None = None, progress: bool = False, embedder=None,
                 sampler=None, responder=None, **options):
        super().__init__(engine, prompt, progress, **options)
        self._embedder, self._sampler, self._responder = embedder, sampler, responder
        self._fitted: tuple[Any, int] | None = None  # (GAT, documents it was trained on)

    @classmethod
    def configure(cls, **options: Any) -> Any:
        """`Method.configure`, with chunk_overlap below chunk_tokens (so the CLI refuses it before the model loads)."""
        config = super().configure(**options)
        if config.chunk_overlap >= config.chunk_tokens:
            raise ValueError(f"GoR option chunk_overlap ({config.chunk_overlap}) must be below chunk_tokens "
                             f"({config.chunk_tokens})")
        return config

    @classmethod
    def dataset_defaults(cls, dataset):
        if dataset not in TABLE6:
            return {}
        alpha, dropout = TABLE6[dataset]
        return {"alpha": (alpha, "Table 6"), "dropout": (dropout, "Table 6")}

    def index_key(self) -> dict:
        return {**{k: getattr(self.config, k) for k in GRAPH_OPTIONS}, **kv_index_key(self.config)}

    @property
    def embedder(self):
        if self._embedder is None:
            from ..retrieval.embedder import Embedder

            self._embedder = Embedder.shared()
        return self._embedder

    def train_config(self) -> TrainConfig:
        c = self.config
        return TrainConfig(hidden=int(self.embedder.dim), dropout=c.dropout, epochs=c.epochs, lr=c.lr, batch=c.batch,
                           tau=c.tau, alpha=c.alpha, cl=c.cl, in_batch=c.in_batch, seed=c.seed, recipe=c.recipe)

    def chunks(self, document: str) -> list[str]:
        tok, c = self.engine.tokenizer, self.config
        ids = tok.encode(document)
        return [tok.decode(ids[a:b]) for a, b in chunk_tokens(ids, c.chunk_tokens, c.chunk_overlap)]

    def index(self, document: str) -> GorIndex:
        c = self.config
        graph = RecordGraph(self.chunks(document))
        sample = self._sampler or engine_sampler(self.engine, c.query_tokens, c.temperature)
        simulate_queries(graph, sample, c.queries, c.seed, c.attempts)
        build_records(graph, self._responder or engine_responder(self.engine, c.response_tokens), self._encode,
                      c.graph_k)
        texts = graph.texts
        tokens = self.embedder.token_embeddings(texts)
        idf = idf_weights([ids for ids, _ in tokens], set(self.embedder.special_ids))
        ranking = bertscore_ranking(tokens, [tokens[s] for s in graph.sources], idf)
        index = GorIndex(graph, self._encode(texts), self._encode(graph.queries), ranking,
                         config={k: getattr(c, k) for k in GRAPH_OPTIONS})
        return index if c.kv_reuse == "off" else self.store_kv(index)

    def store_kv(self, index: GorIndex) -> GorIndex:
        """Each node's KV (chunks in document order, then responses) as the reader places it."""
        nodes = [self.reader.passage_ids(t) for t in index.graph.texts]
        return replace(index, stored=store_kv_nodes(self.engine, nodes, self.config))

    def _trained(self, index: GorIndex) -> GorIndex:
        """`index` with a GAT trained on its own graph under the current training options (kept if it has one)."""
        wanted = self.train_config()
        if self.config.train == "gat" and index.trained_with != wanted and len(index.queries):
            index.gat, index.trained_with = train_gat([self._data(index, index.queries, index.ranking)], wanted), wanted
        return index

    def fit(self, examples: Sequence[tuple[GorIndex, Any]]) -> None:
        """Train the GAT that answers from now on over the graphs of `examples` ((index, record) pairs of other
        documents); `supervision=summary` ranks each document's nodes against its records' references."""
        if self.config.train == "none":
            return
        graphs, seen = [], set()
        for index, record in examples:
            if self.config.supervision == "self":
                if id(index) not in seen:
                    seen.add(id(index))
                    graphs.append(self._data(index, index.queries, index.ranking))
                continue
            tokens = self.embedder.token_embeddings(index.graph.texts + list(record.references))
            idf = idf_weights([ids for ids, _ in tokens], set(self.embedder.special_ids))
            nodes, refs = tokens[:len(index.graph.texts)], tokens[len(index.graph.texts):]
            rank = bertscore_ranking(nodes, refs[:1], idf)  # the first reference, as the query's one label
            graphs.append(self._data(index, self._encode([record.question]), rank))
        graphs = [g for g in graphs if len(g.queries)]
        self._fitted = (train_gat(graphs, self.train_config()), len(seen) or len(graphs)) if graphs else None

    def check_without_fit(self) -> None:
        if self.config.train == "gat" and self.config.supervision == "summary":
            raise ValueError("GoR supervision=summary trains on other documents' summaries: it needs a fit "
                             "(nodekv eval runs one), not a single document")

    def node_vectors(self, index: GorIndex) -> tuple[torch.Tensor, str]:
        """The embeddings retrieval ranks by, and which model made them."""
        if self.config.train == "none":
            return index.features, "none (MiniLM vectors)"
        if self._fitted is not None:
            gat, docs = self._fitted
            how = f"fitted on {docs} other document{'s' if docs != 1 else ''}"
        else:
            self.check_without_fit()
            gat, how = self._trained(index).gat, "this document's graph"
        if gat is None:  # no simulated query: nothing trained it
            return index.features, "none (no simulated queries)"
        with torch.no_grad():
            return gat(index.features, self._edges(index)), how

    def answer(self, index: GorIndex, question: str, options: tuple[str, ...] = ()) -> Answer:
        if options:
            raise ValueError("GoR answers open queries; multiple-choice options are not supported")
        vectors, model = self.node_vectors(index)
        scores = vectors @ self._encode([question])[0]
        if self.config.rank == "fused":
            scores = torch.from_numpy(fuse_with_bm25(scores.numpy(), BM25Index(index.graph.texts).scores(question)))
        top = torch.argsort(-scores, stable=True)[:self.config.k].tolist()
        texts, chunks = index.graph.texts, len(index.graph.chunks)
        shown = sorted(top) if self.config.order == "document" else top  # chunk ids run in document order
        trace = [{"model": model, "nodes": [{"node": j, "kind": "chunk" if j < chunks else "response",
                                            "score": round(float(scores[j]), 4)} for j in top]}]
        context = "\n\n".join(texts[j] for j in shown)
        if index.stored is None:
            return self.reader.read(context, question, (), shown, trace)
        return self.reader.read_stored([index.stored[j] for j in shown], question, (), shown, trace,
                                       Repair.of(self.config), context)

    def save_index(self, index: GorIndex, path) -> None:
        save(index, path, self.engine, self.config.kv_dtype)

    def load_index(self, path) -> GorIndex:
        """The saved index; its node store is opened (nodes read when used) only with `kv_reuse`."""
        return load(path, self.engine, kv=self.config.kv_reuse != "off")

    def describe(self, index: GorIndex) -> list[str]:
        g = index.graph
        return [f"{len(g.chunks)} chunks, {len(g.queries)} simulated queries ({g.draws} draws), "
                f"{len(g.responses)} responses, {len(g.edges)} edges",
                f"GAT: {'trained on this graph' if index.gat is not None else 'trained on this graph when asked'}"]

    def _edges(self, index: GorIndex) -> torch.Tensor:
        return index.graph.edge_index(both_ways=self.config.recipe == "paper")

    def _data(self, index: GorIndex, queries: torch.Tensor, ranking: torch.Tensor) -> GraphData:
        return GraphData(index.features, self._edges(index), queries, ranking)

    def _encode(self, texts: list[str]) -> torch.Tensor:
        if not texts:
            return torch.zeros(0, int(self.embedder.dim))
        return self.embedder.encode(list(texts))
