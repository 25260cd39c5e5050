"""The papers' published cost numbers and the arithmetic that sets nodekv's FLOP account against them.

Every convention is a function of one prompt's length T on a model config; all of them are quadratic in T, so the
mean over documents is f(T̄) + b·Var(T) with b the second difference / 2, and the length a published figure implies
is found by bisection. Numbers are FLOPs (not TFLOPs) unless a name says otherwise.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable, Sequence

from nodekv.engine.config import ModelConfig
from nodekv.engine.flops import forward_flops, parameter_count, per_example_convention, per_token_convention

# PECAN Table 1 (full-context Llama-3.1-8B TFLOPs per query; Table A4 prints HotpotQA as 23.6) and Table A3
# (document tokens: mean, min, max); NarrativeQA was cut to a 100K-token window, 22.3% of its documents truncated.
PECAN_FULL_TFLOPS = {"narrativeqa": 3361.9, "qasper": 92.5, "hotpotqa": 23.7, "musique": 40.6}
PECAN_LENGTHS = {"narrativeqa": (79_457, 5_077, 467_867), "qasper": (4_866, 918, 29_408),
                 "hotpotqa": (1_318, 70, 3_575), "musique": (2_267, 909, 4_432)}
NARRATIVEQA_WINDOW, NARRATIVEQA_TRUNCATED = 100_000, 0.223
# PECAN Table A4: construction TFLOPs per document and search TFLOPs per query (same dataset order).
PECAN_CONSTRUCTION = {"narrativeqa": 2042.8, "qasper": 136.6, "hotpotqa": 40.2, "musique": 66.7}
PECAN_SEARCH = {"narrativeqa": 31.0, "qasper": 66.9, "hotpotqa": 16.0, "musique": 30.9}
PECAN_AMORTISED = {1: (2073.8, 203.5, 56.2, 97.6), 2: (1052.4, 135.2, 36.1, 64.3), 4: (541.7, 101.1, 26.1, 47.6),
                   8: (286.4, 84.0, 21.0, 39.2)}
# Our stand-in files for PECAN's datasets (NarrativeQA's long stories are not here: its lengths are modelled).
PECAN_FILES = {"qasper": "scientific_qa", "hotpotqa": "hotpotqa", "musique": "musique"}

# JERR Table 6 (thousand tokens per query, 15.5K-token contexts), GoR Table 4 (retrieval seconds per query on
# WCEP, the LLM excluded), DICE Table 4 (minutes per LongBench dataset of 200 records, Llama2-13B on an A40).
JERR_TOKENS_K = {"JERR": 98.54, "JERR w/o graph construction": 44.33, "ReadAgent": 79.98, "BM25": 39.18,
                 "full context (qwen-plus-128k)": 16.99}
GOR_RETRIEVAL_S = {"GoR": 0.58, "BM25": 0.02, "SBERT": 0.01, "Contriever": 0.20, "BM25+DPR": 0.04}
DICE_MINUTES = {"hotpotqa": 34, "2wikimqa": 37, "musique": 32}  # bge-small, the retriever nearest ours
DICE_RECORDS = 200


@dataclass(frozen=True)
class Convention:
    """A way of counting one forward over a T-token prompt."""

    name: str
    formula: str
    flops: Callable[[ModelConfig, int], int]


def _square_attention(c: ModelConfig, t: int) -> int:
    return 2 * parameter_count(c) * t + 4 * c.n_layers * c.dim * t * t


def _hooked(c: ModelConfig, t: int) -> int:
    return 2 * (parameter_count(c, embeddings=False) + c.vocab_size * c.dim) * t + 4 * c.n_layers * c.dim * t * t


CONVENTIONS = (
    Convention("exact (nodekv)", "causal attention, logits at the last position", lambda c, t: forward_flops(c, t)),
    Convention("per-token (Kaplan)", "(2N₀ + 2·L·T·d)·T, N₀ without embeddings",
               lambda c, t: per_token_convention(c, t) * t),
    Convention("per-example", "2N·T + 2·L·d·T²", per_example_convention),
    Convention("square attention", "2N·T + 4·L·d·T² (QKᵀ and PV over all T×T)", _square_attention),
    Convention("hooked matmuls", "2(N₀ + V·d)·T + 4·L·d·T² (every position's logits)", _hooked),
)


def quadratic(conv: Convention, c: ModelConfig, near: int = 4096) -> tuple[float, float, float]:
    """(a, b, k) with conv(T) = a·T + b·T² + k, read from three points around `near` (exact for a quadratic)."""
    f0, f1, f2 = (conv.flops(c, near + i) for i in (-1, 0, 1))
    b = (f2 - 2 * f1 + f0) / 2
    a = f2 - f1 - b * (2 * near + 1)
    return a, b, f1 - a * near - b * near * near


def mean_flops(conv: Convention, c: ModelConfig, mean_tokens: float, cv: float) -> float:
    """Mean FLOPs over prompts of mean length `mean_tokens` and coefficient of variation `cv`:
    a·T̄ + b·T̄²(1 + cv²) + k, since E[T²] = T̄²(1 + cv²)."""
    a, b, k = quadratic(conv, c, max(2, round(mean_tokens)))
    return a * mean_tokens + b * mean_tokens ** 2 * (1 + cv * cv) + k


def implied_tokens(conv: Convention, c: ModelConfig, target: float, cv: float) -> float:
    """The mean prompt length at which `conv`'s mean FLOPs reach `target`."""
    lo, hi = 2.0, 1e7
    while hi - lo > 0.5:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_flops(conv, c, mid, cv) < target else (lo, mid)
    return (lo + hi) / 2


def modelled_lengths(mean: float, low: float, high: float, share_above: float, cut: float,
                     n: int = 2000) -> list[list[float]]:
    """Document lengths of a log-normal with this mean and P(T > cut) = share_above, clipped to [low, high]: one
    list of n quantiles per σ that satisfies both (there are two roots). For NarrativeQA, whose lengths are
    given only as Table A3's mean/min/max and the truncated share."""
    z = statistics.NormalDist().inv_cdf(1 - share_above)
    # ln(cut) = μ + zσ and μ = ln(mean) − σ²/2  ⇒  σ² − 2zσ + 2·ln(cut/mean) = 0
    disc = z * z - 2 * math.log(cut / mean)
    if disc < 0:
        raise ValueError("no log-normal has this mean and this share above the cut")
    out = []
    for sigma in (z - math.sqrt(disc), z + math.sqrt(disc)):
        mu = math.log(mean) - sigma * sigma / 2
        normal = statistics.NormalDist(mu, sigma)
        out.append([min(high, max(low, math.exp(normal.inv_cdf((i + 0.5) / n)))) for i in range(n)])
    return out


def amortised(construction: float, search: float, queries: int) -> float:
    """Table A4's combined cost per query when one document's graph serves `queries` questions."""
    return construction / queries + search


def spread(values: Sequence[float]) -> float:
    """max − min: how far apart the prompt overheads a convention implies on different datasets are."""
    return max(values) - min(values)
