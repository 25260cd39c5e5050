"""Nodes prefilled once and placed at any position: a node's keys and values computed from an empty cache, kept with
the keys un-rotated, and written into a session's cache at its current position with the engine's own RoPE.

Prefix caching reuses KV only where the reused text is the prompt's prefix. A retrieved node arrives at a different
offset for every question; RoPE makes its keys depend on that offset, and only there: a key at position p is R(p) k
for the un-rotated k that the layer computed. So a stored node keeps k (and v, which has no position), and placing it
at p rotates k by the same tables a prefill at p uses. What placing cannot reproduce is context: the stored node's
tokens attended to nothing before it, where a prefill at p would have attended to everything cached there (the
repair that recomputes some tokens, CacheBlend's, is the next step).

`Engine.store_node` prefills the node at positions 0..n-1 and reads its keys back from the cache, un-rotated in
float64 (exact up to the fp32 tables' own rounding: cos² + sin² = 1 within ~1e-7); `Engine.place_stored` and
`Session.append_stored` put it anywhere.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class StoredNode:
    """A node's tokens, its un-rotated keys and its values, from a prefill with no context before it."""

    tokens: tuple[int, ...]
    k: torch.Tensor  # [layers, tokens, kv_heads, head_dim], before RoPE
    v: torch.Tensor  # [layers, tokens, kv_heads, head_dim]

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


def check_fits(node: StoredNode, config) -> None:
    """ValueError unless `node` was stored by a model of `config`'s attention shape."""
    want = (config.n_layers, len(node), config.n_kv_heads, config.head_dim)
    if tuple(node.k.shape) != want or tuple(node.v.shape) != want:
        raise ValueError(f"stored node of K {list(node.k.shape)} and V {list(node.v.shape)} does not fit this model: "
                         f"it needs [layers, tokens, kv_heads, head_dim] = {list(want)}")


def unrotate(k: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Keys [layers, n, kv_heads, hd] as rope left them at the positions of cos, sin_signed [n, hd], turned back, in
    float64: rope's x cos + roll(x) sin_signed inverted as y cos - roll(y) sin_signed."""
    k, cos, sin_signed = k.double(), cos.double()[:, None, :], sin_signed.double()[:, None, :]
    return k * cos - k.roll(k.shape[-1] // 2, -1) * sin_signed
