"""Triton ops module: fused RMSNorm (optionally with the residual add before it), RoPE and SiLU·mul kernels with
`reference`'s semantics, plus `paged_attention`, `write_kv` and a batch's decode step (`decode_attention`, which
`CacheBatch` uses where a backend has it) from `triton_attention`, so that this module is a
complete backend for the model (see `nodekv.kernels.backend_ops`). A bf16/fp16 prefill on CUDA that has no cached
prefix attends through torch's SDPA instead (`paged_attention` here), which is faster there; with node mass only
where `FRESH_PREFILL_MASS` says so.

Each kernel reads its inputs once and writes its output once, computing in fp32 whatever the storage dtype (fp32,
bf16, fp16), and rounds once when it stores; the torch reference rounds after every op in bf16, so bf16 results
agree to bf16 rounding, fp32 ones to a few fp32 ulps. Inputs need a contiguous last dim (other dims may be strided,
such as the q/k columns of a fused QKV output). Under TRITON_INTERPRET=1 they run on CPU tensors.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_attention
from .reference import overlaps
from .triton_attention import decode_attention, write_kv

__all__ = ["FRESH_PREFILL_MASS", "MASS_TILES", "add_rms_norm_", "decode_attention", "paged_attention", "rms_norm",
           "rope", "silu_mul", "write_kv"]

_MAX_ROW_BLOCK = 4096  # columns a norm program holds at once; longer rows loop


# ---------------------------------------------------------------- attention


# How a bf16/fp16 prefill on CUDA from an empty cache sums node mass: "kernel", the Triton kernel's one pass (node
# mass 1.06x / 1.38x of a 2K / 8K prefill without it on qwen2.5-1.5b's shapes, H100, before its accumulator was
# touched only where nodes end; untimed since), or "sdpa", SDPA's output and
# log-sum-exp then the Triton mass pass (`triton_attention.sdpa_prefill`; not yet timed on a GPU:
# `bench gpu_engine --fresh-mass kernel,sdpa` times both, and this follows the measurement)
FRESH_PREFILL_MASS = "kernel"
# The tiles (BLOCK_M, BLOCK_N, num_warps, num_stages) of an attention call that sums node mass in the Triton kernel
# over at least BLOCK_M query rows (a decode step or a short probe keeps its 16- or 32-row tiles), where the caller
# gives none; None: the kernel's defaults. On an H100, 512 query rows of qwen2.5-1.5b's shapes over
# 8K keys took 1.17x the fastest no-mass tiles' time with node mass at (64, 32, 4, 2), 1.40x at the defaults (kernel
# alone, results/gpu_h100.md); not yet timed in the engine: `bench gpu_engine --fresh-mass kernel,kernel/64x32x4x2`
MASS_TILES: tuple[int, int, int, int] | None = None


def paged_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, layer: int,
                    block_table: torch.Tensor, end: int, k_new: torch.Tensor | None = None,
                    v_new: torch.Tensor | None = None, node_bounds: torch.Tensor | None = None,
                    mass: torch.Tensor | None = None, **options) -> torch.Tensor:
    """`triton_attention.paged_attention` (same arguments, same result), except where it is not the fastest correct
    kernel: a prefill from an empty cache (every key among k_new), in bf16 or fp16 on CUDA, of all its queries or of
    the last one only (the final layer's pruned rows), without node mass (or with it, where FRESH_PREFILL_MASS is
    "sdpa") goes through `triton_attention.sdpa_prefill`: torch's SDPA (flash attention) over k_new, v_new, which it
    also stores. On an H200 the Triton kernel, which gathers keys through the block table, took 1.7x SDPA's time on
    512 rows over 8K keys (bench triton_gpu). fp32 keeps the Triton kernel, whose IEEE dots the fp32 tests hold to a
    few ulps. A Triton call with node mass over at least MASS_TILES[0] query rows (n x heads per KV head) and no
    `tiles` of its own takes MASS_TILES, where set."""
    n = q.shape[0]
    fresh = k_new is not None and k_new.shape[0] == end and n in (1, end)
    half_on_cuda = q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
    if fresh and half_on_cuda and not options and (mass is None or FRESH_PREFILL_MASS == "sdpa"):
        return triton_attention.sdpa_prefill(q, k_pages, v_pages, layer, block_table, k_new, v_new, node_bounds,
                                             mass)
    rows = n * (q.shape[1] // k_pages.shape[2])  # a tile's rows are (query, head of the KV head's group) pairs
    if mass is not None and MASS_TILES is not None and rows >= MASS_TILES[0]:
        options = {"tiles": MASS_TILES, **options}
    return triton_attention.paged_attention(q, k_pages, v_pages, layer, block_table, end, k_new, v_new,
                                            node_bounds, mass, **options)


# ---------------------------------------------------------------- RMSNorm


@triton.jit(do_not_specialize=["eps"])
def _rms_norm_kernel(X, D, W, Y, stride_x, stride_d, stride_y, d_model, eps,
                     ADD: tl.constexpr, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr):
    """One program per row: s = x (+ delta, stored back into x when ADD); y = s * rsqrt(mean(s²) + eps) * w.

    Rows longer than BLOCK take two passes (sum of squares, then normalise), recomputing x + delta in the second
    so that x is written once, after it was last read."""
    row = tl.program_id(0).to(tl.int64)
    x_row, d_row, y_row = X + row * stride_x, D + row * stride_d, Y + row * stride_y
    if ONE_BLOCK:
        cols = tl.arange(0, BLOCK)
        mask = cols < d_model
        s = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if ADD:
            s += tl.load(d_row + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(x_row + cols, s.to(X.dtype.element_ty), mask=mask)
            s = s.to(X.dtype.element_ty).to(tl.float32)  # normalise the residual as stored, like the reference
        rstd = 1.0 / tl.sqrt(tl.sum(s * s, 0) / d_model + eps)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + cols, (s * rstd * w).to(Y.dtype.element_ty), mask=mask)
    else:
        sq = tl.zeros([BLOCK], tl.float32)
        for c0 in range(0, d_model, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            mask = cols < d_model
            s = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            if ADD:
                s += tl.load(d_row + cols, mask=mask, other=0.0).to(tl.float32)
                s = s.to(X.dtype.element_ty).to(tl.float32)
            sq += s * s
        rstd = 1.0 / tl.sqrt(tl.sum(sq, 0) / d_model + eps)
        for c0 in range(0, d_model, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            mask = cols < d_model
            s = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            if ADD:
                s += tl.load(d_row + cols, mask=mask, other=0.0).to(tl.float32)
                tl.store(x_row + cols, s.to(X.dtype.element_ty), mask=mask)
                s = s.to(X.dtype.element_ty).to(tl.float32)
            w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_row + cols, (s * rstd * w).to(Y.dtype.element_ty), mask=mask)


def _rows(name: str, t: torch.Tensor, fn: str) -> torch.Tensor:
    """t [..., d] as a 2-D view [rows, d] (a view: in-place writes reach t)."""
    if t.dim() == 0 or t.stride(-1) != 1:
        raise ValueError(f"{fn}: {name} needs a contiguous last dim, got shape {tuple(t.shape)} strides "
                         f"{t.stride()}")
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        raise ValueError(f"{fn}: {name} {tuple(t.shape)} with strides {t.stride()} is not viewable as rows") from None


def _norm(fn: str, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"{fn}: weight {tuple(weight.shape)} does not match x {tuple(x.shape)}")
    if delta is not None and delta.shape != x.shape:
        raise ValueError(f"{fn}: delta {tuple(delta.shape)} != x {tuple(x.shape)}")
    if delta is not None and overlaps(x):  # rows written in place to one memory would race
        raise ValueError(f"{fn}: x is added to in place, so no two of its elements may share memory, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    x2 = _rows("x", x, fn)
    d2 = x2 if delta is None else _rows("delta", delta, fn)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0] == 0:
        return y
    y2 = y.view(-1, d)
    block = min(triton.next_power_of_2(d), _MAX_ROW_BLOCK)
    _rms_norm_kernel[(x2.shape[0],)](x2, d2, weight.contiguous(), y2, x2.stride(0), d2.stride(0), y2.stride(0), d,
                                     float(eps), ADD=delta is not None, BLOCK=block, ONE_BLOCK=block >= d,
                                     num_warps=4 if block <= 1024 else 8)
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., d] -> x / sqrt(mean(x², -1) + eps) * weight, a new tensor in x's dtype (statistics in fp32)."""
    return _norm("rms_norm", x, None, weight, eps)


def add_rms_norm_(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The residual add fused with the norm after it: x += delta in place (rounded to x's dtype), then
    rms_norm(x, weight, eps) as a new tensor. One read of x and delta, one write of x and of the result."""
    return _norm("add_rms_norm_", x, delta, weight, eps)


# ---------------------------------------------------------------- RoPE


@triton.jit
def _rope_kernel(QK, C, S, Y, stride_qt, stride_qh, stride_c, stride_s, stride_yt, stride_yh, heads,
                 HD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (token t, head block): y = qk * cos + roll(qk, HD/2) * sin_signed, with roll(x, HD/2)[d] =
    x[(d + HD/2) % HD] (the partner of each element in the other half), cos/sin shared by the token's heads."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    dmask = d < HD
    mask = (h < heads) & dmask
    row = QK + t * stride_qt + h * stride_qh
    x = tl.load(row + d, mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(row + (d + HD // 2) % HD, mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(C + t * stride_c + d, mask=dmask, other=0.0).to(tl.float32)
    sin = tl.load(S + t * stride_s + d, mask=dmask, other=0.0).to(tl.float32)
    y = x * cos + partner * sin
    tl.store(Y + t * stride_yt + h * stride_yh + d, y.to(Y.dtype.element_ty), mask=mask)


def rope(qk: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on qk [T, heads, hd] (hd even; any strides with a contiguous last dim) with cos,
    sin_signed [T, hd] (sin_signed = [-sin, sin]): qk * cos + roll(qk, hd/2, -1) * sin_signed as a new contiguous
    [T, heads, hd] tensor in the promoted dtype of qk and cos (qk's dtype in the model)."""
    T, heads, hd = qk.shape
    if hd % 2 or cos.shape != (T, hd) or sin_signed.shape != (T, hd):
        raise ValueError(f"rope: qk {tuple(qk.shape)} (even head dim) needs cos, sin_signed [{T}, {hd}], got "
                         f"{tuple(cos.shape)} and {tuple(sin_signed.shape)}")
    if qk.stride(-1) != 1:
        qk = qk.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin_signed = sin_signed if sin_signed.stride(-1) == 1 else sin_signed.contiguous()
    y = torch.empty(T, heads, hd, dtype=torch.result_type(qk, cos), device=qk.device)
    if T == 0 or heads == 0:
        return y
    block_d = triton.next_power_of_2(hd)
    block_h = max(1, min(triton.next_power_of_2(heads), 4096 // block_d))
    _rope_kernel[(T, triton.cdiv(heads, block_h))](
        qk, cos, sin_signed, y, qk.stride(0), qk.stride(1), cos.stride(0), sin_signed.stride(0), y.stride(0),
        y.stride(1), heads, HD=hd, BLOCK_H=block_h, BLOCK_D=block_d)
    return y


# ---------------------------------------------------------------- SiLU · mul


@triton.jit
def _silu_mul_kernel(GU, stride_t, inter, BLOCK: tl.constexpr):
    """Program (row, column block): gate = GU[:, :inter], up = GU[:, inter:]; gate <- gate * sigmoid(gate) * up,
    in place (each element is read and written by the same program)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    row = GU + t * stride_t
    gate = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(row + cols, y.to(GU.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate | up) -> silu(gate) * up [T, I], computed in gate_up's storage: like the reference, the
    result is the view gate_up[:, :I] (rows keep gate_up's stride)."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"silu_mul: gate_up must be [T, 2I] with a contiguous last dim, got "
                         f"{tuple(gate_up.shape)} strides {gate_up.stride()}")
    if overlaps(gate_up):  # computed in place: a row would overwrite the input of the rows sharing its memory
        raise ValueError(f"silu_mul: gate_up is computed in place, so no two of its elements may share memory, got "
                         f"shape {tuple(gate_up.shape)} strides {gate_up.stride()}")
    T, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if T and inter:
        block = min(triton.next_power_of_2(inter), 1024)
        _silu_mul_kernel[(T, triton.cdiv(inter, block))](gate_up, gate_up.stride(0), inter, BLOCK=block)
    return gate_up[:, :inter]
