"""Exact FLOP counts of the forward pass, an account that accumulates them per scope, and the papers' conventions.

Counted: every matmul (2·m·n·k: Q/K/V, output, gate/up/down projections, lm_head only at positions whose logits
are taken) and attention with its causal shape (QKᵀ and PV: 2·head_dim FLOPs each per query head per visible key).
Not counted: norms, RoPE, softmax, activations and residual adds (O(d) per token, <1% for these models), as in
the papers' tables.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterator

from .config import ModelConfig


def _visible(n_rows: int, n_new: int, n_past: int) -> int:
    """Keys seen by the last n_rows of n_new causal queries after n_past cached tokens (query t sees n_past+t+1)."""
    first = n_new - n_rows
    return n_rows * (n_past + 1) + (first + n_new - 1) * n_rows // 2


def forward_flop_parts(c: ModelConfig, n_new: int, n_past: int = 0, n_logits: int = 1,
                       collect: bool = False) -> tuple[int, int, int]:
    """(projection matmuls, attention, lm_head) FLOPs of one forward of n_new tokens after n_past cached ones.

    The last layer computes attention, output projection and MLP only for the n_logits positions whose logits
    are taken (its other outputs feed nothing); its Q/K/V projection runs for every new token. When attention
    mass is collected (`collect`), the last layer's attention runs for every new token too."""
    qkv = 2 * c.dim * (c.q_dim + 2 * c.kv_dim)
    rest = 2 * c.q_dim * c.dim + 2 * c.dim * 2 * c.intermediate_size + 2 * c.intermediate_size * c.dim
    matmuls = c.n_layers * n_new * qkv + ((c.n_layers - 1) * n_new + n_logits) * rest
    per_key = c.n_heads * 4 * c.head_dim  # QKᵀ and PV, every query head
    last_rows = n_new if collect else n_logits
    attention = per_key * ((c.n_layers - 1) * _visible(n_new, n_new, n_past) + _visible(last_rows, n_new, n_past))
    return matmuls, attention, n_logits * 2 * c.dim * c.vocab_size


def forward_flops(c: ModelConfig, n_new: int, n_past: int = 0, n_logits: int = 1, collect: bool = False) -> int:
    """Exact FLOPs of one forward of n_new tokens after n_past cached ones, with logits at n_logits positions."""
    return sum(forward_flop_parts(c, n_new, n_past, n_logits, collect))


def recompute_flops(c: ModelConfig, positions: list[int], layers: int | None = None) -> int:
    """Exact FLOPs of recomputing the tokens at `positions` (`Llama.recompute`): in every layer each one's
    projections and attention over the position + 1 keys up to its own, no lm_head; with `layers`, the first layers
    and the last one's Q/K/V projection only (the key-deviation pass)."""
    qkv = 2 * c.dim * (c.q_dim + 2 * c.kv_dim)
    rest = 2 * c.q_dim * c.dim + 2 * c.dim * 2 * c.intermediate_size + 2 * c.intermediate_size * c.dim
    per_layer = len(positions) * (qkv + rest) + c.n_heads * 4 * c.head_dim * sum(p + 1 for p in positions)
    if layers is None:
        return c.n_layers * per_layer
    return (layers - 1) * per_layer + len(positions) * qkv


def parameter_count(c: ModelConfig, embeddings: bool = True) -> int:
    """N: weights of the matmuls and norms, with the input embedding and an untied lm_head when `embeddings`."""
    per_layer = (c.dim * (c.q_dim + 2 * c.kv_dim) + c.q_dim * c.dim + 3 * c.dim * c.intermediate_size + 2 * c.dim
                 + (c.q_dim + 2 * c.kv_dim if c.qkv_bias else 0))
    n = c.n_layers * per_layer + c.dim
    if embeddings:
        n += c.vocab_size * c.dim * (1 if c.tie_embeddings else 2)
    return n


def per_token_convention(c: ModelConfig, n_ctx: int) -> int:
    """Kaplan et al.'s forward cost per token: 2N + 2·L·n_ctx·d, N without embeddings, n_ctx the window."""
    return 2 * parameter_count(c, embeddings=False) + 2 * c.n_layers * n_ctx * c.dim


def per_example_convention(c: ModelConfig, tokens: int) -> int:
    """The per-example cost many long-context papers quote: 2N·T + 2·L·d·T², N including embeddings."""
    return 2 * parameter_count(c, embeddings=True) * tokens + 2 * c.n_layers * c.dim * tokens * tokens


def _forward_of(shape: tuple[int, int, int, bool], config: ModelConfig) -> int:
    return forward_flops(config, *shape)


@dataclass
class FlopAccount:
    """Running totals of FLOPs and tokens, also per named scope (scopes may nest; each level is charged).

    `saved`: FLOPs not run because a cached prompt prefix was forked instead of prefilled again (`PrefixCache`), and
    those of a prefix prefilled again inside `uncharged` (one an earlier process of the same run paid for).
    `project_to` names other configs (e.g. the llama-3.1-8b preset) whose FLOPs for the same forwards (same token
    counts) are accumulated alongside: `projected[name]` and `projected_scopes[name][scope]`."""

    total: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    saved: int = 0
    scopes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    project_to: dict[str, ModelConfig] = field(default_factory=dict)
    projected: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    projected_scopes: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    _active: list[str] = field(default_factory=list)
    _uncharged: int = 0

    def add(self, flops: int, n_new: int, decode: bool = False, shape: tuple[int, int, int, bool] | None = None,
            count: Callable[[ModelConfig], int] | None = None):
        """Charge one forward of n_new tokens; for the projections, `shape` = (n_new, n_past, n_logits, collect) of a
        forward, or `count`(config), the FLOPs of another kind of step."""
        if self._uncharged:
            self.saved += flops
            return
        if count is None and shape is not None:
            count = partial(_forward_of, shape)
        self.total += flops
        if decode:
            self.decode_tokens += n_new
        else:
            self.prefill_tokens += n_new
        active = set(self._active)
        for name in active:
            self.scopes[name] += flops
        if count is not None:
            for target, config in self.project_to.items():
                f = count(config)
                self.projected[target] += f
                for name in active:
                    self.projected_scopes[target][name] += f

    @contextlib.contextmanager
    def scope(self, name: str) -> Iterator["FlopAccount"]:
        """Charge every forward inside the block to `name` as well as to the total."""
        self._active.append(name)
        try:
            yield self
        finally:
            self._active.pop()

    @contextlib.contextmanager
    def uncharged(self) -> Iterator["FlopAccount"]:
        """Book every forward inside the block as `saved`: work that is run again but was paid for already (a
        resumed run's shared prefix), so that it costs no scope, total, token count or projection twice."""
        self._uncharged += 1
        try:
            yield self
        finally:
            self._uncharged -= 1

    def reset(self) -> None:
        self.total = self.prefill_tokens = self.decode_tokens = self.saved = 0
        self.scopes.clear()
        self.projected.clear()
        self.projected_scopes.clear()


def format_report(c: ModelConfig, name: str, tokens: int, n_ctx: int | None = None) -> str:
    """The `nodekv flops` table: exact count of one prefill plus the papers' conventions."""
    n_ctx = n_ctx or min(tokens, c.max_seq_len)
    matmuls, attention, lm_head = forward_flop_parts(c, tokens, 0, n_logits=1)
    exact = matmuls + attention + lm_head
    rows = [
        ("model", name),
        ("tokens T", f"{tokens:,}"),
        ("params N (with embeddings)", f"{parameter_count(c):,}"),
        ("params N (without embeddings)", f"{parameter_count(c, embeddings=False):,}"),
        ("exact prefill FLOPs (causal attention, last-position logits)", f"{exact:,}  ({exact / 1e12:.3f} TFLOPs)"),
        ("  of which projections", f"{matmuls:,}"),
        ("  of which attention", f"{attention:,}"),
        ("  of which lm_head", f"{lm_head:,}"),
        (f"per-token 2N + 2·L·n_ctx·d (n_ctx={n_ctx:,})", f"{per_token_convention(c, n_ctx):,}"),
        ("  x T", f"{per_token_convention(c, n_ctx) * tokens:,}  "
                  f"({per_token_convention(c, n_ctx) * tokens / 1e12:.3f} TFLOPs)"),
        ("per-example 2N·T + 2·L·d·T²", f"{per_example_convention(c, tokens):,}  "
                                        f"({per_example_convention(c, tokens) / 1e12:.3f} TFLOPs)"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
