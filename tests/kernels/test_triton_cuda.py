"""The Triton kernels compiled for a real GPU, in float32 and bfloat16 (the interpreter runs fp32 only), at model
head shapes and lengths the interpreter is too slow for, including the split-KV decode path chosen from the SM
count. Skipped without CUDA.

Bounds as in flash-attention's tests: against a float64 oracle, a kernel's max error must stay within a small
multiple of the error of plain torch (`nodekv.kernels.reference`) computing the same thing in the same dtype on
the same GPU. Node mass is accumulated in fp32 whatever the inputs, and must sum to the head count per query.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nodekv.kernels import reference
from numerics import gen
from paged_cases import PagedCase, brute_force, make_batch, make_case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DTYPES = [torch.float32, torch.bfloat16]
FACTOR = 4.0


def _within(got: torch.Tensor, exact: torch.Tensor, torch_same_dtype: torch.Tensor, what: str,
            floor: float = 0.0) -> None:
    """got's max error within FACTOR x that of torch in the same dtype, or of eps x max |exact| (rounding the result
    costs that), or of `floor` (what the computation's own sensitivity costs, where the caller knows it)."""
    eps = torch.finfo(got.dtype).eps
    torch_err = (torch_same_dtype.double().cpu() - exact).abs().max().item()
    floor = max(floor, eps * exact.abs().max().item())
    err = (got.double().cpu() - exact).abs().max().item()
    assert err <= FACTOR * max(torch_err, floor), f"{what}: max |err| {err:.3g} vs torch {torch_err:.3g}"


def _score_rounding_floor(case: PagedCase) -> float:
    """fp32 eps x max |s| x max |v| over the case's scores s = q.k / sqrt(hd) and values: relative errors of eps in
    the scores, which any fp32 dot product makes (the kernels accumulate scores in fp32 whatever the inputs), move
    an attention output by up to about this. A peaked softmax feels them:
    one head of a 500-key decode case errs by 0.63e-6 through torch's einsum, 1.1e-6 with the dot products summed
    in reverse and 2.0e-6 summed in order (fp32, on the CPU), so torch's own error is no bound there."""
    P, T = case.k_pages.shape[3], case.k_new.shape[0]
    keys = torch.stack([case.k_pages[case.layer, case.block_table[s // P], :, s % P] for s in range(case.end)])
    values = torch.stack([case.v_pages[case.layer, case.block_table[s // P], :, s % P] for s in range(case.end)])
    keys[case.end - T:], values[case.end - T:] = case.k_new, case.v_new
    G = case.q.shape[1] // keys.shape[1]
    scores = torch.einsum("nhd,khd->nhk", case.q.double(), keys.double().repeat_interleave(G, 1))
    return torch.finfo(torch.float32).eps * (scores.abs().max() / case.q.shape[2] ** 0.5 * values.abs().max()).item()


def _on(case: PagedCase, dtype: torch.dtype) -> PagedCase:
    c = lambda t: t.to("cuda", dtype)  # noqa: E731
    return PagedCase(c(case.q), c(case.k_pages), c(case.v_pages), case.layer, case.block_table.cuda(), case.end,
                     c(case.k_new), c(case.v_new), case.node_bounds.cuda())


def _as_cpu_dtype(case: PagedCase, dtype: torch.dtype) -> PagedCase:
    """The problem rounded to `dtype`, on the CPU in float32: the oracle sees exactly the kernel's inputs."""
    r = lambda t: t.to(dtype).float()  # noqa: E731
    return PagedCase(r(case.q), r(case.k_pages), r(case.v_pages), case.layer, case.block_table, case.end,
                     r(case.k_new), r(case.v_new), case.node_bounds)


SHAPES = [  # (n queries, T new tokens, end, H, Hkv, hd, page size, nodes)
    (1, 1, 4096, 14, 2, 64, 16, 40),     # qwen2.5-0.5b decode over a long prompt (split-KV)
    (1, 1, 8192, 32, 8, 128, 16, 80),    # llama-3.1-8b decode (split-KV)
    (40, 40, 3000, 14, 2, 64, 16, 25),   # a probe appended to a long prompt
    (300, 300, 300, 9, 3, 64, 64, 6),    # prefill from empty, SmolLM2 heads
    (256, 512, 2048, 32, 8, 128, 16, 30),  # last rows of a chunk (last-layer pruning), 8B heads
]


@pytest.mark.parametrize("mass_pass", ["one", "two"])  # node mass inside the attention pass or after it
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_paged_attention_and_node_mass_on_cuda(shape, dtype, mass_pass):
    from nodekv.kernels import triton_attention

    n, T, end, H, Hkv, hd, P, N = shape
    rounded = _as_cpu_dtype(make_case(n, T, end, H, Hkv, hd, P, N), dtype)
    exact_out, exact_mass = brute_force(rounded)
    gpu = _on(rounded, dtype)
    mass = torch.zeros(n, N, device="cuda")
    out = triton_attention.paged_attention(gpu.q, gpu.k_pages, gpu.v_pages, gpu.layer, gpu.block_table, end,
                                           gpu.k_new, gpu.v_new, gpu.node_bounds, mass, mass_pass=mass_pass)
    ref_gpu = _on(rounded, dtype)
    ref_mass = torch.zeros(n, N, device="cuda")
    ref_out = reference.paged_attention(ref_gpu.q, ref_gpu.k_pages, ref_gpu.v_pages, ref_gpu.layer,
                                        ref_gpu.block_table, end, ref_gpu.k_new, ref_gpu.v_new, ref_gpu.node_bounds,
                                        ref_mass)
    assert out.dtype == dtype and mass.dtype == torch.float32
    _within(out, exact_out, ref_out, "out")
    _within(mass, exact_mass, ref_mass, "mass")
    torch.testing.assert_close(mass.sum(1).double().cpu(), torch.full((n,), float(H), dtype=torch.float64),
                               atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("rows", ["all", "last"])
def test_a_bf16_prefill_without_mass_attends_through_sdpa(rows, monkeypatch):
    """`triton_ops.paged_attention` of a prefill from an empty cache without node mass: SDPA's output (the Triton
    kernel is not called) within the bound of torch, its keys and values stored in the pages; with mass, the kernel,
    unless FRESH_PREFILL_MASS is "sdpa"."""
    from nodekv.kernels import triton_attention, triton_ops

    T, H, Hkv, hd, P = 700, 12, 2, 128, 16
    n = T if rows == "all" else 1
    rounded = _as_cpu_dtype(make_case(n, T, T, H, Hkv, hd, P, 5), torch.bfloat16)
    gpu, ref_gpu = _on(rounded, torch.bfloat16), _on(rounded, torch.bfloat16)
    kernel, calls = triton_attention.paged_attention, []
    monkeypatch.setattr(triton_attention, "paged_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    out = triton_ops.paged_attention(gpu.q, gpu.k_pages, gpu.v_pages, gpu.layer, gpu.block_table, T, gpu.k_new,
                                     gpu.v_new)
    ref = reference.paged_attention(ref_gpu.q, ref_gpu.k_pages, ref_gpu.v_pages, ref_gpu.layer, ref_gpu.block_table,
                                    T, ref_gpu.k_new, ref_gpu.v_new)
    assert calls == [] and out.shape == (n, H * hd)
    _within(out, brute_force(rounded)[0], ref, "out")
    assert torch.equal(gpu.k_pages, ref_gpu.k_pages) and torch.equal(gpu.v_pages, ref_gpu.v_pages)
    triton_ops.paged_attention(gpu.q, gpu.k_pages, gpu.v_pages, gpu.layer, gpu.block_table, T, gpu.k_new, gpu.v_new,
                               gpu.node_bounds, torch.zeros(n, 5, device="cuda"))
    assert calls == [1]
    monkeypatch.setattr(triton_ops, "FRESH_PREFILL_MASS", "sdpa")  # now with mass too
    triton_ops.paged_attention(gpu.q, gpu.k_pages, gpu.v_pages, gpu.layer, gpu.block_table, T, gpu.k_new, gpu.v_new,
                               gpu.node_bounds, torch.zeros(n, 5, device="cuda"))
    assert calls == [1]


FRESH_SHAPES = [  # (n queries, T = end keys, H, Hkv, hd, page size, nodes): prefills from an empty cache
    (300, 300, 9, 3, 64, 64, 6),       # SmolLM2 heads
    (1024, 1024, 12, 2, 128, 64, 32),  # qwen2.5-1.5b heads, the engine bench's nodes
    (1, 1500, 32, 8, 128, 16, 30),     # the last query only (last-layer pruning), 8B heads
]


@pytest.mark.parametrize("shape", FRESH_SHAPES, ids=str)
def test_sdpa_prefill_and_its_mass_pass_on_cuda(shape):
    """`sdpa_prefill` in bf16: SDPA's output and the mass pass over its log-sum-exp against the float64 oracle,
    within the bound of torch's own bf16 attention; fp32 on CUDA is refused before anything is written."""
    from nodekv.kernels import triton_attention

    n, T, H, Hkv, hd, P, N = shape
    rounded = _as_cpu_dtype(make_case(n, T, T, H, Hkv, hd, P, N), torch.bfloat16)
    exact_out, exact_mass = brute_force(rounded)
    gpu, ref_gpu = _on(rounded, torch.bfloat16), _on(rounded, torch.bfloat16)
    mass, ref_mass = torch.zeros(n, N, device="cuda"), torch.zeros(n, N, device="cuda")
    out = triton_attention.sdpa_prefill(gpu.q, gpu.k_pages, gpu.v_pages, gpu.layer, gpu.block_table, gpu.k_new,
                                        gpu.v_new, gpu.node_bounds, mass)
    ref_out = reference.paged_attention(ref_gpu.q, ref_gpu.k_pages, ref_gpu.v_pages, ref_gpu.layer,
                                        ref_gpu.block_table, T, ref_gpu.k_new, ref_gpu.v_new, ref_gpu.node_bounds,
                                        ref_mass)
    _within(out, exact_out, ref_out, "out")
    _within(mass, exact_mass, ref_mass, "mass")
    assert torch.equal(gpu.k_pages, ref_gpu.k_pages) and torch.equal(gpu.v_pages, ref_gpu.v_pages)
    fp32 = _on(rounded, torch.float32)
    pages = fp32.k_pages.clone()
    with pytest.raises(ValueError, match="bf16 or fp16"):
        triton_attention.sdpa_prefill(fp32.q, fp32.k_pages, fp32.v_pages, fp32.layer, fp32.block_table, fp32.k_new,
                                      fp32.v_new, fp32.node_bounds, torch.zeros(n, N, device="cuda"))
    assert torch.equal(fp32.k_pages, pages)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_attention_of_a_batch_on_cuda(dtype):
    """A decode step of 32 sequences of different lengths in one launch (split-KV for the long ones): each
    sequence's output within the bound of torch computing it alone, and the new keys and values written."""
    from nodekv.kernels import triton_attention

    ends = [1, 7, 64, 65, 500, 1024, 2049, 4096] * 4
    cases, k_pages, v_pages, tables = make_batch(ends, 12, 2, 128, 16)
    cases = [_as_cpu_dtype(c, dtype) for c in cases]
    k_pages, v_pages = k_pages.to(dtype).cuda(), v_pages.to(dtype).cuda()
    out = triton_attention.decode_attention(
        torch.cat([c.q for c in cases]).to(dtype).cuda(), k_pages, v_pages, cases[0].layer, tables.cuda(),
        torch.tensor(ends, dtype=torch.int32).cuda(), max(ends), torch.cat([c.k_new for c in cases]).to(dtype).cuda(),
        torch.cat([c.v_new for c in cases]).to(dtype).cuda())
    for b, c in enumerate(cases):
        gpu = _on(c, dtype)
        ref = reference.paged_attention(gpu.q, gpu.k_pages, gpu.v_pages, gpu.layer, gpu.block_table, c.end,
                                        gpu.k_new, gpu.v_new)
        _within(out[b:b + 1], brute_force(c)[0], ref, f"sequence {b}", _score_rounding_floor(c))
        page, row = int(tables[b, (c.end - 1) // 16]), (c.end - 1) % 16
        assert torch.equal(k_pages[c.layer, page, :, row].cpu(), c.k_new[0].to(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_elementwise_ops_on_cuda(dtype):
    from nodekv.kernels import triton_ops as tro

    t, d, inter, hd, n_qk = 37, 896, 4864, 64, 16
    x = (torch.randn(t, d, generator=gen(1)) * 3).to(dtype)
    delta = torch.randn(t, d, generator=gen(2)).to(dtype)
    w = torch.randn(d, generator=gen(3)).to(dtype)
    exact = F.rms_norm(x.double(), (d,), w.double(), 1e-6)
    xc, dc, wc = x.cuda(), delta.cuda(), w.cuda()
    _within(tro.rms_norm(xc, wc, 1e-6), exact, reference.rms_norm(xc, wc, 1e-6), "rms_norm")
    summed = (x.cuda() + dc).cpu()  # the residual stream as the GPU adds it in `dtype`
    xs = xc.clone()
    y = tro.add_rms_norm_(xs, dc, wc, 1e-6)
    assert torch.equal(xs.cpu(), summed)
    _within(y, F.rms_norm(summed.double(), (d,), w.double(), 1e-6),
            reference.add_rms_norm_(xc.clone(), dc, wc, 1e-6), "add_rms_norm_")

    gate_up = (torch.randn(t, 2 * inter, generator=gen(4)) * 4).to(dtype)
    exact = F.silu(gate_up[:, :inter].double()) * gate_up[:, inter:].double()
    _within(tro.silu_mul(gate_up.cuda()), exact, reference.silu_mul(gate_up.cuda()), "silu_mul")

    qk = (torch.randn(t, n_qk, hd, generator=gen(5)) * 2).to(dtype)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hd, 2).double() / hd))
    freqs = torch.arange(5, 5 + t, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([freqs.cos(), freqs.cos()], -1), torch.cat([-freqs.sin(), freqs.sin()], -1)
    exact = reference.rope(qk.double(), cos, sin)
    cos32, sin32 = cos.float().cuda(), sin.float().cuda()
    _within(tro.rope(qk.cuda(), cos32, sin32).to(dtype), exact, reference.rope(qk.cuda(), cos32, sin32).to(dtype),
            "rope")
