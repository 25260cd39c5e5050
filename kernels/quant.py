"""Linear layers on GGUF block-quantised weights with fp32 activations (C++ kernels in csrc/quant_matmul.cpp).

A weight [out_features, in_features] stays in its ggml block format, one row of blocks per output feature;
each block covers 32 consecutive inputs:

    q4_0  18 B: fp16 d, 16 B of nibbles        w = d * (q - 8)
    q4_1  20 B: fp16 d, fp16 m, 16 B nibbles   w = d * q + m
    q8_0  34 B: fp16 d, 32 x int8              w = d * q

In the nibble formats byte j of a block holds element j (low nibble) and element j + 16 (high nibble).
Activations are never quantised: `quant_linear(x, w)` equals `x @ w.dequantize().T` up to fp32 rounding, while
reading only the quantised bytes (about 1/6 of fp32 for q4_1); dense fp32 decode is bound by those bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nodekv import _C

# ggml type ids (gguf.GGMLQuantizationType values)
QTYPES: dict[str, int] = {"q4_0": 2, "q4_1": 3, "q8_0": 8}
BLOCK_SIZE = 32
BLOCK_BYTES: dict[str, int] = {"q4_0": 18, "q4_1": 20, "q8_0": 34}


@dataclass(frozen=True, eq=False)
class QuantWeight:
    """A linear weight [out_features, in_features] kept in its GGUF block format (raw bytes, one row per output
    feature).

    `data` is uint8 [out_features, in_features / 32 * block_bytes(qtype)], made contiguous on construction;
    in_features must be a positive multiple of 32. Frozen, because the kernels trust the checks made here.
    Inference only: no autograd.
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
        k = int(self.in_features)
        if k <= 0 or k % BLOCK_SIZE:
            raise ValueError(f"QuantWeight: in_features must be a positive multiple of {BLOCK_SIZE}, got {k}")
        row_bytes = k // BLOCK_SIZE * BLOCK_BYTES[self.qtype]
        if data.shape[1] != row_bytes:
            raise ValueError(f"QuantWeight: {self.qtype} rows of {k} inputs take {row_bytes} bytes, "
                             f"but data has {data.shape[1]} bytes per row")
        object.__setattr__(self, "data", data.contiguous())
        object.__setattr__(self, "in_features", k)
        # plain attributes for the per-call fast path
        object.__setattr__(self, "_n", data.shape[0])
        object.__setattr__(self, "_qid", QTYPES[self.qtype])

    @property
    def out_features(self) -> int:
        return self._n

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features), like the dense weight's."""
        return self._n, self.in_features

    def dequantize(self) -> torch.Tensor:
        """float32 [out_features, in_features], bit-identical to gguf.quants.dequantize of the same bytes."""
        out = torch.empty(self._n, self.in_features, dtype=torch.float32)
        _C.quant_dequantize(self.data.data_ptr(), self._n, self.in_features, self._qid, out.data_ptr(),
                            torch.get_num_threads())
        return out

    @staticmethod
    def cat(parts: list[QuantWeight]) -> QuantWeight:
        """Stack along out_features (fuses q/k/v or gate/up into one matmul); same qtype and in_features needed."""
        if not parts:
            raise ValueError("QuantWeight.cat: no parts given")
        first = parts[0]
        for i, p in enumerate(parts[1:], 1):
            if p.qtype != first.qtype:
                raise ValueError(f"QuantWeight.cat: part {i} is {p.qtype}, part 0 is {first.qtype}")
            if p.in_features != first.in_features:
                raise ValueError(f"QuantWeight.cat: part {i} has in_features {p.in_features}, "
                                 f"part 0 has {first.in_features}")
        return QuantWeight(torch.cat([p.data for p in parts]), first.qtype, first.in_features)


_F32 = torch.float32


def quant_linear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: float32 [..., in_features] -> float32 [..., out_features] = x @ dequant(w).T (+ bias).

    CPU only, no autograd; runs on torch.get_num_threads() OpenMP threads. Any number of leading dims. One token
    (decode) reads each weight block once; more tokens decode each weight row once per chunk of tokens.
    Called ~120 times per decoded token, so the checks here are kept to a few attribute reads.
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
        _C.quant_matmul(x.data_ptr(), t, k, w.data.data_ptr(), n, w._qid, bias_ptr, y.data_ptr(),
                        torch.get_num_threads())
    return y if x.dim() == 2 else y.view(*x.shape[:-1], n)
