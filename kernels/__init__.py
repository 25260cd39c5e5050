"""Kernels of the forward, in interchangeable backends with one interface: `rms_norm`, `add_rms_norm_`, `rope`,
`silu_mul` and `paged_attention` (with node-mass output). `reference` (torch) is the oracle and the fallback."""
from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

BACKENDS = ("auto", "torch", "cpu", "triton")


def backend_ops(backend: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> ModuleType:
    """The ops module of a backend: "torch" (reference, any device), "cpu" (C++, fp32 CPU tensors only), "triton"
    (the GPU kernels, or Triton's interpreter on CPU tensors with TRITON_INTERPRET=1), "auto" (triton on CUDA; on
    the CPU, cpu for fp32, else torch)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    on_cuda = torch.device(device).type == "cuda"
    if backend == "auto":
        backend = "triton" if on_cuda else "cpu" if dtype == torch.float32 else "torch"
    if backend == "cpu" and (dtype != torch.float32 or on_cuda):
        raise ValueError(f"the cpu backend runs float32 CPU tensors only, got {dtype} on {device}; use "
                         f"backend='auto'")
    if backend == "triton" and not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the triton backend runs on CUDA, or on the CPU under Triton's interpreter "
                         "(TRITON_INTERPRET=1); use backend='auto'")
    module = {"torch": "reference", "cpu": "cpu_ops", "triton": "triton_ops"}[backend]
    return importlib.import_module(f"{__name__}.{module}")
