"""A contiguous, growable KV cache: the simple cache behind `Session` until the paged node cache replaces it.

Layout [layers, kv_heads, capacity, head_dim] so a layer's keys for the first n positions are one strided view.
Attention is grouped-query without materialising repeated K/V. fp32: C++ kernels, one for few queries (decode,
probes, the last layer's single row) and a flash-style tiled one for prefill chunks up to 4K keys (1.4-2x torch's
SDPA at 512-2K tokens); longer prefills and other dtypes: SDPA with GQA.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import cpu_ops
from .config import ModelConfig
from .errors import ContextOverflowError

# Up to this many queries the C++ attention (no per-call setup, k/v written in the same call) beats SDPA.
FEW_QUERIES = 16
# Up to this many keys the C++ prefill attention beats SDPA (1.3-2x at 512-2K); at 8K it measured 0.7-1.1x.
CPU_PREFILL_MAX_KEYS = 4096


class ContiguousKVCache:
    """Keys and values of one token sequence, grown by doubling up to the model's context window."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, capacity: int = 256, cpu_kernels: bool = True):
        """cpu_kernels: attend with the C++ kernels (fp32 only; False or another dtype: torch's SDPA)."""
        self.config, self.dtype = config, dtype
        self.cpu_kernels = cpu_kernels and dtype == torch.float32
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
        if n == T and n <= FEW_QUERIES and self.cpu_kernels:  # one C++ call that also writes k/v
            return cpu_ops.decode_attention(q, self._k, self._v, layer, start, k, v)
        self._k[layer, :, start:end] = k.transpose(0, 1)
        self._v[layer, :, start:end] = v.transpose(0, 1)
        if n == 0:
            return q.new_empty(0, H * hd)
        if self.cpu_kernels and n <= FEW_QUERIES:
            return cpu_ops.decode_attention(q, self._k, self._v, layer, end - n)
        if self.cpu_kernels and end <= CPU_PREFILL_MAX_KEYS:
            return cpu_ops.prefill_attention(q, self._k, self._v, layer, end - n)
        # 4-D inputs: with 3-D ones torch falls back to its (T×T-materialising) math kernel
        qh = q.transpose(0, 1)[None]
        keys, values = self._k[layer, :, :end][None], self._v[layer, :, :end][None]
        mask = None
        if n > 1 and not (start == 0 and n == T):
            mask = torch.arange(end)[None, :] <= torch.arange(end - n, end)[:, None]
        out = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, is_causal=mask is None and n > 1,
                                             enable_gqa=True)
        return out[0].transpose(0, 1).reshape(n, H * hd)

    def commit(self, n_tokens: int) -> None:
        self.length += n_tokens

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on (the stale K/V are overwritten by the next append)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        self.length = length
