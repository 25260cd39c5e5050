"""Decode attention over the paged KV cache: nodekv.kernels.cpu_ops.paged_attention for 1 to 16 new tokens (the C++
decode kernel) at the CPU's best SIMD level and capped at AVX2 (the same bits), from float32 and float16 pages.

Head shapes by --heads (default qwen2.5-1.5b's 12 query / 2 KV heads of 128) and --layers (28): each measurement
runs the new tokens through every layer's cache, so that K and V come from beyond the CPU's private caches, not
from ones a single layer has warmed. Pages of 64 in random order; --mass adds node mass (nodes of --node-len keys).
The levels take turns, once per round; best of --rounds, each round the mean of --reps passes over the layers.
GFLOP/s counts QK^T and PV, 4 * queries * S * hd * H per layer; GB/s the K and V bytes read.
Run: nodekv bench decode_attention [--seq 512 2048 8192] [--queries 1 4 16] [--heads 12 2 128]

--model M instead times whole greedy decode steps of a registered model after each --seq context of random token ids
(--decode tokens on a fork of the prefilled session, for each --kv-dtype), both levels in turn in one process, with
the attention part of the fused step timed inside it; the tokens must agree.
"""
from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

from nodekv import _C
from nodekv.bench import count, model
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
    ap.add_argument("--queries", type=count, nargs="+", default=[1, 4, 16],
                    help="new tokens attending at once (the decode kernel takes up to 16)")
    ap.add_argument("--mass", action="store_true", help="collect node mass too")
    ap.add_argument("--node-len", type=count, default=32, help="keys per node for the mass output")
    ap.add_argument("--rounds", type=count, default=8)
    ap.add_argument("--reps", type=count, default=3)
    ap.add_argument("--model", type=model, default=None, help="time a model's whole decode steps instead")
    ap.add_argument("--kv-dtype", nargs="+", choices=["float32", "float16"], default=["float32", "float16"],
                    help="with --model: the KV caches to time")
    ap.add_argument("--decode", type=count, default=16, help="with --model: greedy tokens a round")
    args = ap.parse_args()
    H, KV, HD = args.heads
    if H % KV:
        ap.error(f"--heads: {KV} KV heads do not divide {H} query heads")
    if max(args.queries) > 16 or max(args.queries) > min(args.seq):
        ap.error("--queries: at most 16 (more take the prefill kernel) and at most the shortest --seq")
    if args.model:
        from nodekv.engine.loader import model_config
        from nodekv.engine.models import resolve_model

        window = model_config(resolve_model(args.model)).max_seq_len
        if max(args.seq) + args.decode > window:
            ap.error(f"a context of {max(args.seq)} and {args.decode} decoded tokens exceed the model's {window}")
    torch.set_num_threads(args.threads)
    isa = _C.isa()
    if isa != "avx512":
        print(f"note: this CPU's best SIMD level is {isa}; both columns run it")
    levels = [isa, "avx2"]
    if args.model:
        decode_steps(args, levels)
        return
    mass_note = f"with node mass (nodes of {args.node_len} keys)" if args.mass else "without node mass"
    print(f"threads {args.threads}, H={H}, kv_heads={KV}, hd={HD}, {args.layers} layers, pages of {PAGE}, "
          f"{mass_note}; ms for all layers, best of {args.rounds} rounds (GFLOP/s, GB/s)")
    print(f"{'S':>6} {'queries':>7} {'pages':>8} {isa:>22} {'avx2':>22} {'avx2 / ' + isa:>14}")
    g = torch.Generator().manual_seed(0)
    for s in args.seq:
        n_pages = -(-s // PAGE)
        table = torch.randperm(n_pages, generator=g).int()
        bounds = torch.tensor(sorted({*range(0, s, args.node_len), s}), dtype=torch.int32)
        for dtype in (torch.float32, torch.float16):
            k_pages = torch.randn(args.layers, n_pages, KV, PAGE, HD, generator=g).to(dtype)
            v_pages = torch.randn(args.layers, n_pages, KV, PAGE, HD, generator=g).to(dtype)
            for n in args.queries:
                q, out = torch.randn(n, H, HD, generator=g), torch.empty(n, H * HD)
                extra = dict(node_bounds=bounds, mass=torch.zeros(n, bounds.shape[0] - 1)) if args.mass else {}
                step = lambda i: cpu_ops.paged_attention(q, k_pages, v_pages, i, table, s, out=out, **extra)  # noqa: E731
                best = dict.fromkeys(levels, float("inf"))
                for _ in range(args.rounds):
                    for level in levels:
                        with cpu_ops.simd_level(level):
                            best[level] = min(best[level], time_ms(step, args.layers, args.reps))
                gflop = 4 * n * s * HD * H * args.layers / 1e9
                gbyte = 2 * s * KV * HD * k_pages.element_size() * args.layers / 1e9
                cell = lambda ms: f"{ms:.2f} ({gflop / ms * 1e3:.0f}, {gbyte / ms * 1e3:.1f})"  # noqa: E731
                print(f"{s:>6} {n:>7} {str(dtype).removeprefix('torch.'):>8} {cell(best[isa]):>22} "
                      f"{cell(best['avx2']):>22} {best['avx2'] / best[isa]:>13.2f}x", flush=True)


def decode_steps(args: argparse.Namespace, levels: list[str]) -> None:
    """Whole decode steps of args.model after each context, at each SIMD level in turn (see the module doc)."""
    from nodekv import load_engine
    from nodekv.engine.cpu import native_bf16_matmul

    precision = "bf16" if native_bf16_matmul() else "exact"  # the same decode, a faster prefill
    print(f"{args.model}, threads {args.threads}, greedy steps after each context on a fork, best of {args.rounds} "
          f"rounds of {args.decode} tokens; prompts with precision {precision!r}; ms a token (attention part)")
    print(f"{'S':>6} {'KV cache':>9} {levels[0]:>16} {'avx2':>16} {'avx2 / ' + levels[0]:>14} {'same tokens':>12}")
    contexts = sorted(set(args.seq))
    for kv_dtype in args.kv_dtype:
        eng = load_engine(args.model, threads=args.threads, precision=precision, kv_dtype=kv_dtype,
                          kv_tokens=contexts[-1] + args.decode + 64)
        ids = torch.randint(1000, min(eng.config.vocab_size, 30000), (contexts[-1],),
                            generator=torch.Generator().manual_seed(0)).tolist()
        session, cached = eng.session(), 0
        for s in contexts:
            session.append(ids[cached:s])
            cached = s
            step, attention = (dict.fromkeys(levels, float("inf")) for _ in range(2))
            tokens = {}
            for r in range(args.rounds):
                for level in levels[r % 2:] + levels[:r % 2]:  # each level first in every other round
                    with cpu_ops.simd_level(level):
                        if eng.model._decoder:  # the fused step, built by the first decode
                            eng.model._decoder.reset_times()
                        t0 = time.perf_counter()
                        with session.fork() as fork:
                            tokens[level] = fork.generate(args.decode, temperature=0.0).ids
                        step[level] = min(step[level], (time.perf_counter() - t0) * 1e3 / args.decode)
                        part = eng.model._decoder.times()["attention"] * 1e3 / args.decode
                        attention[level] = min(attention[level], part)
            cell = lambda level: f"{step[level]:.1f} ({attention[level]:.1f})"  # noqa: E731
            print(f"{s:>6} {kv_dtype:>9} {cell(levels[0]):>16} {cell('avx2'):>16} "
                  f"{step['avx2'] / step[levels[0]]:>13.3f}x {str(tokens[levels[0]] == tokens['avx2']):>12}")
        del eng, session


if __name__ == "__main__":
    main()
