"""Retrieval for the methods and baselines: chunking by LLM tokens, BM25 / dense / hybrid indexes over chunks, and
the packaged all-MiniLM-L6-v2 embedder."""
from .chunking import chunk_text, chunk_tokens, text_chunk_spans
from .embedder import Embedder, default_embedder_path
from .indexes import BM25Index, DenseIndex, HybridIndex, fuse_with_bm25, rank_fusion, similarity

__all__ = ["BM25Index", "DenseIndex", "Embedder", "HybridIndex", "chunk_text", "chunk_tokens", "default_embedder_path",
           "fuse_with_bm25", "rank_fusion", "similarity", "text_chunk_spans"]
