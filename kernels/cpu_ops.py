"""Small fp32 CPU kernels for few-token forward steps (C++ in csrc/cpu_ops.cpp): RMSNorm (optionally fused with the
residual add before it), RoPE, silu(gate) * up, and causal GQA attention over a contiguous KV cache.

At one token each of these ops touches a few KiB, so torch's per-op overhead (an RMSNorm is 6 ops, RoPE 4) costs far
more than the arithmetic; each function here is one call of a few µs, most of it the argument checks. They are fast
paths only: float32 CPU tensors in the layouts stated, else a ValueError naming the offending argument, and no
fallback. `out=` takes a preallocated result (float32, contiguous, the result's shape; it must not overlap the
inputs) and saves the allocation. Any T works, but only attention uses more than one thread: the others are meant
for few tokens. The AVX2/FMA code is picked at run time (`_C.cpu_ops_isa()`); `_C.cpu_ops_force_scalar(True)` forces
the scalar one (a testing hook).
"""
from __future__ import annotations

import torch

from nodekv import _C

_F32 = torch.float32
_BAD = (AttributeError, TypeError, ValueError)  # what the fast checks raise on non-tensors or wrong ranks


# The functions test their arguments with one fast expression; only when it fails do these helpers find out why.

def _f32(name: str, t, fn: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != _F32 or not t.is_cpu:
        got = f"{t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{fn}: {name} must be a float32 CPU tensor, got {got}")


def _shape(name: str, t: torch.Tensor, want: tuple, fn: str) -> None:
    if t.shape != want:
        raise ValueError(f"{fn}: {name} must have shape {list(want)}, got {list(t.shape)}")


def _contig(name: str, t: torch.Tensor, fn: str) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{fn}: {name} must be contiguous, got strides {t.stride()}")


def _dense(name: str, t, want: tuple, fn: str) -> None:
    _f32(name, t, fn)
    _shape(name, t, want, fn)
    _contig(name, t, fn)


def _rank(name: str, t, ndim: int, dims: str, fn: str) -> None:
    _f32(name, t, fn)
    if t.dim() != ndim:
        raise ValueError(f"{fn}: {name} must be {ndim}-D {dims}, got shape {list(t.shape)}")


def _last_contig(name: str, t: torch.Tensor, fn: str) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{fn}: {name}'s last dim must be contiguous, got strides {t.stride()}")


def _out_ok(out: torch.Tensor | None, shape: tuple) -> bool:
    return out is None or (out.dtype is _F32 and out.is_cpu and out.shape == shape and out.is_contiguous())


def _check_out(out, shape: tuple, fn: str) -> None:
    if out is not None:
        _dense("out", out, shape, fn)


def _unexplained(fn: str):
    return ValueError(f"{fn}: invalid arguments")  # a check the fast path makes that the helpers missed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, d], weight [d] -> [T, d] = x / sqrt(mean(x², -1) + eps) * weight, float32, contiguous.

    The sum of squares runs in fp32 over 32 interleaved partial sums; matches F.rms_norm(x, (d,), weight, eps) to a
    few ulp. `out` may be x itself.
    """
    return _norm("rms_norm", x, None, weight, eps, out)


def add_rms_norm_(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """The residual add fused with the norm after it: x += delta in place (exactly as torch adds), then return
    rms_norm(x, weight, eps). x, delta [T, d] and weight [d], float32 and contiguous; delta must not overlap x."""
    return _norm("add_rms_norm_", x, delta, weight, eps, out)


def _norm(fn: str, x, delta, weight, eps: float, out) -> torch.Tensor:
    try:
        t, d = x.shape
        ok = (x.dtype is _F32 and x.is_cpu and x.is_contiguous() and weight.dtype is _F32 and weight.is_cpu
              and weight.shape == (d,) and weight.is_contiguous() and _out_ok(out, (t, d))
              and (delta is None or (delta.dtype is _F32 and delta.is_cpu and delta.shape == (t, d)
                                     and delta.is_contiguous())))
    except _BAD:
        ok = False
    if not ok:
        _explain_norm(fn, x, delta, weight, out)
    y = torch.empty(t, d, dtype=_F32) if out is None else out
    if delta is None:
        _C.rms_norm(x.data_ptr(), t, d, weight.data_ptr(), eps, y.data_ptr())
    else:
        _C.add_rms_norm(x.data_ptr(), delta.data_ptr(), t, d, weight.data_ptr(), eps, y.data_ptr())
    return y


def _explain_norm(fn, x, delta, weight, out):
    _rank("x", x, 2, "[T, d]", fn)
    _contig("x", x, fn)
    if delta is not None:
        _dense("delta", delta, x.shape, fn)
    _dense("weight", weight, x.shape[1:], fn)
    _check_out(out, x.shape, fn)
    raise _unexplained(fn)


def rope_(qk: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in place on qk [T, n_heads, head_dim]; returns qk.

        qk <- qk * cos[:, None, :] + qk.roll(head_dim // 2, -1) * sin_signed[:, None, :]

    with cos and sin_signed [T, head_dim] (sin_signed = [-sin, sin], as `Llama.rope` builds them), bit-identical to
    that torch expression in fp32. qk may be a strided view (e.g. the q|k columns of a fused qkv output) as long as
    its last dim is contiguous; cos and sin_signed must be contiguous. head_dim must be even.
    """
    try:
        t, n, hd = qk.shape
        st, sh, sd = qk.stride()
        ok = (qk.dtype is _F32 and qk.is_cpu and sd == 1 and hd % 2 == 0
              and cos.dtype is _F32 and cos.is_cpu and cos.shape == (t, hd) and cos.is_contiguous()
              and sin_signed.dtype is _F32 and sin_signed.is_cpu and sin_signed.shape == (t, hd)
              and sin_signed.is_contiguous())
    except _BAD:
        ok = False
    if not ok:
        _explain_rope(qk, cos, sin_signed)
    _C.rope(qk.data_ptr(), t, n, hd, st, sh, cos.data_ptr(), sin_signed.data_ptr())
    return qk


def _explain_rope(qk, cos, sin_signed):
    fn = "rope_"
    _rank("qk", qk, 3, "[T, n_heads, head_dim]", fn)
    _last_contig("qk", qk, fn)
    t, _, hd = qk.shape
    if hd % 2:
        raise ValueError(f"{fn}: head_dim must be even, got {hd}")
    _dense("cos", cos, (t, hd), fn)
    _dense("sin_signed", sin_signed, (t, hd), fn)
    raise _unexplained(fn)


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [T, 2I] (gate in columns :I, up in I:, as a fused gate|up projection writes them) -> [T, I] =
    silu(gate) * up, float32, contiguous; within a few ulp of F.silu(gate) * up."""
    try:
        t, w = gate_up.shape
        ok = (gate_up.dtype is _F32 and gate_up.is_cpu and gate_up.is_contiguous() and w % 2 == 0
              and _out_ok(out, (t, w // 2)))
    except _BAD:
        ok = False
    if not ok:
        _explain_silu(gate_up, out)
    y = torch.empty(t, w // 2, dtype=_F32) if out is None else out
    _C.silu_mul(gate_up.data_ptr(), t, w // 2, y.data_ptr())
    return y


def _explain_silu(gate_up, out):
    fn = "silu_mul"
    _rank("gate_up", gate_up, 2, "[T, 2I]", fn)
    _contig("gate_up", gate_up, fn)
    t, w = gate_up.shape
    if w % 2:
        raise ValueError(f"{fn}: gate_up must have an even number of columns, got {w}")
    _check_out(out, (t, w // 2), fn)
    raise _unexplained(fn)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: int, start: int,
                     k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal grouped-query attention of T new tokens over one layer of a contiguous KV cache -> [T, H * hd].

    q: [T, H, hd], the new tokens' queries at absolute positions start .. start+T-1 (a strided view is fine; the
    last dim must be contiguous). k_cache, v_cache: [layers, kv_heads, capacity, hd] contiguous (the layout of
    `ContiguousKVCache`); `layer` selects the layer. If k_new and v_new ([T, kv_heads, hd], last dim contiguous) are
    given they are first written to positions start .. start+T-1 of that layer; otherwise the cache must already
    hold them. Query head h uses KV head h // (H // kv_heads); token t attends to positions [0, start + t]:

        out[t, h*hd:(h+1)*hd] = softmax_s(q[t, h] · k[g, s] / sqrt(hd), s <= start + t) @ v[g, :start+t+1]

    fp32 throughout; the softmax is max-subtracted, computed online per chunk of 128 positions, and the chunks are
    merged by log-sum-exp (scratch: hd + 2 floats per query row and chunk, so any length works). Runs on up to
    torch.get_num_threads() threads when the work is large enough (at SmolLM2's shapes from ~110 cached positions
    on); the results do not depend on the thread count. Meant for few tokens (T up to ~16): prefill belongs to
    `prefill_attention`.
    """
    try:
        t, h, hd, kv, cap, qst, qsh, ok = _attention_args(q, k_cache, v_cache, layer, start, out)
        if k_new is None:
            ok = ok and v_new is None
            kp = kst = ksh = vp = vst = vsh = 0
        else:
            kst, ksh, ksd = k_new.stride()
            vst, vsh, vsd = v_new.stride()
            ok = (ok and k_new.dtype is _F32 and k_new.is_cpu and k_new.shape == (t, kv, hd) and ksd == 1
                  and v_new.dtype is _F32 and v_new.is_cpu and v_new.shape == (t, kv, hd) and vsd == 1)
            kp, vp = k_new.data_ptr(), v_new.data_ptr()
    except _BAD:
        ok = False
    if not ok:
        _explain_attention(q, k_cache, v_cache, layer, start, k_new, v_new, out)
    y = torch.empty(t, h * hd, dtype=_F32) if out is None else out
    layer_offset = layer * kv * cap * hd * 4  # bytes
    _C.decode_attention(q.data_ptr(), qst, qsh, k_cache.data_ptr() + layer_offset,
                        v_cache.data_ptr() + layer_offset, cap, kp, kst, ksh, vp, vst, vsh, t, h, kv, hd, start,
                        y.data_ptr(), torch.get_num_threads())
    return y


def _attention_args(q, k_cache, v_cache, layer, start, out):
    """(T, H, hd, kv_heads, capacity, q strides, ok) with ok the fast check shared by both attention kernels."""
    t, h, hd = q.shape
    qst, qsh, qsd = q.stride()
    n_layers, kv, cap, hd_c = k_cache.shape
    ok = (q.dtype is _F32 and q.is_cpu and qsd == 1
          and k_cache.dtype is _F32 and k_cache.is_cpu and k_cache.is_contiguous()
          and v_cache.dtype is _F32 and v_cache.is_cpu and v_cache.shape == k_cache.shape
          and v_cache.is_contiguous()
          and hd_c == hd and h % kv == 0 and 0 <= layer < n_layers and 0 <= start and start + t <= cap
          and _out_ok(out, (t, h * hd)))
    return t, h, hd, kv, cap, qst, qsh, ok


def _explain_attention(q, k_cache, v_cache, layer, start, k_new, v_new, out, fn="decode_attention"):
    _rank("q", q, 3, "[T, H, head_dim]", fn)
    _last_contig("q", q, fn)
    t, h, hd = q.shape
    _rank("k_cache", k_cache, 4, "[layers, kv_heads, capacity, head_dim]", fn)
    _contig("k_cache", k_cache, fn)
    _dense("v_cache", v_cache, k_cache.shape, fn)
    n_layers, kv, cap, hd_c = k_cache.shape
    if hd_c != hd:
        raise ValueError(f"{fn}: q has head_dim {hd}, the cache {hd_c}")
    if h % kv:
        raise ValueError(f"{fn}: q's {h} heads are not a multiple of the cache's {kv} KV heads")
    if not 0 <= layer < n_layers:
        raise ValueError(f"{fn}: layer {layer} out of range for a cache of {n_layers} layers")
    if start < 0 or start + t > cap:
        raise ValueError(f"{fn}: positions [{start}, {start + t}) do not fit the cache's capacity {cap}")
    if (k_new is None) != (v_new is None):
        raise ValueError(f"{fn}: give both k_new and v_new or neither")
    if k_new is not None:
        for name, x in (("k_new", k_new), ("v_new", v_new)):
            _f32(name, x, fn)
            _shape(name, x, (t, kv, hd), fn)
            _last_contig(name, x, fn)
    _check_out(out, (t, h * hd), fn)
    raise _unexplained(fn)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: int, start: int,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal grouped-query attention of n new tokens over one layer of a contiguous KV cache -> [n, H * hd], for
    prefill (n in the hundreds or thousands; C++ in csrc/prefill_attention.cpp).

    Same arguments and math as `decode_attention` without k_new/v_new: q [n, H, hd] (a strided view is fine; the
    last dim must be contiguous) holds the queries at positions start .. start+n-1; k_cache, v_cache
    [layers, kv_heads, capacity, hd] contiguous must already hold positions 0 .. start+n-1 of `layer`. Query head h
    uses KV head h // (H // kv_heads); token t attends to positions [0, start + t], scale 1/sqrt(hd).

    Flash-style: per (KV head, block of query tokens) the key blocks up to the diagonal are visited once, with an
    online (base-2) softmax in fp32. Runs on up to torch.get_num_threads() threads; as the split into tasks does
    not depend on the thread count, neither do the results.
    """
    try:
        t, h, hd, kv, cap, qst, qsh, ok = _attention_args(q, k_cache, v_cache, layer, start, out)
    except _BAD:
        ok = False
    if not ok:
        _explain_attention(q, k_cache, v_cache, layer, start, None, None, out, "prefill_attention")
    y = torch.empty(t, h * hd, dtype=_F32) if out is None else out
    layer_offset = layer * kv * cap * hd * 4  # bytes
    _C.prefill_attention(q.data_ptr(), qst, qsh, k_cache.data_ptr() + layer_offset,
                         v_cache.data_ptr() + layer_offset, cap, t, h, kv, hd, start, y.data_ptr(),
                         torch.get_num_threads())
    return y


rope = rope_  # the name the forward's op table shares with `reference.rope` (which is not in place)
