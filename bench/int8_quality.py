"""How far the int8 fast path moves the logits, as llama.cpp measures its quantised paths (`llama-perplexity
--kl-divergence`): over the first N tokens of a real document, the mean and 99th-percentile KL divergence
KL(exact || fast) of the next-token distributions and how often their top-1 tokens agree, with the exact path
(fp32 activations) as the reference.

The int8 engine runs the tokens in 32-token teacher-forced steps, the step size up to which precision "int8" takes
the int8 kernels (longer steps stay exact), so every position's logits come from int8 activations. llama.cpp
(llama-cpp-python, when installed) reads the same GGUF with its own q8 activations and stands beside it as the
peer's version of the same trade. A bf16 model of the same GGUF (dtype "bfloat16", whose prompts run on bf16 matrix
units where the CPU has them) is measured the same way, in one forward, and so, on CPUs with those units, is the exact
model with precision "bf16" (its prompts' projections multiplied in bf16, everything else exact), and the exact
model over a KV cache of halves (kv_dtype "float16", llama.cpp's default cache type).

    nodekv bench int8_quality [--models qwen2.5-0.5b,qwen2.5-1.5b] [--tokens 2048] [--threads 2]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import time

import torch

from nodekv.bench import count, models
from nodekv.paths import data_dir, example

KL_TARGET, TOP1_TARGET = 0.01, 0.98  # mean nats, agreement


def document_ids(engine, n: int) -> tuple[list[int], str]:
    """The first n tokens of QuALITY's second dev story (the first is the bundled example), or of the bundled story
    repeated when the data folder is absent; and where they came from."""
    path = data_dir() / "leval" / "quality.jsonl"
    if path.exists():
        with path.open() as f:
            f.readline()
            text, source = json.loads(f.readline())["input"], "L-Eval QuALITY dev story 2"
    else:
        text, source = example("lost_in_translation.txt").read_text(), "the bundled story (no data folder)"
    ids = engine.tokenizer.encode(text)
    return (ids * -(-n // len(ids)))[:n], source


def int8_logits(engine, ids: list[int], step: int) -> torch.Tensor:
    """Logits at every position, run `step` tokens at a time from an empty cache."""
    cache = engine.new_cache()
    try:
        return torch.cat([engine.run(ids[i:i + step], cache, logits="all") for i in range(0, len(ids), step)])
    finally:
        cache.release()


def llama_cpp_logits(path, ids: list[int], threads: int) -> torch.Tensor:
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(ids) + 8, n_threads=threads, n_threads_batch=threads,
                          n_batch=512, logits_all=True, verbose=False)
    llm.eval(ids)
    return torch.from_numpy(np.array(llm.scores[:len(ids)], dtype=np.float32))


def compare(ref: torch.Tensor, got: torch.Tensor, rows: int = 256) -> tuple[float, float, float]:
    """(mean KL(ref || got), its 99th percentile, top-1 agreement), in float64 a block of rows at a time."""
    kls, agree = [], 0
    for i in range(0, ref.shape[0], rows):
        p, q = ref[i:i + rows].double().log_softmax(-1), got[i:i + rows].double().log_softmax(-1)
        kls.append((p.exp() * (p - q)).sum(-1))
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
    kl = torch.cat(kls)
    return kl.mean().item(), kl.quantile(0.99).item(), agree / ref.shape[0]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-1.5b", type=models)  # all checked before the first runs
    p.add_argument("--tokens", type=count, default=2048)
    p.add_argument("--threads", type=count, default=2)
    args = p.parse_args(argv)
    from nodekv.engine.cpu import native_bf16_matmul
    from nodekv.engine.engine import load_engine
    from nodekv.engine.model import QUANT_MAX_TOKENS

    peer = importlib.util.find_spec("llama_cpp") is not None
    print(f"{args.tokens} tokens, {args.threads} threads; KL(exact || path) in nats per position; targets: mean KL "
          f"<= {KL_TARGET}, top-1 agreement >= {TOP1_TARGET:.0%}\n")
    print("| model | path | mean KL | p99 KL | top-1 agreement | seconds | targets |")
    print("|---|---|---:|---:|---:|---:|---|")
    for model in args.models:
        exact = load_engine(model, threads=args.threads)
        ids, source = document_ids(exact, args.tokens)
        t = time.perf_counter()
        ref = exact.forward_logits(ids)
        rows = [("exact (reference)", ref, time.perf_counter() - t)]
        path = exact.path
        del exact
        fast = load_engine(model, threads=args.threads, precision="int8")
        t = time.perf_counter()
        rows.append((f"nodekv int8 ({QUANT_MAX_TOKENS}-token steps)", int8_logits(fast, ids, QUANT_MAX_TOKENS),
                     time.perf_counter() - t))
        del fast
        if native_bf16_matmul():
            prompts = load_engine(model, threads=args.threads, precision="bf16")
            t = time.perf_counter()
            rows.append(("nodekv bf16 prompts (precision bf16)", prompts.forward_logits(ids), time.perf_counter() - t))
            del prompts
        half = load_engine(model, threads=args.threads, dtype="bfloat16")
        t = time.perf_counter()
        rows.append(("nodekv bf16 (a bf16 model)", half.forward_logits(ids), time.perf_counter() - t))
        del half
        kv16 = load_engine(model, threads=args.threads, kv_dtype="float16")
        t = time.perf_counter()
        rows.append(("nodekv kv16 (a KV cache of halves)", kv16.forward_logits(ids), time.perf_counter() - t))
        del kv16
        if peer:
            t = time.perf_counter()
            rows.append(("llama.cpp (its q8 activations)", llama_cpp_logits(path, ids, args.threads),
                         time.perf_counter() - t))
        for name, logits, seconds in rows:
            kl, p99, top1 = compare(ref, logits)
            met = "" if logits is ref else ("met" if kl <= KL_TARGET and top1 >= TOP1_TARGET else "**not met**")
            print(f"| {model} | {name} | {kl:.2g} | {p99:.2g} | {top1:.2%} | {seconds:.0f} | {met} |", flush=True)
        del rows, ref
    print(f"\nText: {source}." + ("" if peer else " llama-cpp-python is not installed: no llama.cpp rows."))


if __name__ == "__main__":
    main()
