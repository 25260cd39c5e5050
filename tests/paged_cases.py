"""Random paged-attention problems and a brute-force float64 oracle shared by the kernel tests of every backend."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class PagedCase:
    """One layer's worth of a random problem: pages in a shuffled pool, queries, new K/V and key nodes."""

    q: torch.Tensor            # [n, H, hd]
    k_pages: torch.Tensor      # [L, n_pages, Hkv, P, hd]
    v_pages: torch.Tensor
    layer: int
    block_table: torch.Tensor  # int32
    end: int
    k_new: torch.Tensor        # [T, Hkv, hd], stored at end - T .. end - 1
    v_new: torch.Tensor
    node_bounds: torch.Tensor  # int32 [N + 1]

    def clone_pages(self) -> "PagedCase":
        return PagedCase(self.q, self.k_pages.clone(), self.v_pages.clone(), self.layer, self.block_table,
                         self.end, self.k_new, self.v_new, self.node_bounds)


def make_case(n: int, T: int, end: int, H: int = 4, Hkv: int = 2, hd: int = 16, page_size: int = 8,
              n_nodes: int = 3, layers: int = 2, dtype: torch.dtype = torch.float32, seed: int = 0) -> PagedCase:
    """n queries (the last n of T new tokens) after end - T cached ones; pages scattered in a pool twice as big."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = -(-end // page_size)
    n_pages = 2 * n_blocks + 1
    k_pages = torch.randn(layers, n_pages, Hkv, page_size, hd, generator=g).to(dtype)
    v_pages = torch.randn(layers, n_pages, Hkv, page_size, hd, generator=g).to(dtype)
    block_table = torch.randperm(n_pages, generator=g)[:n_blocks].int()
    cuts = sorted(torch.randperm(end - 1, generator=g)[: n_nodes - 1].add(1).tolist()) if n_nodes > 1 else []
    node_bounds = torch.tensor([0, *cuts, end], dtype=torch.int32)
    q = (torch.randn(n, H, hd, generator=g) * 2).to(dtype)  # larger scores: a peaked softmax
    k_new = torch.randn(T, Hkv, hd, generator=g).to(dtype)
    v_new = torch.randn(T, Hkv, hd, generator=g).to(dtype)
    return PagedCase(q, k_pages, v_pages, layers - 1, block_table, end, k_new, v_new, node_bounds)


def brute_force(case: PagedCase) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [n, H*hd], mass [n, N]) in float64 from full softmax matrices, after writing k_new/v_new."""
    n, H, hd = case.q.shape
    P = case.k_pages.shape[3]
    T = case.k_new.shape[0]
    keys = torch.stack([case.k_pages[case.layer, case.block_table[s // P], :, s % P] for s in range(case.end)])
    values = torch.stack([case.v_pages[case.layer, case.block_table[s // P], :, s % P] for s in range(case.end)])
    keys, values = keys.double(), values.double()  # [end, Hkv, hd]
    keys[case.end - T:] = case.k_new.double()
    values[case.end - T:] = case.v_new.double()
    G = H // keys.shape[1]
    keys, values = keys.repeat_interleave(G, 1), values.repeat_interleave(G, 1)  # [end, H, hd]
    scores = torch.einsum("nhd,khd->hnk", case.q.double(), keys) / math.sqrt(hd)
    pos = torch.arange(case.end - n, case.end)
    scores = scores.masked_fill(torch.arange(case.end)[None, :] > pos[:, None], float("-inf"))
    p = torch.softmax(scores, -1)  # [H, n, end]
    out = torch.einsum("hnk,khd->nhd", p, values).reshape(n, H * hd)
    b = case.node_bounds.tolist()
    mass = torch.stack([p[:, :, b[j]:b[j + 1]].sum((0, 2)) for j in range(len(b) - 1)], 1)
    return out, mass


def make_batch(ends: list[int], H: int, Hkv: int, hd: int, page_size: int
               ) -> tuple[list[PagedCase], torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step of len(ends) sequences (one query and one new token each) in one shared pool: each sequence's
    case (for the oracle, on its own pages) and the pool's k_pages, v_pages and the block tables [B, pages], padded
    with -1 (no program may read it)."""
    cases = [make_case(1, 1, end, H, Hkv, hd, page_size, seed=b) for b, end in enumerate(ends)]
    offsets = torch.tensor([0, *[c.k_pages.shape[1] for c in cases]]).cumsum(0)
    tables = torch.full((len(cases), max(c.block_table.shape[0] for c in cases)), -1, dtype=torch.int32)
    for b, c in enumerate(cases):
        tables[b, : c.block_table.shape[0]] = c.block_table + offsets[b]
    return cases, torch.cat([c.k_pages for c in cases], 1), torch.cat([c.v_pages for c in cases], 1), tables


def record_attention_tiles(monkeypatch) -> list[tuple]:
    """Record each launch of the Triton attention kernel (`triton_attention._attn_fwd[grid](...)`, for the rest of the
    test) as (BLOCK_M, BLOCK_N, num_warps, num_stages), in a list returned now and filled as the kernel launches."""
    from nodekv.kernels import triton_attention

    launched, kernel = [], triton_attention._attn_fwd

    class Recording:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launched.append((kw["BLOCK_M"], kw["BLOCK_N"], kw.get("num_warps"), kw.get("num_stages")))
                return kernel[grid](*args, **kw)
            return launch

    monkeypatch.setattr(triton_attention, "_attn_fwd", Recording())
    return launched
