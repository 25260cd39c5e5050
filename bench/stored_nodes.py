"""Seconds to first token and query FLOPs of a method that reads stored nodes (BM25 or dense Top-k, PECAN, any
method with the `kv_reuse` option), with its nodes prefilled where it reads them (kv_reuse=off), placed from the
node store (reuse) and placed with a fraction of their tokens recomputed (blend: those whose keys deviate most, or
each node's first tokens), side by side on the same dev records in one process, and the store's size per token in
each dtype.

Each record is indexed once with its nodes' KV stored (charged to the index, not timed; with `--indexes`, through
an evaluation's index store, so that indexes `nodekv eval` built are loaded, not rebuilt); every setting then answers
the record's question from that index, the settings in a rotated order per record so that none always runs first (a
machine shared with other work slows them alike). Time to first token is `Answer.prompt_s`: from the question to the
prompt in the cache, the nodes placed and repaired included (for PECAN, its whole search with its probes). The store
sizes are the bytes of the node store file (`write_node_store`) of each record's nodes, per stored token.

    nodekv bench stored_nodes [--method bm25] [--model qwen2.5-1.5b] [--dataset hotpotqa] [--records 5]
                                        [--repair 0.05,0.15,0.3] [--repair-by deviation,boundary] [--k 5]
                                        [--kv-context document] [--indexes DIR] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

from nodekv.bench import count


def _fractions(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", default="bm25", help="a registered method with the kv_reuse option")
    p.add_argument("--model", default="qwen2.5-1.5b")
    p.add_argument("--dataset", default="hotpotqa")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--records", type=count, default=5, help="the first N good records")
    p.add_argument("--k", type=count, default=5, help="chunks retrieved (methods with a k option)")
    p.add_argument("--repair", type=_fractions, default=[0.05, 0.15, 0.3], help="blend's repaired fractions")
    p.add_argument("--repair-by", type=lambda t: t.split(","), default=["deviation", "boundary"],
                   help="blend's rules for which tokens to repair")
    p.add_argument("--kv-context", default=None,
                   help="how the nodes are stored: none (each alone) or document (default: the method's default)")
    p.add_argument("--indexes", type=Path, default=None,
                   help="an index store directory (an evaluation's runs/indexes): indexes found there are loaded, "
                        "others built and saved there")
    p.add_argument("--threads", type=count, default=2)
    args = p.parse_args(argv)
    if min(args.records, args.threads) < 1:
        p.error("--records and --threads must be at least 1")
    if args.indexes is not None and not args.indexes.is_dir():
        p.error(f"--indexes {args.indexes}: no such directory")

    from nodekv.methods.registry import get
    try:
        method_class = get(args.method)
    except ValueError as e:
        p.error(str(e))
    known = {o.name for o in method_class.options}
    if "kv_reuse" not in known:
        p.error(f"method {args.method} has no kv_reuse option: it reads no stored nodes")
    base = {name: value for name, (value, _) in method_class.dataset_defaults(args.dataset).items()}
    base.update({"k": args.k} if "k" in known else {}, **({"kv_context": args.kv_context} if args.kv_context else {}))
    settings = {"off": {"kv_reuse": "off"}, "reuse": {"kv_reuse": "reuse"},
                **{f"blend {r:g} by {by}": {"kv_reuse": "blend", "repair": r, "repair_by": by}
                   for by in args.repair_by for r in args.repair}}
    for options in settings.values():  # the method's own checks of its options, before any loading
        try:
            method_class.configure(**base, **options)
        except ValueError as e:
            p.error(str(e))

    import nodekv
    from nodekv.engine.node_store import STORE_DTYPES, NodeStore, write_node_store
    from nodekv.evaluation.datasets import load_dataset
    from nodekv.evaluation.index_store import IndexStore
    from nodekv.evaluation.metrics import score
    from nodekv.methods.prompts import prompt_for

    records = load_dataset(args.dataset, args.data_dir, args.records).records  # refuses a missing set before loading
    engine = nodekv.load_engine(args.model, threads=args.threads)
    prompt = prompt_for(args.dataset)
    methods = {name: method_class(engine, prompt, **base, **options) for name, options in settings.items()}
    rows = {name: {"ttft": [], "flops": [], "f1": []} for name in settings}
    store_bytes = {dtype: 0 for dtype in STORE_DTYPES}
    stored_tokens, index_flops = 0, []
    with tempfile.TemporaryDirectory() as tmp:
        store = IndexStore.for_method(args.indexes or Path(tmp), engine, methods["reuse"])
        for i, record in enumerate(records):
            built = store.build_or_load(methods["reuse"], record.document)
            index, index_flops = built.index, index_flops + [built.flops]
            names = list(settings)[i % len(settings):] + list(settings)[:i % len(settings)]
            for name in names:
                used = replace(index, stored=None) if name == "off" else index
                answer = methods[name].answer(used, record.question, record.options)
                rows[name]["ttft"].append(answer.prompt_s)
                rows[name]["flops"].append(answer.flops)
                rows[name]["f1"].append(score(record, answer.text).get("f1", 0.0))
            stored = index.stored  # as built: a list (chunks) or a dict (PECAN's nodes); as loaded: a NodeStore
            stored = ({i: stored[i] for i in stored.ids} if isinstance(stored, NodeStore) else
                      stored if isinstance(stored, dict) else dict(enumerate(stored)))
            for dtype in STORE_DTYPES:
                path = Path(tmp) / f"{dtype}.kv"
                write_node_store(path, stored, engine.model_id, dtype)
                store_bytes[dtype] += path.stat().st_size
            stored_tokens += sum(len(node) for node in stored.values())
            print(f"record {i + 1}/{len(records)} done", flush=True)

    off_ttft, off_flops = statistics.mean(rows["off"]["ttft"]), statistics.mean(rows["off"]["flops"])
    print(f"\n## {method_class.title} with stored nodes (kv_context={methods['reuse'].config.kv_context}), {args.model}, "
          f"{args.dataset} records 0-{len(records) - 1}, {args.threads} threads\n")
    print("| kv_reuse | s to first token | faster than off | query TFLOPs | fewer than off | F1 |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        ttft, flops = statistics.mean(r["ttft"]), statistics.mean(r["flops"])
        print(f"| {name} | {ttft:.2f} | {off_ttft / ttft:.2f}x | {flops / 1e12:.3f} | {off_flops / flops:.1f}x | "
              f"{100 * statistics.mean(r['f1']):.1f} |")
    print(f"\nIndex with the nodes' KV: {statistics.mean(index_flops) / 1e12:.2f} TFLOPs (model) a document. Node store "
          f"per stored token ({stored_tokens} tokens in {len(records)} records; KB per token = MB per 1K tokens): "
          + ", ".join(f"{dtype} {store_bytes[dtype] / stored_tokens / 1e3:.1f} KB" for dtype in STORE_DTYPES))


if __name__ == "__main__":
    main()
