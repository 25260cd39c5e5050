"""Correct the full-context lines that paid their document's shared prefix a second time: the first question a resumed
run answered in a half-done document prefilled the prefix again in the new process (before eval lines recorded
`prefixes_paid`, so the run could not know it was paid), and was charged for it. An uninterrupted run charges the
prefix to the document's first question only, and each later one records it as saved.

A line is corrected when it saved nothing while other lines of its document saved the prefix. The prefix length L
is what those lines' prompts share and did not run (prompt_tokens - query_tokens, one value for all of them), and
the correction is exact: the prefix's prefill, forward_flops(L) on the model (checked equal to what the siblings
saved) and on the 8B projection, moves from the line's charged FLOPs and tokens to its saved FLOPs. Idempotent.

    python repaid_prefix.py [run.jsonl ...]   # from results/issue31; default runs/full-quality.jsonl
"""
import json
import sys
from pathlib import Path

from nodekv.engine.config import PRESETS
from nodekv.engine.flops import forward_flops
from nodekv.paths import write_atomic

HERE = Path(__file__).resolve().parent.parent
MODEL, PROJECTED = PRESETS["qwen2.5-1.5b"], PRESETS["llama-3.1-8b"]


def corrected(lines: list[dict]) -> int:
    """Correct `lines` in place; returns how many changed."""
    changed = 0
    for line in lines:
        siblings = [s for s in lines if s.get("document") == line.get("document") and s.get("query_flops_saved")]
        if "error" in line or line.get("query_flops_saved") or not siblings:
            continue
        (prefix,) = {s["prompt_tokens"] - s["query_tokens"] for s in siblings}
        (saved,) = {s["query_flops_saved"] for s in siblings}
        assert forward_flops(MODEL, prefix) == saved, (line["id"], prefix, saved)
        if line is min(siblings + [line], key=lambda s: lines.index(s)):
            continue  # the document's first question: it paid the prefix for all of them
        line["query_flops"] -= saved
        line["query_flops_8b"] -= forward_flops(PROJECTED, prefix)
        line["query_flops_saved"] = saved
        line["query_tokens"] -= prefix
        changed += 1
    return changed


def main() -> None:
    for path in [Path(p) for p in sys.argv[1:]] or [HERE / "runs" / "full-quality.jsonl"]:
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        n = corrected(lines)
        if n:
            write_atomic(path, "".join(json.dumps(x) + "\n" for x in lines))
        print(f"{path}: {n} line(s) corrected")


if __name__ == "__main__":
    main()
