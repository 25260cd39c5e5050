"""Prefill attention: nodekv.kernels.cpu_ops.prefill_attention vs torch's SDPA (CPU flash, is_causal, enable_gqa) at
SmolLM2-135M shapes (9 query / 3 KV heads of 64), start=0, n=T, side by side. Best-of-N wall time and GFLOP/s
counting the causal half: 4 * T^2 / 2 * hd * H. Run: python -m nodekv.bench.prefill_attention [--threads 2]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from nodekv.kernels import cpu_ops

H, KV, HD = 9, 3, 64


def best_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seq", type=int, nargs="+", default=[512, 2048, 8192])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    print(f"threads {args.threads}, best of {args.reps}; H={H}, kv_heads={KV}, hd={HD}")
    print(f"{'T':>6} {'nodekv ms':>10} {'GFLOP/s':>8} {'SDPA ms':>10} {'GFLOP/s':>8} {'speedup':>8} {'max|diff|':>10}")
    for t in args.seq:
        q = torch.randn(t, H, HD, generator=g)                # [n, H, hd], as the engine holds it
        k_cache = torch.randn(1, KV, t, HD, generator=g)      # [layers, kv_heads, capacity, hd]
        v_cache = torch.randn(1, KV, t, HD, generator=g)
        qs = q.transpose(0, 1).contiguous()[None]             # SDPA's [1, H, T, hd]
        ours = lambda: cpu_ops.prefill_attention(q, k_cache, v_cache, 0, 0)  # noqa: E731
        ref = lambda: F.scaled_dot_product_attention(qs, k_cache, v_cache, is_causal=True,  # noqa: E731
                                                     enable_gqa=True)
        diff = (ours() - ref()[0].transpose(0, 1).reshape(t, H * HD)).abs().max().item()
        a, b = best_ms(ours, args.reps), best_ms(ref, args.reps)
        gflop = 4 * t * t / 2 * HD * H / 1e9
        print(f"{t:>6} {a:>10.2f} {gflop / a * 1e3:>8.1f} {b:>10.2f} {gflop / b * 1e3:>8.1f} {b / a:>7.2f}x "
              f"{diff:>10.2e}")


if __name__ == "__main__":
    main()
