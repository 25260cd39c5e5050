"""The engines `engine_speed` compares, behind one small interface, and the measurement each child process runs.

Every runner does the same work on the same token ids: `reset()` empties its cache, `extend(ids)` runs ids after
what is cached and returns the greedy next token (argmax of the last position's logits), `decode(token, n)` feeds
`token` and then n - 1 greedy choices, one token per forward, never stopping at EOS, and returns the n tokens fed,
so the engines' continuations can be compared.
"""
from __future__ import annotations

import functools
import inspect
import time
from contextlib import contextmanager
from pathlib import Path

import torch

WARMUP_TOKENS = 32


def hf_from_gguf(path: Path, **kwargs) -> torch.nn.Module:
    """HF transformers' fp32 model of a GGUF file, in eval mode: `AutoModelForCausalLM.from_pretrained(dir,
    gguf_file=..., dtype=torch.float32, **kwargs)`, which dequantises every tensor, with gguf's parsers memoised
    (`_gguf_parsed_once`): the same model, sooner. Not for loads in several threads at once."""
    import transformers

    with _gguf_parsed_once():
        return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                                 **kwargs).eval()


def hf_cache_name(model: torch.nn.Module) -> str:
    """The name of a transformers causal LM's KV cache, as a forward keyword and an output field: "cache" where its
    forward takes one (transformers 5.2x renamed it, and warns on the old name until 5.40 drops it), else
    "past_key_values"."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@contextmanager
def _gguf_parsed_once():
    """transformers' GGUF load builds a gguf GGUFReader for the config and another for the weights, each parsing all
    of the file's metadata (~20 s for a Qwen vocabulary on one core), and a tensor-name map for each of the model's
    ~400 modules (~9 s for SmolLM2's). Both only read, and transformers imports them from gguf on each load, so
    within this context gguf hands out one per distinct arguments."""
    import gguf

    real = {name: getattr(gguf, name) for name in ("GGUFReader", "get_tensor_name_map")}
    for name, build in real.items():
        setattr(gguf, name, functools.cache(build))
    try:
        yield
    finally:
        for name, build in real.items():
            setattr(gguf, name, build)


class Runner:
    """The decode loop every engine shares: `step` runs one token (by default as an `extend` of one id)."""

    def extend(self, ids: list[int]) -> int:
        raise NotImplementedError

    def step(self, token: int) -> int:
        return self.extend([token])

    def decode(self, token: int, n: int) -> list[int]:
        out = []
        for _ in range(n):
            out.append(token)
            token = self.step(token)
        return out


class NodekvRunner(Runner):
    """nodekv on the GGUF's quantised blocks (the engine picks each step's kernels), with fp32 activations, int8
    ones in the quantised projections (precision "int8"), or as a bf16 model (dtype "bfloat16": dense bf16 weights,
    multiplied in bf16 where the CPU has bf16 matrix units); kv_dtype "float16": a KV cache of halves; isa caps the
    SIMD level of every C++ kernel."""

    def __init__(self, path: Path, threads: int, precision: str = "exact", dtype: str = "float32",
                 isa: str = "avx512", kv_dtype: str | None = None):
        import nodekv
        from nodekv import _C

        _C.limit_isa(isa)  # this process runs one engine
        self.engine = nodekv.load_engine(model=path, threads=threads, precision=precision, dtype=dtype,
                                         kv_dtype=kv_dtype)
        self.cache = None

    def flops(self) -> int:
        """FLOPs run so far, from the engine's exact account."""
        return self.engine.flops.total

    def reset(self) -> None:
        if self.cache is not None:
            self.cache.release()
        self.cache = self.engine.new_cache()

    def extend(self, ids: list[int]) -> int:
        return int(self.engine.run(ids, self.cache)[-1].argmax())

    def step(self, token: int) -> int:
        return int(self.engine.run([token], self.cache, decode=True)[-1].argmax())  # charged as a decode token


class HFRunner(Runner):
    """HF transformers on the same GGUF, dequantised to fp32, SDPA (or eager) attention, its DynamicCache."""

    def __init__(self, path: Path, threads: int, attention: str = "sdpa"):
        torch.set_num_threads(threads)
        self.model = hf_from_gguf(path, attn_implementation=attention)
        self.past, self.cache_name = None, hf_cache_name(self.model)

    def reset(self) -> None:
        from transformers import DynamicCache

        self.past = DynamicCache()

    @torch.inference_mode()
    def extend(self, ids: list[int]) -> int:
        # logits_to_keep=1: the lm_head only at the last position, as the other engines do
        out = self.model(torch.tensor([ids]), use_cache=True, logits_to_keep=1, **{self.cache_name: self.past})
        return int(out.logits[0, -1].argmax())


class LlamaCppRunner(Runner):
    """llama.cpp through llama-cpp-python's low-level eval: it computes on the GGUF's quantised blocks throughout."""

    def __init__(self, path: Path, threads: int, n_ctx: int):
        import llama_cpp

        self._lib = llama_cpp
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                   n_batch=512, verbose=False)

    def reset(self) -> None:
        self.truncate(0)

    def truncate(self, n: int) -> None:
        """Keep the first n cached positions: the next eval() drops the KV of those past n_tokens."""
        self.llm.n_tokens = n

    def extend(self, ids: list[int]) -> int:
        import numpy as np

        self.llm.eval(ids)
        logits = np.ctypeslib.as_array(self._lib.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.llm.n_vocab(),))
        return int(logits.argmax())


NODEKV_VARIANTS = {"nodekv": {}, "nodekv-avx2": {"isa": "avx2"}, "nodekv-int8": {"precision": "int8"},
                   "nodekv-bf16-prompts": {"precision": "bf16"}, "nodekv-bf16": {"dtype": "bfloat16"},
                   "nodekv-kv16": {"kv_dtype": "float16"},
                   "nodekv-bf16-prompts-kv16": {"precision": "bf16", "kv_dtype": "float16"}}  # NodekvRunner's options


def load(engine: str, path: Path, threads: int, n_ctx: int):
    if engine in NODEKV_VARIANTS:
        return NodekvRunner(path, threads, **NODEKV_VARIANTS[engine])
    if engine in ("hf", "hf-eager"):
        return HFRunner(path, threads, "eager" if engine == "hf-eager" else "sdpa")
    return LlamaCppRunner(path, threads, n_ctx)


def memory_gib() -> dict[str, float]:
    """This process's resident memory now and its peak so far, GiB (Linux: /proc/self/status)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    kib = {name: int(fields[key].split()[0]) for name, key in (("rss", "VmRSS"), ("peak", "VmHWM"))}
    return {name: value / 2**20 for name, value in kib.items()}


def _timed(fn, *args):
    t = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - t


def measure(engine: str, path: Path, ids: list[int], rounds: tuple[tuple[int, int], ...], decode_tokens: int,
            repeats: int, threads: int) -> dict:
    """Load `engine`, warm it up, then run `repeats` times each round (prefill, context): prefill ids[:prefill] from an
    empty cache (timed), extend it to ids[:context] (not timed), decode decode_tokens greedy steps (timed).
    The fastest repeat of each number counts."""
    n_ctx = max(context for _, context in rounds) + decode_tokens + 16
    runner = load(engine, path, threads, n_ctx)
    runner.reset()
    runner.decode(runner.extend(ids[:WARMUP_TOKENS]), 2)  # one-off setup (kernels, buffers), mmapped weights read
    result = {"rss_after_load_gib": memory_gib()["rss"], "prefill_s": {}, "decode_s": {}, "prefill_flops": {},
              "continuation": {}, "peak_rss_gib_at": {}}
    count_flops = isinstance(runner, NodekvRunner)
    for _ in range(repeats):
        for prefill, context in rounds:
            runner.reset()
            flops_before = runner.flops() if count_flops else 0
            token, seconds = _timed(runner.extend, ids[:prefill])
            result["prefill_s"][prefill] = min(seconds, result["prefill_s"].get(prefill, seconds))
            if count_flops:
                result["prefill_flops"][prefill] = runner.flops() - flops_before
            if context > prefill:
                token = runner.extend(ids[prefill:context])
            tokens, seconds = _timed(runner.decode, token, decode_tokens)
            result["decode_s"][context] = min(seconds, result["decode_s"].get(context, seconds))
            result["continuation"][context] = tokens
            result["peak_rss_gib_at"].setdefault(context, memory_gib()["peak"])
    result["peak_rss_gib"] = memory_gib()["peak"]
    return result
