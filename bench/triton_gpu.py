"""What node mass costs inside the Triton paged-attention kernel on a GPU: one layer's attention of n queries over
`end` paged keys, without mass, with mass over N nodes, and torch's SDPA over the same keys laid out contiguously
(no paging, no mass), timed side by side with CUDA events (median of repeats after warm-up). Needs CUDA.

    python -m nodekv.bench.triton_gpu [--dtype bfloat16] [--repeats 50]
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

CASES = [  # (label, n queries, end, H, Hkv, hd, nodes)
    ("qwen-0.5b decode, 4K", 1, 4096, 14, 2, 64, 40),
    ("8B decode, 8K", 1, 8192, 32, 8, 128, 80),
    ("8B probe 40 rows, 8K", 40, 8192, 32, 8, 128, 80),
    ("8B chunk 512 rows, 8K", 512, 8192, 32, 8, 128, 80),
]
PAGE = 16


def _time(fn, repeats: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> None:
    from nodekv.kernels.triton_attention import paged_attention

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--repeats", type=int, default=50)
    args = p.parse_args(argv)
    dtype, dev = getattr(torch, args.dtype), "cuda"
    print(f"{torch.cuda.get_device_name()} {args.dtype}; times in microseconds (median of {args.repeats})")
    print("| case | paged, no mass | paged + node mass | mass overhead | SDPA contiguous |")
    print("|---|---|---|---|---|")
    for label, n, end, H, Hkv, hd, N in CASES:
        pages = -(-end // PAGE)
        k_pages = torch.randn(1, 2 * pages, Hkv, PAGE, hd, device=dev, dtype=dtype)
        v_pages = torch.randn_like(k_pages)
        table = torch.randperm(2 * pages, device=dev)[:pages].int()
        q = torch.randn(n, H, hd, device=dev, dtype=dtype)
        bounds = torch.linspace(0, end, N + 1, device=dev).round().int()
        mass = torch.zeros(n, N, device=dev)
        k = k_pages[0, table.long()].permute(1, 0, 2, 3).reshape(Hkv, pages * PAGE, hd)[:, :end]
        v = v_pages[0, table.long()].permute(1, 0, 2, 3).reshape(Hkv, pages * PAGE, hd)[:, :end]
        k, v = k.repeat_interleave(H // Hkv, 0)[None], v.repeat_interleave(H // Hkv, 0)[None]
        qs = q.transpose(0, 1)[None]
        mask = torch.arange(end, device=dev)[None, :] <= torch.arange(end - n, end, device=dev)[:, None]
        plain = _time(lambda: paged_attention(q, k_pages, v_pages, 0, table, end), args.repeats)
        with_mass = _time(lambda: paged_attention(q, k_pages, v_pages, 0, table, end, None, None, bounds, mass),
                          args.repeats)
        sdpa = _time(lambda: F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=1 / math.sqrt(hd)),
                     args.repeats)
        print(f"| {label} | {plain * 1e3:.1f} | {with_mass * 1e3:.1f} | {with_mass / plain:.2f}x | "
              f"{sdpa * 1e3:.1f} |")


if __name__ == "__main__":
    main()
