"""Seconds to first token and query FLOPs of BM25 Top-k with its chunks prefilled in the prompt (kv_reuse=off), placed
from the node store (reuse) and placed with a fraction of their tokens recomputed (blend: those whose keys deviate
most, or each chunk's first tokens), side by side on the same dev records in one process, and the store's size per
token in each dtype.

Each record is indexed once with its chunks' KV stored (charged to the index, not timed); every setting then answers
the record's question from that index, the settings in a rotated order per record so that none always runs first
(a machine shared with other work slows them alike). Time to first token is `Answer.prompt_s`: from the question to
the prompt in the cache, the chunks placed and repaired included. The store sizes are the bytes of the node store
file (`write_node_store`) of each record's chunks, per stored token.

    python -m nodekv.bench.stored_nodes [--model qwen2.5-1.5b] [--dataset hotpotqa] [--records 5]
                                        [--repair 0.05,0.15,0.3] [--repair-by deviation,boundary] [--k 5]
                                        [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path


def _fractions(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-1.5b")
    p.add_argument("--dataset", default="hotpotqa")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--records", type=int, default=5, help="the first N good records")
    p.add_argument("--k", type=int, default=5, help="chunks retrieved")
    p.add_argument("--repair", type=_fractions, default=[0.05, 0.15, 0.3], help="blend's repaired fractions")
    p.add_argument("--repair-by", type=lambda t: t.split(","), default=["deviation", "boundary"],
                   help="blend's rules for which tokens to repair")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if min(args.records, args.threads) < 1:
        p.error("--records and --threads must be at least 1")

    import nodekv
    from nodekv.engine.node_store import STORE_DTYPES, write_node_store
    from nodekv.evaluation.datasets import load_dataset
    from nodekv.evaluation.metrics import score
    from nodekv.methods.baselines import BM25TopK
    from nodekv.methods.index_file import model_id
    from nodekv.methods.prompts import prompt_for

    settings = {"off": {"kv_reuse": "off"}, "reuse": {"kv_reuse": "reuse"},
                **{f"blend {r:g} by {by}": {"kv_reuse": "blend", "repair": r, "repair_by": by}
                   for by in args.repair_by for r in args.repair}}
    for options in settings.values():  # the method's own checks of k, repair and repair_by, before any loading
        try:
            BM25TopK.configure(k=args.k, **options)
        except ValueError as e:
            p.error(str(e))
    records = load_dataset(args.dataset, args.data_dir, args.records).records  # refuses a missing set before loading
    engine = nodekv.load_engine(args.model, threads=args.threads)
    prompt = prompt_for(args.dataset)
    methods = {name: BM25TopK(engine, prompt, k=args.k, **options) for name, options in settings.items()}
    rows = {name: {"ttft": [], "flops": [], "f1": []} for name in settings}
    store_bytes = {dtype: 0 for dtype in STORE_DTYPES}
    stored_tokens = 0
    for i, record in enumerate(records):
        index = methods["reuse"].index(record.document)
        names = list(settings)[i % len(settings):] + list(settings)[:i % len(settings)]
        for name in names:
            used = replace(index, stored=None) if name == "off" else index
            answer = methods[name].answer(used, record.question, record.options)
            rows[name]["ttft"].append(answer.prompt_s)
            rows[name]["flops"].append(answer.flops)
            rows[name]["f1"].append(score(record, answer.text).get("f1", 0.0))
        with tempfile.TemporaryDirectory() as tmp:
            for dtype in STORE_DTYPES:
                path = Path(tmp) / f"{dtype}.kv"
                write_node_store(path, dict(enumerate(index.stored)), model_id(engine), dtype)
                store_bytes[dtype] += path.stat().st_size
        stored_tokens += sum(len(node) for node in index.stored)
        print(f"record {i + 1}/{len(records)} done", flush=True)

    off_ttft, off_flops = statistics.mean(rows["off"]["ttft"]), statistics.mean(rows["off"]["flops"])
    print(f"\n## BM25 Top-{args.k} with stored chunks, {args.model}, {args.dataset} records 0-{len(records) - 1}, "
          f"{args.threads} threads\n")
    print("| kv_reuse | s to first token | faster than off | query TFLOPs | fewer than off | F1 |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        ttft, flops = statistics.mean(r["ttft"]), statistics.mean(r["flops"])
        print(f"| {name} | {ttft:.2f} | {off_ttft / ttft:.2f}x | {flops / 1e12:.3f} | {off_flops / flops:.1f}x | "
              f"{100 * statistics.mean(r['f1']):.1f} |")
    print(f"\nNode store per stored token ({stored_tokens} tokens in {len(records)} records; KB per token = MB per 1K "
          "tokens): " + ", ".join(f"{dtype} {store_bytes[dtype] / stored_tokens / 1e3:.1f} KB" for dtype in STORE_DTYPES))


if __name__ == "__main__":
    main()
