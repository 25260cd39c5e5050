"""Peak memory and time of per-node attention mass inside HF transformers: SmolLM2 (HF's own modeling code, weights
from the packaged GGUF) prefilling T tokens with attn_implementation="nodekv" and a `nodekv.hf.NodeMassCollector`,
against eager attention with output_attentions=True (what a user would otherwise aggregate) and plain sdpa. Each in a
fresh process; peak RSS is the process's high-water mark after a warm-up forward without collection, so the figure
is what the measured forward adds.

    nodekv bench hf_plugin [--tokens 4096] [--node 300] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time

from nodekv.bench import count, run_child, window

MiB = 1 << 20


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _available() -> int:
    """Bytes of memory the kernel says are available now (Linux: /proc/meminfo)."""
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def child(mode: str, tokens: int, node: int, threads: int) -> dict:
    import torch

    import nodekv.hf
    from nodekv.bench.engine_runners import hf_from_gguf
    from nodekv.bench.engine_speed import prompt_ids
    from nodekv.engine.models import resolve_model

    torch.set_num_threads(threads)
    path = resolve_model("smollm2-135m")
    ids = torch.tensor([prompt_ids(path, tokens)])
    nodekv.hf.register()
    model = hf_from_gguf(path, attn_implementation=mode)
    bounds = list(range(0, tokens, node)) + [tokens]
    with torch.inference_mode():
        model(ids, logits_to_keep=1)  # warm-up without collection: weights, caches and allocator at their peak
        base, start = _peak(), time.perf_counter()
        if mode == "nodekv":
            mass = nodekv.hf.NodeMassCollector(bounds)
            model(ids, logits_to_keep=1, node_mass=mass)
            per_node = mass.mean()[0]
        elif mode == "eager":
            attentions = model(ids, logits_to_keep=1, output_attentions=True).attentions  # L x [1, H, T, T]
            mean = torch.stack([a[0].mean(0) for a in attentions]).mean(0)
            per_node = torch.stack([mean[:, a:b].sum(-1) for a, b in zip(bounds, bounds[1:])], -1)
        else:
            model(ids, logits_to_keep=1)
            per_node = None
        seconds = time.perf_counter() - start
    label = {"sdpa": "sdpa, no mass", "nodekv": "nodekv + NodeMassCollector",
             "eager": "eager + output_attentions"}[mode]
    if per_node is not None and not torch.allclose(per_node.sum(-1), torch.ones(tokens), atol=1e-4):
        raise AssertionError(f"{mode}: per-node mass rows do not sum to 1")
    return {"label": label, "seconds": seconds, "extra_bytes": max(0, _peak() - base)}


def main() -> None:
    p = argparse.ArgumentParser(prog="nodekv bench hf_plugin", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=count, default=4096)
    p.add_argument("--node", type=count, default=300)
    p.add_argument("--threads", type=count, default=2)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.tokens, args.node, args.threads)))
        return
    if args.tokens > (room := window("smollm2-135m")):
        p.error(f"--tokens {args.tokens} is longer than SmolLM2's {room:,}-token window")
    print(f"SmolLM2-135M in HF transformers, fp32, {args.threads} threads, one prefill of {args.tokens} tokens in "
          f"nodes of {args.node}\n\n| attention | seconds | peak RSS added MiB |\n|---|---:|---:|")
    from nodekv.engine.config import PRESETS

    c = PRESETS["smollm2-135m"]
    maps = c.n_layers * c.n_heads * args.tokens ** 2 * 4  # output_attentions: L x H x T x T floats
    for mode in ("sdpa", "nodekv", "eager"):
        if mode == "eager" and maps * 1.2 > _available():
            print(f"| eager + output_attentions | not run: its maps need {maps / MiB:,.0f} MiB, "
                  f"{_available() / MiB:,.0f} MiB available | |")
            continue
        r = run_child([sys.executable, "-m", "nodekv.bench.hf_plugin", "--child", mode, "--tokens", str(args.tokens),
                       "--node", str(args.node), "--threads", str(args.threads)], f"the {mode} forward")
        print(f"| {r['label']} | {r['seconds']:.2f} | {r['extra_bytes'] / MiB:,.0f} |", flush=True)
    print(f"\noutput_attentions holds L x H x T^2 = {maps / MiB:,.0f} MiB of maps; NodeMassCollector holds T x N "
          "floats.")


if __name__ == "__main__":
    main()
