"""A contiguous, growable KV cache: the simple cache behind `Session` until the paged node cache replaces it.

Layout [layers, kv_heads, capacity, head_dim] so a layer's keys for the first n positions are one strided view.
Attention is grouped-query without materialising repeated K/V: for a single query token the G query heads that
share a KV head are laid out as G query rows of that head, which needs no mask; longer chunks use SDPA's GQA.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .cpu import native_bf16_matmul
from .errors import ContextOverflowError


class ContiguousKVCache:
    """Keys and values of one token sequence, grown by doubling up to the model's context window."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, capacity: int = 256):
        self.config, self.dtype = config, dtype
        # bf16 bmm without native bf16 units is ~10x slower than upcasting the operands
        self.compute_dtype = dtype if dtype == torch.float32 or native_bf16_matmul() else torch.float32
        self.length = 0
        self._k = self._v = torch.empty(config.n_layers, config.n_kv_heads, 0, config.head_dim, dtype=dtype)
        self._reserve(min(capacity, config.max_seq_len))

    def _reserve(self, needed: int) -> None:
        cap = self._k.shape[2]
        if needed <= cap:
            return
        new_cap = min(max(needed, 2 * cap), self.config.max_seq_len)
        shape = (self.config.n_layers, self.config.n_kv_heads, new_cap, self.config.head_dim)
        k, v = torch.empty(shape, dtype=self.dtype), torch.empty(shape, dtype=self.dtype)
        k[:, :, : self.length] = self._k[:, :, : self.length]
        v[:, :, : self.length] = self._v[:, :, : self.length]
        self._k, self._v = k, v

    def begin(self, n_tokens: int) -> int:
        end = self.length + n_tokens
        if end > self.config.max_seq_len:
            raise ContextOverflowError(
                f"{end} tokens exceed the model's context window of {self.config.max_seq_len} "
                f"({self.length} cached + {n_tokens} new)"
            )
        self._reserve(end)
        return self.length

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store k, v ([T, kv_heads, hd]) after the cached tokens; causal attention over everything cached for
        q ([n, heads, hd]), the queries of the last n <= T new positions. Returns [n, heads * hd]."""
        T = k.shape[0]
        n, H, hd = q.shape
        start, end = self.length, self.length + T
        self._k[layer, :, start:end] = k.transpose(0, 1)
        self._v[layer, :, start:end] = v.transpose(0, 1)
        keys, values = self._k[layer, :, :end], self._v[layer, :, :end]
        hkv = keys.shape[0]
        if n == 0:
            return q.new_empty(0, H * hd)
        if n == 1:  # the last position sees every key: plain matmuls, no mask, no SDPA call overhead
            cd = self.compute_dtype
            qg = q.view(hkv, H // hkv, hd).to(cd)
            scores = torch.softmax((qg @ keys.to(cd).transpose(1, 2)) * hd ** -0.5, dim=-1)
            return (scores @ values.to(cd)).to(q.dtype).view(1, H * hd)
        # 4-D inputs: with 3-D ones torch falls back to its (T×T-materialising) math kernel
        qh, keys, values = q.transpose(0, 1)[None], keys[None], values[None]
        if start == 0 and n == T:
            out = F.scaled_dot_product_attention(qh, keys, values, is_causal=True, enable_gqa=True)
        else:
            rows = torch.arange(end - n, end)[:, None]
            mask = torch.arange(end)[None, :] <= rows
            out = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, enable_gqa=True)
        return out[0].transpose(0, 1).reshape(n, H * hd)

    def commit(self, n_tokens: int) -> None:
        self.length += n_tokens

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on (the stale K/V are overwritten by the next append)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        self.length = length
