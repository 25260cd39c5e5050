"""Per-call time of the few-token CPU kernels (nodekv.kernels.cpu_ops) vs the torch ops they replace, at T=1 with
SmolLM2-135M shapes (dim 576, 9 query / 3 KV heads of 64, FFN 1536), attention over S keys of the paged cache (pages
of 64 scattered in a pool; the torch side is `reference.paged_attention`).

Each call is timed in batches of 30 (one per layer; attention cycles through a 30-layer cache, ~24 MB at S=512, so
K/V come from the last-level cache or DRAM as in a forward pass, not from L1). Median and 10th percentile per call;
a busy machine shows up as median >> p10. Run: nodekv bench cpu_kernels [--threads N] [--seq 512]

--decode N instead times whole decode steps of the embedded SmolLM2 GGUF after a prompt of --seq tokens: N greedy
tokens with the fused one-token step (cpu_ops.Decoder, one C++ call per token) and op by op, alternating, best of
--rounds each, and the fused step's time per part per token (from its own counters).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from nodekv import _C
from nodekv.bench import count
from nodekv.kernels import cpu_ops, reference
from nodekv.paths import example

DIM, HIDDEN, N_HEADS, N_KV, HD, LAYERS, EPS, PAGE = 576, 1536, 9, 3, 64, 30, 1e-5, 64


def per_call_us(fn, seconds: float) -> tuple[float, float]:
    """(median, p10) µs per call of fn(layer), over batches of one call per layer for about `seconds`."""
    for i in range(LAYERS):
        fn(i)
    times = []
    stop = time.perf_counter() + seconds
    while time.perf_counter() < stop or len(times) < 5:
        t0 = time.perf_counter_ns()
        for i in range(LAYERS):
            fn(i)
        times.append((time.perf_counter_ns() - t0) / LAYERS / 1e3)
    times.sort()
    return statistics.median(times), times[len(times) // 10]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=count, default=torch.get_num_threads())
    ap.add_argument("--seq", type=count, default=512, help="cached positions S the new token attends to")
    ap.add_argument("--seconds", type=float, default=0.3, help="time per measurement")
    ap.add_argument("--decode", type=int, default=0, help="time N-token decodes, fused vs op by op, instead")
    ap.add_argument("--rounds", type=count, default=3, help="with --decode: alternating rounds")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.decode:
        decode_steps(args.decode, args.seq, args.rounds, args.threads)
        return
    g = torch.Generator().manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731

    x, delta, w = randn(1, DIM), torch.zeros(1, DIM), randn(DIM)
    qkv = randn(1, (N_HEADS + 2 * N_KV) * HD)
    n_qk = N_HEADS + N_KV
    qk = qkv[:, : n_qk * HD].view(1, n_qk, HD)
    freqs = 511.0 * (1.0 / 10000.0 ** (torch.arange(0, HD, 2).float() / HD))[None, :]
    cos = torch.cat([freqs.cos(), freqs.cos()], -1)
    sin = torch.cat([-freqs.sin(), freqs.sin()], -1)
    cos3, sin3 = cos[:, None, :], sin[:, None, :]
    gate_up = randn(1, 2 * HIDDEN)

    end = args.seq
    n_blocks = -(-end // PAGE)
    n_pages = 2 * n_blocks  # pages scattered in a pool twice as big
    k_pages, v_pages = randn(LAYERS, n_pages, N_KV, PAGE, HD), randn(LAYERS, n_pages, N_KV, PAGE, HD)
    table = torch.randperm(n_pages, generator=g)[:n_blocks].int()
    q = randn(1, N_HEADS, HD)
    k_new = qkv[:, N_HEADS * HD: n_qk * HD].view(1, N_KV, HD)
    v_new = qkv[:, n_qk * HD:].view(1, N_KV, HD)
    bounds = torch.tensor(sorted({*range(0, end, 32), end}), dtype=torch.int32)
    mass = torch.zeros(1, bounds.shape[0] - 1)

    def silu_torch(_):
        gate, up = gate_up.chunk(2, -1)
        return F.silu(gate) * up

    y_dim, y_hidden, y_attn = torch.empty(1, DIM), torch.empty(1, HIDDEN), torch.empty(1, N_HEADS * HD)
    cases = [  # name, torch ops replaced, torch, nodekv, nodekv with out= (None: in place anyway)
        ("rms_norm", "F.rms_norm",
         lambda _: F.rms_norm(x, (DIM,), w, EPS), lambda _: cpu_ops.rms_norm(x, w, EPS),
         lambda _: cpu_ops.rms_norm(x, w, EPS, out=y_dim)),
        ("add_rms_norm_", "x + d, F.rms_norm",
         lambda _: F.rms_norm(x + delta, (DIM,), w, EPS), lambda _: cpu_ops.add_rms_norm_(x, delta, w, EPS),
         lambda _: cpu_ops.add_rms_norm_(x, delta, w, EPS, out=y_dim)),
        ("rope_", "x*cos + roll(x)*sin",
         lambda _: qk * cos3 + qk.roll(HD // 2, -1) * sin3, lambda _: cpu_ops.rope_(qk, cos, sin), None),
        ("silu_mul", "chunk, silu(g) * u", silu_torch, lambda _: cpu_ops.silu_mul(gate_up),
         lambda _: cpu_ops.silu_mul(gate_up, out=y_hidden)),
        (f"paged_attention S={args.seq}", "gather, SDPA",
         lambda i: reference.paged_attention(q, k_pages, v_pages, i, table, end),
         lambda i: cpu_ops.paged_attention(q, k_pages, v_pages, i, table, end),
         lambda i: cpu_ops.paged_attention(q, k_pages, v_pages, i, table, end, out=y_attn)),
        ("  + store new k, v", "index_put + the above",
         lambda i: reference.paged_attention(q, k_pages, v_pages, i, table, end, k_new, v_new),
         lambda i: cpu_ops.paged_attention(q, k_pages, v_pages, i, table, end, k_new, v_new),
         lambda i: cpu_ops.paged_attention(q, k_pages, v_pages, i, table, end, k_new, v_new, out=y_attn)),
        ("  + node mass (32/node)", "softmax, index_add",
         lambda i: reference.paged_attention(q, k_pages, v_pages, i, table, end, k_new, v_new, bounds, mass),
         lambda i: cpu_ops.paged_attention(q, k_pages, v_pages, i, table, end, k_new, v_new, bounds, mass),
         lambda i: cpu_ops.paged_attention(q, k_pages, v_pages, i, table, end, k_new, v_new, bounds, mass,
                                           out=y_attn)),
    ]
    print(f"T=1, SmolLM2-135M shapes, {args.threads} threads, isa {_C.isa()}; µs per call, median (p10)")
    print(f"{'kernel':<26}{'torch ops replaced':<22}{'torch':>16}{'nodekv':>16}{'nodekv out=':>16}{'speedup':>9}")
    for name, what, torch_fn, ours_fn, out_fn in cases:
        (tm, tp), (om, op) = per_call_us(torch_fn, args.seconds), per_call_us(ours_fn, args.seconds)
        with_out = "{:>8.2f} ({:5.2f})".format(*per_call_us(out_fn, args.seconds)) if out_fn else f"{'-':>16}"
        print(f"{name:<26}{what:<22}{tm:>8.2f} ({tp:5.2f}){om:>8.2f} ({op:5.2f}){with_out}{tm / om:>8.1f}x")
    print("(speedup: torch median / nodekv median, without out=)")


def decode_steps(n: int, prompt_len: int, rounds: int, threads: int) -> None:
    """Greedy decode of n tokens after prompt_len, fused and op by op alternately; tok/s and the fused breakdown."""
    import nodekv

    eng = nodekv.load_engine("smollm2-135m", threads=threads)
    text = example("lost_in_translation.txt").read_text()
    ids = eng.tokenizer.encode(text)
    while len(ids) < prompt_len:
        ids += ids
    ids = ids[:prompt_len]
    best: dict[bool, float] = {True: 0.0, False: 0.0}
    parts: dict[str, float] = {}
    for _ in range(rounds):
        for fused in (True, False):
            eng.model.fused_decode = fused
            s = eng.session()
            s.append(ids)
            s.generate(4)  # warm: builds the decoder, grows the RoPE table
            dec = eng.model._decoder if fused else None
            if dec:
                dec.reset_times()
            t = time.perf_counter()
            s.generate(n)
            dt = time.perf_counter() - t
            got = (len(s) - prompt_len - 4) / dt
            if got > best[fused]:
                best[fused] = got
                if dec:
                    parts = {k: v / (len(s) - prompt_len - 4) for k, v in dec.times().items()}
                    parts["outside the step"] = dt / (len(s) - prompt_len - 4) - sum(parts.values())
            s.release()
    print(f"decode after {prompt_len} tokens, {threads} threads, best of {rounds}: fused {best[True]:.1f} tok/s, "
          f"op by op {best[False]:.1f} tok/s")
    print("fused step, ms per token: " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in parts.items()))


if __name__ == "__main__":
    main()
