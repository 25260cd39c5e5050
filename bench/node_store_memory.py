"""Resident memory of a corpus of node stores: opening the stores of many documents costs their headers, and a
query's reads cost the nodes it reads, because a store is memory-mapped and each node is read (and decoded) when
it is used.

The stores hold KV of a model's attention shape (default qwen2.5-1.5b: 28 layers, 2 KV heads of 128) with random
values, `--documents` of them (and one more to warm up the decoding), each `--tokens` long in nodes of `--node-tokens`, written once at bench time into a
temporary folder (never committed). A child process then reads /proc/self/statm's resident size before and after
opening every store, and after reading `--read` nodes spread over the stores (as a query reads its k chunks), and
compares the growth with the bytes of those nodes in the file and decoded to fp32.

    nodekv bench node_store_memory [--documents 100] [--tokens 2048] [--node-tokens 300] [--read 5]
                                             [--dtype float16] [--layers 28] [--kv-heads 2] [--head-dim 128]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = {"name": "node_store_memory bench"}  # the stores' model id: random KV, no model behind it


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def write_stores(folder: Path, args: argparse.Namespace) -> None:
    import torch

    from nodekv.engine.node_store import StoredNode, write_node_store

    sizes = [min(args.node_tokens, args.tokens - a) for a in range(0, args.tokens, args.node_tokens)]
    gen = torch.Generator().manual_seed(0)
    nodes = {}
    for i, n in enumerate(sizes):
        k, v = (torch.randn(args.layers, n, args.kv_heads, args.head_dim, generator=gen) for _ in range(2))
        nodes[i] = StoredNode(tuple(range(n)), k, v)
    for name in ["warm-up", *(f"doc{d}" for d in range(args.documents))]:  # the same nodes in each: bytes count
        write_node_store(folder / f"{name}.kv", nodes, MODEL, args.dtype)


def child(folder: Path, documents: int, read: int) -> dict:
    from nodekv.engine.node_store import NodeStore

    warm = NodeStore(folder / "warm-up.kv", MODEL)
    warm.get(warm.ids[0])  # torch's decoding code paged in before anything is measured
    before = resident_bytes()
    stores = [NodeStore(folder / f"doc{d}.kv", MODEL) for d in range(documents)]
    opened = resident_bytes()
    step = max(1, documents // read)
    picked = [(stores[(j * step) % documents], j % len(stores[0].ids)) for j in range(read)]
    nodes = [store.get(store.ids[i]) for store, i in picked]
    after = resident_bytes()
    return {"open_bytes": opened - before, "read_bytes": after - opened,
            "file_bytes": sum(store.nbytes(store.ids[i]) for store, i in picked),
            "fp32_bytes": sum(n.k.numel() * 4 + n.v.numel() * 4 for n in nodes),
            "store_bytes": sum((folder / f"doc{d}.kv").stat().st_size for d in range(documents)),
            "tokens_read": sum(len(n) for n in nodes)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--documents", type=int, default=100)
    p.add_argument("--tokens", type=int, default=2048, help="tokens stored per document")
    p.add_argument("--node-tokens", type=int, default=300, help="tokens per node (a chunk)")
    p.add_argument("--read", type=int, default=5, help="nodes a query reads, spread over the documents")
    p.add_argument("--dtype", default="float16", choices=("float32", "float16", "int8"))
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: measure the stores in this folder
    args = p.parse_args(argv)
    for name in ("documents", "tokens", "node_tokens", "read", "layers", "kv_heads", "head_dim"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.child:
        print(json.dumps(child(Path(args.child), args.documents, args.read)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        write_stores(Path(tmp), args)
        out = subprocess.run([sys.executable, "-m", "nodekv.bench.node_store_memory", "--child", tmp,
                              "--documents", str(args.documents), "--read", str(args.read)],
                             capture_output=True, text=True, check=True)
    r = json.loads(out.stdout)
    mib = 2 ** 20
    print(f"## {args.documents} node stores of {args.tokens} tokens ({args.dtype}; {args.layers} layers, "
          f"{args.kv_heads} KV heads of {args.head_dim})\n")
    print("| | MiB |\n|---|---:|")
    print(f"| the stores on disk | {r['store_bytes'] / mib:.1f} |")
    print(f"| resident growth opening all of them | {r['open_bytes'] / mib:.2f} |")
    print(f"| resident growth reading {args.read} nodes ({r['tokens_read']} tokens) | {r['read_bytes'] / mib:.2f} |")
    print(f"| those nodes in the file | {r['file_bytes'] / mib:.2f} |")
    print(f"| those nodes decoded to fp32 | {r['fp32_bytes'] / mib:.2f} |")
    bound = r["file_bytes"] + r["fp32_bytes"]
    print(f"\nStore size: {r['store_bytes'] / (args.documents * args.tokens) / 1e3:.1f} KB per token. Reading grew "
          f"the resident size by {r['read_bytes'] / bound:.3f}x the nodes read (bound: their bytes in the file plus "
          f"their fp32 copies), {(r['read_bytes'] - r['fp32_bytes']) / mib:+.2f} MiB beside the fp32 copies alone "
          f"(a read drops its mapped pages once decoded); target <= 1.0x: "
          f"{'met' if r['read_bytes'] <= bound else 'not met'}.")


if __name__ == "__main__":
    main()
