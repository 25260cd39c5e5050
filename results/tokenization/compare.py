"""The relevance probe's ranking, its prompt's parts tokenised apart and whole (relevance-*.jsonl, from
relevance_study.py), and each run under runs/ against the run of the same name in ../issue31/runs (parts tokenised
apart) and against full context, paired by record: means, paired differences with 95% bootstrap intervals (2,000
resamples; QuALITY's accuracy and Multi-News' ROUGE-L in the F1 columns), support recall and query TFLOPs (8B
projection). Usage: python compare.py."""
from __future__ import annotations

import json
from pathlib import Path

from nodekv.evaluation.report import bootstrap_difference

HERE = Path(__file__).resolve().parent
OLD = HERE.parent / "issue31" / "runs"


def lines(path: Path) -> dict[str, dict]:
    rows = [json.loads(line) for line in path.open()]
    return {r["id"]: r for r in rows if "error" not in r}


def relevance() -> None:
    print("| model | records | AUC apart | AUC whole | whole - apart (95%) | supporting chunks in the top 3, apart / whole |")
    print("|---|---:|---:|---:|---|---|")
    for path in sorted(HERE.glob("relevance-*.jsonl")):
        rows = [json.loads(line) for line in path.open()]
        rows = [r for r in rows if r["pieces"]["auc"] is not None]
        auc = {k: [r[k]["auc"] for r in rows] for k in ("pieces", "whole")}
        diff, low, high = bootstrap_difference(auc["whole"], auc["pieces"])
        top = [sum(r[k]["top3_support"] for r in rows) for k in ("pieces", "whole")]
        most = sum(min(3, sum(r["support"])) for r in rows)
        print(f"| {path.stem.split('-', 1)[1]} | {len(rows)} | {sum(auc['pieces']) / len(rows):.3f} | "
              f"{sum(auc['whole']) / len(rows):.3f} | {diff:+.3f} ({low:+.3f} .. {high:+.3f}) | "
              f"{top[0]} / {top[1]} of {most} |")


def runs() -> None:
    print("| run | records | F1 before | F1 now | now - before (95%) | now - full context (95%) | support recall "
          "before / now | query TFLOPs before / now |")
    print("|---|---:|---:|---:|---|---|---|---|")
    for new_path in sorted((HERE / "runs").glob("*.jsonl")):
        if not (OLD / new_path.name).is_file():  # a run new here (GoR's public recipe): nothing before to pair
            continue
        new, old = lines(new_path), lines(OLD / new_path.name)
        dataset = new_path.stem.rsplit("-", 1)[1]
        full = lines(OLD / f"full-{dataset}.jsonl")
        ids = sorted(set(new) & set(old) & set(full))
        if not ids:
            continue
        metric = next(m for m in ("accuracy", "rougeL", "f1") if m in new[ids[0]]["metrics"])  # QuALITY, Multi-News
        f1 = {name: [100 * run[i]["metrics"][metric] for i in ids] for name, run in
              (("new", new), ("old", old), ("full", full))}
        cells = [f"{sum(f1[k]) / len(ids):.1f}" for k in ("old", "new")]
        for base in ("old", "full"):
            diff, low, high = bootstrap_difference(f1["new"], f1[base])
            cells.append(f"{diff:+.1f} ({low:+.1f} .. {high:+.1f})")
        recall = [sum(run[i]["support_recall"] for i in ids) / len(ids) for run in (old, new)] \
            if "support_recall" in new[ids[0]] else None  # sets with supporting-passage labels only
        flops = [sum(run[i]["query_flops_8b"] for i in ids) / len(ids) / 1e12 for run in (old, new)]
        cells += [f"{100 * recall[0]:.1f}% / {100 * recall[1]:.1f}%" if recall else "-",
                  f"{flops[0]:.1f} / {flops[1]:.1f}"]
        print(f"| {new_path.stem} | {len(ids)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    relevance()
    print()
    runs()
