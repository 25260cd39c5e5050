"""Baselines on the same engine, so that FLOPs compare: the full document in context (cut in the middle to the
window, as LongBench does), and BM25 / dense (all-MiniLM-L6-v2) top-k chunks in one prompt."""
from __future__ import annotations

from dataclasses import dataclass

from ..engine.engine import Engine
from .base import Answer, generate_answer, prompt_ids
from .prompts import PromptSpec, prompt_for
from .retrieval import BM25Index, DenseIndex, text_chunk_spans


class FullContext:
    """The whole document in the prompt (middle-truncated to the model's window when longer)."""

    name = "full"

    def __init__(self, engine: Engine, prompt: PromptSpec | None = None):
        self.engine, self.prompt = engine, prompt or prompt_for("")

    def index(self, document: str) -> str:
        return _check_document(document)

    def answer(self, index: str, question: str, options: tuple[str, ...] = ()) -> Answer:
        ids, truncated = prompt_ids(self.engine, self.prompt, index, question, options)
        return generate_answer(self.engine, ids, self.prompt, ["document"], truncated)


@dataclass
class ChunkIndex:
    """A document cut into chunks of about `chunk_tokens` LLM tokens, with a BM25 or dense index over them."""

    chunks: list[str]
    search: BM25Index | DenseIndex


class TopK:
    """Retrieve the k best chunks for the question and answer from them (kept in document order: the model reads
    the passages as they were written). `retriever` is "bm25" or "dense"."""

    def __init__(self, engine: Engine, retriever: str, k: int = 5, chunk_tokens: int = 300,
                 prompt: PromptSpec | None = None, embedder=None):
        if retriever not in ("bm25", "dense"):
            raise ValueError(f"retriever must be 'bm25' or 'dense', got {retriever!r}")
        if k < 1 or chunk_tokens < 1:
            raise ValueError(f"k and chunk_tokens must be >= 1, got {k} and {chunk_tokens}")
        self.engine, self.retriever, self.k, self.chunk_tokens = engine, retriever, k, chunk_tokens
        self.prompt = prompt or prompt_for("")
        self.name = f"{retriever}-top{k}"
        self._embedder = embedder

    def index(self, document: str) -> ChunkIndex:
        tok = self.engine.tokenizer
        ids = tok.encode(_check_document(document))
        chunks = [tok.decode(ids[a:b]) for a, b in text_chunk_spans(ids, tok, self.chunk_tokens)]
        if self.retriever == "bm25":
            return ChunkIndex(chunks, BM25Index(chunks))
        if self._embedder is None:
            from .embedder import Embedder

            self._embedder = Embedder()
        return ChunkIndex(chunks, DenseIndex(chunks, self._embedder))

    def prompt_for(self, index: ChunkIndex, question: str, options: tuple[str, ...] = ()):
        """(prompt ids, truncated, hits): the k best chunks, in document order, in the dataset's prompt."""
        hits = index.search.search(question, self.k)
        context = "\n\n".join(index.chunks[i].strip() for i in sorted(i for i, _ in hits))
        return (*prompt_ids(self.engine, self.prompt, context, question, options), hits)

    def answer(self, index: ChunkIndex, question: str, options: tuple[str, ...] = ()) -> Answer:
        ids, truncated, hits = self.prompt_for(index, question, options)
        trace = [{"chunk": i, "score": round(s, 4)} for i, s in hits]
        return generate_answer(self.engine, ids, self.prompt, sorted(i for i, _ in hits), truncated, trace)


def _check_document(document: str) -> str:
    if not isinstance(document, str) or not document.strip():
        raise ValueError("the document is empty: nothing to index")
    return document
