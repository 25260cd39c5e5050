"""nodekv.kernels.cpu_ops.prefill_attention against a float64 reference (explicit causal mask, repeat_interleave'd
K/V, softmax), on the SIMD and the forced scalar path. The error must stay within 4x torch fp32 SDPA's own error."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from nodekv import _C
from nodekv.kernels import cpu_ops as co


@pytest.fixture(params=["native", "scalar"])
def isa(request):
    _C.cpu_ops_force_scalar(request.param == "scalar")
    yield request.param
    _C.cpu_ops_force_scalar(False)


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
    """q [n, H, hd], keys/values [kv, end, hd] -> [n, H * hd], in q's dtype."""
    n, h, hd = q.shape
    g, end = h // keys.shape[0], keys.shape[1]
    k, v = keys.repeat_interleave(g, 0), values.repeat_interleave(g, 0)
    scores = torch.einsum("thd,hsd->hts", q, k) / math.sqrt(hd)
    visible = torch.arange(end)[None, :] <= start + torch.arange(n)[:, None]
    scores = scores.masked_fill(~visible, -math.inf)
    return torch.einsum("hts,hsd->thd", scores.softmax(-1), v).reshape(n, h * hd)


def sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
    """torch fp32 SDPA of the same problem (explicit mask, as start may be > 0)."""
    n, h, hd = q.shape
    end = keys.shape[1]
    visible = torch.arange(end)[None, :] <= start + torch.arange(n)[:, None]
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None], attn_mask=visible,
                                       enable_gqa=True)
    return o[0].transpose(0, 1).reshape(n, h * hd)


def case(n: int, start: int, groups: int, hd: int, kv: int = 2, seed: int = 0, scale_q: float = 1.0):
    """A 2-layer cache whose positions past the end are NaN (never to be read); q a strided view of a qkv row."""
    cap, h = start + n + 5, groups * kv
    r = torch.Generator().manual_seed(seed)
    k_cache = torch.full((2, kv, cap, hd), math.nan)
    v_cache = torch.full((2, kv, cap, hd), math.nan)
    k_cache[:, :, : start + n] = torch.randn(2, kv, start + n, hd, generator=r)
    v_cache[:, :, : start + n] = torch.randn(2, kv, start + n, hd, generator=r)
    qkv = torch.randn(n, (h + 2 * kv) * hd + 3, generator=r)
    q = qkv[:, : h * hd].view(n, h, hd) * scale_q
    return q, k_cache, v_cache


def check(out, q, k_cache, v_cache, start, factor=4.0):
    end = start + q.shape[0]
    keys, values = k_cache[1, :, :end], v_cache[1, :, :end]
    ref = reference(q.double(), keys.double(), values.double(), start)
    torch_err = (sdpa(q, keys, values, start).double() - ref).abs().max().item()
    floor = 2.0 ** -24 * ref.abs().max().item()
    err = (out.double() - ref).abs().max().item()
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert err <= factor * max(torch_err, floor), f"max |err| {err:.3g} vs torch fp32 SDPA {torch_err:.3g}"


@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("start", [0, 5, 200])
@pytest.mark.parametrize("n", [1, 7, 64, 300])
def test_prefill_attention(isa, n, start, groups, hd):
    q, k_cache, v_cache = case(n, start, groups, hd, seed=n + start + hd + groups)
    out = co.prefill_attention(q, k_cache, v_cache, 1, start)
    check(out, q, k_cache, v_cache, start)


def test_prefill_attention_matches_decode(isa):
    """Same numbers (to fp32 rounding) as decode_attention over the same cache."""
    q, k_cache, v_cache = case(40, 100, 3, 64, seed=3)
    a = co.prefill_attention(q, k_cache, v_cache, 1, 100)
    b = co.decode_attention(q, k_cache, v_cache, 1, 100)
    assert (a - b).abs().max().item() < 1e-5


@pytest.mark.parametrize("scale_q", [30.0, 1e-3])
def test_prefill_attention_peaked_and_flat(isa, scale_q):
    q, k_cache, v_cache = case(130, 70, 3, 64, seed=4, scale_q=scale_q)
    check(co.prefill_attention(q, k_cache, v_cache, 1, 70), q, k_cache, v_cache, 70)


def test_prefill_attention_out_threads_and_strides(isa):
    """out= is filled and returned; the thread count and a head stride other than hd change nothing."""
    q, k_cache, v_cache = case(150, 20, 3, 64, seed=5)
    want = co.prefill_attention(q.contiguous(), k_cache, v_cache, 1, 20)
    buf = torch.randn(150, 2 * q.shape[1], 64)
    buf[:, ::2] = q
    y = torch.empty_like(want)
    n_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(co.prefill_attention(q, k_cache, v_cache, 1, 20), want)
    finally:
        torch.set_num_threads(n_threads)
    assert co.prefill_attention(buf[:, ::2], k_cache, v_cache, 1, 20, out=y) is y
    assert torch.equal(y, want)


def test_prefill_attention_other_head_dim(isa):
    """A head_dim that is not a multiple of 16 takes the scalar kernel on either path."""
    q, k_cache, v_cache = case(70, 30, 2, 24, seed=6)
    check(co.prefill_attention(q, k_cache, v_cache, 1, 30), q, k_cache, v_cache, 30)


def test_prefill_attention_bad_input():
    q, k_cache, v_cache = case(8, 4, 3, 64)
    pa = co.prefill_attention
    with pytest.raises(ValueError, match="q must be a float32"):
        pa(q.double(), k_cache, v_cache, 1, 4)
    with pytest.raises(ValueError, match="q's last dim"):
        pa(torch.randn(8, 64, 6).transpose(1, 2), k_cache, v_cache, 1, 4)
    with pytest.raises(ValueError, match="k_cache must be contiguous"):
        pa(q, k_cache.transpose(0, 1), v_cache.transpose(0, 1), 1, 4)
    with pytest.raises(ValueError, match="v_cache must have shape"):
        pa(q, k_cache, v_cache[:, :1], 1, 4)
    with pytest.raises(ValueError, match="head_dim"):
        pa(q[:, :, :32], k_cache, v_cache, 1, 4)
    with pytest.raises(ValueError, match="not a multiple"):
        pa(q[:, :5], k_cache, v_cache, 1, 4)
    with pytest.raises(ValueError, match="layer 2 out of range"):
        pa(q, k_cache, v_cache, 2, 4)
    with pytest.raises(ValueError, match="do not fit"):
        pa(q, k_cache, v_cache, 1, 10)
    with pytest.raises(ValueError, match="out must have shape"):
        pa(q, k_cache, v_cache, 1, 4, out=torch.empty(8, 100))
    with pytest.raises(ValueError, match="prefill_attention"):
        pa(None, k_cache, v_cache, 1, 4)
