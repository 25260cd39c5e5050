"""Kernel micro-benchmarks through pytest-benchmark: the CPU kernels nodekv runs every forward (paged attention for
decode and prefill, with and without node mass; RMSNorm, RoPE, SwiGLU; a quantised GEMV), each against the torch op
it replaces, at qwen2.5-0.5b's shapes (14 query / 2 KV heads of 64, dim 896, FFN 4864) or, with `-k tiny`, tiny
ones (the smoke test runs those once each with --benchmark-disable).

    nodekv bench kernel_bench [pytest options, e.g. -k attention --benchmark-sort=mean]
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from nodekv.bench.quant_gemv import random_quant
from nodekv.kernels import cpu_ops, quant, reference

SHAPES = {  # dim, ffn, query heads, kv heads, head dim, cached keys, prefill tokens, page
    "qwen": (896, 4864, 14, 2, 64, 2048, 256, 64),
    "tiny": (64, 128, 4, 2, 16, 64, 16, 16),
}


def _attention_case(name: str, n: int):
    dim, _, h, kv, hd, keys, _, page = SHAPES[name]
    gen = torch.Generator().manual_seed(0)
    pages = -(-keys // page)
    k_pages = torch.randn(1, pages, kv, page, hd, generator=gen)
    v_pages = torch.randn(1, pages, kv, page, hd, generator=gen)
    table = torch.randperm(pages, generator=gen).to(torch.int32)
    q = torch.randn(n, h, hd, generator=gen)
    bounds = torch.tensor([0, keys // 4, keys // 2, keys - n, keys], dtype=torch.int32)
    return q, k_pages, v_pages, table, keys, bounds


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("rows", ["decode", "prefill"])
@pytest.mark.parametrize("impl", ["nodekv", "nodekv+mass", "torch"])
def test_paged_attention(benchmark, shape, rows, impl):
    n = 1 if rows == "decode" else SHAPES[shape][6]
    q, k_pages, v_pages, table, end, bounds = _attention_case(shape, n)
    if impl == "torch":
        benchmark(reference.paged_attention, q, k_pages, v_pages, 0, table, end)
    else:
        mass = torch.zeros(n, bounds.numel() - 1) if impl == "nodekv+mass" else None
        benchmark(cpu_ops.paged_attention, q, k_pages, v_pages, 0, table, end, node_bounds=bounds, mass=mass)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("impl", ["nodekv", "torch"])
@pytest.mark.parametrize("op", ["rms_norm", "rope", "silu_mul"])
def test_pointwise(benchmark, shape, impl, op):
    dim, ffn, h, _, hd, _, _, _ = SHAPES[shape]
    x, w = torch.randn(1, dim), torch.ones(dim)
    qk = torch.randn(1, h, hd)
    angle = torch.randn(1, hd // 2)
    cos, sin = angle.cos().repeat(1, 2), torch.cat([-angle.sin(), angle.sin()], dim=-1)
    gate_up = torch.randn(1, 2 * ffn)
    kernels = cpu_ops if impl == "nodekv" else reference  # the reference module is the torch ops they replace
    ops = {"rms_norm": lambda: kernels.rms_norm(x, w, 1e-6),
           "rope": lambda: (kernels.rope_ if impl == "nodekv" else kernels.rope)(qk, cos, sin),
           "silu_mul": lambda: kernels.silu_mul(gate_up)}
    benchmark(ops[op])


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("impl", ["nodekv q8_0", "torch fp32"])
def test_gemv(benchmark, shape, impl):
    dim, ffn = SHAPES[shape][:2]
    w = random_quant(ffn, dim, "q8_0", torch.Generator().manual_seed(0))
    x = torch.randn(1, dim)
    if impl == "torch fp32":
        dense = torch.randn(ffn, dim)
        benchmark(torch.nn.functional.linear, x, dense)
    else:
        benchmark(quant.quant_linear, x, w)


def main() -> None:
    sys.exit(pytest.main([str(Path(__file__)), "-p", "no:cacheprovider", "-q", "--benchmark-only",
                          "--benchmark-columns=min,median,mean,rounds", "--benchmark-group-by=func", "-k",
                          "not tiny", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
