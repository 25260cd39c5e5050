"""Linear layers on GGUF block-quantised weights with fp32 activations (C++ kernels in csrc/quant_matmul.cpp, one
traits struct per format in csrc/quant_formats.h).

A weight [out_features, in_features] stays in its ggml block format, one row of blocks per output feature. The
formats with native kernels (block sizes and type ids from gguf's tables):

    q4_0, q4_1, q5_0, q8_0   blocks of 32 inputs, one fp16 scale (and min) each
    q4_k, q6_k               super-blocks of 256 inputs with 8 / 16 sub-block scales

so in_features must be a multiple of the type's block (32 or 256). A fused projection whose parts differ in type
(Qwen2.5's q|k|v = q5_0|q5_0|q8_0) is a `QuantStack`: row segments of one type each, run by the same kernels in one
call, with no copy of the parts. Activations stay fp32 unless asked (`int8=True`, the fast path): `quant_linear(x, w)`
equals `x @ w.dequantize().T` up to fp32 rounding, while reading only the quantised bytes (about 1/6 of fp32 for
q4_1); dense fp32 decode is bound by those bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from nodekv import _C

_NATIVE = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0,
           GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K)
QTYPES: dict[str, int] = {t.name.lower(): int(t) for t in _NATIVE}  # name -> ggml type id
BLOCK_ELEMS: dict[str, int] = {t.name.lower(): GGML_QUANT_SIZES[t][0] for t in _NATIVE}
BLOCK_BYTES: dict[str, int] = {t.name.lower(): GGML_QUANT_SIZES[t][1] for t in _NATIVE}


def _segment_table(segments: list[tuple[int, int, int]]) -> torch.Tensor:
    """The kernels' description of a weight: int64 [n, 3] rows of (data address, ggml type id, rows)."""
    return torch.tensor(segments, dtype=torch.int64)


class _QuantRows:
    """The dense weight's shape, for the quantised weights below (their constructors set `_n` and in_features)."""

    _n: int
    in_features: int

    @property
    def out_features(self) -> int:
        return self._n

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features), like the dense weight's."""
        return self._n, self.in_features


@dataclass(frozen=True, eq=False)
class QuantWeight(_QuantRows):
    """A linear weight [out_features, in_features] kept in its GGUF block format (raw bytes, one row per output
    feature).

    `data` is uint8 [out_features, in_features / block_elems * block_bytes], made contiguous on construction;
    in_features must be a positive multiple of the type's block elements (BLOCK_ELEMS). Frozen, because the kernels
    trust the checks made here. Inference only: no autograd.
    """

    data: torch.Tensor
    qtype: str
    in_features: int

    def __post_init__(self) -> None:
        if self.qtype not in QTYPES:
            raise ValueError(f"QuantWeight: unsupported qtype {self.qtype!r}; supported: {sorted(QTYPES)}")
        data = self.data
        if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8:
            got = data.dtype if isinstance(data, torch.Tensor) else type(data).__name__
            raise ValueError(f"QuantWeight: data must be a uint8 torch.Tensor, got {got}")
        if data.dim() != 2:
            raise ValueError(f"QuantWeight: data must be 2-D [out_features, row_bytes], got shape {list(data.shape)}")
        if data.device.type != "cpu":
            raise ValueError(f"QuantWeight: data must be on the CPU, got {data.device}")
        k, elems = int(self.in_features), BLOCK_ELEMS[self.qtype]
        if k <= 0 or k % elems:
            raise ValueError(f"QuantWeight: in_features must be a positive multiple of {elems} for {self.qtype}, "
                             f"got {k}")
        row_bytes = k // elems * BLOCK_BYTES[self.qtype]
        if data.shape[1] != row_bytes:
            raise ValueError(f"QuantWeight: {self.qtype} rows of {k} inputs take {row_bytes} bytes, "
                             f"but data has {data.shape[1]} bytes per row")
        data = data.contiguous()
        object.__setattr__(self, "data", data)
        object.__setattr__(self, "in_features", k)
        # plain attributes for the per-call fast path; _segs is the kernels' view: one segment (see QuantStack)
        object.__setattr__(self, "_n", data.shape[0])
        object.__setattr__(self, "_qid", QTYPES[self.qtype])
        object.__setattr__(self, "_segs", _segment_table([(data.data_ptr(), self._qid, self._n)]))
        object.__setattr__(self, "_nseg", 1)

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [out_features, in_features], bit-identical to gguf.quants.dequantize of the same bytes; into
        `out` (a contiguous float32 or bfloat16 CPU tensor of that shape) when given. Into bfloat16, each value is
        rounded to nearest even (torch's conversion of the float32 result, bit for bit) as its row is decoded, so
        no float32 copy of the weight is made."""
        out = _dequantize_target(out, self._n, self.in_features)
        _C.quant_dequantize(self.data.data_ptr(), self._n, self.in_features, self._qid, out.data_ptr(),
                            torch.get_num_threads(), out.dtype == torch.bfloat16)
        return out

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [len(ids), in_features]: the rows `ids` (int64, 1-D) decoded, as dequantize()[ids] (an embedding
        lookup that never decodes the whole table); an id out of range raises IndexError."""
        if ids.numel() and int(ids.min()) < 0:  # torch would index from the end
            raise IndexError(f"QuantWeight.rows: id {int(ids.min())} is out of range [0, {self._n})")
        return QuantWeight(self.data[ids], self.qtype, self.in_features).dequantize()

    def row_slice(self, start: int, stop: int) -> "QuantWeight":
        """Rows [start, stop) as a weight of their own, on the same bytes (no copy)."""
        return QuantWeight(self.data[start:stop], self.qtype, self.in_features)


@dataclass(frozen=True, eq=False)
class QuantStack(_QuantRows):
    """QuantWeights of possibly different types stacked along out_features, each a row segment of the kernels' one
    call (a fused projection such as q|k|v = q5_0|q5_0|q8_0), in which each segment writes its slice of the output.
    The parts are not copied: a fused projection takes no memory beyond the file's blocks (segments of one type
    share the activations the kernel prepares, so unmerged runs cost it nothing). Frozen, as QuantWeight."""

    parts: tuple[QuantWeight, ...]

    def __post_init__(self) -> None:
        parts = tuple(self.parts)
        if not parts:
            raise ValueError("QuantStack: no parts given")
        for i, p in enumerate(parts):
            if not isinstance(p, QuantWeight):
                raise ValueError(f"QuantStack: part {i} must be a QuantWeight, got {type(p).__name__}")
            if p.in_features != parts[0].in_features:
                raise ValueError(f"QuantStack: part {i} has in_features {p.in_features}, "
                                 f"part 0 has {parts[0].in_features}")
        object.__setattr__(self, "parts", parts)
        object.__setattr__(self, "in_features", parts[0].in_features)
        object.__setattr__(self, "_n", sum(p.out_features for p in parts))
        object.__setattr__(self, "_segs", _segment_table([(p.data.data_ptr(), p._qid, p._n) for p in parts]))
        object.__setattr__(self, "_nseg", len(parts))

    def row_slice(self, start: int, stop: int) -> QuantWeight | QuantStack:
        """Rows [start, stop) of the stack as a weight of their own, on the same bytes (no copy)."""
        pieces, row = [], 0
        for p in self.parts:
            lo, hi = max(start, row), min(stop, row + p.out_features)
            if lo < hi:
                pieces.append(p.row_slice(lo - row, hi - row))
            row += p.out_features
        return pieces[0] if len(pieces) == 1 else QuantStack(tuple(pieces))

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [out_features, in_features]: the parts' dequantisations stacked (into `out`, float32 or bfloat16,
        when given)."""
        out = _dequantize_target(out, self._n, self.in_features)
        row = 0
        for p in self.parts:
            p.dequantize(out[row:row + p.out_features])
            row += p.out_features
        return out


def _dequantize_target(out: torch.Tensor | None, n: int, k: int) -> torch.Tensor:
    """`out`, checked to be what the dequantise kernels may write (float32 or bfloat16, contiguous, CPU, [n, k]), or a
    new float32 one."""
    if out is None:
        return torch.empty(n, k, dtype=torch.float32)
    if (out.dtype not in (torch.float32, torch.bfloat16) or not out.is_cpu or not out.is_contiguous()
            or tuple(out.shape) != (n, k)):
        raise ValueError(f"dequantize: out must be a contiguous float32 or bfloat16 CPU tensor [{n}, {k}], got "
                         f"{out.dtype} {list(out.shape)} on {out.device}")
    return out


QuantLinearWeight = Union[QuantWeight, QuantStack]

_F32 = torch.float32


def quant_linear(x: torch.Tensor, w: QuantLinearWeight, bias: torch.Tensor | None = None,
                 int8: bool = False) -> torch.Tensor:
    """x: float32 [..., in_features] -> float32 [..., out_features] = x @ dequant(w).T (+ bias).

    CPU only, no autograd; runs on torch.get_num_threads() OpenMP threads. Any number of leading dims. One token
    (decode) reads each weight block once; more tokens unpack each block once per pass of up to 8 tokens. Each
    token's output row is bit for bit what that token gets alone (whatever the other tokens and the thread count), so
    batched decode steps reproduce sequential ones. Called ~120 times per decoded token, so the checks here are kept
    to a few attribute reads.

    int8: the fast path. Each token's x is quantised per weight block (32 inputs, or 256 for q4_k/q6_k) to int8 with
    one fp32 scale d = max|x| / 127, and the products are integer: an input moves by at most d / 2, so an output by
    at most the sum of |w| d / 2 over its inputs (plus fp32 rounding).
    """
    k = w.in_features
    if x.dtype != _F32 or not x.is_cpu:
        raise ValueError(f"quant_linear: x must be a float32 CPU tensor, got {x.dtype} on {x.device}")
    if x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"quant_linear: x has shape {list(x.shape)}, weight has in_features {k}")
    if not x.is_contiguous():
        x = x.contiguous()
    n = w._n
    bias_ptr = 0
    if bias is not None:
        if bias.dtype != _F32 or not bias.is_cpu or bias.shape != (n,):
            raise ValueError(f"quant_linear: bias must be float32 [{n}] on the CPU, "
                             f"got {bias.dtype} {list(bias.shape)} on {bias.device}")
        bias = bias.contiguous()
        bias_ptr = bias.data_ptr()
    t = x.numel() // k
    y = torch.empty(t, n, dtype=_F32)
    if t:
        _C.quant_matmul(x.data_ptr(), t, k, w._segs.data_ptr(), w._nseg, bias_ptr, y.data_ptr(),
                        torch.get_num_threads(), int8)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], n)
