"""nodekv.kernels.triton_ops (Triton; under TRITON_INTERPRET=1 on CPU, see conftest) against float64 computations
and the torch reference.

Accuracy is judged as in flash-attention's tests: a kernel's max error vs the float64 result must stay within a small
multiple of the error of plain torch evaluating the same formula in float32 (or one fp32 ulp where torch is exact).
The interpreter runs fp32 only, so bf16 is not tested here. Shapes are small: the interpreter is slow.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nodekv.kernels import reference
from paged_cases import brute_force, make_case, record_attention_tiles
from conftest import needs_triton_interpreter
from numerics import assert_close, gen

tro = pytest.importorskip("nodekv.kernels.triton_ops", exc_type=ImportError)
pytestmark = needs_triton_interpreter



def test_is_a_complete_ops_module():
    from nodekv.kernels import backend_ops, triton_attention

    assert backend_ops("triton", torch.float32) is tro
    for name in ("rms_norm", "add_rms_norm_", "rope", "silu_mul", "paged_attention", "write_kv"):
        assert callable(getattr(tro, name)), name
    assert tro.write_kv is triton_attention.write_kv  # paged_attention: SDPA serves some CUDA prefills (test_triton_cuda)


# ---------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("t, d", [(1, 64), (3, 100), (5, 576), (2, 7)])
def test_rms_norm(t, d):
    x = torch.randn(t, d, generator=gen(d + t)) * 3 + 0.5
    w = torch.randn(d, generator=gen(1))
    x0 = x.clone()
    ref = F.rms_norm(x.double(), (d,), w.double(), 1e-5)
    assert_close(tro.rms_norm(x, w, 1e-5), ref, reference.rms_norm(x, w, 1e-5))
    assert torch.equal(x, x0)


@pytest.mark.parametrize("t", [1, 4])
def test_add_rms_norm(t):
    d = 96
    x = torch.randn(t, d, generator=gen(t))
    delta = torch.randn(t, d, generator=gen(t + 10))
    w = torch.randn(d, generator=gen(2))
    x0 = x.clone()
    y = tro.add_rms_norm_(x, delta, w, 1e-6)
    assert torch.equal(x, x0 + delta)  # the residual stream, updated in place exactly as torch adds
    ref = F.rms_norm(x.double(), (d,), w.double(), 1e-6)
    assert_close(y, ref, F.rms_norm(x, (d,), w, 1e-6))


@pytest.mark.parametrize("add", [False, True])
def test_norm_rows_longer_than_a_block(monkeypatch, add):
    """Rows longer than the column block take the two-pass loop (forced here with a 32-column block)."""
    monkeypatch.setattr(tro, "_MAX_ROW_BLOCK", 32)
    d = 100
    x = torch.randn(3, d, generator=gen(5)) * 2
    delta = torch.randn(3, d, generator=gen(6))
    w = torch.randn(d, generator=gen(7))
    want_x = x + delta if add else x.clone()
    y = tro.add_rms_norm_(x, delta, w, 1e-5) if add else tro.rms_norm(x, w, 1e-5)
    assert torch.equal(x, want_x)
    assert_close(y, F.rms_norm(want_x.double(), (d,), w.double(), 1e-5), F.rms_norm(want_x, (d,), w, 1e-5))


def test_norm_strided_rows_and_leading_dims():
    """A row-strided view (such as x[T - keep:] of a wider buffer) and 3-D input."""
    base = torch.randn(4, 80, generator=gen(8))
    x = base[:, :64]  # row stride 80
    delta = torch.randn(4, 64, generator=gen(9))
    w = torch.randn(64, generator=gen(10))
    want = base.clone()
    want[:, :64] += delta
    y = tro.add_rms_norm_(x, delta, w, 1e-5)
    assert torch.equal(base, want)  # only the viewed columns changed
    assert_close(y, F.rms_norm(want[:, :64].double(), (64,), w.double(), 1e-5), F.rms_norm(want[:, :64], (64,), w,
                                                                                              1e-5))
    x3 = torch.randn(2, 3, 64, generator=gen(11))
    assert_close(tro.rms_norm(x3, w, 1e-5), F.rms_norm(x3.double(), (64,), w.double(), 1e-5),
                 F.rms_norm(x3, (64,), w, 1e-5))


# ---------------------------------------------------------------- RoPE


def rope_tables(T: int, hd: int, start: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin_signed [T, hd] as the model builds them."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hd, 2).float() / hd))
    freqs = torch.arange(start, start + T, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.cos()], -1), torch.cat([-freqs.sin(), freqs.sin()], -1)


@pytest.mark.parametrize("T, n_q, n_kv, hd", [(1, 4, 2, 16), (5, 9, 3, 64), (3, 6, 2, 24)])
def test_rope_on_the_model_strided_view(T, n_q, n_kv, hd):
    """qk = qkv[:, :n_qk * hd].view(T, n_qk, hd): rows strided by the fused QKV width."""
    n_qk = n_q + n_kv
    qkv = torch.randn(T, (n_qk + n_kv) * hd, generator=gen(T + hd)) * 2
    qk = qkv[:, : n_qk * hd].view(T, n_qk, hd)
    cos, sin = rope_tables(T, hd)
    qkv0 = qkv.clone()
    got = tro.rope(qk, cos, sin)
    assert torch.equal(qkv, qkv0)
    ref = reference.rope(qk.double(), cos.double(), sin.double())
    half = hd // 2  # the rotate-half definition, independently of the roll form
    rot = torch.cat([-qk.double()[..., half:], qk.double()[..., :half]], -1)
    sin_plain = sin.double()[:, None, half:].repeat(1, 1, 2)
    torch.testing.assert_close(ref, qk.double() * cos.double()[:, None] + rot * sin_plain)
    assert got.is_contiguous()
    assert_close(got, ref, reference.rope(qk, cos, sin))


# ---------------------------------------------------------------- SiLU · mul


@pytest.mark.parametrize("t, inter", [(1, 96), (3, 100), (2, 1500)])
def test_silu_mul(t, inter):
    gate_up = torch.randn(t, 2 * inter, generator=gen(inter)) * 4
    ref = F.silu(gate_up[:, :inter].double()) * gate_up[:, inter:].double()
    torch_f32 = reference.silu_mul(gate_up.clone())
    got = tro.silu_mul(gate_up)
    assert got.data_ptr() == gate_up.data_ptr() and got.shape == (t, inter)  # in gate_up's storage
    assert_close(got, ref, torch_f32)


def test_in_place_ops_refuse_inputs_whose_rows_share_memory():
    """silu_mul and add_rms_norm_ write their input in place, so an expanded view (rows on one memory) is refused
    as torch refuses it, rather than each row overwriting the input of the next (silently wrong results)."""
    gate_up, x = torch.randn(1, 8, generator=gen(0)).expand(3, 8), torch.randn(1, 8, generator=gen(1)).expand(3, 8)
    before = gate_up.clone(), x.clone()
    with pytest.raises(ValueError, match="silu_mul: gate_up is computed in place, so no two of its elements"):
        tro.silu_mul(gate_up)
    with pytest.raises(ValueError, match="add_rms_norm_: x is added to in place, so no two of its elements"):
        tro.add_rms_norm_(x, torch.randn(3, 8, generator=gen(2)), torch.ones(8), 1e-6)
    assert torch.equal(gate_up, before[0]) and torch.equal(x, before[1])


# ---------------------------------------------------------------- paged KV write


@pytest.mark.parametrize("T, end, page_size", [(1, 1, 4), (5, 21, 8), (20, 37, 16), (3, 64, 64)])
def test_write_kv_matches_reference(T, end, page_size):
    """k and v as the model passes them: k a head slice of the RoPE output, v a column slice of the fused QKV."""
    n_q, n_kv, hd = 4, 2, 16
    case = make_case(T, T, end, n_q, n_kv, hd, page_size)
    qkv = torch.randn(T, (n_q + 2 * n_kv) * hd, generator=gen(T))
    k = qkv[:, n_q * hd: (n_q + n_kv) * hd].view(T, n_kv, hd)
    v = qkv[:, (n_q + n_kv) * hd:].view(T, n_kv, hd)
    want_k, want_v = case.k_pages.clone(), case.v_pages.clone()
    reference.write_kv(want_k, want_v, case.layer, case.block_table, end, k, v)
    tro.write_kv(case.k_pages, case.v_pages, case.layer, case.block_table, end, k, v)
    assert torch.equal(case.k_pages, want_k) and torch.equal(case.v_pages, want_v)


# ---------------------------------------------------------------- paged attention: paths the shared test does not force


@pytest.mark.parametrize("shape, splits", [
    ((1, 1, 200, 4, 2, 16, 8, 150), 3),    # decode, split-KV, nodes of one or two keys
    ((7, 7, 130, 6, 2, 32, 4, 60), 4),     # a few queries over splits, some empty for early queries
    ((4, 4, 90, 4, 2, 24, 8, 90), 1),      # head dim 24 (padded to 32), one key per node
])
def test_paged_attention_splits_small_nodes_odd_head_dim(shape, splits):
    n, T, end, H, Hkv, hd, P, N = shape
    case = make_case(n, T, end, H, Hkv, hd, P, N)
    want_out, want_mass = brute_force(case)
    wide = torch.randn(n, H + 3, hd, generator=gen(1))
    wide[:, :H] = case.q
    q = wide[:, :H]  # a strided view, like the q heads of the RoPE output
    mass = torch.zeros(n, N)
    out = tro.paged_attention(q, case.k_pages, case.v_pages, case.layer, case.block_table, end, case.k_new,
                              case.v_new, case.node_bounds, mass, num_splits=splits)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mass.double(), want_mass, atol=1e-5, rtol=1e-5)
    out2 = tro.paged_attention(q, case.k_pages, case.v_pages, case.layer, case.block_table, end,
                               num_splits=splits)  # no mass, no writes
    torch.testing.assert_close(out2.double(), want_out, atol=1e-5, rtol=1e-5)


def test_paged_attention_no_queries():
    case = make_case(0, 2, 10)
    out = tro.paged_attention(case.q, case.k_pages, case.v_pages, case.layer, case.block_table, 10, case.k_new,
                              case.v_new, case.node_bounds, torch.zeros(0, 3))
    assert out.shape == (0, 4 * 16)
    torch.testing.assert_close(case.k_pages[case.layer, case.block_table[1], :, 0], case.k_new[0])


def test_mass_tiles_reach_the_calls_with_node_mass_over_a_whole_tile_and_only_those(monkeypatch):
    """MASS_TILES (the engine's tiles for attention with node mass) launches the kernel at those tiles where node mass
    is summed over at least BLOCK_M query rows and the caller gave no tiles; output and mass against brute force. A
    call without mass, a decode-sized one, or one with its own tiles keeps its blocking."""
    launched = record_attention_tiles(monkeypatch)
    monkeypatch.setattr(tro, "MASS_TILES", (16, 32, 2, 1))
    case = make_case(12, 12, 150, 4, 2, 16, 8, 5)  # 24 rows: 12 queries x 2 heads per KV head
    want_out, want_mass = brute_force(case)
    mass = torch.zeros(12, 5)
    out = tro.paged_attention(case.q, case.k_pages, case.v_pages, case.layer, case.block_table, case.end, case.k_new,
                              case.v_new, case.node_bounds, mass)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mass.double(), want_mass, atol=1e-5, rtol=1e-5)
    tro.paged_attention(case.q, case.k_pages, case.v_pages, case.layer, case.block_table, case.end)
    tro.paged_attention(case.q[-1:], case.k_pages, case.v_pages, case.layer, case.block_table, case.end,
                        node_bounds=case.node_bounds, mass=torch.zeros(1, 5))  # one query: 2 rows
    tro.paged_attention(case.q, case.k_pages, case.v_pages, case.layer, case.block_table, case.end,
                        node_bounds=case.node_bounds, mass=torch.zeros(12, 5), tiles=(32, 16, 4, 2))
    # by default 24 rows take 32-row tiles, 2 rows 16-row ones
    assert launched == [(16, 32, 2, 1), (32, 64, None, None), (16, 64, None, None), (32, 16, 4, 2)]
