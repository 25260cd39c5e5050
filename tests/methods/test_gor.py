"""GoR as a method: training (Eq. 8 over a batch by the loss functions, deterministic, the labelled node to rank 1),
the index (chunk wiring of the BERTScore ranking, safetensors + JSON round trip, refusals), which model answers, and
the documents' folds, and on SmolLM2 `nodekv eval` fitting on the other folds before answering one."""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from nodekv.methods.gor.gor import GRAPH_OPTIONS, Gor
from nodekv.methods.gor.gor_store import IndexFileError, tensors_path
from nodekv.methods.gor.gor_train import (GAT, GraphData, PublicGAT, TrainConfig, _batch_loss, info_nce,
                                      pairwise_rank_loss, train_gat)
from nodekv.methods.reader import Answer
from conftest import bare_engine

LETTERS = "abcdefghij"


def _graph(seed: int, n: int = 10, q: int = 3, dim: int = 6) -> GraphData:
    g = torch.Generator().manual_seed(seed)
    edges = torch.randint(0, n, (2, 2 * n), generator=g)
    ranking = torch.stack([torch.randperm(n, generator=g) for _ in range(q)])
    return GraphData(F.normalize(torch.randn(n, dim, generator=g), dim=1), torch.cat([edges, edges.flip(0)], 1),
                     F.normalize(torch.randn(q, dim, generator=g), dim=1), ranking)


def test_batch_loss_is_eq8_with_the_other_graphs_nodes_as_negatives():
    torch.manual_seed(0)
    a, b = _graph(1), _graph(2, n=7)
    gat = GAT(6, 4, heads=2).eval()
    cfg = TrainConfig(hidden=4, heads=2, tau=0.5, alpha=0.3)
    ha, hb = gat(a.features, a.edges), gat(b.features, b.edges)

    def cl(g, h, negatives=None):
        return info_nce(g.queries, h, g.ranking[:, 0], 0.5, negatives)

    def rank(g, h):
        return 0.3 * pairwise_rank_loss(g.queries, h, g.ranking, 0.5)

    both = (cl(a, ha, hb) + rank(a, ha) + cl(b, hb, ha) + rank(b, hb)) / 2
    torch.testing.assert_close(_batch_loss(gat, [a, b], cfg), both)
    own = (cl(a, ha) + rank(a, ha) + cl(b, hb) + rank(b, hb)) / 2
    torch.testing.assert_close(_batch_loss(gat, [a, b], TrainConfig(4, 2, tau=0.5, alpha=0.3, in_batch=False)), own)
    torch.testing.assert_close(_batch_loss(gat, [a], TrainConfig(4, 2, tau=0.5, alpha=0.3, cl=False)), rank(a, ha))


def test_public_batch_loss_forwards_the_graphs_as_one_and_averages_eq7_over_pairs():
    """In training, the public recipe's batch norm normalises over every node of the step: one forward over the
    disjoint union (the second graph's edges shifted by the first's size), then Eq. 8 per graph with L_RANK the mean
    over pairs."""
    torch.manual_seed(0)
    a, b = _graph(1), _graph(2, n=7)
    gat = PublicGAT(6, 6, heads=2).train()
    for layer in gat.layers:
        layer.attn_dropout.p = 0.0  # deterministic, so the loss can be recomputed
    cfg = TrainConfig(hidden=6, heads=2, tau=0.5, alpha=0.3, recipe="public")
    ha, hb = gat(torch.cat([a.features, b.features]), torch.cat([a.edges, b.edges + 10], 1)).split([10, 7])

    def loss(g, h, negatives):
        rank = pairwise_rank_loss(g.queries, h, g.ranking, 0.5) / (len(h) * (len(h) - 1) / 2)
        return info_nce(g.queries, h, g.ranking[:, 0], 0.5, negatives) + 0.3 * rank

    torch.testing.assert_close(_batch_loss(gat, [a, b], cfg), (loss(a, ha, hb) + loss(b, hb, ha)) / 2)
    apart = gat(a.features, a.edges), gat(b.features, b.edges)  # batch norm over each graph alone differs
    assert not torch.allclose(_batch_loss(gat, [a, b], cfg), (loss(a, apart[0], apart[1]) + loss(b, apart[1],
                                                                                                apart[0])) / 2)


def test_training_is_deterministic_and_brings_the_top_ranked_node_to_rank_one():
    graphs = [_graph(s) for s in range(3)]
    cfg = TrainConfig(hidden=16, heads=2, epochs=150, lr=1e-2, batch=2, tau=0.1, alpha=0.0)
    one, two = train_gat(graphs, cfg), train_gat(graphs, cfg)
    for p, r in zip(one.parameters(), two.parameters()):
        assert torch.equal(p, r)
    for g in graphs:
        top = (g.queries @ one(g.features, g.edges).T).argmax(1)
        assert torch.equal(top, g.ranking[:, 0])
    with pytest.raises(ValueError, match="at least one graph with simulated queries"):
        train_gat([GraphData(graphs[0].features, graphs[0].edges, torch.zeros(0, 6), torch.zeros(0, 10).long())], cfg)


# ---- the method on stand-ins -------------------------------------------------------------------------------------
class WordTokenizer:
    """One token per word, ids from a growing vocabulary."""

    def __init__(self):
        self.vocab: list[str] = []

    def encode(self, text):
        for w in text.split():
            if w not in self.vocab:
                self.vocab.append(w)
        return [self.vocab.index(w) for w in text.split()]

    def decode(self, ids):
        return " ".join(self.vocab[i] for i in ids)


class LetterEmbedder:
    """Sentence vector: letter counts a-j; token vectors: each word's letter counts, ids from a stable hash."""

    dim, special_ids = len(LETTERS), frozenset()

    @staticmethod
    def _vec(text):
        return torch.tensor([text.count(c) + 1e-3 for c in LETTERS])

    def encode(self, texts, batch_size=64):
        return F.normalize(torch.stack([self._vec(t) for t in texts]), dim=1)

    def token_embeddings(self, texts, batch_size=64):
        return [([zlib.crc32(w.encode()) for w in t.split()], torch.stack([self._vec(w) for w in t.split()]))
                for t in texts]


@dataclass
class TinyConfig:
    layers: int = 1
    max_seq_len: int = 4096


def _engine():
    return bare_engine(tokenizer=WordTokenizer(), config=TinyConfig(), path=Path("tiny.gguf"),
                       model_id={"name": "tiny.gguf", "config": "0" * 64})


DOC = " ".join(f"{LETTERS[i % 10] * 3}{i}" for i in range(40))  # 40 words: aaa0 bbb1 ... jjj39


def _gor(engine, **options):
    def sample(draws):
        return [f"what about {text.split()[0]} seed {seed % 5}?" for text, seed in draws]

    def respond(question, materials):
        return " ".join(m.split()[0] for m in materials)

    options = {"chunk_tokens": 8, "chunk_overlap": 2, "queries": 4, "attempts": 12, "graph_k": 2, "epochs": 20,
               **options}
    return Gor(engine, embedder=LetterEmbedder(), sampler=sample, responder=respond, **options)


def test_the_index_ranks_each_querys_source_chunk_first_and_round_trips_through_its_files(tmp_path):
    eng = _engine()
    gor = _gor(eng)
    index = gor.index(DOC)
    g = index.graph
    assert g.chunks[0].split() == DOC.split()[:8] and g.chunks[1].split()[:2] == DOC.split()[6:8]  # overlap 2
    assert len(g.queries) == 4 and len(g.responses) == 4 and len(g.edges) == 8
    assert index.ranking.shape == (4, len(g.texts)) and index.features.shape == (len(g.texts), 10)
    assert [int(r[0]) for r in index.ranking] == g.sources  # a chunk's BERTScore against itself is 1
    assert index.gat is None and gor.node_vectors(index)[1] == "this document's graph" and index.gat is not None

    path = tmp_path / "doc.gor"
    gor.save_index(index, path)
    back = gor.load_index(path)
    assert back.graph == g and back.config == index.config and back.gat is None  # the GAT is not saved
    assert set(load_file(str(tensors_path(path)))) == {"features", "queries", "ranking"}
    for name in ("features", "queries", "ranking"):
        assert torch.equal(getattr(back, name), getattr(index, name))
    torch.testing.assert_close(gor.node_vectors(back)[0], gor.node_vectors(index)[0])  # retrained alike (seeded)

    sidecar = tensors_path(path)
    data = sidecar.read_bytes()
    sidecar.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(IndexFileError, match="not the tensor file written with"):
        gor.load_index(path)
    sidecar.unlink()
    with pytest.raises(IndexFileError, match="no tensor file"):
        gor.load_index(path)
    body = json.loads(path.read_text())
    body["graph"]["queries"][0] = "tampered"
    path.write_text(json.dumps(body))
    with pytest.raises(IndexFileError, match="corrupt"):
        gor.load_index(path)


def test_which_model_answers_and_what_is_refused():
    eng = _engine()
    a, b = _gor(eng).index(DOC), _gor(eng).index(DOC[::-1])
    untrained = _gor(eng, train="none")
    vectors, how = untrained.node_vectors(a)
    assert torch.equal(vectors, a.features) and how.startswith("none")
    fitted = _gor(eng)
    fitted.fit([(b, None), (b, None)])  # one document's two records: its graph counts once
    assert fitted.node_vectors(a)[1] == "fitted on 1 other document"
    with pytest.raises(ValueError, match="needs a fit"):
        _gor(eng, supervision="summary").node_vectors(a)
    public = _gor(eng, recipe="public", epochs=2)
    public.fit([(b, None)])
    gat = public._fitted[0]
    assert isinstance(gat, PublicGAT) and public.node_vectors(a)[1] == "fitted on 1 other document"
    chunks = len(a.graph.chunks)
    moved = a.features.clone()
    moved[chunks:] += 1.0  # the responses: no edge leads from a response to a chunk in the public code's graph
    with torch.no_grad():
        torch.testing.assert_close(gat(moved, a.graph.edge_index(both_ways=False))[:chunks],
                                   public.node_vectors(a)[0][:chunks])
        both = a.graph.edge_index()  # the paper recipe's edges would carry the move to the chunks the responses read
        assert not torch.allclose(gat(moved, both)[:chunks], gat(a.features, both)[:chunks])
    with pytest.raises(ValueError, match="document is empty"):
        _gor(eng).index("  ")
    with pytest.raises(ValueError, match="chunk_overlap .* below chunk_tokens"):
        _gor(eng, chunk_overlap=8)
    for seed in (-1, 10**13):  # the engine's sampling takes seed * 1_000_003 + the draw's number in [0, 2**64)
        with pytest.raises(ValueError, match=r"GoR option seed must be in \[0, 1e\+09\]"):
            _gor(eng, seed=seed)
    with pytest.raises(ValueError, match="multiple-choice"):
        _gor(eng).answer(a, "q?", options=("x", "y"))
    assert Gor.dataset_defaults("qmsum_general") == {"alpha": (0.9, "Table 6"), "dropout": (0.2, "Table 6")}


def test_supervision_summary_without_a_fit_is_refused_by_a_check_that_needs_no_model():
    Gor(None).check_without_fit()
    Gor(None, supervision="summary", train="none").check_without_fit()  # the MiniLM vectors need no training
    with pytest.raises(ValueError, match="^GoR supervision=summary trains on other documents' summaries: it needs "
                                         "a fit"):
        Gor(None, supervision="summary").check_without_fit()


@pytest.mark.parametrize("order", ["document", "score"])
def test_the_prompt_shows_the_k_best_nodes_in_document_or_score_order(monkeypatch, order):
    from nodekv.methods.reader import Reader

    shown = {}

    def read(self, context, question, options=(), nodes=(), trace=None, shared_prefix=False):
        shown["context"] = context
        return Answer("", list(nodes), trace)

    monkeypatch.setattr(Reader, "read", read)
    gor = _gor(_engine(), train="none", k=5, order=order)
    index = gor.index(DOC)
    question = "which ccc and ggg?"
    scores = (LetterEmbedder().encode(index.graph.texts) @ LetterEmbedder().encode([question])[0]).tolist()
    best = sorted(range(len(scores)), key=lambda j: -scores[j])[:5]  # by hand: the stand-in vectors, no GAT
    want = sorted(best) if order == "document" else best
    assert sorted(best) != best  # the two orders differ here
    answer = gor.answer(index, question)
    nodes, trace = answer.nodes, answer.trace
    assert nodes == want and shown["context"] == "\n\n".join(index.graph.texts[j] for j in want)
    assert [n["node"] for n in trace[0]["nodes"]] == best  # the trace keeps the retrieval order


def test_rank_fused_takes_the_reciprocal_rank_fusion_with_bm25(monkeypatch):
    """rank=fused: the k nodes with the largest 1/(60 + rank) summed over the vector ranking and BM25's (only nodes
    that share a term with the question), computed here by hand from the two rankings."""
    from nodekv.methods.reader import Reader
    from nodekv.methods.retrieval import BM25Index

    monkeypatch.setattr(Reader, "read", lambda self, context, question, options=(), nodes=(), trace=None:
                        Answer("", list(nodes), trace))
    gor = _gor(_engine(), train="none", k=4, rank="fused")
    index = gor.index(DOC)
    question = "which aaa10 and ggg36?"  # exact words for BM25, letters for the vectors
    scores = (LetterEmbedder().encode(index.graph.texts) @ LetterEmbedder().encode([question])[0]).tolist()
    lexical = BM25Index(index.graph.texts).scores(question).tolist()
    fused = [0.0] * len(scores)
    for ranking in (sorted(range(len(scores)), key=lambda j: (-scores[j], j)),
                    [j for j in sorted(range(len(lexical)), key=lambda j: (-lexical[j], j)) if lexical[j] > 0]):
        for rank, j in enumerate(ranking, 1):
            fused[j] += 1 / (60 + rank)
    want = sorted(range(len(fused)), key=lambda j: (-fused[j], j))[:4]
    assert any(v > 0 for v in lexical) and want != sorted(range(len(scores)), key=lambda j: -scores[j])[:4]
    assert [n["node"] for n in gor.answer(index, question).trace[0]["nodes"]] == want


def test_documents_are_dealt_into_folds_in_order_of_first_appearance():
    from nodekv.evaluation.runner import document_folds, document_hash

    records = [SimpleNamespace(document=d) for d in "aabcdefgc"]
    folds = document_folds(records, 3)
    assert folds == {document_hash(d): i % 3 for i, d in enumerate("abcdefg")}


def _meetings_and_argv(root) -> list[str]:
    """Three QMSum-style meetings under root/data, and the `nodekv eval` arguments of a small GoR run on them."""
    meetings = [{"meeting_transcripts": [{"speaker": "A", "content": f"We discuss the {topic} budget. " * 30},
                                         {"speaker": "B", "content": f"The {topic} plan needs more staff. " * 30}],
                 "general_query_list": [{"query": "Summarize the whole meeting.", "answer": f"The {topic} budget."}],
                 "specific_query_list": []} for topic in ("remote", "design", "market")]
    (root / "data" / "qmsum").mkdir(parents=True)
    (root / "data" / "qmsum" / "qmsum.jsonl").write_text("".join(json.dumps(m) + "\n" for m in meetings))
    return ["eval", "--method", "gor", "--dataset", "qmsum_general", "--data-dir", str(root / "data"),
            "--model", "smollm2-135m", "--option", "queries=2", "--option", "attempts=4", "--option",
            "query_tokens=16", "--option", "response_tokens=8", "--option", "epochs=3", "--label", "gor",
            "--max-new-tokens", "32", "--threads", "1"]  # summaries of 32 tokens, not the prompt's 512


def _rows(out) -> list[dict]:
    return [json.loads(x) for x in (out / "gor-qmsum_general.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def local_run(tmp_path_factory) -> tuple[list[str], Path]:
    """The small GoR run of `_meetings_and_argv`, run once locally: its arguments (without --out) and its out dir."""
    from nodekv.cli import main as cli_main

    root = tmp_path_factory.mktemp("gor-eval")
    argv = _meetings_and_argv(root)
    assert cli_main([*argv, "--out", str(root / "local")]) == 0
    return argv, root / "local"


@pytest.mark.model
def test_eval_fits_on_the_other_folds_before_answering_one(local_run, capsys):
    """... and a run file is resumed only over the records its folds were dealt over: resuming it over fewer (or
    more) would mix answers fitted on different numbers of documents under one label."""
    from nodekv.cli import main as cli_main

    argv, out = local_run
    rows = _rows(out)
    assert [r["id"] for r in rows] == ["0-g0", "1-g0", "2-g0"] and all("error" not in r for r in rows)
    assert all(r["trace"][0]["model"] == "fitted on 2 other documents" and r["fit_s"] >= 0 for r in rows)
    assert len({r["document"] for r in rows}) == 3 and all(r["index_flops"] > 0 for r in rows)
    assert len(list((out / "indexes").glob("*.safetensors"))) == 3

    written = (out / "gor-qmsum_general.jsonl").read_text()
    capsys.readouterr()
    assert cli_main([*argv, "--out", str(out), "--limit", "2"]) == 2
    assert "records 3 now 2 (the folds are dealt over the run's records)" in capsys.readouterr().err
    assert (out / "gor-qmsum_general.jsonl").read_text() == written


@pytest.mark.model
def test_eval_on_ray_builds_the_graphs_on_the_workers_and_answers_as_a_local_run(local_run, tmp_path):
    """With two Ray workers building the graphs, the graph files are byte for byte the local run's and the lines
    are the local run's, times and index costs aside: a graph's FLOPs depend on what its builder's engine had cached
    (`Engine.prefixes` holds the simulation prompt's opening from the document built before it on that engine)."""
    pytest.importorskip("ray", reason="the ray extra is not installed")
    from nodekv.cli import main as cli_main

    argv, local_out = local_run
    ray_out = tmp_path / "ray"
    assert cli_main([*argv, "--out", str(ray_out), "--ray", "--workers", "2"]) == 0
    varying = ("wall_s", "index_s", "prompt_s", "fit_s", "index_flops", "index_flops_8b", "index_tokens")
    local, ray = ([{k: v for k, v in r.items() if k not in varying} for r in _rows(out)]
                  for out in (local_out, ray_out))
    assert ray == local and len(ray) == 3
    graphs = [{p.name: p.read_bytes() for p in (out / "indexes").iterdir() if p.suffix != ".json"}
              for out in (local_out, ray_out)]  # the .json beside each graph holds its build time
    assert graphs[1] == graphs[0] and len(graphs[0]) == 6
    assert cli_main([*argv, "--out", str(ray_out), "--ray"]) == 0  # the rerun finds nothing left to do
    assert len(_rows(ray_out)) == 3


def test_kv_reuse_stores_every_node_once_and_places_the_k_retrieved(hf_tiny, tmp_path):
    """With kv_reuse the index stores the KV of every node (chunks, then responses) as the reader places it; an
    answer places the k retrieved nodes, in the order the kv-free answer reads them; the index round-trips through
    its files with its node store; kv_reuse=off keeps the index key of the saved kv-free graphs, and a store written
    without KV is refused by name with kv_reuse on."""
    from char_engine import char_engine
    from nodekv.engine.node_store import NodeStoreError
    from nodekv.methods.prompts import PromptSpec

    eng = char_engine(hf_tiny[1])
    spec = PromptSpec("{context}|{question}", 4)

    def gor(**options):
        return _gor(eng, prompt=spec, train="none", k=2, **options)

    off, blend = gor(), gor(kv_reuse="blend", repair=0.5, kv_dtype="float32")
    assert off.index_key() == {k: getattr(off.config, k) for k in GRAPH_OPTIONS}
    assert blend.index_key() == {**off.index_key(), "kv_dtype": "float32", "kv_context": "document"}
    index = blend.index(DOC[:60])
    texts = index.graph.texts
    assert len(index.stored) == len(texts)
    for text, node in zip(texts, index.stored):
        assert list(node.tokens) == blend.reader.passage_ids(text)
    question = "which ccc?"
    want, got = off.answer(index, question), blend.answer(index, question)
    assert got.nodes == want.nodes and len(got.nodes) == 2
    last = got.trace[-1]
    assert [n["node"] for n in last["nodes"]] == got.nodes and last["repaired"] == round(0.5 * last["placed"])
    assert last["placed"] == sum(len(blend.reader.passage_ids(texts[j])) for j in got.nodes)

    blend.save_index(index, tmp_path / "doc.gor")
    back = blend.load_index(tmp_path / "doc.gor")
    assert len(back.stored.ids) == len(texts)
    for j, node in enumerate(index.stored):
        assert torch.equal(back.stored[j].k, node.k) and torch.equal(back.stored[j].v, node.v)
    again = blend.answer(back, question)
    assert (again.text, again.nodes, again.flops) == (got.text, got.nodes, got.flops)
    assert off.load_index(tmp_path / "doc.gor").stored is None
    off.save_index(off.index(DOC[:60]), tmp_path / "off.gor")
    with pytest.raises(NodeStoreError, match="indexed with kv_reuse=off"):
        blend.load_index(tmp_path / "off.gor")
