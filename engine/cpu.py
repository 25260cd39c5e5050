"""Facts about the CPU that decide which code path is fast."""
from __future__ import annotations

import functools

import torch


@functools.cache
def native_bf16_matmul() -> bool:
    """Whether torch has a fast bf16 GEMM on this CPU (AVX512-BF16 / AMX through oneDNN)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
