"""nodekv.kernels.cpu_ops against float64 references written with plain torch ops, on the SIMD and the scalar path.

Accuracy is judged against torch itself: a kernel's max error vs the float64 result must stay within a small
multiple of the error of the same formula evaluated by torch in float32.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from nodekv import _C
from nodekv.kernels import cpu_ops as co

TS = [1, 3, 8]


@pytest.fixture(params=["native", "scalar"])
def isa(request):
    """Run a test on the SIMD path where the CPU has it, and on the forced scalar path."""
    _C.cpu_ops_force_scalar(request.param == "scalar")
    yield request.param
    _C.cpu_ops_force_scalar(False)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def assert_close(got: torch.Tensor, ref: torch.Tensor, torch_f32: torch.Tensor, factor: float = 4.0) -> None:
    """max |got - ref| within `factor` x max |torch_f32 - ref| (ref in float64), or a 1-ulp floor where torch is
    exact."""
    assert got.shape == ref.shape and got.dtype == torch.float32
    torch_err = (torch_f32.double() - ref).abs().max().item()
    floor = 2.0 ** -24 * ref.abs().max().item()
    err = (got.double() - ref).abs().max().item()
    assert err <= factor * max(torch_err, floor), f"max |err| {err:.3g} vs torch fp32 {torch_err:.3g}"


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
    q, k_cache, v_cache, k_new, v_new = attention_case(3, 20, 3, 64)
    y = torch.empty(3, 6 * 64)
    assert co.decode_attention(q, k_cache, v_cache, 1, 20, k_new, v_new, out=y) is y
    assert torch.equal(y, co.decode_attention(q, k_cache, v_cache, 1, 20))


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


# ---------------------------------------------------------------- attention


def attention_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
    """q [T, H, hd]; keys/values [kv, end, hd] -> [T, H * hd] with repeat_interleave'd K/V and an explicit causal
    mask, in q's dtype."""
    t, h, hd = q.shape
    end = keys.shape[1]
    g = h // keys.shape[0]
    k = keys.repeat_interleave(g, 0)  # [H, end, hd]
    v = values.repeat_interleave(g, 0)
    scores = torch.einsum("thd,hsd->hts", q, k) / math.sqrt(hd)
    visible = torch.arange(end)[None, :] <= start + torch.arange(t)[:, None]  # [T, end]
    scores = scores.masked_fill(~visible, -math.inf)
    return torch.einsum("hts,hsd->thd", scores.softmax(-1), v).reshape(t, h * hd)


def attention_case(t: int, start: int, groups: int, hd: int, kv: int = 2, scale_q: float = 1.0, seed: int = 0):
    """A 2-layer cache (capacity beyond the end filled with NaN, which must never be read), layer 1 holding
    positions [0, start) and new q/k/v as strided views of a fused qkv row."""
    n_layers, cap = 2, start + t + 5
    h = groups * kv
    r = gen(seed)
    k_cache = torch.full((n_layers, kv, cap, hd), math.nan)
    v_cache = torch.full((n_layers, kv, cap, hd), math.nan)
    k_cache[:, :, :start] = torch.randn(n_layers, kv, start, hd, generator=r)
    v_cache[:, :, :start] = torch.randn(n_layers, kv, start, hd, generator=r)
    qkv = torch.randn(t, (h + 2 * kv) * hd + 3, generator=r)
    q = qkv[:, : h * hd].view(t, h, hd)
    if scale_q != 1.0:
        q = q * scale_q
    k_new = qkv[:, h * hd: (h + kv) * hd].view(t, kv, hd)
    v_new = qkv[:, (h + kv) * hd: (h + 2 * kv) * hd].view(t, kv, hd)
    return q, k_cache, v_cache, k_new, v_new


@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("start", [0, 1, 17, 600])
@pytest.mark.parametrize("t", TS)
def test_decode_attention(isa, t, start, groups, hd):
    q, k_cache, v_cache, k_new, v_new = attention_case(t, start, groups, hd, seed=t + start + hd)
    out = co.decode_attention(q, k_cache, v_cache, 1, start, k_new, v_new)
    end = start + t
    assert torch.equal(k_cache[1, :, start:end], k_new.transpose(0, 1))
    assert torch.equal(v_cache[1, :, start:end], v_new.transpose(0, 1))
    assert k_cache[0, :, start:].isnan().all() and k_cache[1, :, end:].isnan().all()  # nothing else written
    keys, values = k_cache[1, :, :end], v_cache[1, :, :end]
    ref = attention_reference(q.double(), keys.double(), values.double(), start)
    assert_close(out, ref, attention_reference(q, keys, values, start))
    # the same step with the cache already holding the new tokens
    assert torch.equal(co.decode_attention(q, k_cache, v_cache, 1, start), out)


@pytest.mark.parametrize("scale_q", [30.0, 1e-3])
def test_decode_attention_peaked_and_flat(isa, scale_q):
    """Scores of several hundred (softmax needs the max subtracted) and nearly uniform attention."""
    q, k_cache, v_cache, k_new, v_new = attention_case(3, 700, 3, 64, scale_q=scale_q, seed=4)
    out = co.decode_attention(q, k_cache, v_cache, 1, 700, k_new, v_new)
    keys, values = k_cache[1, :, :703], v_cache[1, :, :703]
    ref = attention_reference(q.double(), keys.double(), values.double(), 700)
    assert_close(out, ref, attention_reference(q, keys, values, 700))


def test_decode_attention_long_context(isa):
    q, k_cache, v_cache, k_new, v_new = attention_case(1, 8191, 3, 64, kv=3, seed=8)
    out = co.decode_attention(q, k_cache, v_cache, 1, 8191, k_new, v_new)
    keys, values = k_cache[1, :, :8192], v_cache[1, :, :8192]
    ref = attention_reference(q.double(), keys.double(), values.double(), 8191)
    assert_close(out, ref, attention_reference(q, keys, values, 8191))


def test_decode_attention_strided_q(isa):
    """Queries with a head stride other than head_dim (every other head of a buffer) give the same results."""
    q, k_cache, v_cache, k_new, v_new = attention_case(3, 150, 3, 64)
    buf = torch.randn(3, 2 * q.shape[1], 64)
    buf[:, ::2] = q
    want = co.decode_attention(q.contiguous(), k_cache, v_cache, 1, 150, k_new, v_new)
    assert torch.equal(co.decode_attention(buf[:, ::2], k_cache, v_cache, 1, 150), want)


def test_decode_attention_other_head_dim(isa):
    """A head_dim that is not a multiple of 16 takes the scalar kernel on either path."""
    q, k_cache, v_cache, k_new, v_new = attention_case(3, 40, 2, 24, seed=6)
    out = co.decode_attention(q, k_cache, v_cache, 1, 40, k_new, v_new)
    keys, values = k_cache[1, :, :43], v_cache[1, :, :43]
    ref = attention_reference(q.double(), keys.double(), values.double(), 40)
    assert_close(out, ref, attention_reference(q, keys, values, 40))


@pytest.mark.parametrize("t,start", [(1, 2000), (3, 600)])
def test_decode_attention_threads_do_not_change_results(t, start):
    q, k_cache, v_cache, k_new, v_new = attention_case(t, start, 3, 64, kv=3, seed=9)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        y1 = co.decode_attention(q, k_cache, v_cache, 1, start, k_new, v_new)
        torch.set_num_threads(2)
        y2 = co.decode_attention(q, k_cache, v_cache, 1, start)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(y1, y2)


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

    with pytest.raises(ValueError, match="gate_up must be a float32"):
        co.silu_mul(torch.randn(1, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="even number of columns"):
        co.silu_mul(torch.randn(1, 7))
    with pytest.raises(ValueError, match="gate_up must be 2-D"):
        co.silu_mul(torch.randn(8))
    with pytest.raises(ValueError, match="out must be a float32"):
        co.silu_mul(torch.randn(1, 8), out=torch.empty(1, 4, dtype=torch.float64))

    q, kc, vc, kn, vn = attention_case(2, 10, 3, 64)
    with pytest.raises(ValueError, match="q must be a float32"):
        co.decode_attention(q.double(), kc, vc, 1, 10, kn, vn)
    with pytest.raises(ValueError, match="q must be 3-D"):
        co.decode_attention(q.reshape(2, -1), kc, vc, 1, 10, kn, vn)
    with pytest.raises(ValueError, match="k_cache must be 4-D"):
        co.decode_attention(q, kc[1], vc, 1, 10, kn, vn)
    with pytest.raises(ValueError, match="k_cache must be contiguous"):
        co.decode_attention(q, kc.transpose(0, 1), vc.transpose(0, 1), 1, 10, kn, vn)
    with pytest.raises(ValueError, match="v_cache must have shape"):
        co.decode_attention(q, kc, vc[:, :, :-1], 1, 10, kn, vn)
    with pytest.raises(ValueError, match="v_cache must be a float32"):
        co.decode_attention(q, kc, vc.bfloat16(), 1, 10, kn, vn)
    with pytest.raises(ValueError, match="head_dim 32, the cache 64"):
        co.decode_attention(q[..., :32], kc, vc, 1, 10, kn, vn)
    with pytest.raises(ValueError, match="5 heads are not a multiple"):
        co.decode_attention(q[:, :5], kc, vc, 1, 10, kn, vn)
    with pytest.raises(ValueError, match="layer 2 out of range"):
        co.decode_attention(q, kc, vc, 2, 10, kn, vn)
    with pytest.raises(ValueError, match="do not fit the cache's capacity 17"):
        co.decode_attention(q, kc, vc, 1, 16, kn, vn)
    with pytest.raises(ValueError, match="positions \\[-1, 1\\)"):
        co.decode_attention(q, kc, vc, 1, -1, kn, vn)
    with pytest.raises(ValueError, match="both k_new and v_new"):
        co.decode_attention(q, kc, vc, 1, 10, kn)
    with pytest.raises(ValueError, match="v_new must have shape \\[2, 2, 64\\]"):
        co.decode_attention(q, kc, vc, 1, 10, kn, vn[:1])
    with pytest.raises(ValueError, match="k_new's last dim must be contiguous"):
        co.decode_attention(q, kc, vc, 1, 10, torch.randn(2, 2, 128)[..., ::2], vn)
    with pytest.raises(ValueError, match="out must have shape \\[2, 384\\]"):
        co.decode_attention(q, kc, vc, 1, 10, kn, vn, out=torch.empty(2, 383))
