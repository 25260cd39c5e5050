"""Where DICE's wrong answers go wrong, read off its traces: for each answered record of a DICE run file, whether a
reference answer (LongBench-normalised) occurs in what T was given (facts, thoughts), in the chunks retrieved, or
only in chunks never retrieved.

    right          F1 >= 0.5
    answer         wrong, though a reference occurs in a fact or thought written into T
    extraction     a reference occurs in a retrieved chunk, but in no fact or thought
    retrieval      a reference occurs in the document, but in no retrieved chunk
    not verbatim   no reference occurs verbatim in the document (yes/no questions, paraphrased answers)

Also per run: steps per question, how the runs stopped, and how often the first step restates the question (at
least 80% of its words are the question's).

    python -m nodekv.bench.dice_failures RUN.jsonl... [--records]
"""
from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

from nodekv.bench.pecan_failures import mentions, table_row

CATEGORIES = ("right", "answer", "extraction", "retrieval", "not verbatim")


def classify(f1: float, references: list[str], written: str, retrieved: str, document: str) -> str:
    if f1 >= 0.5:
        return "right"
    for kind, text in (("answer", written), ("extraction", retrieved), ("retrieval", document)):
        if mentions(text, references):
            return kind
    return "not verbatim"


def restates(step: str, question: str) -> bool:
    words = lambda t: set(re.findall(r"\w+", t.lower()))  # noqa: E731
    asked = words(step)
    return bool(asked) and len(asked & words(question)) >= 0.8 * len(asked)


def main(argv: list[str] | None = None) -> None:
    from nodekv.methods.data import load_dataset
    from nodekv.methods.dice import word_chunks
    from nodekv.methods.evaluate import read_done

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="DICE run files (<label>-<dataset>.jsonl)")
    ap.add_argument("--records", action="store_true", help="one line per record as well")
    args = ap.parse_args(argv)
    print("| run | n | " + " | ".join(CATEGORIES) + " | steps | first step restates Q | stops |")
    print("|---|---|" + "---|" * (len(CATEGORIES) + 3))
    for path in args.runs:
        meta = json.loads(path.with_suffix(".meta.json").read_text())
        records = {r.id: r for r in load_dataset(meta["dataset"], None, meta["records"]).records}
        words = meta["options"].get("chunk_words", 80)
        counts, stops, steps, restated, lines = Counter(), Counter(), 0, 0, []
        for r in (r for r in read_done(path) if "error" not in r):
            chunks = word_chunks(records[r["id"]].document, words)
            trace = r["trace"][:-1]
            written = "\n".join(s.get("fact", s.get("thought", "")) for s in trace)
            retrieved = "\n".join(chunks[c["chunk"]] for s in trace for c in s.get("retrieved", ()))
            kind = classify(r["metrics"]["f1"], r["references"], written, retrieved, "\n".join(chunks))
            counts[kind] += 1
            stops[r["trace"][-1]["stop"]] += 1
            steps += len(trace)
            first = trace[0].get("subquestion", trace[0].get("draft", "")) if trace else ""
            restated += restates(first, r["question"])
            lines.append(f"  {kind:12s} f1={r['metrics']['f1']:.2f} steps={len(trace)} "
                         f"{r['prediction'][:40]!r} <- {r['references']}")
        stopped = ", ".join(f"{why} {k}" for why, k in sorted(stops.items()))
        print(table_row(meta, counts, CATEGORIES, f"{steps / max(sum(counts.values()), 1):.1f}", restated, stopped))
        if args.records:
            print("\n".join(lines))


if __name__ == "__main__":
    main()
