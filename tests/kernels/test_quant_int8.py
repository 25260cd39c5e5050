"""The int8 fast path of nodekv.kernels.quant (quant_linear(..., int8=True)) against an independent float64 reference:
x quantised here in numpy by the stated rule (per block of 32, or 256 for the K-quants: d = max|x| / 127, q = round
half to even of x * (1 / d), in float32), then the float64 product of d q with gguf's dequantisation of the weight.
The kernels' integer sums are exact, so only their few fp32 roundings separate them from that reference; against the
exact fp32 path the error stays within the quantisation bound sum |w| d / 2. On random blocks of every native type,
odd shapes and the tail block, on the SIMD and the scalar path."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

from nodekv.kernels.quant import BLOCK_ELEMS, QTYPES, QuantStack, quant_linear  # noqa: E402

from nodekv.kernels.cpu_ops import simd_level  # noqa: E402
from test_quant import SHAPES, isa, make_weight  # noqa: E402,F401  (isa: the SIMD/scalar fixture)


def x_block(qtype: str) -> int:
    """Inputs per quantised x block: the K-quants' 256, else 32."""
    return 256 if BLOCK_ELEMS[qtype] == 256 else 32


def quantize_x(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d q as float64 [T, K], d per element float64 [T, K]) by the rule in the module docstring, in numpy."""
    xs = x.numpy().astype(np.float32).reshape(x.shape[0], -1, block)
    amax = np.abs(xs).max(axis=2, keepdims=True)
    d = (amax / np.float32(127)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    q = np.rint((xs * inv).astype(np.float32))
    assert np.abs(q).max() <= 127
    dq = (d.astype(np.float64) * q).reshape(x.shape)
    return torch.from_numpy(dq), torch.from_numpy(np.broadcast_to(d, xs.shape).reshape(x.shape).astype(np.float64))


def assert_int8_product(y: torch.Tensor, x: torch.Tensor, ref: torch.Tensor, block: int,
                        bias: torch.Tensor | None = None) -> None:
    """y against the float64 product of the quantised x and ref: within a few fp32 roundings of each output's terms
    (one per block of the sum, a handful per block); and against the exact product within the quantisation bound."""
    dq, d = quantize_x(x, block)
    b = 0 if bias is None else bias.double()
    want = dq @ ref.double().T + b
    terms = dq.abs() @ ref.double().abs().T + (0 if bias is None else bias.double().abs())
    blocks = x.shape[1] // block
    err = (y.double() - want).abs()
    assert (err <= (blocks + 8) * 2.0 ** -23 * terms + 1e-30).all(), f"max |err| {err.max().item():.3g}"
    exact = x.double() @ ref.double().T + b
    bound = (d / 2) @ ref.double().abs().T
    assert ((y.double() - exact).abs() <= bound * (1 + 1e-3) + (blocks + 8) * 2.0 ** -23 * terms).all()


@pytest.mark.parametrize("qtype", list(QTYPES))
@pytest.mark.parametrize("n,blocks", SHAPES)
@pytest.mark.parametrize("t", [1, 3, 9])
def test_matches_quantised_reference(isa, qtype, n, blocks, t):
    k = blocks * BLOCK_ELEMS[qtype]
    w, ref = make_weight(qtype, n, k, seed=n * k + t)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(t)) * torch.linspace(0.1, 3.0, k)
    y = quant_linear(x, w, int8=True)
    assert y.shape == (t, n) and y.dtype == torch.float32
    assert_int8_product(y, x, ref, x_block(qtype))


@pytest.mark.parametrize("qtype", list(QTYPES))
def test_offset_weights_zero_blocks_and_bias(isa, qtype):
    """K-quant mins and Q4_1's offsets meet x's sums; an all-zero x block (d = 0) contributes nothing."""
    k = 2 * x_block(qtype) if BLOCK_ELEMS[qtype] == 32 else 512
    w, ref = make_weight(qtype, 37, k, seed=5, offset=0.3)
    x = torch.rand(4, k, generator=torch.Generator().manual_seed(1)) + 0.5
    x[1, : x_block(qtype)] = 0.0
    x[2] = 0.0
    bias = torch.randn(37, generator=torch.Generator().manual_seed(2))
    y = quant_linear(x, w, bias, int8=True)
    assert_int8_product(y, x, ref, x_block(qtype), bias)
    assert torch.equal(y[2], bias)


@pytest.mark.parametrize("qtype", list(QTYPES))
def test_batch_rows_match_single_tokens(isa, qtype):
    """Each token's int8 outputs are bit for bit what it gets alone (batched decode = sequential decode)."""
    k = 3 * BLOCK_ELEMS[qtype]
    w, _ = make_weight(qtype, 45, k, seed=3)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(4))
    y = quant_linear(x, w, int8=True)
    for t in (0, 7, 8, 63, 64, 69):
        assert torch.equal(y[t], quant_linear(x[t:t + 1], w, int8=True)[0])


@pytest.mark.parametrize("qtype", list(QTYPES))
def test_vnni_gives_the_avx2_bits(qtype):
    """Where the CPU has AVX-512 VNNI, its integer dots sum the same integers as AVX2's maddubs and the same float
    steps follow: the same bits for every type, odd shapes, one token and several passes of them."""
    from nodekv import _C

    if _C.isa() != "avx512":
        pytest.skip(f"this CPU takes the {_C.isa()} path (no AVX-512 VNNI)")
    for n, blocks in SHAPES:
        w, _ = make_weight(qtype, n, blocks * BLOCK_ELEMS[qtype], seed=n + blocks, offset=0.1)
        for t in (1, 3, 70):
            x = torch.randn(t, blocks * BLOCK_ELEMS[qtype], generator=torch.Generator().manual_seed(t)) * 3
            vnni = quant_linear(x, w, int8=True)
            with simd_level("avx2") as level:
                assert level == "avx2"
                avx2 = quant_linear(x, w, int8=True)
            assert torch.equal(vnni, avx2), (n, blocks, t)


def test_scalar_and_simd_agree_closely():
    """The two paths quantise x to the same bits and differ only in the order of fp32 roundings."""
    for qtype in QTYPES:
        k = 2 * BLOCK_ELEMS[qtype]
        w, ref = make_weight(qtype, 29, k, seed=11)
        x = torch.randn(5, k, generator=torch.Generator().manual_seed(12))
        simd = quant_linear(x, w, int8=True)
        with simd_level("scalar"):
            scalar = quant_linear(x, w, int8=True)
        scale = (x.abs() @ ref.abs().T).max().item()
        assert (simd - scalar).abs().max().item() <= 2 * k * 2.0 ** -24 * scale, qtype


def test_stack_of_mixed_types(isa):
    """A fused q|k|v of Q5_0 and Q8_0 parts quantises x once per type and writes each part's slice."""
    k = 256
    (a, ra), (b, rb) = make_weight("q5_0", 24, k, seed=1), make_weight("q8_0", 8, k, seed=2)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(3))
    y = quant_linear(x, QuantStack((a, b)), int8=True)
    assert torch.equal(y[:, :24], quant_linear(x, a, int8=True))
    assert torch.equal(y[:, 24:], quant_linear(x, b, int8=True))
    assert_int8_product(y, x, torch.cat([ra, rb]), 32)
