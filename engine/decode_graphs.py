"""CUDA graphs of the decode step: one new token for each of B sequences, replayed in one call instead of launched
kernel by kernel from Python.

A decode step of qwen2.5-1.5b reads ~4 GB of weights, about 1 ms on an H200, but launches ~300 kernels; launched
from Python they took 15.8 ms a step there (bench gpu_engine, batch 1). A graph records the step's launches once
per batch-size bucket and replays them. What changes from step to step lives in static device buffers that the
graph reads: token ids, positions, each sequence's block table (padded to the longest context the graphs serve) and
its length. The host keeps the bookkeeping outside the graph: `CacheBatch.begin` reserves pages, `commit` counts.

Attention is `decode_attention` with its key splits sized for `max_len`, since a replay cannot change its grid; a
sequence's later splits stay empty until it grows into them. The rows of a bucket beyond the batch run a padding
sequence of one token whose key and value go to a page of the pool reserved for it, and their outputs are dropped.
"""
from __future__ import annotations

from types import ModuleType
from typing import Callable

import torch

from .cache_batch import CacheBatch
from .config import ModelConfig
from .kv_cache import PagedKVCache
from .page_pool import PagePool

# the model's layers over new rows (`Llama._forward_rows`): (tokens, (cos, sin), cache, rows, want_logits) -> logits
ForwardRows = Callable[..., torch.Tensor]
# the model's RoPE tables at positions (`Llama.rope`): slice -> (cos, sin)
Rope = Callable[[slice], tuple[torch.Tensor, torch.Tensor]]

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # batch sizes with a graph each; a batch runs in the smallest that holds it


class _StaticBatch:
    """The cache protocol of a recorded step (`Llama._forward_rows`): attention over the buffers' tables and
    lengths, nothing counted (the host commits after the replay)."""

    collecting = False

    def __init__(self, pool: PagePool, ops, tables: torch.Tensor, ends: torch.Tensor, max_len: int):
        self.pool, self.ops, self.tables, self.ends, self.max_len = pool, ops, tables, ends, max_len

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.ops.decode_attention(q, self.pool.k, self.pool.v, layer, self.tables, self.ends, self.max_len,
                                         k, v)

    def commit(self, n_tokens: int) -> None:
        pass


class _Bucket:
    """One batch size's static inputs, its graph and the logits it writes."""

    def __init__(self, size: int, max_pages: int, sink: int, device: torch.device):
        self.size = size
        self.tokens = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.ends = torch.ones(size, dtype=torch.int32, device=device)
        self.tables = torch.full((size, max_pages), sink, dtype=torch.int32, device=device)
        self.rows: list[torch.Tensor | None] = [None] * size  # the block table each row holds a copy of
        self.live = 0  # rows holding sequences; the others are padding
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None


class DecodeGraphs:
    """Decode steps of batches over one page pool, each batch size's step recorded once as a CUDA graph.

    The model comes as what a step needs of it: its config, its ops (the backend, whose `decode_attention` the step
    uses), its RoPE tables (`rope`) and its layers over new rows (`forward_rows`). `serves(batch)` says whether a
    step applies (one token a sequence, every cache on this pool, no node mass, at most BUCKETS[-1] sequences, every
    sequence within `max_len` after it); `step` runs it. capture=False runs the same static-buffer step eagerly (no
    CUDA needed: the tests check it against the op-by-op forward on the CPU). Building one reserves a page of the
    pool for the padding rows, for the graphs' lifetime."""

    def __init__(self, config: ModelConfig, ops: ModuleType, rope: Rope, forward_rows: ForwardRows, pool: PagePool,
                 capture: bool = True):
        self.ops, self.forward_rows, self.pool, self.capture = ops, forward_rows, pool, capture
        self.max_len = min(config.max_seq_len, pool.n_pages * pool.page_size)
        self.max_pages = -(-self.max_len // pool.page_size)
        (self.sink,) = pool.alloc(1)
        # every position's RoPE rows, kept here: a graph reads these tensors' memory whatever the model builds later
        self.cos, self.sin = rope(slice(0, self.max_len))
        self._buckets: dict[int, _Bucket] = {}

    def serves(self, batch: CacheBatch) -> bool:
        caches = batch.caches
        return (len(caches) <= BUCKETS[-1] and all(n == 1 for n in batch.counts) and not batch.collecting
                and all(type(c) is PagedKVCache and c.pool is self.pool and c.ops is self.ops
                        and c.length < self.max_len for c in caches))

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, batch: CacheBatch, want_logits: bool) -> torch.Tensor | None:
        """The batch's decode step (tokens [B], one a sequence, valid ids): float32 logits [B, vocab] (a copy), or
        None when not wanted."""
        n = len(batch.caches)
        size = next(b for b in BUCKETS if b >= n)
        bucket = self._buckets.get(size)
        if bucket is None:
            bucket = self._buckets[size] = _Bucket(size, self.max_pages, self.sink, self.pool.device)
        positions = batch.begin()
        self._load(bucket, tokens, positions, batch.caches)
        if bucket.graph is not None:
            bucket.graph.replay()
        elif self.capture:
            self._record(bucket)
            bucket.graph.replay()
        else:
            bucket.logits = self._run(bucket)
        batch.commit(n)
        return bucket.logits[:n].clone() if want_logits else None

    def _load(self, bucket: _Bucket, tokens: torch.Tensor, positions: torch.Tensor, caches) -> None:
        n = len(caches)
        bucket.tokens[:n].copy_(tokens)
        bucket.positions[:n].copy_(positions)
        bucket.ends[:n].copy_(positions + 1)
        for b, cache in enumerate(caches):
            table = cache.block_table  # a new tensor whenever the cache's pages change, so identity tells
            if bucket.rows[b] is not table:
                bucket.tables[b, :table.shape[0]].copy_(table)
                bucket.rows[b] = table
        if bucket.live > n:  # rows that held sequences last time go back to padding
            bucket.tokens[n:bucket.live].zero_()
            bucket.positions[n:bucket.live].zero_()
            bucket.ends[n:bucket.live].fill_(1)
            bucket.tables[n:bucket.live].fill_(self.sink)
            bucket.rows[n:bucket.live] = [None] * (bucket.live - n)
        bucket.live = n

    def _run(self, bucket: _Bucket) -> torch.Tensor:
        """The step over the bucket's buffers: logits [size, vocab]."""
        cache = _StaticBatch(self.pool, self.ops, bucket.tables, bucket.ends, self.max_len)
        rope = self.cos[bucket.positions], self.sin[bucket.positions]
        return self.forward_rows(bucket.tokens, rope, cache, None, True)

    def _record(self, bucket: _Bucket) -> None:
        """Record the bucket's graph. A warm-up run on a side stream first compiles the Triton kernels and sets up
        cuBLAS, which a capture cannot do; it computes the step of the rows loaded now, which the replay then writes
        again, identically."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._run(bucket)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            bucket.logits = self._run(bucket)
        bucket.graph = graph
