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


@functools.cache
def int8_prompts_outrun_fp32() -> bool:
    """Whether many-token steps on the int8 kernels (256-bit integer dots) outrun torch's fp32 GEMM on this CPU. They
    do where the GEMM's FMAs are at most 256 bits a cycle, as on AMD's Zen 4, which splits 512-bit ones (qwen2.5-1.5b's
    K-quant prompts 1.37-1.55x the exact prefill), and not on Intel cores with AVX-512, whose full-width 512-bit FMA
    units double the GEMM's rate (a Cascade Lake Xeon: 0.60-0.76x). One CPU of each kind was measured."""
    return not (_cpu_has("avx512") and _cpu_vendor() == "GenuineIntel")


def _cpu_vendor() -> str:
    """The CPU's vendor_id from /proc/cpuinfo ("GenuineIntel", "AuthenticAMD"); "" where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _cpu_has(feature: str) -> bool:
    """torch.cpu._is_<feature>_supported(); False on a torch that cannot tell (the exact path is always safe)."""
    ask = getattr(torch.cpu, f"_is_{feature}_supported", None)
    return bool(ask and ask())
