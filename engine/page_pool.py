"""A pool of fixed-size KV pages shared by every session of an engine: storage, refcounts and a free list.

A page holds `page_size` consecutive token positions of every layer and KV head. Sessions own pages through
block tables (lists of page ids); a page shared by several sessions (a common prompt prefix, a fork) is
refcounted and copied before one of them writes to it. Bookkeeping is plain Python: every operation is O(pages
touched) list work, far below the cost of the forward it serves, so a C++ allocator would not pay.
"""
from __future__ import annotations

import torch

from .config import ModelConfig
from .errors import PoolExhaustedError


class PagePool:
    """K and V storage [layers, n_pages, kv_heads, page_size, head_dim] with a refcount per page and a free list."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, n_pages: int, page_size: int = 64,
                 device: torch.device | str = "cpu"):
        if n_pages < 1 or page_size < 1:
            raise ValueError(f"a page pool needs n_pages >= 1 and page_size >= 1, got {n_pages} and {page_size}")
        self.config, self.dtype = config, dtype
        self.n_pages, self.page_size = n_pages, page_size
        shape = (config.n_layers, n_pages, config.n_kv_heads, page_size, config.head_dim)
        # torch.empty reserves address space only: pages cost memory once written
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.refcount = [0] * n_pages
        self._free = list(range(n_pages - 1, -1, -1))  # pop() hands out low page ids first

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def bytes_per_page(self) -> int:
        return 2 * self.k[:, 0].numel() * self.k.element_size()

    def alloc(self, n: int) -> list[int]:
        """n fresh pages with refcount 1; all or nothing."""
        if n > len(self._free):
            raise PoolExhaustedError(
                f"KV page pool exhausted: {n} more pages needed, {len(self._free)} of {self.n_pages} free "
                f"({self.page_size} tokens each); release sessions or load the engine with a larger kv_tokens")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self.refcount[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """One more owner for each page."""
        for p in pages:
            if self.refcount[p] <= 0:
                raise RuntimeError(f"page {p} is free; only a live page can be shared")
            self.refcount[p] += 1

    def free(self, pages: list[int]) -> None:
        """One owner less for each page; pages nobody owns go back to the free list."""
        for p in pages:
            if self.refcount[p] <= 0:
                raise RuntimeError(f"page {p} is already free")
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self._free.append(p)

    def copy(self, page: int) -> int:
        """A private copy of a shared page (copy-on-write); the caller's reference to `page` is dropped."""
        (new,) = self.alloc(1)
        self.k[:, new] = self.k[:, page]
        self.v[:, new] = self.v[:, page]
        self.free([page])
        return new


def default_pool_pages(config: ModelConfig, dtype: torch.dtype, page_size: int, kv_tokens: int | None,
                       device: torch.device | str = "cpu") -> int:
    """Pages for kv_tokens positions (default: four full context windows, capped at a quarter of the device's
    memory: physical memory on the CPU, a quarter of what is free on a GPU once the weights are there). A pool that
    would need more than that memory (all of it, not a quarter) is refused here, before torch is asked for it."""
    per_token = 2 * config.n_layers * config.n_kv_heads * config.head_dim * torch.finfo(dtype).bits // 8
    device = torch.device(device)
    memory = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else _physical_memory()
    if kv_tokens is None:
        kv_tokens = min(4 * config.max_seq_len, memory // 4 // per_token)
    if kv_tokens < 1:
        raise ValueError(f"kv_tokens must be >= 1, got {kv_tokens}")
    pages = -(-kv_tokens // page_size)
    need = pages * page_size * per_token  # whole pages: the last one's unused positions take memory too
    if need > memory:
        there = "free memory" if device.type == "cuda" else "memory"
        raise ValueError(f"kv_tokens {kv_tokens:,} in pages of page_size {page_size:,} need {need:,} bytes of KV "
                         f"pages, more than the {memory:,} bytes of {there} on {device}")
    return pages


def _physical_memory() -> int:
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30
