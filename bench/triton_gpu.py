"""What node mass costs inside the Triton paged-attention kernel on a GPU: one layer's attention of n queries over
`end` paged keys, without mass, with mass over N nodes summed in the attention pass (mass_pass="one") and in a second
pass (mass_pass="two"), and torch's SDPA over the same keys laid out contiguously (no paging, no mass), timed side by
side with CUDA events (median of repeats after warm-up). The target for the one pass is at most 1.25x the time without
mass. Needs CUDA.

--tiles sweeps the kernel's tiles instead (`paged_attention(tiles=(BLOCK_M, BLOCK_N, num_warps, num_stages))`) over
the prefill cases, without mass and with one-pass mass, and prints the default tiles' times beside the five fastest
with mass and against the fastest without; a tile that does not compile or run on the device is listed as failed.

    nodekv bench triton_gpu [--dtype bfloat16] [--repeats 50] [--tiles]
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from nodekv.bench import count, device

CASES = [  # (label, n queries, end, H, Hkv, hd, nodes)
    ("qwen-0.5b decode, 4K", 1, 4096, 14, 2, 64, 40),
    ("8B decode, 8K", 1, 8192, 32, 8, 128, 80),
    ("8B probe 40 rows, 8K", 40, 8192, 32, 8, 128, 80),
    ("8B chunk 512 rows, 8K", 512, 8192, 32, 8, 128, 80),
]
PAGE = 16
TARGET = 1.25  # the most that one-pass node mass may cost, as a multiple of attention without mass
TILE_CASES = [("qwen2.5-1.5b prefill 2K", 2048, 2048, 12, 2, 128, 32),
              ("qwen2.5-1.5b chunk 512 rows, 8K", 512, 8192, 12, 2, 128, 32), CASES[-1]]
TILES = [(m, n, w, st) for m in (64, 128) for n in (32, 64, 128) for w in (4, 8) for st in (2, 3)]


def problem(n: int, end: int, H: int, Hkv: int, hd: int, N: int, dtype: torch.dtype, dev: str):
    """One layer's paged keys and values (pages in random order), n queries, N equal nodes and a mass buffer."""
    pages = -(-end // PAGE)
    k_pages = torch.randn(1, 2 * pages, Hkv, PAGE, hd, device=dev, dtype=dtype)
    v_pages = torch.randn_like(k_pages)
    table = torch.randperm(2 * pages, device=dev)[:pages].int()
    q = torch.randn(n, H, hd, device=dev, dtype=dtype)
    bounds = torch.linspace(0, end, N + 1, device=dev).round().int()
    return q, k_pages, v_pages, table, bounds, torch.zeros(n, N, device=dev)


def sweep(dtype: torch.dtype, repeats: int, time_it, dev: str = "cuda", cases=TILE_CASES, grid=TILES) -> None:
    """The tile sweep (--tiles): per case, the default tiles and the five of `grid` fastest with one-pass mass, each
    with and without mass, and with mass against the fastest tiles without it."""
    from nodekv.kernels.triton_attention import paged_attention

    print("| case | tiles (BLOCK_M, BLOCK_N, warps, stages) | no mass, us | one-pass mass, us | mass / no mass "
          "| mass / fastest no mass |")
    print("|---|---|---|---|---|---|")
    for label, n, end, H, Hkv, hd, N in cases:
        q, k_pages, v_pages, table, bounds, mass = problem(n, end, H, Hkv, hd, N, dtype, dev)

        def run(tiles, mass_pass):
            args = (bounds, mass) if mass_pass else (None, None)
            return time_it(lambda: paged_attention(q, k_pages, v_pages, 0, table, end, None, None, *args,
                                                   mass_pass=mass_pass, tiles=tiles), repeats)

        rows, failed = [], []
        for tiles in [None, *grid]:
            try:
                rows.append((tiles, run(tiles, None), run(tiles, "one")))
            except Exception as e:  # out of shared memory or registers on this device
                failed.append(f"{tiles}: {type(e).__name__}")
        default, tuned = rows[0], sorted(rows[1:], key=lambda r: r[2])[:5]
        fastest = min(plain for _, plain, _ in rows)
        for tiles, plain, one in [default, *tuned]:
            print(f"| {label} | {tiles or 'default'} | {plain * 1e6:.1f} | {one * 1e6:.1f} | {one / plain:.2f}x | "
                  f"{one / fastest:.2f}x |")
        if failed:
            print(f"| {label} | failed: {'; '.join(failed)} | | | | |")


def main(argv: list[str] | None = None) -> None:
    from nodekv.bench.gpu_engine import timer
    from nodekv.kernels.triton_attention import paged_attention

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--repeats", type=count, default=50)
    p.add_argument("--tiles", action="store_true", help="sweep the kernel's tiles over the prefill cases")
    args = p.parse_args(argv)
    try:
        device("cuda")  # Triton's kernels need a GPU: say so before the first one asserts it
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    dtype, dev = getattr(torch, args.dtype), "cuda"
    time_it = timer(torch.device(dev), warmup=5)  # seconds, the median of CUDA-event timings
    print(f"{torch.cuda.get_device_name()} {args.dtype}; times in microseconds (median of {args.repeats})")
    if args.tiles:
        return sweep(dtype, args.repeats, time_it)
    print(f"| case | paged, no mass | mass, one pass | mass, two passes | one pass / no mass (target <= {TARGET}) "
          f"| two passes / no mass | SDPA contiguous |")
    print("|---|---|---|---|---|---|---|")
    for label, n, end, H, Hkv, hd, N in CASES:
        q, k_pages, v_pages, table, bounds, mass = problem(n, end, H, Hkv, hd, N, dtype, dev)
        pages = table.shape[0]
        k = k_pages[0, table.long()].permute(1, 0, 2, 3).reshape(Hkv, pages * PAGE, hd)[:, :end]
        v = v_pages[0, table.long()].permute(1, 0, 2, 3).reshape(Hkv, pages * PAGE, hd)[:, :end]
        k, v = k.repeat_interleave(H // Hkv, 0)[None], v.repeat_interleave(H // Hkv, 0)[None]
        qs = q.transpose(0, 1)[None]
        mask = torch.arange(end, device=dev)[None, :] <= torch.arange(end - n, end, device=dev)[:, None]
        plain = time_it(lambda: paged_attention(q, k_pages, v_pages, 0, table, end), args.repeats)

        def with_mass(how: str) -> float:
            return time_it(lambda: paged_attention(q, k_pages, v_pages, 0, table, end, None, None, bounds, mass,
                                                 mass_pass=how), args.repeats)

        one, two = with_mass("one"), with_mass("two")
        sdpa = time_it(lambda: F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=1 / math.sqrt(hd)),
                     args.repeats)
        verdict = "ok" if one / plain <= TARGET else "over"
        print(f"| {label} | {plain * 1e6:.1f} | {one * 1e6:.1f} | {two * 1e6:.1f} | {one / plain:.2f}x {verdict} | "
              f"{two / plain:.2f}x | {sdpa * 1e6:.1f} |")


if __name__ == "__main__":
    main()
