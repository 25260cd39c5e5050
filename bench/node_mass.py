"""Cost of collecting attention mass per node: time and peak extra memory of a prompt appended as 300-token nodes
with collect=True against the same appends without collection, and against HF transformers' eager attention with
output_attentions=True (which returns L x H x T^2 floats), on SmolLM2.

nodekv and HF each run in a fresh subprocess (peak RSS is per process). nodekv's plain and collecting appends run
alternately in one process after a plain warm-up that touches the KV pages, so the peak the first collecting run
adds is the collection's own memory, and the time ratio is measured side by side.

    nodekv bench node_mass [--tokens 2048,8192] [--node 300] [--hf-max 2048] [--threads 2] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time

from nodekv.bench import count, counts, output_file, run_child, window
from nodekv.paths import example, write_atomic

TEXT = example("lost_in_translation.txt")
MiB = 1 << 20


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _prompt(tokenizer, n: int) -> list[int]:
    ids = tokenizer.encode(TEXT.read_text())
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def child(mode: str, n: int, node: int, threads: int) -> dict:
    """mode "nodekv": plain and collecting appends alternated (best of 2 each) and the peak memory collection adds;
    mode "hf": HF eager attention with output_attentions=True (seconds, extra bytes over a plain HF forward)."""
    import torch

    import nodekv

    torch.set_num_threads(threads)
    engine = nodekv.load_engine("smollm2-135m", threads=threads)
    ids = _prompt(engine.tokenizer, n)

    def appends(collect: bool) -> float:
        t = time.perf_counter()
        with engine.session() as s:
            for i in range(0, n, node):
                s.append(ids[i:i + node], collect=collect)
            if collect:
                s.node_mass()
        return time.perf_counter() - t

    appends(False)  # warm-up: model, KV pages and allocator caches at their plain-prefill peak
    if mode == "nodekv":
        base = _peak_rss()
        plain, collect = [appends(False)], [appends(True)]
        extra = _peak_rss() - base
        plain.append(appends(False))
        collect.append(appends(True))
        return {"plain": min(plain), "collect": min(collect), "extra_bytes": max(0, extra)}
    from nodekv.bench.engine_runners import hf_from_gguf

    path = engine.path
    del engine
    model = hf_from_gguf(path, attn_implementation="eager")
    with torch.inference_mode():
        model(torch.tensor([ids]), logits_to_keep=1)  # warm-up without attentions
        base = _peak_rss()
        t = time.perf_counter()
        out = model(torch.tensor([ids]), logits_to_keep=1, output_attentions=True)
        torch.stack([a[0].mean(0) for a in out.attentions]).mean(0)  # the head/layer average PECAN needs
        seconds = time.perf_counter() - t
    return {"seconds": seconds, "extra_bytes": max(0, _peak_rss() - base)}


def measure(mode: str, n: int, node: int, threads: int) -> dict:
    return run_child([sys.executable, "-m", "nodekv.bench.node_mass", "--child", mode, "--tokens", str(n),
                      "--node", str(node), "--threads", str(threads)], f"{mode} at {n:,} tokens")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="2048,8192", type=counts)
    p.add_argument("--node", default=300, type=count, help="tokens per node")
    p.add_argument("--hf-max", default=2048, type=int, help="longest prompt to run HF output_attentions on (0: none)")
    p.add_argument("--threads", default=2, type=count)
    p.add_argument("--json", type=output_file, default=None, help="also write the rows here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.tokens[0], args.node, args.threads)))
        return
    if max(args.tokens) > (room := window("smollm2-135m")):
        p.error(f"--tokens {max(args.tokens)} is longer than SmolLM2's {room:,}-token window")

    from nodekv.engine.config import PRESETS

    c = PRESETS["smollm2-135m"]
    print(f"SmolLM2-135M fp32, {args.threads} threads, nodes of {args.node} tokens appended one by one")
    print(f"{'tokens':>6} {'nodes':>5} {'plain s':>8} {'collect s':>9} {'overhead':>8} {'extra MiB':>9} "
          f"{'mass MiB':>8} {'HF attn s':>9} {'HF extra MiB':>12} {'HF needs MiB':>12}")
    rows = []
    for n in args.tokens:
        nodes = -(-n // args.node)
        ours = measure("nodekv", n, args.node, args.threads)
        hf_needs = c.n_layers * c.n_heads * n * n * 4 / MiB
        hf = measure("hf", n, args.node, args.threads) if n <= args.hf_max else None
        rows.append({"tokens": n, "nodes": nodes, "nodekv": ours, "hf": hf, "hf_attention_bytes": hf_needs * MiB})
        hf_s = f"{hf['seconds']:>9.2f}" if hf else f"{'not run':>9}"
        hf_mib = f"{hf['extra_bytes'] / MiB:>12.0f}" if hf else f"{'-':>12}"
        print(f"{n:>6} {nodes:>5} {ours['plain']:>8.2f} {ours['collect']:>9.2f} "
              f"{ours['collect'] / ours['plain'] - 1:>8.1%} {ours['extra_bytes'] / MiB:>9.1f} "
              f"{n * nodes * 4 / MiB:>8.2f} {hf_s} {hf_mib} {hf_needs:>12,.0f}", flush=True)
    if args.json:
        write_atomic(args.json, json.dumps({"model": "smollm2-135m", "threads": args.threads, "node": args.node,
                                            "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
