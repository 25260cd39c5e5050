"""nodekv.kernels.cpu_ops.paged_attention (C++: the decode kernel up to 16 queries, the tiled kernel beyond) against
a float64 brute force, on the SIMD and the forced scalar path: page sizes, pruned last rows, long contexts, peaked
and flat softmax, strided queries, thread counts, node mass, and bad arguments.

Accuracy is judged against torch itself: the max error vs float64 must stay within 4x that of the torch fp32
reference (`reference.paged_attention`: SDPA for the output, a plain softmax for the mass) on the same problem.
Pages hold NaN wherever the problem has no key (other layers, pages outside the table, rows past the cached ones),
so a kernel that reads there fails."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from nodekv.kernels import cpu_ops as co
from nodekv.kernels.cpu_ops import simd_level
from nodekv.kernels import reference
from paged_cases import PagedCase, brute_force, make_case


@pytest.fixture(params=["avx512", "avx2", "scalar"])
def isa(request):
    """Run a test at each SIMD level the CPU has (AVX-512 serves prefills with hd % 32 == 0, decodes with hd % 16 == 0)."""
    with simd_level(request.param) as level:
        if level != request.param:
            pytest.skip(f"this CPU has no {request.param}")
        yield level


def case(n: int, T: int, end: int, H: int, Hkv: int, hd: int, P: int, N: int, seed: int = 0,
         scale_q: float = 1.0) -> PagedCase:
    """make_case with NaN in every page row that holds no cached key; the T new rows are NaN until written."""
    c = make_case(n, T, end, H, Hkv, hd, P, N, seed=seed)
    if scale_q != 1.0:
        c = dataclasses.replace(c, q=c.q * scale_q)
    held = torch.zeros(c.k_pages.shape[:4], dtype=torch.bool)
    pos = torch.arange(end - T)
    held[c.layer, c.block_table[pos // P].long(), :, pos % P] = True
    c.k_pages[~held] = float("nan")
    c.v_pages[~held] = float("nan")
    return c


def run(c: PagedCase, mass: bool = True, **kw) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, mass) of cpu_ops.paged_attention on c (writing k_new/v_new into c's pages)."""
    m = torch.zeros(c.q.shape[0], c.node_bounds.shape[0] - 1) if mass else None
    out = co.paged_attention(c.q, c.k_pages, c.v_pages, c.layer, c.block_table, c.end, c.k_new, c.v_new,
                             c.node_bounds if mass else None, m, **kw)
    return out, m


def assert_close(got: torch.Tensor, want: torch.Tensor, torch_f32: torch.Tensor, factor: float = 4.0) -> None:
    """max |got - want| (want in float64) within `factor` x max |torch_f32 - want|, or a 1-ulp floor."""
    assert got.shape == want.shape and got.dtype == torch.float32
    torch_err = (torch_f32.double() - want).abs().max().item()
    floor = 2.0 ** -24 * want.abs().max().item()
    err = (got.double() - want).abs().max().item()
    assert err <= factor * max(torch_err, floor), f"max |err| {err:.3g} vs torch fp32 {torch_err:.3g}"


def check(c: PagedCase, out: torch.Tensor, mass: torch.Tensor | None = None) -> None:
    want_out, want_mass = brute_force(c)
    r = c.clone_pages()
    ref_mass = None if mass is None else torch.zeros_like(mass)
    ref_out = reference.paged_attention(r.q, r.k_pages, r.v_pages, r.layer, r.block_table, r.end, r.k_new, r.v_new)
    assert_close(out, want_out, ref_out)
    if mass is not None:
        reference.paged_attention(r.q, r.k_pages, r.v_pages, r.layer, r.block_table, r.end, None, None,
                                  r.node_bounds, ref_mass)
        assert_close(mass, want_mass, ref_mass)


SHAPES = [  # (n queries, T new tokens, end, H, Hkv, hd, page size, nodes)
    (1, 1, 1, 4, 2, 64, 16, 1),         # decode kernel: first token
    (1, 1, 601, 6, 2, 64, 64, 9),       # decode at 600 cached
    (3, 3, 20, 6, 2, 128, 4, 5),        # a few tokens, hd 128
    (8, 8, 618, 6, 6, 64, 16, 40),      # MHA, 8 tokens after 610
    (16, 16, 216, 9, 3, 64, 1, 16),     # the most queries the decode kernel takes; pages of 1
    (4, 24, 700, 8, 1, 64, 16, 30),     # pruned last rows (T > n), MQA
    (5, 5, 45, 4, 2, 24, 3, 4),         # hd 24: the scalar kernel on either path
    (17, 17, 17, 9, 3, 64, 64, 3),      # tiled kernel: the fewest queries it takes, from empty
    (64, 64, 269, 6, 2, 128, 4, 12),    # hd 128 after a prefix, pages of 4
    (300, 300, 300, 9, 3, 64, 64, 20),  # several key blocks from empty
    (300, 300, 500, 6, 6, 64, 16, 7),   # MHA after a prefix of 200
    (130, 150, 350, 9, 3, 64, 8, 50),   # pruned last rows on the tiled kernel
    (77, 77, 333, 4, 2, 64, 1, 333),    # every key its own node, pages of 1
    (70, 70, 100, 4, 2, 24, 5, 6),      # hd 24, odd page size
    (90, 90, 190, 6, 2, 80, 64, 11),    # hd 80: the AVX2 tiled kernel at level avx512 too
    (61, 61, 61, 12, 2, 96, 64, 61),    # hd 96, 6 query heads a KV head, one key block, every key a node
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "n{}-T{}-end{}-H{}-kv{}-hd{}-P{}-N{}".format(*s))
def test_matches_float64(isa, shape):
    c = case(*shape, seed=sum(shape))
    out, mass = run(c)
    check(c, out, mass)
    torch.testing.assert_close(mass.sum(1), torch.full((c.q.shape[0],), float(c.q.shape[1])), atol=1e-5, rtol=0)
    # mass changes nothing else; the second call finds the new keys stored already
    assert torch.equal(run(c, mass=False)[0], out)
    assert torch.equal(co.paged_attention(c.q, c.k_pages, c.v_pages, c.layer, c.block_table, c.end), out)


def test_decode_long_context(isa):
    c = case(1, 1, 8192, 9, 3, 64, 64, 100, seed=8)
    check(c, *run(c))


@pytest.mark.parametrize("n", [3, 130])
@pytest.mark.parametrize("scale_q", [15.0, 5e-4])
def test_peaked_and_flat(isa, n, scale_q):
    """Scores of several hundred (the softmax needs its max subtracted) and nearly uniform attention."""
    c = case(n, n, n + 700, 9, 3, 64, 16, 25, seed=4, scale_q=scale_q)
    check(c, *run(c))


@pytest.mark.parametrize("n,end", [(1, 2000), (3, 600), (150, 400)])
def test_threads_do_not_change_results(n, end):
    c = case(n, n, end, 9, 3, 64, 16, 13, seed=9)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        out1, mass1 = run(c)
        torch.set_num_threads(2)
        out2, mass2 = run(c)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(out1, out2) and torch.equal(mass1, mass2)


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[0] > 16],
                         ids=lambda s: "n{}-T{}-end{}-H{}-kv{}-hd{}-P{}-N{}".format(*s))
def test_avx512_prefill_gives_the_avx2_bits(shape):
    """The AVX-512 tiled kernel sums every score, output element and row sum in the AVX2 kernel's order: the same
    output and node mass, bit for bit (also where hd % 32 != 0 sends it to the AVX2 kernel)."""
    with simd_level("avx512") as level:
        if level != "avx512":
            pytest.skip(f"this CPU has no AVX-512 (it takes {level})")
        c = case(*shape, seed=sum(shape))
        wide, wide_mass = run(c)
    with simd_level("avx2"):
        narrow, narrow_mass = run(c)
    assert torch.equal(wide, narrow) and torch.equal(wide_mass, narrow_mass)


DECODE_SHAPES = [s for s in SHAPES if s[0] <= 16] + [
    (1, 1, 8192, 12, 2, 128, 64, 40),  # qwen2.5-1.5b's heads after 8K: 3 query-row pairs a pass over the keys
    (1, 1, 333, 14, 2, 64, 16, 7),     # qwen2.5-0.5b's 7 query heads a KV head: an odd row; 333 % 8 keys past the 8s
    (2, 2, 77, 7, 1, 128, 8, 5),       # two tokens of 7 rows: a pair across the tokens
    (3, 3, 1000, 8, 2, 32, 64, 9),     # hd 32, 12 rows: two passes of pairs
    (1, 1, 99, 2, 2, 48, 16, 3),       # hd 48 (16 lanes, not 32), one row a KV head
]


@pytest.mark.parametrize("half", [False, True], ids=["float32", "float16"])
@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=lambda s: "n{}-T{}-end{}-H{}-kv{}-hd{}-P{}-N{}".format(*s))
def test_avx512_decode_gives_the_avx2_bits(shape, half):
    """The AVX-512 decode kernel sums every score and output element in the AVX2 kernel's order, and its tail keys
    through the AVX2 code: the same output and node mass, bit for bit, from float and half pages."""
    with simd_level("avx512") as level:
        if level != "avx512":
            pytest.skip(f"this CPU has no AVX-512 (it takes {level})")
    c = case(*shape, seed=sum(shape))
    if half:
        c = half_pages(c)[0]
    narrow_case = dataclasses.replace(c, k_pages=c.k_pages.clone(), v_pages=c.v_pages.clone())
    with simd_level("avx512"):
        wide, wide_mass = run(c)
    with simd_level("avx2"):
        narrow, narrow_mass = run(narrow_case)
    assert torch.equal(wide, narrow) and torch.equal(wide_mass, narrow_mass)


def test_kernels_agree(isa):
    """17 queries (tiled kernel) and the last 16 of them (decode kernel) over the same keys."""
    c = case(17, 17, 400, 9, 3, 64, 8, 30, seed=3)
    tiled, tiled_mass = run(c)
    last = dataclasses.replace(c, q=c.q[1:])
    decode, decode_mass = run(last)
    assert (tiled[1:] - decode).abs().max().item() < 1e-5
    assert (tiled_mass[1:] - decode_mass).abs().max().item() < 1e-5


@pytest.mark.parametrize("n", [3, 150])
def test_out_and_strided_q(isa, n):
    """out= is filled and returned; q as a view of a fused qkv row or every other head of a buffer changes nothing."""
    c = case(n, n, n + 40, 6, 2, 64, 16, 5, seed=5)
    want, want_mass = run(c)
    H, hd = c.q.shape[1:]
    qkv = torch.randn(n, (H + 4) * hd + 3)
    qkv[:, : H * hd] = c.q.reshape(n, -1)
    buf = torch.randn(n, 2 * H, hd)
    buf[:, ::2] = c.q
    for q in (qkv[:, : H * hd].view(n, H, hd), buf[:, ::2]):
        y = torch.empty_like(want)
        got, mass = run(dataclasses.replace(c, q=q), out=y)
        assert got is y and torch.equal(y, want) and torch.equal(mass, want_mass)


@pytest.mark.parametrize("n,T", [(2, 2), (40, 45)])
def test_writes_land_in_the_table_pages_only(n, T):
    c = case(n, T, 90, 4, 2, 64, 8, 3, seed=7)
    k_before, v_before = c.k_pages.clone(), c.v_pages.clone()
    run(c)
    pos = torch.arange(90 - T, 90)
    pages, rows = c.block_table[pos // 8].long(), pos % 8
    k_before[c.layer, pages, :, rows] = c.k_new
    v_before[c.layer, pages, :, rows] = c.v_new
    torch.testing.assert_close(c.k_pages, k_before, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(c.v_pages, v_before, rtol=0, atol=0, equal_nan=True)


def test_zero_queries_still_store():
    c = case(0, 3, 30, 4, 2, 64, 8, 2)
    out, mass = run(c)
    assert out.shape == (0, 4 * 64) and mass.shape == (0, 2)
    pos = torch.arange(27, 30)
    assert torch.equal(c.k_pages[c.layer, c.block_table[pos // 8].long(), :, pos % 8], c.k_new)


def test_out_is_filled_for_both_kernels():
    for n in (2, 40):
        c = case(n, n, 200, 9, 3, 64, 16, 4, seed=11)
        y = torch.full((n, 9 * 64), float("nan"))
        out, _ = run(c, mass=False, out=y)
        assert out is y
        check(c, out)


def test_bad_arguments():
    c = case(2, 2, 12, 6, 2, 64, 4, 3)
    q, kp, vp, bt, kn, vn, nb = c.q, c.k_pages, c.v_pages, c.block_table, c.k_new, c.v_new, c.node_bounds
    mass = torch.zeros(2, 3)
    pa = co.paged_attention
    L = c.layer

    def bad(match, *args, **kw):
        with pytest.raises(ValueError, match=match):
            pa(*args, **kw)

    bad("q must be a float32", q.double(), kp, vp, L, bt, 12, kn, vn)
    bad("q must be 3-D", q.reshape(2, -1), kp, vp, L, bt, 12, kn, vn)
    bad("q's last dim must be contiguous", torch.randn(2, 64, 6).transpose(1, 2), kp, vp, L, bt, 12)
    bad("k_pages must be 5-D", q, kp[L], vp, L, bt, 12)
    bad("k_pages must be contiguous", q, kp.transpose(1, 2), vp.transpose(1, 2), L, bt, 12)
    bad("v_pages must have shape", q, kp, vp[:, :-1], L, bt, 12)
    bad("v_pages must be a float32", q, kp, vp.bfloat16(), L, bt, 12)
    bad("head_dim 32, the pages 64", q[..., :32], kp, vp, L, bt, 12)
    bad("5 heads are not a multiple of the pages' 2", q[:, :5], kp, vp, L, bt, 12)
    bad("layer 2 out of range", q, kp, vp, 2, bt, 12)
    bad("block_table must be an int32", q, kp, vp, L, bt.long(), 12)
    bad("block_table must be 1-D", q, kp, vp, L, bt[None], 12)
    bad("hold fewer than end=13", q, kp, vp, L, bt, 13)
    bad("2 queries do not fit before end=1", q, kp, vp, L, bt, 1)
    bad("both k_new and v_new", q, kp, vp, L, bt, 12, kn)
    bad("v_new must have shape \\[2, 2, 64\\]", q, kp, vp, L, bt, 12, kn, vn[:, :1])
    bad("k_new's last dim must be contiguous", q, kp, vp, L, bt, 12, torch.randn(2, 2, 128)[..., ::2], vn)
    bad("k_new's 1 rows must number from n=2", q, kp, vp, L, bt, 12, kn[:1], vn[:1])
    bad("mass needs node_bounds", q, kp, vp, L, bt, 12, kn, vn, None, mass)
    bad("node_bounds must be an int32", q, kp, vp, L, bt, 12, kn, vn, nb.long(), mass)
    bad("node_bounds must be 1-D", q, kp, vp, L, bt, 12, kn, vn, nb[0], mass)
    bad("mass must have shape \\[2, 3\\]", q, kp, vp, L, bt, 12, kn, vn, nb, mass[:, :2])
    bad("mass must be contiguous", q, kp, vp, L, bt, 12, kn, vn, nb, torch.zeros(3, 2).T)
    bad("out must have shape \\[2, 384\\]", q, kp, vp, L, bt, 12, out=torch.empty(2, 383))
    bad("paged_attention", None, kp, vp, L, bt, 12)
    # scalars pybind would refuse with a TypeError listing the whole signature
    bad("end must be an integer, got float 12.0", q, kp, vp, L, bt, 12.0, kn, vn)
    bad("layer must be an integer, got float", q, kp, vp, float(L), bt, 12, kn, vn)
    bad("layer must be an integer, got str '0'", q, kp, vp, "0", bt, 12, kn, vn)
    # table contents are checked before anything is written
    k_before = kp.clone()
    bad_table = torch.tensor([0, 99, 1], dtype=torch.int32)
    bad("block_table\\[1\\] = 99 is not a page of the pool's 7", q, kp, vp, L, bad_table, 12, kn, vn)
    for bounds in ([0, 5, 5, 12], [0, 4, 8, 11], [1, 4, 8, 12]):
        bad("node_bounds must rise strictly from 0 to end=12", q, kp, vp, L, bt, 12, kn, vn,
            torch.tensor(bounds, dtype=torch.int32), mass)
    torch.testing.assert_close(kp, k_before, rtol=0, atol=0, equal_nan=True)
    assert not mass.any()


def half_pages(c: PagedCase) -> tuple[PagedCase, PagedCase]:
    """(c with float16 pages, the same problem in float32 holding what the halves hold: k_new / v_new rounded to
    nearest even as the kernel stores them), for the float64 oracle."""
    c16 = dataclasses.replace(c, k_pages=c.k_pages.half(), v_pages=c.v_pages.half())
    rounded = dataclasses.replace(c, k_pages=c16.k_pages.float(), v_pages=c16.v_pages.float(),
                                  k_new=c.k_new.half().float(), v_new=c.v_new.half().float())
    return c16, rounded


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "n{}-T{}-end{}-H{}-kv{}-hd{}-P{}-N{}".format(*s))
def test_half_pages_match_float64_on_the_halves(isa, shape):
    """Half pages: attention and mass within 4x torch's fp32 error of float64 attention over the values the halves
    hold, and the new keys stored as torch rounds them."""
    c16, rounded = half_pages(case(*shape, seed=sum(shape)))
    out, mass = run(c16)
    check(rounded, out, mass)
    pos = torch.arange(c16.end - c16.k_new.shape[0], c16.end)
    pages, rows = c16.block_table[pos // c16.k_pages.shape[3]].long(), pos % c16.k_pages.shape[3]
    assert torch.equal(c16.k_pages[c16.layer, pages, :, rows], c16.k_new.half())
    assert torch.equal(c16.v_pages[c16.layer, pages, :, rows], c16.v_new.half())


@pytest.mark.parametrize("shape", SHAPES + DECODE_SHAPES[-5:],
                         ids=lambda s: "n{}-T{}-end{}-H{}-kv{}-hd{}-P{}-N{}".format(*s))
def test_half_pages_give_the_bits_of_float_pages_holding_their_values(isa, shape):
    """Halves become floats exactly (the decode kernel converts them in registers as it loads them, the tiled one as
    it packs a block), and the arithmetic is the float pages': the same output and node mass, bit for bit."""
    c16, rounded = half_pages(case(*shape, seed=sum(shape)))
    out16, mass16 = run(c16)
    out, mass = run(rounded)
    assert torch.equal(out16, out) and torch.equal(mass16, mass)


def test_half_rounding_gives_torchs_bits(isa):
    """Every float32 -> float16 case the store meets, against torch's conversion: ties to even at every scale,
    subnormals and their ties, the overflow threshold (65520 rounds to inf, the float below it to 65504), signed
    zeros and infinities; NaN stays NaN."""
    g = torch.Generator().manual_seed(0)
    exps = torch.arange(-30, 17, dtype=torch.float32)
    ties = (1 + (2 * torch.arange(64) + 1) / 2048.0)[:, None] * 2.0 ** exps[None, :]  # halfway between two halves
    special = torch.tensor([0.0, -0.0, 65504.0, 65519.99, 65520.0, -65520.0, 1e6, float("inf"), float("-inf"),
                            2.0 ** -24, 2.0 ** -25, 1.5 * 2.0 ** -25, 2.0 ** -26, 2.0 ** -14, 2.0 ** -14 - 2.0 ** -25,
                            6.1e-5, 1e-8, 1e-45])
    values = torch.cat([ties.flatten(), -ties.flatten(), special, torch.randn(4000, generator=g) * 300,
                        torch.randn(1000, generator=g) * 1e-6])
    hd = 64
    values = torch.cat([values, torch.zeros(-len(values) % hd)]).view(-1, 1, hd)
    nan_row = torch.full((1, 1, hd), float("nan"))
    k_new = torch.cat([values, nan_row])
    T = k_new.shape[0]
    k_pages = torch.zeros(1, T, 1, 1, hd, dtype=torch.float16)
    v_pages = torch.zeros_like(k_pages)
    table = torch.arange(T, dtype=torch.int32)
    co.paged_attention(torch.zeros(0, 1, hd), k_pages, v_pages, 0, table, T, k_new, k_new.neg())
    stored = k_pages[0, :, 0, 0]
    assert torch.equal(stored[:-1].view(torch.int16), values[:, 0].half().view(torch.int16))
    assert torch.equal(v_pages[0, :-1, 0, 0].view(torch.int16), values[:, 0].neg().half().view(torch.int16))
    assert stored[-1].isnan().all()


@pytest.mark.parametrize("v_dtype,words", [(torch.float32, "v_pages must have k_pages' dtype torch.float16"),
                                           (torch.bfloat16, "v_pages must be a float32 or float16 CPU tensor")])
def test_half_pages_need_half_values(v_dtype, words):
    c16, _ = half_pages(case(3, 3, 20, 4, 2, 16, 4, 2))
    with pytest.raises(ValueError, match=words):
        co.paged_attention(c16.q, c16.k_pages, c16.v_pages.to(v_dtype), c16.layer, c16.block_table, c16.end)
