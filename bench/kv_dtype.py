"""Decode speed against context length with the KV cache in float32 and in halves (`load_engine(kv_dtype=...)`),
and llama.cpp's (its default f16 cache) where llama-cpp-python is installed, side by side in one process: the
engines share the machine's state of the moment, rounds alternate between them, and the fastest round counts. Also
the pool's bytes per token, whether the greedy tokens agree, and the attention part of nodekv's fused decode step
(its fastest round: the part the cache's dtype changes, timed inside the step, apart from the matmuls' noise).

A decode step reads every cached key and value once, so at long contexts it is bound by memory as much as by the
weights; halves halve those bytes (and add a conversion). The prompt is random token ids, prefilled once per engine
and context (with precision "bf16" where the CPU has bf16 matrix units: the same decode, a faster prefill), then
`--decode` greedy tokens are timed on a fork of it, `--rounds` times.

    nodekv bench kv_dtype [--model qwen2.5-1.5b] [--contexts 512,2048,8192] [--decode 16] [--rounds 3]
"""
from __future__ import annotations

import argparse
import importlib.util
import time

from nodekv.bench import count, counts, model

KV_DTYPES = ("float32", "float16")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="nodekv bench kv_dtype", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=model, default="qwen2.5-1.5b", help="a registered name or a .gguf path")
    p.add_argument("--contexts", type=counts, default=[512, 2048, 8192], help="cached tokens before decoding")
    p.add_argument("--decode", type=count, default=16, help="greedy tokens timed per round")
    p.add_argument("--rounds", type=count, default=3, help="rounds per engine and context (fastest counts)")
    p.add_argument("--threads", type=count, default=2)
    args = p.parse_args(argv)

    import torch

    from nodekv import load_engine
    from nodekv.engine.cpu import native_bf16_matmul
    from nodekv.engine.loader import model_config
    from nodekv.engine.models import resolve_model

    contexts = sorted(set(args.contexts))
    window = model_config(resolve_model(args.model)).max_seq_len
    if contexts[-1] + args.decode > window:
        p.error(f"a context of {contexts[-1]} and {args.decode} decoded tokens exceed the model's {window}")
    precision = "bf16" if native_bf16_matmul() else "exact"
    kv_tokens = contexts[-1] + args.decode + 64
    engines = {kv: load_engine(args.model, threads=args.threads, precision=precision, kv_dtype=kv,
                               kv_tokens=kv_tokens) for kv in KV_DTYPES}
    peer = None
    if importlib.util.find_spec("llama_cpp") is not None:
        from nodekv.bench.engine_runners import LlamaCppRunner

        peer = LlamaCppRunner(engines["float32"].path, args.threads, kv_tokens)
    print(f"## {args.model}: decode after each context, {args.threads} threads, fastest of {args.rounds} rounds of "
          f"{args.decode} tokens; nodekv's prompts with precision {precision!r}\n")
    print("| context | float32 KV ms/token | float16 KV ms/token | float16 / float32 speed | its attention: float32 / "
          "float16 ms | llama.cpp ms/token | float16 / llama.cpp speed | same tokens |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    gen = torch.Generator().manual_seed(0)
    vocab = engines["float32"].config.vocab_size
    ids = torch.randint(1000, min(vocab, 30000), (contexts[-1],), generator=gen).tolist()
    sessions = {kv: e.session() for kv, e in engines.items()}

    def nodekv_round(kv: str) -> tuple[list[int], float]:
        """A greedy continuation on a fork of the session, and its fused steps' attention seconds per token."""
        decoder = engines[kv].model._decoder  # the fused step (built by the first decode), timed by parts
        if decoder:
            decoder.reset_times()
        with sessions[kv].fork() as f:
            out = f.generate(args.decode, temperature=0.0).ids
        return out, engines[kv].model._decoder.times()["attention"] / args.decode

    def peer_round(first: int, ctx: int) -> list[int]:
        """llama.cpp's continuation of `first` (one forward per token, as a generate's), rolled back to ctx."""
        out = peer.decode(first, args.decode)
        peer.truncate(ctx)
        return out

    names = [*KV_DTYPES, "llama.cpp"] if peer else list(KV_DTYPES)
    cached = first = 0
    for ctx in contexts:
        for s in sessions.values():
            s.append(ids[cached:ctx])
        if peer:  # rolled back to the last context after its rounds
            first = peer.extend(ids[cached:ctx])
        cached = ctx
        best, attention, tokens = {n: float("inf") for n in names}, {kv: float("inf") for kv in KV_DTYPES}, {}
        for r in range(args.rounds):
            # alternating, so that all see the same swings of a noisy machine, and each round in another order (no
            # engine always runs right after the same one)
            for name in names[r % len(names):] + names[:r % len(names)]:
                t = time.perf_counter()
                if name == "llama.cpp":
                    tokens[name] = peer_round(first, ctx)
                else:
                    tokens[name], part = nodekv_round(name)
                    attention[name] = min(attention[name], part)
                best[name] = min(best[name], (time.perf_counter() - t) / args.decode)
        same = ", ".join(name for name in ("float16", "llama.cpp") if tokens.get(name) == tokens["float32"]) or "-"
        peer_cols = (f"{1e3 * best['llama.cpp']:.1f} | {best['llama.cpp'] / best['float16']:.2f}x" if peer
                     else "not installed | -")
        print(f"| {ctx} | {1e3 * best['float32']:.1f} | {1e3 * best['float16']:.1f} | "
              f"{best['float32'] / best['float16']:.2f}x | {1e3 * attention['float32']:.1f} / "
              f"{1e3 * attention['float16']:.1f} | {peer_cols} | {same} |", flush=True)
    per_token = {kv: e.pool.bytes_per_page // e.pool.page_size for kv, e in engines.items()}
    print(f"\nKV bytes per token: float32 {per_token['float32']:,}, float16 {per_token['float16']:,}. \"same "
          f"tokens\": the greedy tokens equal to the float32 cache's.")


if __name__ == "__main__":
    main()
