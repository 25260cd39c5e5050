"""Facts about the CPU that decide which code path is fast."""
from __future__ import annotations

import functools

import torch


@functools.cache
def native_bf16_matmul() -> bool:
    """Whether torch has a fast bf16 GEMM on this CPU: bf16 instructions (AVX512-BF16, or AMX tiles) under oneDNN.
    oneDNN also calls bf16 supported on any AVX-512 CPU, where it emulates the products at a third of fp32's speed (a
    Cascade Lake Xeon), so the instructions are asked of the CPU itself."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) and (_cpu_has("avx512_bf16") or _cpu_has("amx_tile"))


def _cpu_has(feature: str) -> bool:
    """torch.cpu._is_<feature>_supported(); False on a torch that cannot tell (the exact path is always safe)."""
    ask = getattr(torch.cpu, f"_is_{feature}_supported", None)
    return bool(ask and ask())
