"""Time one SmolLM2-135M decode token's worth of GEMVs: C++ quantised blocks vs dense fp32 vs torch int4pack.

Per token: 30 layers x (fused qkv [960x576], o [576x576], fused gate/up [3072x576], down [576x1536]) in Q4_1,
plus the tied lm_head [49152x576] in Q8_0. Every layer gets its own random weights, so the bytes come from DRAM
as in a real forward, not from the last-level cache. Run: python -m nodekv.bench.quant_gemv [--threads N]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from nodekv.kernels.quant import BLOCK_BYTES, QuantWeight, quant_linear

DIM, HIDDEN, VOCAB, LAYERS, KV_DIM = 576, 1536, 49152, 30, 192
LAYER_SHAPES = [(DIM + 2 * KV_DIM, DIM), (DIM, DIM), (2 * HIDDEN, DIM), (DIM, HIDDEN)]  # (out, in)


def random_quant(out_features: int, in_features: int, qtype: str, gen: torch.Generator) -> QuantWeight:
    """Random blocks with sane fp16 scales (d > 0, and m < 0 for q4_1) and random quants."""
    nb, bb = in_features // 32, BLOCK_BYTES[qtype]
    raw = torch.randint(0, 256, (out_features, nb, bb), dtype=torch.uint8, generator=gen)
    d = (torch.rand(out_features, nb, 1, generator=gen) * 0.01 + 1e-3).half().view(torch.uint8)
    raw[..., 0:2] = d
    if qtype == "q4_1":
        raw[..., 2:4] = (-torch.rand(out_features, nb, 1, generator=gen) * 0.08).half().view(torch.uint8)
    return QuantWeight(raw.reshape(out_features, nb * bb), qtype, in_features)


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


def time_token(fn, reps: int) -> tuple[float, float]:
    """(median, min) ms of fn() over reps runs, after two warm-up runs."""
    fn(), fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=1, help="rows of x per GEMV (1 = decode)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)

    layers = [[random_quant(o, i, "q4_1", gen) for o, i in LAYER_SHAPES] for _ in range(LAYERS)]
    head = random_quant(VOCAB, DIM, "q8_0", gen)
    xs = {k: torch.randn(args.tokens, k, generator=gen) for k in (DIM, HIDDEN)}
    quant_bytes = sum(w.data.numel() for ws in layers for w in ws) + head.data.numel()

    def run_quant():
        for ws in layers:
            for w in ws:
                quant_linear(xs[w.in_features], w)
        quant_linear(xs[DIM], head)

    rows = [("C++ quantised (Q4_1 + Q8_0 blocks)", quant_bytes, time_token(run_quant, args.reps))]

    dense = [[w.dequantize() for w in ws] for ws in layers]
    dense_head = head.dequantize()

    def run_dense():
        for ws in dense:
            for w in ws:
                F.linear(xs[w.shape[1]], w)
        F.linear(xs[DIM], dense_head)

    dense_bytes = 4 * (sum(w.numel() for ws in dense for w in ws) + dense_head.numel())
    rows.append(("torch F.linear, dense fp32", dense_bytes, time_token(run_dense, args.reps)))
    del dense

    try:
        packed = [[int4pack(w) for w in ws] for ws in layers]

        def run_int4():
            for ws, ps in zip(layers, packed):
                for w, (p, sz) in zip(ws, ps):
                    torch._weight_int4pack_mm_for_cpu(xs[w.in_features], p, 32, sz)
            F.linear(xs[DIM], dense_head)

        int4_bytes = sum(p.numel() + 4 * sz.numel() for ps in packed for p, sz in ps) + 4 * dense_head.numel()
        rows.append(("torch int4pack (layers) + fp32 lm_head", int4_bytes, time_token(run_int4, args.reps)))
    except (RuntimeError, AttributeError) as e:  # op missing or unsupported on this build / CPU
        print(f"(torch int4pack skipped: {e})")

    print(f"one SmolLM2-135M token of GEMVs, T={args.tokens}, {args.threads} threads, {args.reps} runs")
    print(f"{'kernel':<42}{'weights MB':>11}{'median ms':>10}{'min ms':>8}{'GB/s':>7}")
    for name, nbytes, (med, best) in rows:
        print(f"{name:<42}{nbytes / 1e6:>11.1f}{med:>10.2f}{best:>8.2f}{nbytes / med / 1e6:>7.1f}")
    print("(GB/s: weight bytes per median time; a shared or busy machine shows up as median >> min)")


if __name__ == "__main__":
    main()
