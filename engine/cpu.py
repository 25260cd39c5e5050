"""Facts about the CPU that decide which code path is fast."""
from __future__ import annotations

import functools

import torch


@functools.cache
def native_bf16_matmul() -> bool:
    """Whether torch has a fast bf16 GEMM on this CPU: bf16 instructions (AVX512-BF16, or AMX tiles) under oneDNN.
    oneDNN also calls bf16 supported on any AVX-512 CPU, where it emulates the products in fp32 at a fraction of
    fp32's speed, so the instructions are asked of the CPU itself."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) and (
        torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
