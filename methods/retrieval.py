"""Retrieval building blocks: chunking a document by LLM tokens, BM25 (via `bm25s`), dense (MiniLM) and
their reciprocal rank fusion, top-k.

Every `search(query, k)` returns ``[(chunk_index, score), ...]``, best first, ties broken by the lower index,
at most `k` (fewer when the corpus is smaller).
"""
from __future__ import annotations

import logging
import re
from typing import Protocol, Sequence

import numpy as np
import torch

from .embedder import Embedder, default_embedder_path

__all__ = ["BM25Index", "DenseIndex", "Embedder", "HybridIndex", "chunk_text", "chunk_tokens", "default_embedder_path",
           "rank_fusion", "similarity", "text_chunk_spans"]


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def chunk_tokens(ids: Sequence[int], size: int, overlap: int = 0) -> list[tuple[int, int]]:
    """Spans ``(start, end)`` of consecutive windows of `size` tokens, each starting `size - overlap` after the
    previous; the last one ends at ``len(ids)`` and may be shorter. No empty span; ``[]`` for no tokens."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"chunk size must be a positive int, got {size!r}")
    if isinstance(overlap, bool) or not isinstance(overlap, int) or not 0 <= overlap < size:
        raise ValueError(f"overlap must be an int in [0, size={size}), got {overlap!r}")
    n, step, spans = len(ids), size - overlap, []
    start = 0
    while start < n:
        spans.append((start, min(start + size, n)))
        if start + size >= n:
            break
        start += step
    return spans


_PARAGRAPH_END = re.compile(r"\n[ \t]*\n\s*$")
_SENTENCE_END = re.compile(r"[.!?\u3002\uff01\uff1f][\"')\]\u201d\u2019]*\s*$")


def _boundary_rank(tail: str) -> int:
    """2 if text ending at a cut ends a paragraph (a blank line), 1 if it ends a sentence, else 0."""
    return 2 if _PARAGRAPH_END.search(tail) else 1 if _SENTENCE_END.search(tail) else 0


def _splits_char(ids: list[int], j: int, tokenizer: TextTokenizer) -> bool:
    """Whether cutting before ids[j] splits a character's bytes (byte-level BPE): decoding the two sides apart
    then makes more U+FFFD than decoding them together."""
    left, right = ids[max(0, j - 4):j], ids[j:j + 4]
    apart = tokenizer.decode(left) + tokenizer.decode(right)
    return apart.count("\ufffd") > tokenizer.decode(left + right).count("\ufffd")


def text_chunk_spans(ids: Sequence[int], tokenizer: TextTokenizer, size: int) -> list[tuple[int, int]]:
    """Token spans ``(start, end)`` covering `ids` without overlap, each of at most `size` tokens.

    Cut rule: a chunk ends at ``start + size`` unless a better cut lies in its last quarter (the
    ``max(1, size // 4)`` tokens before that point): the latest cut after a blank line (paragraph break), else
    the latest after a sentence end (``. ! ?``, maybe followed by closing quotes/brackets and whitespace), else
    ``start + size`` itself; the text before a cut is judged from its last two tokens, so "e.g." and "3.14"
    can pass for sentence ends. A cut that would split a character's bytes across tokens (byte-level BPE)
    moves back to the closest cut that does not (a character is split only when no such cut is left in the
    chunk, i.e. for `size` below a few tokens). So all chunks but the last normally hold at least
    ``size - size // 4`` tokens, a few fewer next to multi-token characters; none is empty.
    Cost: one single-token decode per token in the look-back windows plus three short decodes per cut.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"chunk size must be a positive int, got {size!r}")
    ids = list(ids)
    n, window, spans, start = len(ids), max(1, size // 4), [], 0
    while start < n:
        end = start + size
        if end >= n:
            spans.append((start, n))
            break
        lo = max(start + 1, end - window)
        pieces = {j: tokenizer.decode([ids[j - 1]]) for j in range(max(1, lo - 1), end + 1)}  # token before cut j
        ranks = {j: _boundary_rank(pieces.get(j - 1, "") + pieces[j]) for j in range(lo, end + 1)}
        best = max(range(end, lo - 1, -1), key=ranks.__getitem__)  # the latest of the highest rank
        end = best if ranks[best] > 0 else end
        end = next((j for j in range(end, start, -1) if not _splits_char(ids, j, tokenizer)), end)
        spans.append((start, end))
        start = end
    return spans


def chunk_text(text: str, tokenizer: TextTokenizer, size: int) -> list[str]:
    """Split `text` into chunks of about `size` LLM tokens (at most `size`), cut at token boundaries with a
    preference for paragraph, then sentence ends (rule: `text_chunk_spans`). Each chunk is the decoded text of
    its tokens, so ``"".join(chunks)`` is `text` (up to whitespace at the cuts for tokenizers whose decode
    strips a leading space). A document without tokens gives ``[]``."""
    if not isinstance(text, str):
        raise TypeError(f"chunk_text expects a str, got {type(text).__name__}")
    ids = tokenizer.encode(text)
    return [tokenizer.decode(ids[a:b]) for a, b in text_chunk_spans(ids, tokenizer, size)]


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
    idf = ln(1 + (N - df + 0.5) / (df + 0.5))). Text is lower-cased, split into words of 2+ word characters
    (``\\b\\w\\w+\\b``) and English stopwords are dropped, for chunks and queries alike. A query with no
    indexed term scores every chunk 0 (so the ranking is index order); an empty query is a ValueError."""

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
        return self._bm25s.tokenize(texts, lower=True, stopwords="en", return_ids=False, show_progress=False)

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
        dense, lexical = self.dense.scores(query), self.bm25.scores(query)
        by_terms = np.argsort(-lexical, kind="stable")
        return rank_fusion([np.argsort(-dense, kind="stable"), by_terms[lexical[by_terms] > 0]], len(self.chunks))

    def search(self, query: str, k: int) -> list[tuple[int, float]]:
        return _top_k(self.scores(query), k)
