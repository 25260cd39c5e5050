"""Time one decode token's worth of GEMVs on quantised blocks, per projection and type, against dense fp32.

Models (their GGUFs' shapes and types):
  smollm2-135m   30 layers: fused qkv [960x576], o [576x576], fused gate/up [3072x576], down [576x1536], all Q4_1;
                 tied lm_head [49152x576] Q8_0. Also torch's int4pack kernel on the same Q4_1 layers.
  qwen2.5-0.5b   24 layers: fused qkv [1152x896] = Q5_0 (q|k, 1024 rows) | Q8_0 (v, 128 rows), o [896x896] Q5_0,
                 gate/up [9728x896] Q5_0, down [896x4864] Q6_K or Q4_K (as in the Q4_K_M file); lm_head
                 [151936x896] Q8_0.
  qwen2.5-1.5b   28 layers: fused qkv [2048x1536] = Q4_K (q|k, 1792 rows) | Q4_K or Q6_K (v, 256 rows), o [1536x1536]
                 Q4_K, gate/up [17920x1536] Q4_K, down [1536x8960] Q6_K or Q4_K; lm_head [151936x1536] Q6_K.
Every layer gets its own random weights, so the bytes come from DRAM as in a real forward, not from the last-level
cache. Run: nodekv bench quant_gemv [--model qwen2.5-0.5b] [--threads N] [--tokens 1,2,4,8,16]

With one token count (--tokens, default 1: decode) it prints the per-projection table; with several, a sweep: the
whole model's matmuls at each count on the quantised blocks and with dense fp32 F.linear on the dequantised weights,
in ms and tokens/s, and tokens/s relative to one token (what batching that many decode steps buys), measured side by
side. The count where dense overtakes the blocks is where a forward should switch to dense weights. --int8 adds the
int8 fast path (`quant_linear(..., int8=True)`) beside the exact one in either table. On a CPU with AVX-512 the sweep
also runs the kernels limited to AVX2 (the same bits): the exact path's, whose 8 tokens or more take two tokens per
512-bit FMA and whose fewer tokens take the K-quants two rows per 512-bit register, and with --int8 the int8 path's,
which use VNNI.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from nodekv import _C
from nodekv.bench import count
from nodekv.kernels.cpu_ops import simd_level
from nodekv.kernels.quant import BLOCK_BYTES, BLOCK_ELEMS, QuantLinearWeight, QuantStack, QuantWeight, quant_linear

Parts = list[tuple[int, str]]  # (rows, qtype) of the row segments of a projection


def smollm2_layer(i: int) -> list[tuple[str, Parts, int]]:
    return [("qkv", [(960, "q4_1")], 576), ("o", [(576, "q4_1")], 576), ("gate/up", [(3072, "q4_1")], 576),
            ("down", [(576, "q4_1")], 1536)]


QWEN_Q6K_DOWN = {0, 1, 3, 6, 7, 8, 9, 10, 13, 16, 19, 21}  # the layers whose ffn_down is Q6_K (else Q4_K)
# qwen2.5-1.5b: llama.cpp's Q4_K_M gives attn_v and ffn_down more bits in the first and last eighth of the layers and
# every third layer between (its use_more_bits rule)
QWEN15_Q6K = {i for i in range(28) if i < 3 or i >= 24 or (i - 3) % 3 == 2}


def qwen_layer(i: int) -> list[tuple[str, Parts, int]]:
    return [("qkv", [(1024, "q5_0"), (128, "q8_0")], 896), ("o", [(896, "q5_0")], 896),
            ("gate/up", [(9728, "q5_0")], 896), ("down", [(896, "q6_k" if i in QWEN_Q6K_DOWN else "q4_k")], 4864)]


def qwen15_layer(i: int) -> list[tuple[str, Parts, int]]:
    more = "q6_k" if i in QWEN15_Q6K else "q4_k"
    return [("qkv", [(1792, "q4_k"), (256, more)], 1536), ("o", [(1536, "q4_k")], 1536),
            ("gate/up", [(17920, "q4_k")], 1536), ("down", [(1536, more)], 8960)]


MODELS = {  # name: (layers, per-layer projections (name, parts, in_features), lm_head (rows, qtype, in_features))
    "smollm2-135m": (30, smollm2_layer, (49152, "q8_0", 576)),
    "qwen2.5-0.5b": (24, qwen_layer, (151936, "q8_0", 896)),
    "qwen2.5-1.5b": (28, qwen15_layer, (151936, "q6_k", 1536)),
}


def random_quant(out_features: int, in_features: int, qtype: str, gen: torch.Generator) -> QuantWeight:
    """Random blocks with sane fp16 scales (d > 0, and a negative min for q4_1, a small dmin for q4_k) and random
    quants."""
    nb, bb = in_features // BLOCK_ELEMS[qtype], BLOCK_BYTES[qtype]
    raw = torch.randint(0, 256, (out_features, nb, bb), dtype=torch.uint8, generator=gen)
    d_at = 208 if qtype == "q6_k" else 0
    raw[..., d_at:d_at + 2] = (torch.rand(out_features, nb, 1, generator=gen) * 0.01 + 1e-3).half().view(torch.uint8)
    if qtype in ("q4_1", "q4_k"):
        m = -torch.rand(out_features, nb, 1, generator=gen) * 0.08 if qtype == "q4_1" else \
            torch.rand(out_features, nb, 1, generator=gen) * 3e-4
        raw[..., 2:4] = m.half().view(torch.uint8)
    return QuantWeight(raw.reshape(out_features, nb * bb), qtype, in_features)


def stacked(parts: Parts, in_features: int, gen: torch.Generator) -> QuantLinearWeight:
    ws = [random_quant(n, in_features, q, gen) for n, q in parts]
    return ws[0] if len(ws) == 1 else QuantStack(ws)


def nbytes(w: QuantLinearWeight) -> int:
    return sum(p.data.numel() for p in (w.parts if isinstance(w, QuantStack) else [w]))


def int4pack(w: QuantWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """A q4_1 weight as torch's CPU int4pack: w = (q - 8) * scale + zero with scale = d, zero = m + 8 d."""
    n, k = w.out_features, w.in_features
    blocks = w.data.view(n, k // 32, 20)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float().squeeze(-1)
    m = blocks[..., 2:4].contiguous().view(torch.float16).float().squeeze(-1)
    qs = blocks[..., 4:].to(torch.int32)
    q = torch.cat([qs & 0xF, qs >> 4], dim=-1).reshape(n, k)  # low nibbles are elements 0..15 of a block
    packed = torch._convert_weight_to_int4pack_for_cpu(q.contiguous(), 2)
    scales_zeros = torch.stack([d, m + 8 * d], dim=-1).transpose(0, 1).contiguous()  # [k/32, n, 2]
    return packed, scales_zeros


def time_fn(fn, reps: int) -> tuple[float, float, float]:
    """(median, min) wall ms and min process CPU ms of fn() over reps runs, after two warm-up runs. On one thread
    the CPU time is the kernel's own, however busy the machine: on a shared one it is the number to compare."""
    fn(), fn()
    wall, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
    return statistics.median(wall), min(wall), min(cpu)


def sweep(weights: list[QuantLinearWeight], counts: list[int], reps: int, dense: bool, gen: torch.Generator,
          int8: bool = False) -> None:
    """The whole model's matmuls at each token count, quantised and dense fp32, timed side by side: each repetition
    runs every (count, kernel) once, so a busy machine slows all of them alike."""
    dense_ws = [w.dequantize() for w in weights] if dense else []
    ks = {w.in_features for w in weights}
    xs = {(t, k): torch.randn(t, k, generator=gen) for t in counts for k in ks}

    def run_quant(t):
        for w in weights:
            quant_linear(xs[t, w.in_features], w)

    def run_int8(t):
        for w in weights:
            quant_linear(xs[t, w.in_features], w, int8=True)

    def run_quant_avx2(t):  # the exact kernels without token or row pairs, where the CPU has AVX-512 (the same bits)
        with simd_level("avx2"):
            run_quant(t)

    def run_int8_avx2(t):  # the int8 kernels without VNNI, where the CPU has it (the same bits, slower)
        with simd_level("avx2"):
            run_int8(t)

    def run_dense(t):
        for w in dense_ws:
            F.linear(xs[t, w.shape[1]], w)

    avx512 = _C.isa() == "avx512"
    kernels = [("quant", run_quant)] + [("quant avx2", run_quant_avx2)] * avx512 + \
        [(f"int8 {_C.isa()}", run_int8)] * int8 + [("int8 avx2", run_int8_avx2)] * (int8 and avx512) + \
        [("dense", run_dense)] * dense
    times: dict[tuple[str, int], list[float]] = {(name, t): [] for name, _ in kernels for t in counts}
    for rep in range(reps + 1):  # the first round warms up
        for t in counts:
            for name, fn in kernels:
                t0 = time.perf_counter()
                fn(t)
                if rep:
                    times[name, t].append((time.perf_counter() - t0) * 1e3)
    ms = {key: statistics.median(v) for key, v in times.items()}
    width = {name: max(11, len(name) + 4) for name, _ in kernels}
    head = f"{'T':>4}" + "".join(f"{name + ' ms':>{width[name]}}{'tok/s':>8}{'x T=1':>7}" for name, _ in kernels)
    print(head + (f"{'dense/quant':>12}" if dense else ""))
    for t in counts:
        line = f"{t:>4}"
        for name, _ in kernels:
            gain = t * ms[name, 1] / ms[name, t] if 1 in counts else float("nan")
            line += f"{ms[name, t]:>{width[name]}.2f}{t / ms[name, t] * 1e3:>8.1f}{gain:>7.2f}"
        print(line + (f"{ms['dense', t] / ms['quant', t]:>12.2f}" if dense else ""))
    print("(median ms of the whole model's matmuls, lm_head included; x T=1: tokens/s over that at T=1;\n"
          " dense/quant > 1: the quantised blocks are faster)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-0.5b")
    ap.add_argument("--threads", type=count, default=torch.get_num_threads())
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tokens", default="1",
                    help="rows of x per matmul (1 = decode); a comma list (1,2,4,8,16) sweeps the counts")
    ap.add_argument("--no-dense", action="store_true", help="skip the dense fp32 comparison (it needs 4 B/weight)")
    ap.add_argument("--int8", action="store_true", help="also time the int8 fast path")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    counts = [int(t) for t in args.tokens.split(",")]

    n_layers, layer_shapes, (vocab, head_type, dim) = MODELS[args.model]
    layers = [[(name, stacked(parts, k, gen)) for name, parts, k in layer_shapes(i)] for i in range(n_layers)]
    head = random_quant(vocab, dim, head_type, gen)
    if len(counts) > 1:
        print(f"one {args.model} forward's matmuls per token count, {args.threads} threads, {args.reps} runs")
        sweep([w for ws in layers for _, w in ws] + [head], counts, args.reps, not args.no_dense, gen, args.int8)
        return
    tokens = counts[0]
    xs: dict[int, torch.Tensor] = {}
    for ws in layers:
        for _, w in ws:
            xs.setdefault(w.in_features, torch.randn(tokens, w.in_features, generator=gen))
    xs.setdefault(dim, torch.randn(tokens, dim, generator=gen))

    # per projection and type: every layer's weights of that kind, then the lm_head
    groups: dict[str, list[QuantLinearWeight]] = {}
    for ws in layers:
        for name, w in ws:
            types = "|".join(p.qtype for p in (w.parts if isinstance(w, QuantStack) else [w]))
            groups.setdefault(f"{name} {types}", []).append(w)
    groups[f"lm_head {head_type}"] = [head]

    def run(ws, int8=False):
        for w in ws:
            quant_linear(xs[w.in_features], w, int8=int8)

    all_quant = [w for ws in groups.values() for w in ws]
    rows = []
    for name, ws in groups.items():
        rows.append((f"{name} (x{len(ws)})", sum(map(nbytes, ws)), time_fn(lambda ws=ws: run(ws), args.reps)))
        if args.int8:
            rows.append(("  int8", sum(map(nbytes, ws)), time_fn(lambda ws=ws: run(ws, True), args.reps)))
    rows.append(("token total, quantised blocks", sum(map(nbytes, all_quant)), time_fn(lambda: run(all_quant),
                                                                                        args.reps)))
    if args.int8:
        rows.append(("token total, int8 fast path", sum(map(nbytes, all_quant)),
                     time_fn(lambda: run(all_quant, True), args.reps)))

    if not args.no_dense:
        dense = [w.dequantize() for w in all_quant]

        def run_dense():
            for w in dense:
                F.linear(xs[w.shape[1]], w)

        rows.append(("token total, torch F.linear dense fp32", 4 * sum(w.numel() for w in dense),
                     time_fn(run_dense, args.reps)))
        del dense

    if args.model == "smollm2-135m":
        try:
            packed = [(w.in_features, int4pack(w)) for ws in layers for _, w in ws]
            dense_head = head.dequantize()

            def run_int4():
                for k, (p, sz) in packed:
                    torch._weight_int4pack_mm_for_cpu(xs[k], p, 32, sz)
                F.linear(xs[dim], dense_head)

            int4_bytes = sum(p.numel() + 4 * sz.numel() for _, (p, sz) in packed) + 4 * dense_head.numel()
            rows.append(("torch int4pack (layers) + fp32 lm_head", int4_bytes, time_fn(run_int4, args.reps)))
        except (RuntimeError, AttributeError) as e:  # op missing or unsupported on this build / CPU
            print(f"(torch int4pack skipped: {e})")

    print(f"one {args.model} token of GEMVs, T={tokens}, {args.threads} threads, {args.reps} runs")
    print(f"{'kernel':<42}{'weights MB':>11}{'median ms':>10}{'min ms':>8}{'GB/s':>7}{'CPU ms':>8}{'GB/CPU-s':>9}")
    for name, n, (med, best, cpu) in rows:
        print(f"{name:<42}{n / 1e6:>11.1f}{med:>10.2f}{best:>8.2f}{n / med / 1e6:>7.1f}{cpu:>8.2f}"
              f"{n / max(cpu, 1e-3) / 1e6:>9.1f}")
    print("(GB/s: weight bytes per median wall time, a shared or busy machine shows up as median >> min; GB/CPU-s:\n"
          " per CPU second, all threads' time summed (spin-waits included): per core at --threads 1)")


if __name__ == "__main__":
    main()
