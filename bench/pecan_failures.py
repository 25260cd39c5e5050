"""Where PECAN's wrong answers go wrong, read off its traces: for each answered record of a PECAN run file, whether
a reference answer (LongBench-normalised) occurs in the nodes the search read, in the graph's top level, or only
in chunks the search never reached.

    right          F1 >= 0.5
    answer turn    wrong, though a reference occurs in the nodes that were read
    search         wrong; a reference occurs in the document's chunks, but not in any node that was read
    not verbatim   wrong; no reference occurs verbatim in the document (yes/no questions, paraphrased answers)

    python -m nodekv.bench.pecan_failures RUN.jsonl... [--records] [--indexes DIR]

The indexes are read from the run directory's index store (<run dir>/indexes, as `nodekv eval` left them) or from
--indexes DIR.
"""
from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

CATEGORIES = ("right", "answer turn", "search", "not verbatim")


def mentions(text: str, references: list[str]) -> bool:
    """Whether a reference, LongBench-normalised, occurs in the normalised text as whole words."""
    from nodekv.methods.metrics import normalize_answer

    words = f" {normalize_answer(text)} "
    return any(f" {normalize_answer(r)} " in words for r in references if normalize_answer(r))


def table_row(meta: dict, counts: Counter, categories: tuple[str, ...], *extra) -> str:
    """A run's Markdown row: its label and dataset, n, the count per category, then `extra` cells."""
    cells = [f"{meta['method']} {meta['dataset']}", sum(counts.values()), *(counts[c] for c in categories), *extra]
    return "| " + " | ".join(map(str, cells)) + " |"


def classify(f1: float, references: list[str], read: str, document: str) -> str:
    if f1 >= 0.5:
        return "right"
    if mentions(read, references):
        return "answer turn"
    return "search" if mentions(document, references) else "not verbatim"


def main(argv: list[str] | None = None) -> None:
    from nodekv import load_engine
    from nodekv.methods.evaluate import read_done
    from nodekv.methods.index_store import IndexStore
    from nodekv.methods.pecan import Pecan

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="PECAN run files (<label>-<dataset>.jsonl)")
    ap.add_argument("--records", action="store_true", help="one line per record as well")
    ap.add_argument("--indexes", type=Path, default=None, help="the index store (default: <run dir>/indexes)")
    args = ap.parse_args(argv)
    eng = load_engine(None, threads=1)
    print("| run | n | " + " | ".join(CATEGORIES) + " | reference in the top level |")
    print("|---|---|" + "---|" * (len(CATEGORIES) + 1))
    for path in args.runs:
        meta = json.loads(path.with_suffix(".meta.json").read_text())
        method = Pecan(eng, **meta["options"])
        store = IndexStore.for_method(args.indexes or path.parent / "indexes", eng, method)
        counts, in_top, lines = Counter(), 0, []
        for r in (r for r in read_done(path) if "error" not in r):
            found = store.get(method, r["document"])
            if found is None:
                raise SystemExit(f"no index of document {r['document']} in {store.root} (--indexes DIR)")
            graph = found[0].graph
            read = "\n".join(graph.nodes[i].text for i in r["nodes"])
            document = "\n".join(n.text for n in graph.nodes.values() if n.level == 1)
            kind = classify(r["metrics"]["f1"], r["references"], read, document)
            counts[kind] += 1
            in_top += mentions("\n".join(graph.nodes[i].text for i in graph.top_level), r["references"])
            lines.append(f"  {kind:12s} f1={r['metrics']['f1']:.2f} nodes={len(r['nodes']):2d} "
                         f"{r['prediction'][:50]!r} <- {r['references']}")
        print(table_row(meta, counts, CATEGORIES, in_top))
        if args.records:
            print("\n".join(lines))


if __name__ == "__main__":
    main()
