"""Baselines on the same engine, so that FLOPs compare: the question alone (closed book), the full document in
context (cut in the middle to the window, as LongBench does), and BM25 / dense (all-MiniLM-L6-v2) top-k chunks in
one prompt."""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from ..engine.engine import Engine
from ..engine.node_store import NodeStore, StoredNode
from .base import Answer, Method
from .index_file import IndexFileError, read_index_file, read_kv_beside, write_index_files
from .options import Option
from .prompts import PromptSpec
from .reader import KV_REUSE_OPTIONS, Repair, kv_index_key, store_kv_nodes
from .retrieval import BM25Index, DenseIndex, text_chunk_spans

_FORMAT, _VERSION = "nodekv-topk-index", 1  # a Top-k index file's header


class ClosedBook(Method, name="closed-book"):
    """The question alone in the prompt, never reading the document: the floor a method that reads must beat, and
    the smallest whole method (the shared reader's closed-book read: the dataset's answer budget and stop strings;
    multiple choice scored over the option letters)."""

    def index(self, document: str) -> None:
        return None  # nothing to read

    def answer(self, index: None, question: str, options: tuple[str, ...] = ()) -> Answer:
        return self.reader.read(None, question, options)


class FullContext(Method, name="full"):
    """The whole document in the prompt (middle-truncated to the model's window when longer, or to `window`: how
    a model with a shorter window, such as the papers' 4K Llama-2, would read it). The prompt up to the question is
    the same for every question about a document, so it is prefilled once and forked from the engine's prefix
    cache (`shared_prefix=false` prefills every prompt whole)."""

    options = (Option("window", int, 0, "tokens the prompt and the answer must fit in (0: the model's window)",
                      low=0),
               Option("shared_prefix", bool, True, "prefill the prompt up to the question once per document"))

    def index(self, document: str) -> str:
        return document

    def reader_window(self) -> int | None:
        return self.config.window or None

    def answer(self, index: str, question: str, options: tuple[str, ...] = ()) -> Answer:
        return self.reader.read(index, question, options, ["document"], shared_prefix=self.config.shared_prefix)


@dataclass
class ChunkIndex:
    """A document cut into chunks of about `chunk_tokens` LLM tokens, with a BM25 or dense index over them, and with
    `kv_reuse` each chunk's keys and values, prefilled once."""

    chunks: list[str]
    search: BM25Index | DenseIndex
    stored: Sequence[StoredNode] | NodeStore | None = None  # chunk i's KV is stored[i]


class TopK(Method):
    """Retrieve the k best chunks for the question and answer from them (kept in document order: the model reads
    the passages as they were written). Subclasses pick the retriever (`search_index`). A saved index is an index
    file with the chunks and, with `kv_reuse`, a node store beside it (FILE.kv) holding their KV."""

    can_save, index_file_format = True, _FORMAT
    search_class: type  # what `search_index` builds: a ChunkIndex searched otherwise is another Top-k method's

    options = (Option("k", int, 5, "chunks retrieved", low=1),
               Option("chunk_tokens", int, 300, "tokens per chunk", low=1),
               *KV_REUSE_OPTIONS)

    @abstractmethod
    def search_index(self, chunks: list[str]) -> BM25Index | DenseIndex:
        """The retrieval index over `chunks`."""

    def index(self, document: str) -> ChunkIndex:
        tok = self.engine.tokenizer
        ids = tok.encode(document)
        chunks = [tok.decode(ids[a:b]) for a, b in text_chunk_spans(ids, tok, self.config.chunk_tokens)]
        index = ChunkIndex(chunks, self.search_index(chunks))
        return index if self.config.kv_reuse == "off" else self.store_kv(index)

    def store_kv(self, index: ChunkIndex) -> ChunkIndex:
        return replace(index, stored=store_kv_nodes(self.engine, [self.reader.passage_ids(c) for c in index.chunks],
                                                    self.config))

    def index_key(self) -> dict:
        # kv_dtype None without stored KV: the key the saved kv-free indexes were written under
        return {"chunk_tokens": self.config.chunk_tokens, "kv_dtype": None, **kv_index_key(self.config)}

    def save_index(self, index: ChunkIndex, path: str | Path) -> None:
        write_index_files(path, _FORMAT, _VERSION, self.engine,
                          {"chunks": index.chunks, "chunk_tokens": self.config.chunk_tokens},
                          None if index.stored is None else dict(enumerate(index.stored)), self.config.kv_dtype)

    def load_index(self, path: str | Path) -> ChunkIndex:
        """The saved index (by either Top-k method: the chunks are shared, the search is built again) unless it was
        cut at another chunk_tokens (recorded since 2026-11-29); its node store is opened (header checked, nodes
        read when used) only with `kv_reuse`, so an index whose store is missing or bad still serves
        `kv_reuse=off`."""
        data = read_index_file(path, _FORMAT, _VERSION, self.engine, "Top-k index")
        if data.get("chunk_tokens", self.config.chunk_tokens) != self.config.chunk_tokens:
            raise IndexFileError(f"{path} holds chunks of {data['chunk_tokens']} tokens, this {self.name} cuts "
                                 f"{self.config.chunk_tokens}: load it with chunk_tokens={data['chunk_tokens']}, or "
                                 "index again")
        stored = read_kv_beside(path, self.engine, data["stored_kv"]) if self.config.kv_reuse != "off" else None
        return ChunkIndex(data["chunks"], self.search_index(data["chunks"]), stored)

    def context(self, index: ChunkIndex, question: str) -> tuple[str, list[tuple[int, float]]]:
        """(context, hits): the k best chunks for the question, in document order, as the reader reads them."""
        hits = index.search.search(question, self.config.k)
        return "\n\n".join(index.chunks[i].strip() for i in sorted(i for i, _ in hits)), hits

    def answer(self, index: ChunkIndex, question: str, options: tuple[str, ...] = ()) -> Answer:
        if not isinstance(index.search, self.search_class):
            raise ValueError(f"this index searches its chunks by {type(index.search).__name__}, {self.name} by "
                             f"{self.search_class.__name__}: index with {self.name}, or load the saved file with it")
        context, hits = self.context(index, question)
        trace = [{"chunk": i, "score": round(s, 4)} for i, s in hits]
        chosen = sorted(i for i, _ in hits)
        if index.stored is None:
            return self.reader.read(context, question, options, chosen, trace)
        return self.reader.read_stored([index.stored[i] for i in chosen], question, options, chosen, trace,
                                       Repair.of(self.config), context)


class BM25TopK(TopK, name="bm25"):
    """The k chunks that score best for the question by BM25, in one prompt."""

    search_class = BM25Index

    def search_index(self, chunks: list[str]) -> BM25Index:
        return BM25Index(chunks)


class DenseTopK(TopK, name="dense"):
    """The k chunks closest to the question by all-MiniLM-L6-v2 cosine similarity, in one prompt."""

    search_class = DenseIndex

    def __init__(self, engine: Engine, prompt: PromptSpec | None = None, progress: bool = False, embedder=None,
                 **options):
        super().__init__(engine, prompt, progress, **options)
        self._embedder = embedder

    def search_index(self, chunks: list[str]) -> DenseIndex:
        from .retrieval.embedder import Embedder

        return DenseIndex(chunks, self._embedder or Embedder.shared())
