"""Small fp32 CPU kernels for few-token forward steps (C++ in csrc/cpu_ops.cpp): RMSNorm (optionally fused with the
residual add before it), RoPE, silu(gate) * up; and causal GQA attention over the paged KV cache with optional
attention mass per key node (csrc/paged_attention.h), for decode and prefill alike.

At one token each of these ops touches a few KiB, so torch's per-op overhead (an RMSNorm is 6 ops, RoPE 4) costs far
more than the arithmetic; each function here is one call of a few µs, most of it the argument checks. They are fast
paths only: float32 CPU tensors in the layouts stated, else a ValueError naming the offending argument, and no
fallback. `out=` takes a preallocated result (float32, contiguous, the result's shape; it must not overlap the
inputs) and saves the allocation. Any T works, but only attention uses more than one thread: the others are meant
for few tokens. The SIMD code is picked at run time (`_C.isa()`: AVX2/FMA, and AVX-512 for prefill attention and
the quantised matmuls of several tokens); `simd_level("avx2")` or `("scalar")` caps it for every C++ kernel inside a
block (a testing and benchmarking hook).
"""
from __future__ import annotations

import operator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator, Sequence

import torch

from nodekv import _C

from .reference import check_block_table, check_page_shape, check_pages_writable, overlaps


@contextmanager
def simd_level(name: str) -> Iterator[str]:
    """Every C++ CPU kernel (these, attention, the quantised matmuls) at SIMD level `name` ('scalar', 'avx2' or
    'avx512') or the best the CPU has below it, inside the block; yields the level taken. The levels give the same
    bits except the scalar one. Process-wide: not for use while other threads run kernels."""
    _C.limit_isa(name)
    try:
        yield _C.isa()
    finally:
        _C.limit_isa("avx512")

if TYPE_CHECKING:
    from .quant import QuantWeight

_F32 = torch.float32
_I32 = torch.int32
_BAD = (AttributeError, IndexError, TypeError, ValueError)  # what the fast checks raise on non-tensors or wrong ranks


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


def _rank(name: str, t, ndim: int, dims: str, fn: str, check=None) -> None:
    (check or _f32)(name, t, fn)
    if t.dim() != ndim:
        raise ValueError(f"{fn}: {name} must be {ndim}-D {dims}, got shape {list(t.shape)}")


def _last_contig(name: str, t: torch.Tensor, fn: str) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{fn}: {name}'s last dim must be contiguous, got strides {t.stride()}")


_PAGE_DTYPES = (_F32, torch.float16)  # fp32 pages, or IEEE halves (half the memory; converted to fp32 as read)


def _page_dtype(name: str, t, fn: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype not in _PAGE_DTYPES or not t.is_cpu:
        got = f"{t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{fn}: {name} must be a float32 or float16 CPU tensor, got {got}")


def _pages_ok(k_pages: torch.Tensor, v_pages: torch.Tensor) -> bool:
    return (k_pages.dtype in _PAGE_DTYPES and k_pages.is_cpu and k_pages.is_contiguous()
            and v_pages.dtype is k_pages.dtype and v_pages.is_cpu and v_pages.shape == k_pages.shape
            and v_pages.is_contiguous())


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
    try:  # free in the fast path; pybind checks every argument before the kernel runs
        if delta is None:
            _C.rms_norm(x.data_ptr(), t, d, weight.data_ptr(), eps, y.data_ptr())
        else:
            _C.add_rms_norm(x.data_ptr(), delta.data_ptr(), t, d, weight.data_ptr(), eps, y.data_ptr())
    except TypeError:  # the one argument not checked above: eps is not a number
        raise ValueError(f"{fn}: eps must be a number, got {type(eps).__name__}") from None
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
    its last dim is contiguous and no two of its elements share memory (not an expanded view); cos and sin_signed
    must be contiguous. head_dim must be even.
    """
    try:
        t, n, hd = qk.shape
        st, sh, sd = qk.stride()
        ok = (qk.dtype is _F32 and qk.is_cpu and sd == 1 and hd % 2 == 0
              and (hd <= sh and n * sh <= st or not overlaps(qk))  # the usual layouts, or any other without overlap
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
    if overlaps(qk):
        raise ValueError(f"{fn}: qk is rotated in place, so no two of its elements may share memory, got shape "
                         f"{list(qk.shape)} with strides {qk.stride()}")
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


def _mass_args(node_bounds, mass, n: int) -> tuple[bool, int, int, int]:
    """(arguments fine, N, bounds pointer, mass pointer) of an optional node-mass output for n query rows."""
    if mass is None:
        return True, 0, 0, 0
    n_nodes = node_bounds.shape[0] - 1
    ok = (node_bounds.dtype is _I32 and node_bounds.is_cpu and node_bounds.dim() == 1
          and node_bounds.is_contiguous() and n_nodes >= 1 and mass.dtype is _F32 and mass.is_cpu
          and mass.shape == (n, n_nodes) and mass.is_contiguous())
    return ok, n_nodes, node_bounds.data_ptr(), mass.data_ptr()


def paged_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, layer: int,
                    block_table: torch.Tensor, end: int, k_new: torch.Tensor | None = None,
                    v_new: torch.Tensor | None = None, node_bounds: torch.Tensor | None = None,
                    mass: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal GQA attention of q [n, H, hd] over the paged keys [0, end) -> [n, H * hd]; `reference.paged_attention`
    defines the layout and the math, this is its fp32 C++ kernel (csrc/paged_attention.h).

    q holds the queries of the last n positions before `end` (a strided view is fine; the last dim must be
    contiguous); query i sees keys [0, end - n + i], query head h uses KV head h // (H // kv_heads), scale
    1/sqrt(hd). k_pages, v_pages: [layers, n_pages, kv_heads, page_size, hd] contiguous, float32 or both float16 (the
    keys and values are then converted to fp32 as they are read, and k_new / v_new rounded to nearest even as they
    are stored; the arithmetic is fp32 either way); block_table: int32
    [>= ceil(end / page_size)], key position s in page block_table[s // page_size] at row s % page_size. k_new, v_new
    ([T, kv_heads, hd], n <= T <= end, last dim contiguous), when given, are first stored at positions end - T ..
    end - 1. mass (float32 [n, N] contiguous), when given with node_bounds (int32 [N + 1], 0 = b[0] < ... < b[N] =
    end), is added to: mass[i, j] += Σ_h Σ_{k in [b[j], b[j+1])} p_h(i -> k); without mass node_bounds is ignored.

    Up to 16 queries run a decode kernel that splits the keys in chunks shared among threads; more run a flash-style
    tiled kernel. Both are fp32 with an online max-subtracted softmax, run on up to torch.get_num_threads() threads,
    give results that do not depend on the thread count, and keep node mass in O(n * N) memory (plus per-thread
    scratch). Mass costs the tiled kernel a few percent at nodes of 32 keys or more, 10-20% at nodes of 4 keys (SmolLM2
    shapes, bench/prefill_attention.py). `out=` takes a preallocated result.
    """
    fn = "paged_attention"
    try:
        n, h, hd = q.shape
        qst, qsh, qsd = q.stride()
        n_layers, n_pages, kv, page, hd_k = k_pages.shape
        n_table = block_table.shape[0]
        ok = (q.dtype is _F32 and q.is_cpu and qsd == 1 and _pages_ok(k_pages, v_pages) and hd_k == hd
              and kv > 0 and page > 0 and hd > 0 and h % kv == 0 and 0 <= layer < n_layers
              and block_table.dtype is _I32 and block_table.is_cpu and block_table.dim() == 1
              and block_table.is_contiguous() and n <= end <= n_table * page and _out_ok(out, (n, h * hd)))
        if k_new is None:
            ok = ok and v_new is None
            t = kp = kst = ksh = vp = vst = vsh = 0
        else:
            t = k_new.shape[0]
            kst, ksh, ksd = k_new.stride()
            vst, vsh, vsd = v_new.stride()
            ok = (ok and n <= t <= end and k_new.dtype is _F32 and k_new.is_cpu and k_new.shape == (t, kv, hd)
                  and ksd == 1 and v_new.dtype is _F32 and v_new.is_cpu and v_new.shape == (t, kv, hd) and vsd == 1)
            kp, vp = k_new.data_ptr(), v_new.data_ptr()
        mass_ok, n_nodes, bp, mp = _mass_args(node_bounds, mass, n)
        ok = ok and mass_ok
    except _BAD:
        ok = False
    if not ok:
        _explain_paged(q, k_pages, v_pages, layer, block_table, end, k_new, v_new, node_bounds, mass, out)
    y = torch.empty(n, h * hd, dtype=_F32) if out is None else out
    layer_offset = layer * n_pages * kv * page * hd * k_pages.element_size()  # bytes
    try:  # free in the fast path; pybind checks every argument before the kernel runs
        status = _C.paged_attention(q.data_ptr(), qst, qsh, k_pages.data_ptr() + layer_offset,
                                    v_pages.data_ptr() + layer_offset, n_pages, page, block_table.data_ptr(),
                                    n_table, end, kp, kst, ksh, vp, vst, vsh, t, n, h, kv, hd, bp, n_nodes, mp,
                                    y.data_ptr(), torch.get_num_threads(), k_pages.dtype is not _F32)
    except TypeError:  # a layer or end that compares as a number but is not an integer (5.0)
        _integers(fn, layer=layer, end=end)
        raise
    if status:
        _explain_tables(fn, status, k_pages, block_table, end, node_bounds)
    return y


# No torch fallback at any length. `reference.paged_attention` without mass (gather the pages, then SDPA with an
# explicit causal mask) measured 2.1-2.6x slower than the tiled kernel from 512 to 8K keys (prefill from empty,
# SmolLM2 shapes, 2 threads, this VM: 8.6 vs 3.3 ms at 512, 101 vs 47 ms at 2K, 1825 vs 777 ms at 8K), and even SDPA
# with is_causal on K/V already contiguous, which a paged cache would first have to gather, took 2.0x / 1.1x / 0.89x
# of the kernel's time there: a switch to torch beyond some length would win 11% at 8K at best, before the gather.
# Run bench/prefill_attention.py to measure again.


def _explain_paged(q, k_pages, v_pages, layer, block_table, end, k_new, v_new, node_bounds, mass, out):
    fn = "paged_attention"
    _integers(fn, layer=layer, end=end)
    _rank("q", q, 3, "[n, H, head_dim]", fn)
    _last_contig("q", q, fn)
    n, h, hd = q.shape
    _rank("k_pages", k_pages, 5, "[layers, n_pages, kv_heads, page_size, head_dim]", fn, _page_dtype)
    _page_dtype("v_pages", v_pages, fn)
    if k_new is not None:  # an expanded pool gets the line every backend's KV write gives, not "must be contiguous"
        check_pages_writable(k_pages, v_pages, fn)
    _contig("k_pages", k_pages, fn)
    if v_pages.dtype != k_pages.dtype:
        raise ValueError(f"{fn}: v_pages must have k_pages' dtype {k_pages.dtype}, got {v_pages.dtype}")
    _shape("v_pages", v_pages, k_pages.shape, fn)
    _contig("v_pages", v_pages, fn)
    check_page_shape(k_pages, fn)
    n_layers, _, kv, page, hd_k = k_pages.shape
    if hd_k != hd:
        raise ValueError(f"{fn}: q has head_dim {hd}, the pages {hd_k}")
    if h % kv:
        raise ValueError(f"{fn}: q's {h} heads are not a multiple of the pages' {kv} KV heads")
    if not 0 <= layer < n_layers:
        raise ValueError(f"{fn}: layer {layer} out of range for pages of {n_layers} layers")
    _index("block_table", block_table, fn)
    if not n <= end:
        raise ValueError(f"{fn}: {n} queries do not fit before end={end}")
    if end > block_table.shape[0] * page:
        raise ValueError(f"{fn}: block_table's {block_table.shape[0]} pages of {page} hold fewer than end={end} "
                         f"positions")
    if (k_new is None) != (v_new is None):
        raise ValueError(f"{fn}: give both k_new and v_new or neither")
    if k_new is not None:
        _rank("k_new", k_new, 3, "[T, kv_heads, head_dim]", fn)
        t = k_new.shape[0]
        for name, x in (("k_new", k_new), ("v_new", v_new)):
            _f32(name, x, fn)
            _shape(name, x, (t, kv, hd), fn)
            _last_contig(name, x, fn)
        if not n <= t <= end:
            raise ValueError(f"{fn}: k_new's {t} rows must number from n={n} to end={end}")
    if mass is not None:
        if node_bounds is None:
            raise ValueError(f"{fn}: mass needs node_bounds")
        _index("node_bounds", node_bounds, fn)
        if node_bounds.shape[0] < 2:
            raise ValueError(f"{fn}: node_bounds must hold at least 2 bounds, got {node_bounds.shape[0]}")
        _dense("mass", mass, (n, node_bounds.shape[0] - 1), fn)
    _check_out(out, (n, h * hd), fn)
    raise _unexplained(fn)


def _integers(fn: str, **values) -> None:
    """A ValueError naming the first of `values` that is not an integer (pybind's TypeError lists the signature)."""
    for name, value in values.items():
        try:
            operator.index(value)
        except TypeError:
            raise ValueError(f"{fn}: {name} must be an integer, got {type(value).__name__} {value!r}") from None


def _index(name: str, t, fn: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != _I32 or not t.is_cpu:
        got = f"{t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{fn}: {name} must be an int32 CPU tensor, got {got}")
    if t.dim() != 1:
        raise ValueError(f"{fn}: {name} must be 1-D, got shape {list(t.shape)}")
    _contig(name, t, fn)


def _explain_tables(fn, status, k_pages, block_table, end, node_bounds):
    """The C++ side found a table entry wrong (before writing anything)."""
    if status == 1:
        check_block_table(block_table, end, k_pages, fn)
    elif status == 2:
        b = node_bounds.tolist()
        raise ValueError(f"{fn}: node_bounds must rise strictly from 0 to end={end}, got "
                         f"{b if len(b) <= 12 else b[:6] + ['...'] + b[-6:]}")
    raise _unexplained(fn)


rope = rope_  # the name the forward's op table shares with `reference.rope` (which is not in place)


class Decoder:
    """A decode step (one new token for each of B sequences) through every decoder layer in one C++ call
    (csrc/fused_decode.h): a Llama-family model with GGUF block-quantised projections and fp32 activations, run as
    the op-by-op forward runs it (RMSNorm, the quantised matmuls, RoPE, `paged_attention` per sequence with optional
    node mass, SwiGLU, residual adds), on the same kernels in the same order: the results are bit-identical to that
    path, minus ~10 wrapper calls and allocations per layer (and one attention call per sequence and layer).

    Built once over the model's weights (checked here, referenced, and trusted by the C++ side afterwards: do not
    modify them in place with other shapes); `step` runs one token per sequence.
    """

    def __init__(self, embed: torch.Tensor | QuantWeight, layers, final_norm: torch.Tensor, lm_head, *,
                 n_heads: int, n_kv_heads: int, head_dim: int, eps: float, int8: bool = False):
        """embed: float32 [vocab, dim] or a QuantWeight [vocab, dim] (rows decoded as they are looked up, as
        `QuantWeight.rows`); layers: per layer (attn_norm, wqkv, wo, ffn_norm, w13, w2), the norms float32 [dim] and
        each projection a (QuantWeight or QuantStack, float32 bias or None) pair (wqkv rows q | k | v, w13 rows
        gate | up); final_norm [dim]; lm_head: (QuantWeight or QuantStack [vocab, dim], bias) or None (then the caller
        applies it to `step`'s hidden state). All contiguous. int8: the projections take `quant_linear`'s int8 fast
        path (then the op-by-op path matches only when it takes it too)."""
        from .quant import QuantStack, QuantWeight

        fn = "Decoder"
        vocab, dim = embed.shape
        if isinstance(embed, QuantWeight):
            embed_arg = [embed.data.data_ptr(), embed._qid]
            keep = [embed.data]
        else:
            _dense("embed", embed, (vocab, dim), fn)
            embed_arg = [embed.data_ptr(), 0]  # ggml's F32: dense rows
            keep = [embed]
        _dense("final_norm", final_norm, (dim,), fn)
        inter = layers[0][4][0].out_features // 2 if layers else 0
        keep.append(final_norm)  # everything whose address the C++ side holds

        def linear(name, wb, n, k):
            w, b = wb
            if not isinstance(w, (QuantWeight, QuantStack)) or w.shape != (n, k):
                got = list(w.shape) if isinstance(w, (QuantWeight, QuantStack)) else type(w).__name__
                raise ValueError(f"{fn}: {name} must be a QuantWeight or QuantStack of shape [{n}, {k}], got {got}")
            if b is not None:
                _dense(f"{name} bias", b, (n,), fn)
            keep.extend([w, b])
            return [k, 0 if b is None else b.data_ptr()] + w._segs.flatten().tolist()

        qkv = (n_heads + 2 * n_kv_heads) * head_dim
        packed = []
        for i, (attn_norm, wqkv, wo, ffn_norm, w13, w2) in enumerate(layers):
            _dense(f"layers[{i}] attn_norm", attn_norm, (dim,), fn)
            _dense(f"layers[{i}] ffn_norm", ffn_norm, (dim,), fn)
            keep.extend([attn_norm, ffn_norm])
            packed.append([[attn_norm.data_ptr(), ffn_norm.data_ptr()],
                           linear(f"layers[{i}] wqkv", wqkv, qkv, dim),
                           linear(f"layers[{i}] wo", wo, dim, n_heads * head_dim),
                           linear(f"layers[{i}] w13", w13, 2 * inter, dim),
                           linear(f"layers[{i}] w2", w2, dim, inter)])
        head = [] if lm_head is None else linear("lm_head", lm_head, vocab, dim)
        self._c = _C.Decoder(dim, n_heads, n_kv_heads, head_dim, inter, vocab, float(eps), embed_arg, packed,
                             final_norm.data_ptr(), head, int8)
        self._keep = keep
        self.n_layers, self.vocab, self.dim = len(layers), vocab, dim
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.has_lm_head = lm_head is not None

    def step(self, tokens: Sequence[int], cos: torch.Tensor, sin_signed: torch.Tensor, k_pages: torch.Tensor,
             v_pages: torch.Tensor, block_tables: Sequence[torch.Tensor], ends: Sequence[int],
             collectors: Sequence[tuple[torch.Tensor | None, torch.Tensor | None]] | None = None,
             want_out: bool = True, logits: torch.Tensor | None = None) -> torch.Tensor | None:
        """Run tokens[b] at position ends[b] - 1 of sequence b, for the B = len(tokens) sequences at once (rows of one
        batch, as `Llama.forward_batch` stacks them; B = 1 is a one-token step): every layer stores each row's K/V there
        (its pages and block table as in `paged_attention`; the pools are shared, all layers' pages: [layers, n_pages,
        kv_heads, page_size, hd]) and attends over its [0, ends[b]); cos, sin_signed: those positions' RoPE rows [B,
        hd], contiguous; the pools float32 or both float16, as there. collectors[b]: sequence b's (node_bounds [N + 1]
        int32, mass [1, N]), mass added to as `paged_attention` adds, summed over every layer; (None, None) or
        collectors=None: no mass. want_out=False: the last layer only stores its K/V (and attends for rows collecting
        mass), and nothing is returned. Otherwise returns the final normed states [B, dim] and fills logits ([B, vocab]
        float32 contiguous; only with a quantised lm_head) when given. Each row gets exactly the numbers of its
        one-token step. Nothing is written if a token or a table is wrong."""
        fn = "Decoder.step"
        hd = self.head_dim
        rows = []  # per row: token, block table address and length, end, node bounds address and count, mass address
        try:
            B = len(tokens)
            collectors = collectors or [(None, None)] * B
            n_layers, n_pages, kv, page, hd_k = k_pages.shape
            ok = (B >= 1 and len(block_tables) == len(ends) == len(collectors) == B
                  and _pages_ok(k_pages, v_pages) and hd_k == hd and n_layers == self.n_layers
                  and kv == self.n_kv_heads
                  and cos.dtype is _F32 and cos.is_cpu and cos.shape == (B, hd) and cos.is_contiguous()
                  and sin_signed.dtype is _F32 and sin_signed.is_cpu and sin_signed.shape == (B, hd)
                  and sin_signed.is_contiguous()
                  and (logits is None or (self.has_lm_head and want_out and _out_ok(logits, (B, self.vocab)))))
            for token, table, end, (bounds, mass) in zip(tokens, block_tables, ends, collectors):
                mass_ok, n_nodes, bp, mp = _mass_args(bounds, mass, 1)
                ok = (ok and mass_ok and table.dtype is _I32 and table.is_cpu and table.dim() == 1
                      and table.is_contiguous() and 1 <= end <= table.shape[0] * page)
                rows += (token, table.data_ptr(), table.shape[0], end, bp, n_nodes, mp)
        except _BAD:
            ok = False
        if not ok:
            raise ValueError(f"{fn}: invalid arguments (check them with paged_attention, which names the wrong one)")
        hidden = torch.empty(B, self.dim, dtype=_F32) if want_out else None
        try:  # free in the fast path; pybind checks every argument before the kernel runs
            status, bad = self._c.step(rows, cos.data_ptr(), sin_signed.data_ptr(), k_pages.data_ptr(),
                                       v_pages.data_ptr(), k_pages.dtype is not _F32, n_pages, page, want_out,
                                       0 if hidden is None else hidden.data_ptr(),
                                       0 if logits is None else logits.data_ptr(), torch.get_num_threads())
        except TypeError:  # a token or end that is a number but not an integer (5.0)
            _integers(fn, **{f"tokens[{b}]": t for b, t in enumerate(tokens)},
                      **{f"ends[{b}]": e for b, e in enumerate(ends)})
            raise
        if status == 3:
            raise ValueError(f"{fn}: token {tokens[bad]} is outside the vocabulary [0, {self.vocab})")
        if status:
            _explain_tables("paged_attention", status, k_pages, block_tables[bad], ends[bad], collectors[bad][0])
        return hidden

    def times(self) -> dict[str, float]:
        """Seconds spent in each part of the steps (wqkv, rope, attention, wo, w13, w2, norms+silu, lm_head) since
        the last `reset_times()`: a per-token profile from inside the C++ step."""
        return self._c.times()

    def reset_times(self) -> None:
        self._c.reset_times()
