"""What sessions, generations and the prefix cache need of an engine, and generations of a session, as protocols:
`Engine` and `Session` satisfy them, and the modules that use them need not import those (which import them back).
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch

from .config import ModelConfig
from .flops import FlopAccount
from .kv_cache import PagedKVCache
from .page_pool import PagePool


class ModelRunner(Protocol):
    """A model that runs token ids after a KV cache and charges its FLOPs (`Engine`)."""

    config: ModelConfig
    tokenizer: object  # encode / decode / token_id / decode_stream / eos_ids
    flops: FlopAccount
    pool: PagePool
    device: torch.device  # where the forward runs: collection targets live there

    def new_cache(self) -> PagedKVCache: ...

    def run(self, ids: Sequence[int], cache: PagedKVCache, logits: str | None = "last",
            decode: bool = False) -> torch.Tensor | None: ...

    def run_batch(self, ids: Sequence[Sequence[int]], caches: Sequence[PagedKVCache], logits: str | None = "last",
                  decode: bool = False) -> tuple[list[torch.Tensor | None], list[int]]: ...

    def place_stored(self, node, cache: PagedKVCache) -> None: ...  # a StoredNode's KV written after the cache

    def recompute(self, ids: Sequence[int], positions: Sequence[int], cache: PagedKVCache,
                  layers: int | None = None) -> torch.Tensor | None: ...


class DecodingSession(Protocol):
    """A session as a generation sees it (`Session`): its engine, tokens, node spans and cache."""

    engine: ModelRunner
    tokens: list[int]
    nodes: list  # NodeSpan: node_id, start, end
    cache: PagedKVCache

    def start_generation(self, params, /, **options) -> object: ...
