"""nodekv.kernels.cpu_ops against float64 references written with plain torch ops, on the SIMD and the scalar path
(paged attention: test_cpu_attention.py).

Accuracy is judged against torch itself: a kernel's max error vs the float64 result must stay within a small
multiple of the error of the same formula evaluated by torch in float32.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from nodekv.kernels import cpu_ops as co
from nodekv.kernels.cpu_ops import simd_level
from numerics import assert_close, gen

TS = [1, 3, 8]


@pytest.fixture(params=["native", "scalar"])
def isa(request):
    """Run a test on the SIMD path where the CPU has it, and on the forced scalar path."""
    with simd_level("avx512" if request.param == "native" else "scalar"):
        yield request.param



# ---------------------------------------------------------------- rms_norm


@pytest.mark.parametrize("t", TS)
@pytest.mark.parametrize("d", [576, 64, 100, 7])
def test_rms_norm(isa, t, d):
    x = torch.randn(t, d, generator=gen(d + t)) * 3 + 0.5
    w = torch.randn(d, generator=gen(1))
    eps = 1e-5
    ref = F.rms_norm(x.double(), (d,), w.double(), eps)
    assert_close(co.rms_norm(x, w, eps), ref, F.rms_norm(x, (d,), w, eps))


@pytest.mark.parametrize("t", TS)
def test_add_rms_norm(isa, t):
    d = 576
    x = torch.randn(t, d, generator=gen(t))
    delta = torch.randn(t, d, generator=gen(t + 10))
    w = torch.randn(d, generator=gen(2))
    x0 = x.clone()
    y = co.add_rms_norm_(x, delta, w, 1e-6)
    assert torch.equal(x, x0 + delta)  # the residual stream, updated in place exactly as torch adds
    ref = F.rms_norm(x.double(), (d,), w.double(), 1e-6)
    assert_close(y, ref, F.rms_norm(x, (d,), w, 1e-6))


def test_out_buffers(isa):
    """out= gives the same results in the given buffer; rms_norm may write over its input."""
    x, w, d = torch.randn(3, 576), torch.randn(576), torch.randn(3, 576)
    want = co.rms_norm(x, w, 1e-5)
    assert co.rms_norm(x, w, 1e-5, out=x) is x and torch.equal(x, want)
    x2, y = x.clone(), torch.empty(3, 576)
    want = co.add_rms_norm_(x2, d, w, 1e-5)
    assert co.add_rms_norm_(x, d, w, 1e-5, out=y) is y and torch.equal(y, want) and torch.equal(x, x2)
    gu, y = torch.randn(2, 3072), torch.empty(2, 1536)
    assert co.silu_mul(gu, out=y) is y and torch.equal(y, co.silu_mul(gu))


def test_rms_norm_tiny_and_huge_rows(isa):
    """eps dominates an all-zero row; rows of ~1e18 must not overflow the fp32 sum of squares (1e36 < 3.4e38)."""
    x = torch.stack([torch.zeros(64), torch.full((64,), 1e18), torch.full((64,), 1e-20)])
    w = torch.ones(64)
    ref = F.rms_norm(x.double(), (64,), w.double(), 1e-5)
    assert_close(co.rms_norm(x, w, 1e-5), ref, F.rms_norm(x, (64,), w, 1e-5))


# ---------------------------------------------------------------- rope


def rope_tables(start: int, t: int, hd: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cos, sin and sin_signed [t, hd] for positions start.. as a Llama model builds them (theta 10000)."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    freqs = torch.arange(start, start + t, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos = torch.cat([freqs.cos(), freqs.cos()], -1)
    sin = torch.cat([freqs.sin(), freqs.sin()], -1)
    return cos, sin, torch.cat([-freqs.sin(), freqs.sin()], -1)


def rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The HF formula with slices and cat: x * cos + rotate_half(x) * sin, cos/sin broadcast over heads."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


@pytest.mark.parametrize("t", TS)
@pytest.mark.parametrize("hd", [64, 128, 6])
def test_rope_on_fused_qkv_view(isa, t, hd):
    n_q, n_kv = 9, 3
    width = (n_q + 2 * n_kv) * hd
    qkv = torch.randn(t, width, generator=gen(t * hd))
    before = qkv.clone()
    qk = qkv[:, : (n_q + n_kv) * hd].view(t, n_q + n_kv, hd)  # row stride = width, not (n_q + n_kv) * hd
    cos, sin, sin_signed = rope_tables(597, t, hd)
    ref = rotate_half_rope(before[:, : (n_q + n_kv) * hd].view(t, -1, hd).double(), cos.double(), sin.double())
    torch_f32 = before[:, : (n_q + n_kv) * hd].view(t, -1, hd)
    torch_f32 = torch_f32 * cos[:, None, :] + torch_f32.roll(hd // 2, -1) * sin_signed[:, None, :]
    assert co.rope_(qk, cos, sin_signed) is qk
    assert torch.equal(qk, torch_f32)  # the engine's own expression, bit for bit
    assert_close(qk, ref, torch_f32)
    assert torch.equal(qkv[:, (n_q + n_kv) * hd:], before[:, (n_q + n_kv) * hd:])  # v untouched


def test_rope_head_stride(isa):
    """Heads need not be adjacent: every other head of a [T, 2n, hd] buffer."""
    t, hd = 3, 64
    buf = torch.randn(t, 8, hd, generator=gen(5))
    before = buf.clone()
    cos, sin, sin_signed = rope_tables(0, t, hd)
    co.rope_(buf[:, ::2], cos, sin_signed)
    assert_close(buf[:, ::2], rotate_half_rope(before[:, ::2].double(), cos.double(), sin.double()),
                 rotate_half_rope(before[:, ::2], cos, sin))
    assert torch.equal(buf[:, 1::2], before[:, 1::2])


def test_rope_heads_outermost(isa):
    """A [heads, T, hd] buffer seen as [T, heads, hd]: not the usual strides, yet no overlap."""
    t, hd = 3, 64
    buf = torch.randn(4, t, hd, generator=gen(6))
    _, _, sin_signed = rope_tables(0, t, hd)
    cos = rope_tables(0, t, hd)[0]
    want = buf.transpose(0, 1) * cos[:, None, :] + buf.transpose(0, 1).roll(hd // 2, -1) * sin_signed[:, None, :]
    assert torch.equal(co.rope_(buf.transpose(0, 1), cos, sin_signed), want)


# ---------------------------------------------------------------- silu_mul


@pytest.mark.parametrize("t", TS)
@pytest.mark.parametrize("inter", [1536, 13])
def test_silu_mul(isa, t, inter):
    gu = torch.randn(t, 2 * inter, generator=gen(t + inter)) * 4
    g, u = gu.double().chunk(2, -1)
    ref = g / (1 + torch.exp(-g)) * u
    gate, up = gu.chunk(2, -1)
    assert_close(co.silu_mul(gu), ref, F.silu(gate) * up)


def test_silu_mul_extremes(isa):
    """Large |gate| (exp over/underflow, subnormal results), zeros, infinities and NaN behave as torch's."""
    g = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 88.0, -88.0, 89.0, -89.0, 100.0, -100.0, -103.0,
                      -110.0, 1e30, -1e30, math.inf, -math.inf, math.nan, 3.0, -3.0])
    gu = torch.cat([g, torch.full_like(g, 1.5)])[None]
    got = co.silu_mul(gu)[0]
    want = F.silu(g) * 1.5
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~got.isnan()].isinf(), want[~want.isnan()].isinf())
    ref = g.double() / (1 + torch.exp(-g.double())) * 1.5
    normal = ref.isfinite() & (ref.abs() >= 2.0 ** -126)
    assert_close(got[normal], ref[normal], want[normal])
    tiny = ref.isfinite() & ~normal  # torch flushes these to zero; no worse than that
    torch_err = (want[tiny].double() - ref[tiny]).abs().max().item()
    assert (got[tiny].double() - ref[tiny]).abs().max().item() <= max(torch_err, 2.0 ** -149)


# ---------------------------------------------------------------- bad input


def test_bad_inputs():
    x, w = torch.randn(2, 64), torch.randn(64)
    with pytest.raises(ValueError, match="rms_norm: x must be a float32"):
        co.rms_norm(x.double(), w, 1e-5)
    with pytest.raises(ValueError, match="weight must have shape \\[64\\]"):
        co.rms_norm(x, torch.randn(63), 1e-5)
    with pytest.raises(ValueError, match="x must be 2-D"):
        co.rms_norm(x[None], w, 1e-5)
    with pytest.raises(ValueError, match="x must be contiguous"):
        co.rms_norm(torch.randn(64, 2).T, torch.randn(64), 1e-5)
    with pytest.raises(ValueError, match="delta must have shape \\[2, 64\\]"):
        co.add_rms_norm_(x, torch.randn(1, 64), w, 1e-5)
    with pytest.raises(ValueError, match="delta must be a float32"):
        co.add_rms_norm_(x, torch.randn(2, 64, dtype=torch.bfloat16), w, 1e-5)
    with pytest.raises(ValueError, match="x must be a float32 CPU tensor, got list"):
        co.rms_norm([[1.0]], w, 1e-5)
    with pytest.raises(ValueError, match="out must have shape \\[2, 64\\]"):
        co.rms_norm(x, w, 1e-5, out=torch.empty(2, 65))
    with pytest.raises(ValueError, match="out must be contiguous"):
        co.add_rms_norm_(x, x.clone(), w, 1e-5, out=torch.empty(64, 2).T)
    with pytest.raises(ValueError, match="rms_norm: eps must be a number, got str"):
        co.rms_norm(x, w, "1e-5")  # not pybind's TypeError listing the signature
    with pytest.raises(ValueError, match="add_rms_norm_: eps must be a number, got NoneType"):
        co.add_rms_norm_(x, x.clone(), w, None)

    cos = sin = torch.randn(2, 64)
    with pytest.raises(ValueError, match="qk must be 3-D"):
        co.rope_(torch.randn(2, 64), cos, sin)
    with pytest.raises(ValueError, match="qk's last dim must be contiguous"):
        co.rope_(torch.randn(2, 3, 128)[..., ::2], cos, sin)
    with pytest.raises(ValueError, match="sin_signed must have shape \\[2, 64\\]"):
        co.rope_(torch.randn(2, 3, 64), cos, torch.randn(2, 32))
    with pytest.raises(ValueError, match="cos must be a float32"):
        co.rope_(torch.randn(2, 3, 64), cos.half(), sin)
    with pytest.raises(ValueError, match="head_dim must be even"):
        co.rope_(torch.randn(2, 3, 5), torch.randn(2, 5), torch.randn(2, 5))
    # views whose elements share memory, which in place rotated each head the previous one had rotated: refused,
    # as torch's in-place ops refuse them
    with pytest.raises(ValueError, match="no two of its elements may share memory"):
        co.rope_(torch.randn(2, 1, 64).expand(2, 3, 64), cos, sin)
    with pytest.raises(ValueError, match="no two of its elements may share memory"):
        co.rope_(torch.randn(128).as_strided((2, 3, 64), (32, 16, 1)), cos, sin)

    with pytest.raises(ValueError, match="gate_up must be a float32"):
        co.silu_mul(torch.randn(1, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="even number of columns"):
        co.silu_mul(torch.randn(1, 7))
    with pytest.raises(ValueError, match="gate_up must be 2-D"):
        co.silu_mul(torch.randn(8))
    with pytest.raises(ValueError, match="out must be a float32"):
        co.silu_mul(torch.randn(1, 8), out=torch.empty(1, 4, dtype=torch.float64))
