"""The qwen2.5-0.5b rows measured before this issue beside the qwen2.5-1.5b rows here, on the records both answered:
each row's primary metric under each model and the paired difference (1.5B - 0.5B) with its 95% bootstrap interval.
The 0.5B runs predate the shared reader (each method read with its own answer prompt), so a difference is the model
and the reader together. Rows whose 1.5B run has answered none of the 0.5B's records yet are left out.

    python small_model.py            # from results/issue31; prints a markdown table
"""
import json
from pathlib import Path

from nodekv.evaluation.report import bootstrap_difference

HERE = Path(__file__).resolve().parent.parent
OLD = HERE.parent
METRIC = {"hotpotqa": "f1", "2wikimqa": "f1", "musique": "f1", "quality": "accuracy", "multi_news": "rougeL"}
# (dataset, row, 0.5B run, 1.5B run)
PAIRS = [(ds, row, OLD / old.format(ds=ds), HERE / "runs" / new.format(ds=ds))
         for ds in ("hotpotqa", "2wikimqa", "musique")
         for row, old, new in (("full context", "issue12/runs/full-{ds}.jsonl", "full-{ds}.jsonl"),
                               ("PECAN", "issue12/runs/pecan-{ds}.jsonl", "pecan-{ds}.jsonl"),
                               ("DICE Alg. 1", "issue13/runs/dice-algorithm=1-{ds}.jsonl",
                                "dice-algorithm=1-{ds}.jsonl"),
                               ("DICE Alg. 2", "issue13/runs/dice-algorithm=2-{ds}.jsonl", "dice-{ds}.jsonl"))]
PAIRS += [("quality", row, OLD / old, HERE / "runs" / new)
          for row, old, new in (("full context", "issue15/runs/full-quality.jsonl", "full-quality.jsonl"),
                                ("JERR", "issue15/runs/jerr-mcts-quality.jsonl", "jerr-quality.jsonl"),
                                ("BM25 Top-X matched to JERR", "issue15/runs/bm25-topx-quality.jsonl",
                                 "bm25-topx-jerr-quality.jsonl"))]
PAIRS += [("multi_news", row, OLD / old, HERE / "runs" / new)
          for row, old, new in (("full context", "issue14/runs/full-multi_news.jsonl", "full-multi_news.jsonl"),
                                ("GoR", "issue14/runs/gor-multi_news.jsonl", "gor-multi_news.jsonl"),
                                ("BM25 Top-6", "issue14/runs/bm25-top6-multi_news.jsonl",
                                 "bm25-topx-gor-multi_news.jsonl"),
                                ("dense Top-6", "issue14/runs/dense-top6-multi_news.jsonl",
                                 "dense-topx-gor-multi_news.jsonl"))]


def answered(path: Path) -> dict[str, dict]:
    lines = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return {r["id"]: r for r in lines if "metrics" in r}


def main() -> None:
    print("| set | row | records | 0.5B | 1.5B | 1.5B - 0.5B (95% interval) | query TFLOPs (8B), 0.5B / 1.5B |")
    print("|---|---|---:|---:|---:|---|---|")
    for ds, row, old_path, new_path in PAIRS:
        if not (old_path.exists() and new_path.exists()):
            continue
        old, new = answered(old_path), answered(new_path)
        ids = sorted(set(old) & set(new))  # the report's order, so the bootstrap draws alike
        if not ids:
            continue
        key = METRIC[ds]
        a, b = [100 * new[i]["metrics"][key] for i in ids], [100 * old[i]["metrics"][key] for i in ids]
        diff, lo, hi = bootstrap_difference(a, b)
        cost = [sum(runs[i]["query_flops_8b"] for i in ids) / len(ids) / 1e12 for runs in (old, new)]
        print(f"| {ds} | {row} | {len(ids)} | {sum(b) / len(b):.1f} | {sum(a) / len(a):.1f} | "
              f"{diff:+.1f} ({lo:+.1f} .. {hi:+.1f}) | {cost[0]:.1f} / {cost[1]:.1f} |")


if __name__ == "__main__":
    main()
