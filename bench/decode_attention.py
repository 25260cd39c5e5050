"""Decode attention over the paged KV cache: one token's nodekv.kernels.cpu_ops.paged_attention (the C++ decode
kernel) at the CPU's best SIMD level and capped at AVX2 (the same bits), from float32 and float16 pages, with and
without node mass.

Head shapes by --heads (default qwen2.5-1.5b's 12 query / 2 KV heads of 128) and --layers (28): each measurement
runs the token through every layer's cache, so that K and V come from memory as in a decode step, not from a cache
one layer has warmed. Pages of 64 in random order, nodes of --node-len keys for the mass. The variants take turns,
once per round; best of --rounds, each round the mean of --reps passes over the layers. GFLOP/s counts QK^T and PV:
4 * S * hd * H per layer; GB/s the K and V bytes read.
Run: python -m nodekv.bench.decode_attention [--threads 2] [--seq 512 2048 8192] [--heads 12 2 128]
"""
from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

from nodekv import _C
from nodekv.bench import count
from nodekv.kernels import cpu_ops

PAGE = 64


def time_ms(fn: Callable[[int], object], layers: int, reps: int) -> float:
    """Mean ms of one pass of fn(layer) over the layers, over reps passes (after one warm pass)."""
    for i in range(layers):
        fn(i)
    t0 = time.perf_counter()
    for _ in range(reps):
        for i in range(layers):
            fn(i)
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=count, default=2)
    ap.add_argument("--seq", type=count, nargs="+", default=[512, 2048, 8192], help="cached positions S")
    ap.add_argument("--heads", type=count, nargs=3, default=[12, 2, 128], metavar=("H", "KV", "HD"),
                    help="query heads, KV heads (dividing H) and head dim")
    ap.add_argument("--layers", type=count, default=28)
    ap.add_argument("--node-len", type=count, default=32, help="keys per node for the mass output")
    ap.add_argument("--rounds", type=count, default=8)
    ap.add_argument("--reps", type=count, default=3)
    args = ap.parse_args()
    H, KV, HD = args.heads
    if H % KV:
        ap.error(f"--heads: {KV} KV heads do not divide {H} query heads")
    torch.set_num_threads(args.threads)
    isa = _C.isa()
    if isa != "avx512":
        print(f"note: this CPU's best SIMD level is {isa}; both columns run it")
    levels = [isa, "avx2"]
    print(f"threads {args.threads}, H={H}, kv_heads={KV}, hd={HD}, {args.layers} layers, pages of {PAGE}, nodes of "
          f"{args.node_len} keys; ms for all layers, best of {args.rounds} rounds (GFLOP/s, GB/s)")
    print(f"{'S':>6} {'pages':>8} {'mass':>5} {isa:>22} {'avx2':>22} {'avx2 / ' + isa:>14}")
    g = torch.Generator().manual_seed(0)
    for s in args.seq:
        n_pages = -(-s // PAGE)
        table = torch.randperm(n_pages, generator=g).int()
        q = torch.randn(1, H, HD, generator=g)
        out = torch.empty(1, H * HD)
        bounds = torch.tensor(sorted({*range(0, s, args.node_len), s}), dtype=torch.int32)
        mass = torch.zeros(1, bounds.shape[0] - 1)
        for dtype in (torch.float32, torch.float16):
            k_pages = torch.randn(args.layers, n_pages, KV, PAGE, HD, generator=g).to(dtype)
            v_pages = torch.randn(args.layers, n_pages, KV, PAGE, HD, generator=g).to(dtype)
            for with_mass in (False, True):
                extra = dict(node_bounds=bounds, mass=mass) if with_mass else {}
                step = lambda i: cpu_ops.paged_attention(q, k_pages, v_pages, i, table, s, out=out, **extra)  # noqa: E731
                best = dict.fromkeys(levels, float("inf"))
                for _ in range(args.rounds):
                    for level in levels:
                        with cpu_ops.simd_level(level):
                            best[level] = min(best[level], time_ms(step, args.layers, args.reps))
                gflop = 4 * s * HD * H * args.layers / 1e9
                gbyte = 2 * s * KV * HD * k_pages.element_size() * args.layers / 1e9
                cell = lambda ms: f"{ms:.2f} ({gflop / ms * 1e3:.0f}, {gbyte / ms * 1e3:.1f})"  # noqa: E731
                print(f"{s:>6} {str(dtype).removeprefix('torch.'):>8} {'yes' if with_mass else 'no':>5} "
                      f"{cell(best[isa]):>22} {cell(best['avx2']):>22} {best['avx2'] / best[isa]:>13.2f}x")


if __name__ == "__main__":
    main()
