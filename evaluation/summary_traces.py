"""What the summarisation runs' traces show, one row per run file: records, ROUGE-L, how long the summaries are and
how many ran to the token limit, and for GoR runs how many of the retrieved nodes are LLM responses rather than
document chunks (the part of the graph GoR adds).

    python -m nodekv.evaluation.summary_traces RUN.jsonl... [--limit 512]

The token limit is read from each run's meta ("generation": {"max_new_tokens"}) where it was recorded, else --limit.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def run_stats(path: Path, default_limit: int) -> dict:
    """One run file's row: counts over its answered records (error lines are counted apart)."""
    meta = path.with_name(path.name.removesuffix(".jsonl") + ".meta.json")
    limit = default_limit
    if meta.exists():
        limit = json.loads(meta.read_text()).get("generation", {}).get("max_new_tokens", default_limit)
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    done = [x for x in lines if "error" not in x]
    kinds = [n["kind"] for x in done for t in x.get("trace") or [] if isinstance(t, dict)
             for n in t.get("nodes") or [] if isinstance(n, dict) and "kind" in n]
    mean = (lambda v: sum(v) / len(v)) if done else (lambda v: float("nan"))
    return {"run": path.name.removesuffix(".jsonl"), "records": len(done), "errors": len(lines) - len(done),
            "rougeL": 100 * mean([x["metrics"]["rougeL"] for x in done]),
            "tokens": mean([x["generated_tokens"] for x in done]),
            "at_limit": sum(x["generated_tokens"] >= limit for x in done),
            "responses": f"{kinds.count('response')}/{len(kinds)}" if kinds else "-"}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--limit", type=int, default=512, help="token limit of runs whose meta does not record it")
    args = ap.parse_args(argv)
    print("| run | records | errors | ROUGE-L | generated tokens | at the limit | responses among nodes |")
    print("|---|---|---|---|---|---|---|")
    for path in args.runs:
        s = run_stats(path, args.limit)
        print(f"| {s['run']} | {s['records']} | {s['errors']} | {s['rougeL']:.1f} | {s['tokens']:.0f} | "
              f"{s['at_limit']} | {s['responses']} |")


if __name__ == "__main__":
    main()
