"""Ranking chunks for a query: BM25 (via `bm25s`), dense (MiniLM cosine) and their reciprocal rank fusion, top-k.

Every `search(query, k)` returns ``[(chunk_index, score), ...]``, best first, ties broken by the lower index,
at most `k` (fewer when the corpus is smaller).
"""
from __future__ import annotations

import logging
from typing import Sequence

import numpy as np
import torch

from .chunking import HAN_KANA
from .embedder import Embedder


# each Han or kana character is a term (unigrams, as in Lucene's StandardAnalyzer), other words are runs of 2+ word
# characters as in bm25s's default pattern (\b\w\w+\b, which makes a whole Chinese sentence one term that no
# question matches)
_WORD = rf"[^\W{HAN_KANA}]"
TOKEN_PATTERN = rf"(?u)[{HAN_KANA}]|(?<!{_WORD}){_WORD}{{2,}}(?!{_WORD})"


def _top_k(scores: np.ndarray, k: int) -> list[tuple[int, float]]:
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k must be a non-negative int, got {k!r}")
    order = np.argsort(-scores, kind="stable")[:k]  # stable: equal scores keep index order
    return [(int(i), float(scores[i])) for i in order]


def _check_corpus(chunks: Sequence[str]) -> list[str]:
    if isinstance(chunks, str) or not all(isinstance(c, str) for c in chunks):
        raise TypeError("chunks must be a list of strings")
    if len(chunks) == 0:
        raise ValueError("cannot index an empty list of chunks")
    return list(chunks)


def _check_query(query: str) -> None:
    if not isinstance(query, str):
        raise TypeError(f"query must be a str, got {type(query).__name__}")
    if not query.strip():
        raise ValueError("empty query: nothing to search for")


class BM25Index:
    """Okapi BM25 over chunks with `bm25s` (its defaults: Lucene variant, k1=1.5, b=0.75,
    idf = ln(1 + (N - df + 0.5) / (df + 0.5))). Text is lower-cased, split into words of 2+ word characters and
    single Han or kana characters (`TOKEN_PATTERN`) and English stopwords are dropped, for chunks and queries alike.
    A query with no indexed term scores every chunk 0 (so the ranking is index order); an empty query is a
    ValueError."""

    def __init__(self, chunks: Sequence[str], k1: float = 1.5, b: float = 0.75) -> None:
        import bm25s

        logging.getLogger("bm25s").setLevel(logging.WARNING)  # bm25s sets DEBUG and logs every index build
        self.chunks = _check_corpus(chunks)
        self._bm25s = bm25s
        terms = self.tokenize(self.chunks)
        self.retriever = bm25s.BM25(k1=k1, b=b) if any(terms) else None  # None: not one term to index
        if self.retriever is not None:
            self.retriever.index(terms, show_progress=False)

    def tokenize(self, texts: list[str]) -> list[list[str]]:
        return self._bm25s.tokenize(texts, lower=True, token_pattern=TOKEN_PATTERN, stopwords="en", return_ids=False,
                                    show_progress=False)

    def __len__(self) -> int:
        return len(self.chunks)

    def scores(self, query: str) -> np.ndarray:
        """BM25 score of every chunk for `query`, float32 [len(chunks)]."""
        _check_query(query)
        if self.retriever is None:
            return np.zeros(len(self.chunks), dtype=np.float32)
        term_ids = self.retriever.get_tokens_ids(self.tokenize([query])[0])
        if not term_ids:
            return np.zeros(len(self.chunks), dtype=np.float32)
        return np.asarray(self.retriever.get_scores_from_ids(term_ids), dtype=np.float32)

    def search(self, query: str, k: int) -> list[tuple[int, float]]:
        return _top_k(self.scores(query), k)


def similarity(query_vec: torch.Tensor, vecs: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of `query_vec` [d] (or [m, d]) with each row of `vecs` [n, d]: [n] (or [m, n])."""
    q, v = torch.as_tensor(query_vec, dtype=torch.float32), torch.as_tensor(vecs, dtype=torch.float32)
    if v.ndim != 2 or q.ndim not in (1, 2) or q.shape[-1] != v.shape[1]:
        raise ValueError(f"similarity needs query [d] or [m, d] and vecs [n, d], "
                         f"got {tuple(q.shape)} and {tuple(v.shape)}")
    qn = torch.nn.functional.normalize(q, dim=-1)
    return qn @ torch.nn.functional.normalize(v, dim=1).T


class DenseIndex:
    """Chunks embedded once with `embedder` (an `Embedder`, loaded by default); `search` ranks them by cosine
    similarity with the embedded query. Chunks longer than the embedder's limit are embedded by their head."""

    def __init__(self, chunks: Sequence[str], embedder: Embedder | None = None, batch_size: int = 64) -> None:
        self.chunks = _check_corpus(chunks)
        self.embedder = embedder if embedder is not None else Embedder()
        self.vecs = self.embedder.encode(self.chunks, batch_size=batch_size)

    def __len__(self) -> int:
        return len(self.chunks)

    def scores(self, query: str) -> np.ndarray:
        """Cosine similarity of every chunk with `query`, float32 [len(chunks)]."""
        _check_query(query)
        return similarity(self.embedder.encode([query])[0], self.vecs).numpy()

    def search(self, query: str, k: int) -> list[tuple[int, float]]:
        return _top_k(self.scores(query), k)


RRF_K = 60  # Cormack, Clarke and Buettcher (SIGIR 2009), the usual constant


def rank_fusion(rankings: Sequence[np.ndarray], n: int) -> np.ndarray:
    """Reciprocal rank fusion: Σ over the rankings that hold chunk i of 1 / (RRF_K + its rank), ranks from 1; each
    ranking is an array of chunk ids, best first. float32 [n]."""
    fused = np.zeros(n, dtype=np.float64)
    for ranking in rankings:
        fused[np.asarray(ranking, dtype=np.int64)] += 1.0 / (RRF_K + np.arange(1, len(ranking) + 1))
    return fused.astype(np.float32)


def fuse_with_bm25(scores: np.ndarray, lexical: np.ndarray) -> np.ndarray:
    """The ranking by `scores` (dense similarities, or any score, higher first) fused by reciprocal rank with BM25's
    (`lexical`, BM25Index.scores), which ranks only the chunks that share a term with the query. float32 [n]."""
    by_terms = np.argsort(-lexical, kind="stable")
    return rank_fusion([np.argsort(-scores, kind="stable"), by_terms[lexical[by_terms] > 0]], len(scores))


class HybridIndex:
    """Dense and BM25 rankings fused by reciprocal rank (`rank_fusion`). BM25 ranks only the chunks that share a
    term with the query, so a query of rare exact tokens (a name, a number: what the bi-encoder blurs) lifts the
    chunks that hold them, and a query with no indexed term falls back to the dense ranking alone."""

    def __init__(self, chunks: Sequence[str], embedder: Embedder | None = None, batch_size: int = 64) -> None:
        self.dense = DenseIndex(chunks, embedder, batch_size)
        self.bm25 = BM25Index(self.dense.chunks)
        self.chunks = self.dense.chunks

    def __len__(self) -> int:
        return len(self.chunks)

    def scores(self, query: str) -> np.ndarray:
        """The fused score of every chunk for `query`, float32 [len(chunks)]."""
        return fuse_with_bm25(self.dense.scores(query), self.bm25.scores(query))

    def search(self, query: str, k: int) -> list[tuple[int, float]]:
        return _top_k(self.scores(query), k)
