"""Driving nodekv's paged KV cache from someone else's decode loop: a toy two-layer attention stack written here,
with plain tensors in and out, that keeps its keys and values in a `PagedKVCache` — prefill a prompt in two
chunks, fork the cache for a second continuation (the prompt's pages are shared, copied on write), decode a token
on each, and collect the attention mass per node along the way.

    python examples/foreign_loop.py
"""
from __future__ import annotations

import torch

from nodekv.engine.config import ModelConfig
from nodekv.engine.kv_cache import PagedKVCache
from nodekv.engine.page_pool import PagePool
from nodekv.kernels import cpu_ops

CONFIG = ModelConfig(vocab_size=10, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=128,
                     max_seq_len=256)
HEADS, KV_HEADS, HEAD_DIM = CONFIG.n_heads, CONFIG.n_kv_heads, CONFIG.dim // CONFIG.n_heads


def layer_inputs(x: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The foreign model's q, k, v for layer `layer` of hidden states x [T, dim] (fixed random projections)."""
    g = torch.Generator().manual_seed(layer)
    wq, wk, wv = (torch.randn(CONFIG.dim, n * HEAD_DIM, generator=g) / 8 for n in (HEADS, KV_HEADS, KV_HEADS))
    t = x.shape[0]
    return (x @ wq).view(t, HEADS, HEAD_DIM), (x @ wk).view(t, KV_HEADS, HEAD_DIM), (x @ wv).view(t, KV_HEADS, HEAD_DIM)


def forward(cache: PagedKVCache, x: torch.Tensor) -> torch.Tensor:
    """Run the foreign stack on x [T, dim] after what `cache` holds; returns the last layer's output [T, dim]."""
    t = x.shape[0]
    cache.begin(t)  # reserve pages for T more positions
    for layer in range(CONFIG.n_layers):
        q, k, v = layer_inputs(x, layer)
        x = cache.attend(layer, q, k, v)  # stores k, v after the cached tokens, causal GQA over all of them
    cache.commit(t)
    return x


def main() -> dict[str, torch.Tensor]:
    pool = PagePool(CONFIG, torch.float32, n_pages=16, page_size=16)
    prompt = torch.randn(40, CONFIG.dim, generator=torch.Generator().manual_seed(7))
    cache = PagedKVCache(pool, cpu_ops)
    forward(cache, prompt[:24])  # a prompt in two chunks: the cache carries the first to the second
    bounds = torch.tensor([0, 24, 40], dtype=torch.int32)
    mass = torch.zeros(16, 2)
    cache.collect(bounds, mass)  # the second chunk's attention mass on node 0 (0..23) and node 1 (24..39)
    out = forward(cache, prompt[24:])
    cache.collect(None, None)
    other = cache.fork()  # a second continuation on the same prompt pages
    a = forward(cache, torch.ones(1, CONFIG.dim))
    b = forward(other, -torch.ones(1, CONFIG.dim))
    print(f"pages in use: {pool.n_pages - pool.n_free} of {pool.n_pages}; node mass of the second chunk, averaged "
          f"over heads and layers:\n{mass / (HEADS * CONFIG.n_layers)}")
    result = {"prompt_out": out, "a": a, "b": b, "mass": mass / (HEADS * CONFIG.n_layers)}
    cache.release()
    other.release()
    return result


if __name__ == "__main__":
    main()
