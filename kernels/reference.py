"""Torch reference of the forward's elementwise ops: the path for many-token steps and any dtype, and the math the
few-token C++ kernels (`cpu_ops`) reproduce. Each function returns its result; it may reuse its input's storage."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, d] -> x / sqrt(mean(x², -1) + eps) * weight."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rope(qk: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on qk [T, heads, hd] with cos, sin_signed [T, hd] (sin_signed = [-sin, sin]):
    qk * cos + rotate_half(qk) * sin, where rotate_half(x) * sin == roll(x, hd/2) * sin_signed."""
    cos, sin_signed = cos[:, None, :], sin_signed[:, None, :]
    return qk * cos + qk.roll(qk.shape[-1] // 2, -1) * sin_signed


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate | up) -> silu(gate) * up [T, I], computed in gate_up's storage."""
    gate, up = gate_up.chunk(2, -1)
    return F.silu(gate, inplace=True).mul_(up)


def add_rms_norm_(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The residual add fused with the norm after it: x += delta in place, then rms_norm(x, weight, eps)."""
    x += delta
    return rms_norm(x, weight, eps)
