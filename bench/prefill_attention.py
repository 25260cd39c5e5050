"""Prefill attention over the paged KV cache: nodekv.kernels.cpu_ops.paged_attention (the C++ tiled kernel) with and
without node mass, at the CPU's best SIMD level and, where that is AVX-512, capped at AVX2 (the same bits); vs torch
SDPA: `reference.paged_attention` without mass (gathers the pages, then SDPA with an explicit causal mask: the torch
backend's path) and, for scale, SDPA with is_causal on K/V already contiguous.

Head shapes by --heads (default SmolLM2-135M's 9 query / 3 KV heads of 64; qwen2.5-1.5b's are 12 2 128), n = end
queries from empty, pages of 64 scattered in a pool twice the size, nodes of --node-len keys for the mass. The
variants take turns, once per round; best of --reps rounds, and GFLOP/s counting the causal half:
4 * T^2 / 2 * hd * H. On a busy machine the kernels' contention guard (csrc/cpu_common.h) may run them on one thread
for a while: compare with --threads 1 when the numbers jump.
Run: nodekv bench prefill_attention [--threads 2] [--seq 512 2048 8192] [--node-len 32] [--heads 12 2 128]
"""
from __future__ import annotations

import argparse
import time
from typing import Callable

import torch
import torch.nn.functional as F

from nodekv import _C
from nodekv.bench import count
from nodekv.kernels import cpu_ops, reference


def at_level(level: str, fn: Callable[[], object]) -> Callable[[], object]:
    """fn run with every C++ kernel capped at SIMD level `level`."""
    def run() -> object:
        with cpu_ops.simd_level(level):
            return fn()
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=count, default=2)
    ap.add_argument("--reps", type=count, default=5)
    ap.add_argument("--seq", type=count, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--page-size", type=count, default=64)
    ap.add_argument("--node-len", type=count, default=32, help="keys per node for the mass output")
    ap.add_argument("--heads", type=count, nargs=3, default=[9, 3, 64], metavar=("H", "KV", "HD"),
                    help="query heads, KV heads (dividing H) and head dim")
    args = ap.parse_args()
    H, KV, HD = args.heads
    if H % KV:
        ap.error(f"--heads: {KV} KV heads do not divide {H} query heads")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    P, isa = args.page_size, _C.isa()
    wide = isa == "avx512"
    print(f"threads {args.threads}, SIMD {isa}, best of {args.reps}; H={H}, kv_heads={KV}, hd={HD}, page_size {P}, "
          f"nodes of {args.node_len} keys; ms (GFLOP/s)")
    print(f"{'T':>6} {'C++':>16} {'C++ + mass':>16} {'mass cost':>10}"
          + (f" {'C++ avx2 + mass':>16} {'vs C++':>7}" if wide else "")
          + f" {'reference SDPA':>16} {'vs C++':>7} {'SDPA is_causal':>16} {'vs C++':>7} {'max|diff|':>10}")
    for t in args.seq:
        n_blocks = -(-t // P)
        n_pages = 2 * n_blocks
        k_pages = torch.randn(1, n_pages, KV, P, HD, generator=g)
        v_pages = torch.randn(1, n_pages, KV, P, HD, generator=g)
        table = torch.randperm(n_pages, generator=g)[:n_blocks].int()
        q = torch.randn(t, H, HD, generator=g)
        bounds = torch.tensor(sorted({*range(0, t, args.node_len), t}), dtype=torch.int32)
        mass = torch.zeros(t, bounds.shape[0] - 1)
        keys, values = (reference.gather_kv(x, 0, table, t)[None] for x in (k_pages, v_pages))
        qs = q.transpose(0, 1).contiguous()[None]  # SDPA's [1, H, T, hd]
        with_mass = lambda: cpu_ops.paged_attention(q, k_pages, v_pages, 0, table, t,  # noqa: E731
                                                    node_bounds=bounds, mass=mass)
        variants = {
            "C++": lambda: cpu_ops.paged_attention(q, k_pages, v_pages, 0, table, t),
            "mass": with_mass,
            **({"avx2 mass": at_level("avx2", with_mass)} if wide else {}),
            "reference": lambda: reference.paged_attention(q, k_pages, v_pages, 0, table, t),
            "causal": lambda: F.scaled_dot_product_attention(qs, keys, values, is_causal=True, enable_gqa=True),
        }
        diff = (variants["C++"]() - variants["reference"]()).abs().max().item()
        best = dict.fromkeys(variants, float("inf"))
        for _ in range(args.reps):
            for name, fn in variants.items():
                t0 = time.perf_counter()
                fn()
                best[name] = min(best[name], (time.perf_counter() - t0) * 1e3)
        gflop = 4 * t * t / 2 * HD * H / 1e9
        rate = lambda ms: f"{ms:>8.2f} ({gflop / ms * 1e3:>5.1f})"  # noqa: E731
        a = best["C++"]
        print(f"{t:>6} {rate(a):>16} {rate(best['mass']):>16} {best['mass'] / a - 1:>+9.1%}"
              + (f" {rate(best['avx2 mass']):>16} {best['avx2 mass'] / best['mass']:>6.2f}x" if wide else "")
              + f" {rate(best['reference']):>16} {best['reference'] / a:>6.2f}x {rate(best['causal']):>16} "
              f"{best['causal'] / a:>6.2f}x {diff:>10.2e}")
    print("(mass cost: C++ + mass over C++; vs C++: that time / C++'s (avx2: over C++ + mass))")


if __name__ == "__main__":
    main()
