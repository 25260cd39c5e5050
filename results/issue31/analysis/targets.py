"""Each method row against the issue's two targets, from the run files in runs/:
(a) at least its matched best Top-X: of the BM25 and dense rows matched to the method's query FLOPs, the one that
scores higher; full context where the method costs more than reading the whole document afresh (a Top-X matched to
it would read every chunk). On QuALITY full context's mean cost is per question over a prefix the story's questions
share, while a Top-X reads its chunks fresh for each question, so the afresh read there is the story's first
question's (~98 TFLOPs), and JERR (28) has matched rows;
(b) within 10 points of full context at no more than 60% of full context's query FLOPs (8B projection).
Scores and paired differences are on the records both runs answered, with 95% bootstrap intervals; a row whose
method run or every matched run is unfinished is printed as still to run, and a matched run still running is named
beside the best finished one. PECAN with t_p calibrated on records 40-49 (its runs in ../runs-calibrated) has no
Top-X matched to it: its matched row is the BM25 Top-k (k = 1, 3, 5, 8) nearest to it in query FLOPs.
Beside (a), the stricter reading: the best of every finished BM25 or dense Top-X run on the set (any k, matched to any
method) whose mean query FLOPs on the method's records are at most the method's (its own matched rows count as at
its cost: matching picks the k nearest in FLOPs, which can read a few percent more), and full context where the
method costs more than a full read afresh. Top-X curves over k are not monotone, so a cheaper k can beat the one
matched by cost.

    python analysis/targets.py       # from results/issue31; prints a markdown table
"""
import json
from pathlib import Path

from nodekv.evaluation.report import bootstrap_difference

RUNS = Path(__file__).resolve().parent.parent / "runs"
METRIC = {"hotpotqa": "f1", "2wikimqa": "f1", "musique": "f1", "quality": "accuracy", "multi_news": "rougeL"}
MULTI_HOP = ("hotpotqa", "2wikimqa", "musique")
BM25_CURVE = ("bm25-top1", "bm25-top3", "bm25-top5", "bm25-top8")  # a tuple: the one nearest in FLOPs is matched
# (method row, its run stem under runs/, the sets it is judged on, its matched Top-X run stems by set: a list, the
# best-scoring of them)
ROWS = [("PECAN", "pecan", (*MULTI_HOP, "quality"),
         {"hotpotqa": ["bm25-top5", "dense-topx-pecan"], "2wikimqa": ["bm25-topx-pecan", "dense-topx-pecan"],
          "quality": ["bm25-topx-pecan", "dense-topx-pecan"]}),
        ("PECAN, t_p calibrated", "../runs-calibrated/pecan-calibrated", MULTI_HOP,
         {ds: BM25_CURVE for ds in MULTI_HOP}),
        ("DICE Alg. 1", "dice-algorithm=1", MULTI_HOP, {}),
        ("DICE Alg. 2", "dice", MULTI_HOP, {}),
        ("DICE Alg. 2, notes=false rerank=false", "dice-notes=False-rerank=False", MULTI_HOP,
         {ds: ["bm25-topx-dice-fix", "dense-topx-dice-fix"] for ds in MULTI_HOP}),
        ("JERR", "jerr", ("quality",), {"quality": ["bm25-topx-jerr", "dense-topx-jerr"]}),
        ("JERR, read=pages", "jerr-read=pages", ("quality",), {"quality": ["bm25-topx-jerr-pages"]}),
        ("GoR", "gor", ("multi_news",), {"multi_news": ["bm25-topx-gor", "dense-topx-gor"]}),
        ("GoR, rank=fused", "gor-rank=fused", ("multi_news",), {"multi_news": ["bm25-topx-gor", "dense-topx-gor"]})]


def load(stem: str, dataset: str) -> dict[str, dict] | None:
    path = RUNS / f"{stem}-{dataset}.jsonl"
    if not path.exists():
        return None
    lines = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return {r["id"]: r for r in lines if "metrics" in r}


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def fresh_read(full: dict) -> float:
    """Query FLOPs (8B) of reading a record's whole document afresh, averaged over the records: a document's
    dearest full-context line, the one that prefilled the prefix its other questions forked (QuALITY)."""
    dearest = {}
    for r in full.values():
        dearest[r["document"]] = max(dearest.get(r["document"], 0), r["query_flops_8b"])
    return mean(dearest[r["document"]] for r in full.values())


def against(method: dict, other: dict, key: str) -> tuple[int, float, float, float]:
    ids = sorted(set(method) & set(other))  # the report's order, so its intervals are these
    return (len(ids), *bootstrap_difference([100 * method[i]["metrics"][key] for i in ids],
                                            [100 * other[i]["metrics"][key] for i in ids]))


def best_read_within(run: dict, dataset: str, key: str, matched: list[str]) -> tuple[str, dict] | None:
    """The best-scoring finished Top-X run on `dataset` costing at most `run` on its records (or matched to it),
    full context among them where `run` costs more than a full read afresh; None if there is none."""
    own = mean(r["query_flops_8b"] for r in run.values())
    full = load("full", dataset)
    tops = [("full context", full)] if own >= fresh_read(full) else []
    for path in sorted(RUNS.glob(f"*-{dataset}.jsonl")):
        stem = path.name[:-len(f"-{dataset}.jsonl")]
        top = load(stem, dataset) if stem.startswith(("bm25-", "dense-")) else None
        if top and all(i in top for i in run) and (
                stem in matched or mean(top[i]["query_flops_8b"] for i in run) <= own):
            tops.append((stem, top))
    return max(tops, key=lambda t: mean(t[1][i]["metrics"][key] for i in run), default=None)


def main() -> None:
    print("| method | set | n | score | full context | vs full (95%) | query FLOPs / full | matched best Top-X "
          "| vs it (95%) | (a) >= Top-X | best read at <= its cost | vs it (95%) | (b) within 10 at <= 60% |")
    print("|---|---|---:|---:|---:|---|---:|---|---|---|---|---|---|")
    for name, stem, sets, matched in ROWS:
        for ds in sets:
            key, run, full = METRIC[ds], load(stem, ds), load("full", ds)
            if run is None or full is None or len(run) < len(full):
                done = 0 if run is None else len(run)
                print(f"| {name} | {ds} | {done} of {len(full or {}) or '?'} | still to run | | | | | | | | | |")
                continue
            cost = mean(r["query_flops_8b"] for r in run.values()) / mean(r["query_flops_8b"] for r in full.values())
            n, d_full, lo, hi = against(run, full, key)
            if mean(r["query_flops_8b"] for r in run.values()) >= fresh_read(full):
                best, best_name = full, "full context (the method costs more)"
            else:
                stems = matched.get(ds, [])
                runs = {t: load(t, ds) for t in stems}
                tops = [(t, r) for t, r in runs.items() if r is not None and all(i in r for i in run)]
                if isinstance(stems, tuple) and tops:  # a curve over k: its point nearest the method's cost
                    own = mean(r["query_flops_8b"] for r in run.values())
                    tops = [min(tops, key=lambda t: abs(mean(t[1][i]["query_flops_8b"] for i in run) - own))]
                    stems = [tops[0][0]]
                if not tops:
                    print(f"| {name} | {ds} | {n} | {100 * mean(r['metrics'][key] for r in run.values()):.1f} | "
                          f"{100 * mean(full[i]['metrics'][key] for i in run):.1f} | "
                          f"{d_full:+.1f} ({lo:+.1f} .. {hi:+.1f}) | {cost:.2f} | still to run | | | | | |")
                    continue
                best_name, best = max(tops, key=lambda t: mean(t[1][i]["metrics"][key] for i in run))
                unfinished = [t for t in stems if t not in dict(tops)]
                if unfinished:  # the best so far: a matched row still running may score higher
                    best_name += f" ({', '.join(unfinished)} running)"
            _, d_top, tlo, thi = against(run, best, key)
            listed = matched.get(ds, [])
            cheaper = best_read_within(run, ds, key, listed if isinstance(listed, list) else [])
            if cheaper is None:
                strict = "none finished | "
            else:
                _, d_c, clo, chi = against(run, cheaper[1], key)
                strict = f"{cheaper[0]} | {d_c:+.1f} ({clo:+.1f} .. {chi:+.1f})"
            score = 100 * mean(r["metrics"][key] for r in run.values())
            base = 100 * mean(full[i]["metrics"][key] for i in run)
            print(f"| {name} | {ds} | {n} | {score:.1f} | {base:.1f} | {d_full:+.1f} ({lo:+.1f} .. {hi:+.1f}) | "
                  f"{cost:.2f} | {best_name} | {d_top:+.1f} ({tlo:+.1f} .. {thi:+.1f}) | "
                  f"{'yes' if d_top >= 0 else 'no'} | {strict} | "
                  f"{'yes' if d_full >= -10 and cost <= 0.6 else 'no'} |")


if __name__ == "__main__":
    main()
