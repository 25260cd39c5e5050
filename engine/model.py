"""The hand-written Llama forward pass (RMSNorm, RoPE, GQA attention, SwiGLU), over any KV cache with `attend`.

Weights are fused where that saves calls on the decode hot path: Q|K|V into one matrix, gate|up into one. With the
cpu backend and GGUF-quantised projections a decode step (one new token, of one sequence or each of a batch) goes
further: one C++ call runs every layer (`cpu_ops.Decoder`, the same kernels in the same order as the op-by-op forward,
so the same numbers).

Device: on the CPU, GGUF projections run from their quantised blocks (C++ kernels); on CUDA every weight is
dequantised once into a dense tensor on the GPU (cuBLAS matmuls), the kernels are the Triton backend, and the page
pool, RoPE tables and activations live there too; logits come back as the same float32 tensors either way.

bf16 models: weights, matmul inputs and outputs, and the KV cache are bf16; the residual stream, the norms and the
logits stay fp32 (cheap, and it keeps top-1 agreement with fp32 above HF's all-bf16 forward). On CPUs without native
bf16 matrix units (torch's bf16 GEMM there is 3x (AVX-512) to ~100x (AVX2) slower than fp32) the dense weights are
stored as bf16-rounded fp32 and each matmul runs in fp32 with its output rounded to bf16: the arithmetic of a bf16
GEMM with fp32 accumulation, at fp32 speed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Protocol, Union

import torch
import torch.nn.functional as F

from ..kernels import backend_ops, reference
from ..kernels.quant import QuantLinearWeight, QuantStack, QuantWeight, quant_linear
from .config import ModelConfig
from .cpu import int8_prompts_outrun_fp32, native_bf16_matmul
from .errors import ModelLoadError, PoolExhaustedError
from .cache_batch import CacheBatch
from .decode_graphs import DecodeGraphs
from .kv_cache import PagedKVCache
from .page_pool import PagePool

# Up to this many tokens per forward the quantised kernel beats the dense GEMM (qwen2.5-0.5b's matmuls at 2 threads:
# 308 against 443 ms at 32 tokens; dense catches up between 64 and 128), and it computes each row bit-identically
# whatever the token count, so a batched decode step of up to 32 sessions gives the numbers of sequential ones.
QUANT_MAX_TOKENS = 32
GATED_ROWS, GATED_COLS = 512, 2048  # a many-token step's gate|up product in tiles (Linear.gated)
# Types whose int8 kernels outrun the fp32 GEMM on many-token steps too: their sub-block scales are integers, applied
# once a super-block before one conversion. The 32-element types convert every block and lose there (qwen2.5-0.5b's
# Q5_0/Q8_0 projections: int8 prefill 0.84-0.94x the exact path's; qwen2.5-1.5b's K-quants 1.24-1.62x; bench
# engine_speed), so their many-token steps stay on the fp32 GEMM, as every type's do on CPUs where that GEMM has
# full-width 512-bit FMA units (int8_prompts_outrun_fp32).
INT8_PROMPT_QTYPES = frozenset({"q4_k", "q6_k"})
# Llama(precision=...): fp32 activations throughout; int8 ones in the quantised projections; or bf16 GEMMs for the
# quantised projections' many-token steps (prompts) on CPUs with bf16 matrix units, every other step exact
PRECISIONS = ("exact", "int8", "bf16")


def check_precision(precision: str, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse a precision this model and device cannot run, in one line, before any weight loads."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision != "exact" and (dtype != torch.float32 or device.type != "cpu"):
        raise ValueError(f"precision {precision!r} runs float32 models on the CPU only")
    if precision == "bf16" and not native_bf16_matmul():
        raise ValueError("precision 'bf16' needs a CPU with bf16 matrix units (AMX or AVX512-BF16): this one has "
                         "none, and its bf16 GEMM is 3x (AVX-512) to ~100x (AVX2) slower than the exact path's fp32 one")


class KVCache(Protocol):
    """What the forward needs from a cache: room for T tokens, store-and-attend per layer, then commit."""

    length: int  # tokens cached
    released: bool  # the cache gave its storage back and cannot be used
    collecting: bool  # attention mass is being collected: every new position must attend, in every layer

    def begin(self, n_tokens: int) -> int: ...  # reserve room; returns the absolute position of the first token

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...

    def commit(self, n_tokens: int) -> None: ...

    def truncate(self, length: int) -> None: ...  # forget positions from `length` on


class DequantScratch:
    """One buffer that many-token steps decode a quantised weight into, one linear at a time, so that a GGUF model
    keeps no dense copy: resident memory is the file's blocks plus the largest layer. Each weight serves one GEMM per
    forward, so decoding it costs O(weights) beside the GEMM's O(tokens × weights). float32: the GEMM sees the same
    values as from a dense copy (the dequantisation is bit-exact), so the numbers are the dense path's. bfloat16
    (precision "bf16"): the values rounded to nearest even as they are decoded, for a bf16 GEMM."""

    def __init__(self, dtype: torch.dtype = torch.float32):
        self.buffer = torch.empty(0, dtype=dtype)

    def weight(self, quant: QuantLinearWeight, row_ranges: list[tuple[int, int]] | None = None) -> torch.Tensor:
        """[rows, in] in the scratch's dtype: `quant` (or its rows in `row_ranges`, stacked in order) decoded into the
        buffer (valid until the next call)."""
        parts = [quant] if row_ranges is None else [quant.row_slice(a, b) for a, b in row_ranges]
        rows, k = sum(p.out_features for p in parts), quant.in_features
        if self.buffer.numel() < rows * k:
            self.buffer = torch.empty(rows * k, dtype=self.buffer.dtype)
        out = self.buffer[:rows * k].view(rows, k)
        row = 0
        for p in parts:
            p.dequantize(out[row:row + p.out_features])
            row += p.out_features
        return out


@dataclass
class Linear:
    """A linear layer: for GGUF models the quantised blocks (one type, or row segments of several), run directly for
    few-token steps and, for many-token steps, either decoded into a shared `scratch` per call or taken from a `dense`
    copy [out, in] (in the dtype its matmul runs in; the older, memory-hungry path); without either every step runs
    on the blocks. Non-quantised weights have only `dense`. int8: the steps on the blocks take `quant_linear`'s int8
    fast path, and so do many-token steps of K-quant weights (INT8_PROMPT_QTYPES) where it outruns the fp32 GEMM
    (int8_prompts_outrun_fp32)."""

    dense: torch.Tensor | None
    quant: QuantLinearWeight | None = None
    bias: torch.Tensor | None = None
    scratch: DequantScratch | None = None
    int8: bool = False

    def __post_init__(self) -> None:
        parts = () if self.quant is None else getattr(self.quant, "parts", (self.quant,))
        self._int8_prompt_types = int8_prompts_outrun_fp32() and all(p.qtype in INT8_PROMPT_QTYPES for p in parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        quant = self.quant
        if self._on_blocks(x.shape[0]):
            if x.dtype is torch.float32:  # the decode hot path: no conversions, not even no-op ones (~2 µs each)
                return quant_linear(x, quant, self.bias, self.int8)
            bias = None if self.bias is None else self.bias.float()
            return quant_linear(x.float(), quant, bias, self.int8).to(x.dtype)
        return self._product(x, self._weight(), self.bias)

    def gated(self, x: torch.Tensor, act) -> torch.Tensor:
        """act(self(x)) for an activation that halves the width (SwiGLU's silu(gate) * up over a gate|up product).
        A many-token step computes it in tiles of GATED_ROWS rows, so the [T, 2I] product never exists whole (at 2K
        tokens of Qwen2.5-1.5B it would take 147 MB beside the 73 MB result; on the int8 blocks, a 2K-token prefill
        ran 1.1x slower with it whole); on the scratch, the tiles are also GATED_COLS outputs wide, and each column
        block's gate and up rows are decoded once for all row tiles (the scratch then holds 2 x GATED_COLS rows, not
        the 2I of the whole weight: 25 MB, not 110)."""
        T = x.shape[0]
        on_blocks = self._on_blocks(T)
        if T <= GATED_ROWS and (on_blocks or self.dense is not None):
            return act(self(x))
        if on_blocks:  # in row tiles, each on the blocks (as whole rows: their products equal a single step's)
            return torch.cat([act(self(x[i:i + GATED_ROWS])) for i in range(0, T, GATED_ROWS)])
        width = self._rows() // 2
        blocks = [(0, width)] if self.dense is not None else \
            [(a, min(a + GATED_COLS, width)) for a in range(0, width, GATED_COLS)]
        out = None
        for a, b in blocks:
            ranges = [(a, b), (width + a, width + b)]
            weight = self.dense if self.dense is not None else self.scratch.weight(self.quant, ranges)
            bias = None if self.bias is None else torch.cat([self.bias[r0:r1] for r0, r1 in ranges])
            for i in range(0, T, GATED_ROWS):
                y = act(self._product(x[i:i + GATED_ROWS], weight, bias))
                if out is None:
                    out = torch.empty(T, width, dtype=y.dtype, device=y.device)
                out[i:i + y.shape[0], a:b] = y
        return out

    def _on_blocks(self, n_tokens: int) -> bool:
        """Whether a step of n_tokens runs on the quantised blocks (else on the dense copy or the scratch)."""
        return self.quant is not None and (n_tokens <= QUANT_MAX_TOKENS or (self.int8 and self._int8_prompt_types)
                                           or (self.dense is None and self.scratch is None))

    def _rows(self) -> int:
        return self.dense.shape[0] if self.dense is not None else self.quant.out_features

    def _weight(self) -> torch.Tensor:
        return self.dense if self.dense is not None else self.scratch.weight(self.quant)

    @staticmethod
    def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight.T + bias in the weight's dtype, returned in x's. A bias kept in fp32 for the steps on the blocks
        (precision "bf16") is rounded for the bf16 product: its output is rounded to bf16 anyway."""
        if x.dtype != weight.dtype:
            bias = None if bias is None else bias.to(weight.dtype)
            return F.linear(x.to(weight.dtype), weight, bias).to(x.dtype)
        return F.linear(x, weight, bias)


@dataclass
class Layer:
    """One decoder block's weights."""

    attn_norm: torch.Tensor
    wqkv: Linear
    wo: Linear
    ffn_norm: torch.Tensor
    w13: Linear
    w2: Linear


class Llama:
    """A Llama-family decoder with fused weights; `forward` runs new tokens through a KV cache."""

    def __init__(self, config: ModelConfig, tensors: Mapping[str, Union[torch.Tensor, QuantWeight]],
                 dtype: torch.dtype = torch.float32, backend: str = "auto", dense_copy: bool = False,
                 precision: str = "exact", device: torch.device | str = "cpu"):
        """backend: the kernels' backend (see `nodekv.kernels.backend_ops`). dense_copy: keep a dense fp32 copy of
        every quantised projection for many-token steps (the older path: ~4-7x the file's size in memory) instead
        of decoding each into a shared scratch buffer per step (`DequantScratch`); bf16 models always keep one.
        precision (float32 models on the CPU; `check_precision`): "exact" (fp32 activations), "int8" or "bf16".
        int8: steps of up to QUANT_MAX_TOKENS tokens (decode, probes, short appends), the lm_head, and longer steps
        of the K-quant projections (INT8_PROMPT_QTYPES) multiply int8-quantised activations (`quant_linear`'s fast
        path); longer steps of other types, and of every type on a CPU whose fp32 GEMM outruns the int8 kernels
        (`int8_prompts_outrun_fp32`), stay on the fp32 GEMM. bf16: the longer steps of every quantised projection
        multiply in bf16 (inputs, decoded weights and outputs rounded to bf16, fp32 accumulation) on the CPU's bf16
        matrix units, ~4x the fp32 GEMM's speed on AMX, and attend in bf16 unless node mass is collected; every
        other step, the lm_head, the norms, the residual stream and the KV cache stay exact. Either needs quantised
        projections (a ValueError without any). device: where weights, activations and the RoPE tables live ("cpu",
        or a CUDA device: every weight dense on it, the quantised blocks decoded once at load)."""
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype must be float32 or bfloat16, got {dtype}")
        self.device = torch.device(device)
        check_precision(precision, dtype, self.device)
        on_cuda = self.device.type == "cuda"
        self.precision = precision
        self.config = config
        self.dtype = dtype
        # fp32 on CPU: one C++ call and one pass per op (torch's RMSNorm is 6 ops, RoPE 4): decode steps are bound
        # by per-op overhead, and a 512-token prefill runs ~10% faster; other dtypes take the torch reference
        self.ops = backend_ops(backend, dtype, self.device)
        matmul_dtype = dtype if dtype == torch.float32 or on_cuda or native_bf16_matmul() else torch.float32
        # the dtype of the quantised projections' many-token GEMMs, on their scratch or dense copies
        prompt_dtype = torch.bfloat16 if precision == "bf16" else matmul_dtype
        # the scratch decodes fp32 values only: bf16 models round their dense weights to bf16 once, at load
        scratch = None if dense_copy or dtype != torch.float32 or on_cuda else DequantScratch(prompt_dtype)
        weights = _WeightReader(tensors, dtype, matmul_dtype, scratch, int8=precision == "int8", device=self.device,
                                prompt_dtype=prompt_dtype)

        head = "embed" if config.tie_embeddings else "lm_head"
        # Logits leave the bf16 lm_head unrounded (bf16 inputs, fp32 accumulation and output): rounded to bf16's 8
        # mantissa bits they would tie and flip the argmax that greedy decoding and Yes/No probes read.
        # A quantised lm_head keeps no dense copy: on its blocks it runs as fast as the fp32 GEMM from 1 to 512 tokens
        # (Qwen2.5-0.5B's [151936, 896] Q8_0 on one core: 0.30 vs 0.39 s at 64 tokens, 2.2 vs 2.2-2.5 s at 512),
        # and the copy would take 545 MB. On CUDA it is a dense fp32 copy of the bf16-rounded weights: exact logits, at
        # a price to measure there (qwen2.5-1.5b's 151936 x 1536 head is then 0.93 GB, a quarter of a decode step's
        # weight reads; a bf16 product with fp32 output would halve that).
        self.lm_head = weights.linear([head], config.dim, out_sizes=[config.vocab_size], matmul_dtype=torch.float32,
                                      dense=False)
        # The embedding only serves row lookups: a quantised table stays in its blocks, rows decoded as looked up.
        embed_shape = (config.vocab_size, config.dim)
        self.embed: torch.Tensor | QuantWeight = weights.get("embed", embed_shape)
        if not (weights.blocks and isinstance(self.embed, QuantWeight)):
            tied = config.tie_embeddings and self.lm_head.dense.dtype == dtype
            self.embed = self.lm_head.dense if tied else weights.dense("embed", embed_shape)
        self.norm = weights.dense("norm", (config.dim,)).float()
        self.layers = [self._layer(weights, f"layers.{i}.") for i in range(config.n_layers)]
        if precision != "exact" and all(lin.quant is None for l in self.layers for lin in (l.wqkv, l.wo, l.w13, l.w2)):
            raise ValueError(f"precision {precision!r} runs quantised projections, and this model has none")
        inv_freq = rope_inv_freq(config)
        if "rope_freqs" in tensors:
            inv_freq = inv_freq / weights.get("rope_freqs", (config.head_dim // 2,))
        self.inv_freq = inv_freq.to(self.device)
        self._cos = self._sin = torch.empty(0, device=self.device)
        # Decode steps (one token per sequence) as one C++ call through all layers on the CPU, or one CUDA graph
        # replay on a GPU (`_decode_step`) where that applies; False runs them op by op like longer steps (a switch
        # for tests and benchmarks; the C++ step gives the same numbers, a graph's attention splits keys its own way).
        self.fused_decode = True
        self._decoder: object = None  # cpu_ops.Decoder or DecodeGraphs, built on the first decode step; False: neither

    def _layer(self, w: _WeightReader, p: str) -> Layer:
        c = self.config
        bias = [p + "bq", p + "bk", p + "bv"] if c.qkv_bias else None
        return Layer(
            attn_norm=w.dense(p + "attn_norm", (c.dim,)).float(),
            wqkv=w.linear([p + "wq", p + "wk", p + "wv"], c.dim, bias,
                          out_sizes=[c.q_dim, c.kv_dim, c.kv_dim]),
            wo=w.linear([p + "wo"], c.q_dim, out_sizes=[c.dim]),
            ffn_norm=w.dense(p + "ffn_norm", (c.dim,)).float(),
            w13=w.linear([p + "w1", p + "w3"], c.dim, out_sizes=[c.intermediate_size] * 2),
            w2=w.linear([p + "w2"], c.intermediate_size, out_sizes=[c.dim]),
        )

    def rope(self, positions: torch.Tensor | slice) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin at `positions` (int64 [n], or a slice of consecutive ones), each [n, head_dim] in
        the model dtype."""
        end = positions.stop if isinstance(positions, slice) else int(positions.max()) + 1
        if end > self._cos.shape[0]:
            size = min(max(end, 2 * self._cos.shape[0], 256), max(end, self.config.max_seq_len))
            freqs = torch.arange(size, dtype=torch.float32, device=self.device)[:, None] * self.inv_freq[None, :]
            # rotate_half(x) * sin == roll(x, half) * [-sin, sin]: one roll instead of two slices, a neg and a cat
            self._cos = torch.cat([freqs.cos(), freqs.cos()], -1).to(self.dtype)
            self._sin = torch.cat([-freqs.sin(), freqs.sin()], -1).to(self.dtype)
        return self._cos[positions], self._sin[positions]

    def forward(self, tokens: torch.Tensor, cache: KVCache, logits: str | None = "last") -> torch.Tensor | None:
        """Run `tokens` ([T] int64) after what `cache` holds; logits ("last", "all" or None) as float32 [n, vocab].

        The final layer runs attention and MLP only for the positions whose logits are taken (none for None, one
        for "last"): its other outputs feed nothing, while its K/V, which later tokens need, are still cached.
        While the cache collects attention mass, the final layer's attention runs for every position.
        One token on the cpu backend with quantised projections runs fused (`_decode_step`), with the same results."""
        _check_logits(logits)
        if self.fused_decode and tokens.shape[0] == 1:
            out = self._decode_step(tokens, CacheBatch([cache], [1]), logits)
            if out is not _UNFUSED:
                return out
        T = tokens.shape[0]
        start = cache.begin(T)
        keep = {"last": 1, "all": T, None: 0}[logits]
        rows = None if keep == T else slice(T - keep, T)
        return self._forward_rows(tokens, self.rope(slice(start, start + T)), cache, rows, logits is not None)

    def forward_batch(self, tokens: torch.Tensor, batch: CacheBatch,
                      logits: str | None = "last") -> torch.Tensor | None:
        """`forward` of several sequences at once: `tokens` holds batch.counts[i] new tokens of sequence i in turn.
        Logits: "last" gives one row per sequence, "all" every row, None none. One token per sequence runs fused
        where `forward`'s one token would (`_decode_step`), with the same results."""
        _check_logits(logits)
        if self.fused_decode and all(n == 1 for n in batch.counts):
            out = self._decode_step(tokens, batch, logits)
            if out is not _UNFUSED:
                return out
        positions = batch.begin()
        rows = batch.keep_rows({"last": 1, "all": None, None: 0}[logits])
        if rows.shape[0] == tokens.shape[0]:
            rows = None
        return self._forward_rows(tokens, self.rope(positions), batch, rows, logits is not None)

    def _forward_rows(self, tokens: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache | CacheBatch,
                      rows: torch.Tensor | slice | None, want_logits: bool) -> torch.Tensor | None:
        """The layers over `tokens` at the positions `rope` was taken for (the cache has made room for them);
        the final layer runs only `rows` (None: all of them), whose logits come back if `want_logits`."""
        c = self.config
        T = tokens.shape[0]
        dt = self.dtype
        ops = self.ops
        cast = _identity if dt == torch.float32 else lambda t: t.to(dt)
        cos, sin = rope
        n_qk = c.n_heads + c.n_kv_heads
        # precision "bf16": a prompt attends in bf16 too (torch's SDPA on the bf16 units; the cache keeps fp32 K/V),
        # unless node mass is collected, which the fp32 kernels do in one pass
        half_attention = self.precision == "bf16" and T > QUANT_MAX_TOKENS and not cache.collecting
        x = self._embed_rows(tokens)
        h = ops.rms_norm(x, self.layers[0].attn_norm, c.norm_eps)
        for i, layer in enumerate(self.layers):
            qkv = layer.wqkv(cast(h))
            qk = ops.rope(qkv[:, : n_qk * c.head_dim].view(T, n_qk, c.head_dim), cos, sin)
            q, k = qk.split([c.n_heads, c.n_kv_heads], 1)
            v = qkv[:, n_qk * c.head_dim:].view(T, c.n_kv_heads, c.head_dim)
            prune = i == c.n_layers - 1 and rows is not None
            if prune and not cache.collecting:
                q, x = q[rows], x[rows]
            attn = cache.attend(i, q.to(torch.bfloat16), k, v).float() if half_attention else cache.attend(i, q, k, v)
            if prune and cache.collecting:
                attn, x = attn[rows], x[rows]
            h = ops.add_rms_norm_(x, layer.wo(attn), layer.ffn_norm, c.norm_eps)
            next_norm = self.layers[i + 1].attn_norm if i + 1 < c.n_layers else self.norm
            h = ops.add_rms_norm_(x, layer.w2(layer.w13.gated(cast(h), ops.silu_mul)), next_norm, c.norm_eps)
        cache.commit(T)
        if not want_logits:
            return None
        return self.lm_head(cast(h).float())

    def recompute(self, tokens: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache,
                  layers: int | None = None) -> torch.Tensor | None:
        """Recompute the keys and values of `tokens` (int64 [n]) at their `positions` (int64 [n], increasing, already
        cached: placed stored nodes, whose tokens saw no context) with the context the cache holds, and write them
        over the cached ones in every layer: CacheBlend's repair. Layer by layer, the chosen tokens attend to every
        cached position up to their own, through keys and values recomputed in that layer where the position is one
        of theirs and cached ones elsewhere; every position of the cache gives a prefill's keys and values. Attention
        runs on the torch reference (`reference.attention_at`), with node mass where the cache collects it; the
        projections as in `forward`.

        layers: stop after the first `layers` and put their cached keys and values back as they were; returns each
        token's key deviation in the last of them, ||k_new - k_cached|| / ||k_cached|| (CacheBlend's rule for which
        tokens to repair). None: every layer, written, and None returned."""
        c = self.config
        n, end = tokens.shape[0], int(positions.max()) + 1
        positions = positions.to(self.device)
        cos, sin = self.rope(positions)
        cast = _identity if self.dtype == torch.float32 else lambda t: t.to(self.dtype)
        x = self._embed_rows(tokens)
        h = self.ops.rms_norm(x, self.layers[0].attn_norm, c.norm_eps)
        n_qk = c.n_heads + c.n_kv_heads
        kept = []  # with `layers`: the cached keys and values written over, to put back
        for i, layer in enumerate(self.layers[:layers]):
            qkv = layer.wqkv(cast(h))
            q, k = self.ops.rope(qkv[:, : n_qk * c.head_dim].view(n, n_qk, c.head_dim), cos, sin).split(
                [c.n_heads, c.n_kv_heads], 1)
            if layers is not None:
                kept.append(cache.read(i, positions))
                if i == layers - 1:
                    old = kept[-1][0]
                    for j, (k_old, v_old) in enumerate(kept):
                        cache.write(j, k_old, v_old, positions)
                    return ((k - old).flatten(1).norm(dim=1) / old.flatten(1).norm(dim=1).clamp_min(1e-30))
            cache.write(i, k, qkv[:, n_qk * c.head_dim:].view(n, c.n_kv_heads, c.head_dim), positions)
            # the table after the write: the first one copies pages shared with a fork, and only the copies hold it
            keys = reference.gather_kv(cache.pool.k, i, cache.block_table, end)
            values = reference.gather_kv(cache.pool.v, i, cache.block_table, end)
            attn = reference.attention_at(q, keys, values, positions, *cache.collector)
            h = self.ops.add_rms_norm_(x, layer.wo(attn), layer.ffn_norm, c.norm_eps)
            next_norm = self.layers[i + 1].attn_norm if i + 1 < c.n_layers else self.norm
            h = self.ops.add_rms_norm_(x, layer.w2(layer.w13.gated(cast(h), self.ops.silu_mul)), next_norm,
                                       c.norm_eps)

    def _embed_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """The embeddings of `tokens` as float32 [T, dim] (the residual stream is fp32 whatever the model dtype),
        holding model-dtype values; an id outside the vocabulary raises IndexError."""
        if isinstance(self.embed, QuantWeight):
            x = self.embed.rows(tokens)
            return x if self.dtype == torch.float32 else x.to(self.dtype).float()
        return self.embed[tokens.to(self.device)].float()

    def _decode_step(self, tokens: torch.Tensor, batch: CacheBatch, logits: str | None):
        """`forward_batch` of one token per sequence (of a batch of one for `forward`) as one C++ call through every
        layer (`cpu_ops.Decoder`: the same kernels in the same order, so the same numbers, without ~10 Python calls
        and allocations per layer, and one attention call per sequence and layer; a SmolLM2-135M token took ~4 ms of
        them, a step of 8 Qwen2.5-0.5B sequences ~6 ms). Applies to the cpu backend (fp32) with GGUF-quantised
        projections in every layer, over `PagedKVCache`s of one pool, up to QUANT_MAX_TOKENS sequences (beyond, the
        op-by-op path's matmuls go dense, with other rounding); returns _UNFUSED where it does not, for the op-by-op
        path to run (and raise its errors). On CUDA with the Triton backend the step replays a CUDA graph instead
        (`DecodeGraphs`, over the pool of the first decode step's caches), where that serves the batch."""
        caches = batch.caches
        pool = getattr(caches[0], "pool", None)
        dec = self._decoder
        if dec is None and pool is not None:
            dec = self._decoder = self._build_decoder(pool)
        if isinstance(dec, DecodeGraphs):
            if not dec.serves(batch) or int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size:
                return _UNFUSED
            return dec.step(tokens, batch, logits is not None)
        if dec is False or len(caches) > QUANT_MAX_TOKENS or any(
                type(c) is not PagedKVCache or c.ops is not self.ops or c.pool is not pool for c in caches):
            return _UNFUSED
        ids = tokens.tolist()
        if not all(0 <= t < dec.vocab for t in ids):
            return _UNFUSED
        positions = batch.begin()
        want = logits is not None
        out = torch.empty(len(ids), dec.vocab) if want and dec.has_lm_head else None
        # each cache's block table and node-mass target, as `PagedKVCache.attend` passes them to paged_attention
        h = dec.step(ids, *self.rope(positions), pool.k, pool.v, [c.block_table for c in caches],
                     (positions + 1).tolist(), [c.collector for c in caches], want, out)
        batch.commit(len(ids))
        if not want:
            return None
        return out if out is not None else self.lm_head(h)

    def _build_decoder(self, pool: PagePool):
        """The fused decode step: on CUDA with the Triton backend, CUDA graphs of steps over `pool` (`DecodeGraphs`);
        on the CPU the C++ decoder; False where neither applies (or no page of `pool` is free for the graphs)."""
        from ..kernels import cpu_ops, triton_ops

        if self.device.type == "cuda" and self.ops is triton_ops:
            try:
                return DecodeGraphs(self.config, self.ops, self.rope, self._forward_rows, pool)
            except PoolExhaustedError:
                return False
        if self.ops is not cpu_ops or self.dtype != torch.float32:
            return False
        if any(lin.quant is None for l in self.layers for lin in (l.wqkv, l.wo, l.w13, l.w2)):
            return False
        c, head = self.config, self.lm_head
        layers = [(l.attn_norm, (l.wqkv.quant, l.wqkv.bias), (l.wo.quant, l.wo.bias), l.ffn_norm,
                   (l.w13.quant, l.w13.bias), (l.w2.quant, l.w2.bias)) for l in self.layers]
        return cpu_ops.Decoder(self.embed, layers, self.norm, None if head.quant is None else (head.quant, head.bias),
                               n_heads=c.n_heads, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, eps=c.norm_eps,
                               int8=self.precision == "int8")


_UNFUSED = object()  # `_decode_step`: the fused step does not apply


def _check_logits(logits: str | None) -> None:
    if logits not in ("last", "all", None):
        raise ValueError(f"logits must be 'last', 'all' or None, got {logits!r}")


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim/2], with Llama-3 frequency-dependent scaling when configured."""
    hd = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    s = config.rope_scaling
    if s is None:
        return inv_freq
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
              / (s.high_freq_factor - s.low_freq_factor))
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class _WeightReader:
    """Checks each canonical tensor's presence and shape, fuses, and converts to the model's dtypes."""

    def __init__(self, tensors, dtype, matmul_dtype, scratch: DequantScratch | None, int8: bool = False,
                 device: torch.device = torch.device("cpu"), prompt_dtype: torch.dtype | None = None):
        """matmul_dtype: the dtype dense weights multiply in; prompt_dtype: the one of a quantised projection's dense
        copy (default matmul_dtype)."""
        self.tensors, self.dtype, self.matmul_dtype, self.scratch = tensors, dtype, matmul_dtype, scratch
        self.int8, self.device = int8, device
        self.prompt_dtype = prompt_dtype or matmul_dtype
        self.blocks = device.type == "cpu"  # the quantised kernels are C++: on other devices every weight is dense

    def get(self, name: str, shape: tuple[int, ...]):
        t = self.tensors.get(name)
        if t is None:
            raise ModelLoadError(f"checkpoint lacks tensor {name!r}")
        got = (t.out_features, t.in_features) if isinstance(t, QuantWeight) else tuple(t.shape)
        if got != tuple(shape):
            raise ModelLoadError(f"tensor {name!r} has shape {list(got)}, expected {list(shape)}")
        return t

    def dense(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor in the model dtype (so bf16 models hold bf16 values even where kept in fp32)."""
        t = self.get(name, shape)
        t = t.dequantize() if isinstance(t, QuantWeight) else t
        return t.to(self.dtype).to(self.device).contiguous()

    def linear(self, names: list[str], in_features: int, bias: list[str] | None = None, *,
               out_sizes: list[int], matmul_dtype: torch.dtype | None = None, dense: bool = True) -> Linear:
        """The parts `names` stacked along out_features. Quantised parts stay quantised (a `QuantStack` where their
        types differ); many-token steps decode them into the reader's scratch, or, without one, into a dense copy
        made here, unless dense=False (every step on the blocks)."""
        parts = [self.get(n, (o, in_features)) for n, o in zip(names, out_sizes)]
        quant = None
        if self.blocks and all(isinstance(p, QuantWeight) for p in parts):
            quant = parts[0] if len(parts) == 1 else QuantStack(parts)
        matmul_dtype = matmul_dtype or self.matmul_dtype
        weight = None
        if quant is None:
            weight = torch.cat([p.dequantize() if isinstance(p, QuantWeight) else p for p in parts])
        elif dense and self.scratch is None:
            weight = quant.dequantize()
        if weight is not None:  # bf16 numerics: round weights to bf16 even when the matmul itself runs in fp32
            copy_dtype = matmul_dtype if quant is None else self.prompt_dtype  # a quantised one's serves prompts only
            weight = weight.to(self.dtype).to(self.device, copy_dtype).contiguous()
        b = None
        if bias is not None:
            b = torch.cat([self.get(n, (o,)) for n, o in zip(bias, out_sizes)]).to(self.dtype).to(self.device,
                                                                                                 matmul_dtype)
        return Linear(weight, quant, b, self.scratch if quant is not None and dense else None,
                      self.int8 and quant is not None)
