"""Shared test helpers for kernel numerics: seeded generators and flash-attention-style error bounds, and the
head/layer-averaged attention matrix of an HF model (eager attention) used as the node-mass oracle."""
from __future__ import annotations

import torch


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def assert_close(got: torch.Tensor, ref: torch.Tensor, torch_f32: torch.Tensor, factor: float = 4.0) -> None:
    """max |got - ref| within `factor` x max |torch_f32 - ref| (ref in float64), or a 1-ulp floor where torch is
    exact."""
    assert got.shape == ref.shape and got.dtype == torch.float32
    torch_err = (torch_f32.double() - ref).abs().max().item()
    floor = 2.0 ** -24 * ref.abs().max().item()
    err = (got.double() - ref).abs().max().item()
    assert err <= factor * max(torch_err, floor), f"max |err| {err:.3g} vs torch fp32 {torch_err:.3g}"


def hf_attention(hf, ids) -> torch.Tensor:
    """Softmax matrices of every layer and head from HF's eager attention, averaged: [T, T] float64."""
    hf.config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            att = hf(torch.tensor([list(ids)]), output_attentions=True).attentions
    finally:
        hf.config._attn_implementation = "sdpa"
    total = torch.zeros(att[0].shape[-1], att[0].shape[-1], dtype=torch.float64)
    for a in att:
        total += a[0].double().sum(0)
    return total / (len(att) * att[0].shape[1])
