"""Resident memory and prefill speed of answering a long prompt: each projection decoded into one shared scratch per
many-token step (the default) against the older dense fp32 copy of every projection (`load_engine(dense_copy=True)`),
side by side in one run, one child process per round so that each peak RSS is its own.

A round loads the model, prefills N tokens (timed), decodes 16 and reports its peak RSS. The bound printed beside it
is the memory target: 1.3 x the GGUF file + the prompt's KV (fp32) + 300 MiB.

    nodekv bench answer_memory [--model qwen2.5-1.5b] [--tokens 2048] [--threads 2] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time

from nodekv.bench import count, model, run_child, window
from nodekv.paths import example

MODES = {"scratch": False, "dense copy": True}  # name -> load_engine(dense_copy=...)


def child(model: str, tokens: int, threads: int, dense_copy: bool) -> dict:
    import nodekv

    engine = nodekv.load_engine(model, threads=threads, dense_copy=dense_copy)
    ids = engine.tokenizer.encode(example("lost_in_translation.txt").read_text())
    ids = (ids * -(-tokens // len(ids)))[:tokens]
    session = engine.session()
    start = time.perf_counter()
    session.append(ids)
    prefill_s = time.perf_counter() - start
    session.generate(16, stop=[])
    c = engine.config
    return {"prefill_s": prefill_s, "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "file_gib": engine.path.stat().st_size / 2**30,
            "kv_gib": 2 * c.n_layers * c.n_kv_heads * c.head_dim * 4 * (tokens + 16) / 2**30}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-1.5b", type=model)
    p.add_argument("--tokens", type=count, default=2048)
    p.add_argument("--threads", type=count, default=2)
    p.add_argument("--rounds", type=count, default=2, help="rounds per mode, alternating; the median counts")
    p.add_argument("--child", choices=list(MODES), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.model, args.tokens, args.threads, MODES[args.child])))
        return
    if args.tokens + 16 > (room := window(args.model)):
        p.error(f"--tokens {args.tokens} and the 16 decoded tokens do not fit {args.model}'s {room:,}-token window")
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            cmd = [sys.executable, "-m", "nodekv.bench.answer_memory", "--child", mode, "--model", args.model,
                   "--tokens", str(args.tokens), "--threads", str(args.threads)]
            runs[mode].append(run_child(cmd, f"the {mode} round"))
    first = runs["scratch"][0]
    bound = 1.3 * first["file_gib"] + first["kv_gib"] + 300 / 1024
    print(f"{args.model}: {args.tokens}-token prompt + 16 decoded, {args.threads} threads, median of {args.rounds} "
          f"rounds; file {first['file_gib']:.2f} GiB, KV {first['kv_gib']:.2f} GiB, bound 1.3 x file + KV + 300 MiB "
          f"= {bound:.2f} GiB\n")
    print("| prompt weights | peak RSS GiB | within the bound | prefill tok/s | vs dense copy |")
    print("|---|---:|---|---:|---:|")
    rate = {m: args.tokens / statistics.median(r["prefill_s"] for r in runs[m]) for m in MODES}
    for mode in MODES:
        peak = statistics.median(r["peak_gib"] for r in runs[mode])
        print(f"| {mode} | {peak:.2f} | {'yes' if peak <= bound else 'no'} | {rate[mode]:.1f} | "
              f"{rate[mode] / rate['dense copy']:.2f}x |")


if __name__ == "__main__":
    main()
