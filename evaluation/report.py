"""`nodekv eval report`: a Table-1-style comparison of runs (quality against query TFLOPs, measured on the model
and projected to llama-3.1-8b, and tokens the model ran per query and per index, JERR's Table 6), Table A4's
amortisation of index FLOPs over 1/2/4/8 queries per document, paired differences between runs with bootstrap
intervals, written as Markdown and as a PNG plot of F1 against TFLOPs."""
from __future__ import annotations

import json
import random
import re
from collections import Counter, defaultdict
from pathlib import Path
from statistics import mean, quantiles

from ..paths import atomic_path, read_json_lines, write_atomic


# a retrieval run's label (`RunConfig.label`): fixed k (bm25-top5) or matched to a method's FLOPs (bm25-topx-pecan),
# which picks one k for the whole run, so both are points of the retriever's Top-X curve over k; a label with other
# options or an answer budget (key=value) is a point of its own, not to be joined with the defaults' runs
TOP_K_RUN = re.compile(r"(bm25|dense)-top(\d+|x-[^=]+)")
SWEEPS_SUFFIX = ".sweeps.jsonl"  # `nodekv calibrate`'s log of its dev records' sweeps, beside the runs: not a run


def read_meta(path: Path) -> dict:
    """A run's .meta.json, or a ValueError naming the file if it does not hold a JSON object."""
    try:
        meta = json.loads(path.read_text())
    except ValueError as e:  # not JSON, or not UTF-8
        raise ValueError(f"{path} is not JSON ({e})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path} is not a run's meta file (a JSON object)")
    return meta


def run_meta(path: Path) -> tuple[str, str, dict]:
    """A run file's (method, dataset, meta): from its meta file, else from its name (METHOD-DATASET.jsonl)."""
    meta_path = path.with_suffix(".meta.json")
    meta = read_meta(meta_path) if meta_path.exists() else {}
    method, dataset = meta.get("method"), meta.get("dataset")
    if method is None:
        method, _, dataset = path.stem.rpartition("-")
    return method, dataset, meta


def summarize(path: Path) -> dict:
    """Means over a run file's answered records, with counts of failed and skipped ones; a ValueError naming the
    file when it does not read as a run (a dataset file, say)."""
    try:
        return _summarize(path)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path} does not read as a nodekv run file ({type(e).__name__}: {e})") from None


def current_lines(rows: list[dict]) -> list[dict]:
    """A run file's lines, one per record: its last answer, or its last error line while it has none. A resumed run
    appends its retry of a failed record at once (so a kill loses none of it) and drops the lines it replaced when
    it ends; a record answered twice (two runs appended to one file by hand) counts once, as in a pair."""
    last_answer = {r.get("id"): i for i, r in enumerate(rows) if "error" not in r}
    last_error = {r.get("id"): i for i, r in enumerate(rows) if "error" in r}
    return [r for i, r in enumerate(rows) if i == last_answer.get(r.get("id"), last_error.get(r.get("id")))]


def _summarize(path: Path) -> dict:
    rows = current_lines(read_json_lines(path))
    ok = [r for r in rows if "error" not in r]
    method, dataset, meta = run_meta(path)
    docs: dict[str, tuple[int, int]] = {}
    index_s: dict[str, float] = {}
    index_tokens: dict[str, int] = {}
    for r in ok:
        docs[r["document"]] = (r["index_flops"], r["index_flops_8b"])
        index_s[r["document"]] = r.get("index_s", 0.0)
        if r.get("index_tokens") is not None:
            index_tokens[r["document"]] = r["index_tokens"]
    metric_names = sorted({k for r in ok for k in r["metrics"]})
    out = {"method": method, "dataset": dataset, "n": len(ok), "errors": len(rows) - len(ok),
           "reader": ok[0].get("reader", "-") if ok else "-",
           "skipped": len(meta.get("skipped", [])), "docs": len(docs)}
    if not ok:
        return out
    out.update({m: 100 * mean(r["metrics"].get(m, 0.0) for r in ok) for m in metric_names})
    # an index built without the 8B projection set (model FLOPs > 0, projected 0) has no projected cost
    projected = [f8 for f, f8 in docs.values() if f8 > 0 or f == 0]
    out.update(nodes=mean(len(r["nodes"]) for r in ok), wall_s=mean(r["wall_s"] for r in ok),
               query_tflops=mean(r["query_flops"] for r in ok) / 1e12,
               query_tflops_8b=mean(r["query_flops_8b"] for r in ok) / 1e12,
               saved_tflops=mean(r.get("query_flops_saved", 0) for r in ok) / 1e12,
               index_tflops_doc=mean(f for f, _ in docs.values()) / 1e12,
               index_docs_8b=len(projected), index_s_doc=mean(index_s.values()),
               truncated=sum(bool(r.get("truncated")) for r in ok))
    prompt_s = [r["prompt_s"] for r in ok if r.get("prompt_s") is not None]  # runs before it was recorded lack it
    if len(prompt_s) == len(ok):
        out["prompt_s"] = mean(prompt_s)
    if projected:
        out["index_tflops_doc_8b"] = mean(projected) / 1e12
    if all("query_tokens" in r for r in ok):  # lines written before tokens were counted have none
        out["query_tokens"] = mean(r["query_tokens"] for r in ok)
    if len(index_tokens) == len(docs):
        out["index_tokens_doc"] = mean(index_tokens.values())
    fits = {r["fit_s"] for r in ok if "fit_s" in r}  # one per fold (methods that learn across documents)
    if fits:
        out["fit_s"] = mean(fits)
    out.update(_search_stats([step for r in ok for step in r.get("trace", [])]))
    out.update(_diagnostics(ok))
    out.update(_summaries(ok, meta))
    out["settings"] = {k: f"{meta['options'][k]} ({source})" for k, source in meta.get("option_sources", {}).items()}
    if (m := TOP_K_RUN.fullmatch(method)) is not None:  # k from the meta, or a fixed-k label's where there is none
        k = str(meta.get("options", {}).get("k", m.group(2)))
        if k.isdigit():
            out["top_k"] = (m.group(1), int(k))
    return out


def _diagnostics(ok: list[dict]) -> dict:
    """Reader-independent counts: on records with marked support, the mean share of supporting passages the reader
    read and the wrong answers split into retrieval and reader misses; on multiple choice, the accuracy of always
    answering the letter the gold answers hold most often and of the content-free prompts' own answers (each
    prior's most probable letter), and how often each letter was answered."""
    out = {}
    marked = [r for r in ok if "support" in r]
    if marked:
        misses = Counter(r["miss"] for r in marked)
        out.update(support_n=len(marked), support_recall=100 * mean(r["support_recall"] for r in marked),
                   retrieval_misses=misses["retrieval"], reader_misses=misses["reader"])
    scored = [r for r in ok if "choice_probs" in r]
    if scored:
        gold = Counter(r["references"][0].strip().upper() for r in scored)
        content_free = [chr(65 + max(range(len(r["choice_prior"])), key=r["choice_prior"].__getitem__))
                        for r in scored]
        right = sum(c == r["references"][0].strip().upper() for c, r in zip(content_free, scored))
        out.update(mc_n=len(scored), majority_letter=gold.most_common(1)[0][0],
                   majority_letter_acc=100 * gold.most_common(1)[0][1] / len(scored),
                   content_free_acc=100 * right / len(scored),
                   letters_raw=dict(sorted(Counter(r["prediction"] for r in scored).items())),
                   letters_calibrated=dict(sorted(Counter(r["calibrated"] for r in scored).items())))
    return out


def _summaries(ok: list[dict], meta: dict) -> dict:
    """For summarisation runs (ROUGE metrics): mean generated tokens, how many summaries ran to the token budget
    (the run's meta records it), and for runs whose traces name node kinds (GoR) the LLM responses among the
    retrieved nodes."""
    if not ok or "rougeL" not in ok[0]["metrics"] or any("generated_tokens" not in r for r in ok):
        return {}
    limit = meta.get("generation", {}).get("max_new_tokens")
    kinds = [n["kind"] for r in ok for t in r.get("trace") or [] if isinstance(t, dict)
             for n in t.get("nodes") or [] if isinstance(n, dict) and "kind" in n]
    out = {"summary_tokens": mean(r["generated_tokens"] for r in ok)}
    if limit is not None:
        out["at_limit"] = sum(r["generated_tokens"] >= limit for r in ok)
    if kinds:
        out["responses"] = f"{kinds.count('response')}/{len(kinds)}"
    return out


def primary_metric(summary: dict) -> str:
    """The metric a run's task is judged by: accuracy (multiple choice), EM (variable tracking), ROUGE-L
    (summaries), else F1 (QA)."""
    for key, marker in (("accuracy", "accuracy"), ("em", "recall"), ("rougeL", "rougeL")):
        if marker in summary:
            return key
    return "f1"


def _search_stats(steps: list[dict]) -> dict:
    """How searches stopped (steps {"stop": why}) and, for searches that pick nodes by z + similarity (steps with
    "z", "sim" and "by_sim"), how often z changed the pick from the similarity-only one, and both terms' ranges."""
    stops = Counter(step["stop"] for step in steps if "stop" in step)
    picks = [step for step in steps if "by_sim" in step]
    out = {"stops": dict(stops)} if stops else {}
    if picks:
        out.update(picks=len(picks), z_changed=sum(step["by_sim"] != step["node"] for step in picks),
                   z_range=(min(p["z"] for p in picks), max(p["z"] for p in picks)),
                   sim_range=(min(p["sim"] for p in picks), max(p["sim"] for p in picks)))
    return out


def table(summaries: list[dict], reference: str | None = None) -> str:
    """Markdown: one row per (dataset, method); ratio = query TFLOPs over the reference method's on that dataset."""
    ref = {s["dataset"]: s.get("query_tflops_8b") for s in summaries if s["method"] == reference}
    head = ("| dataset | method | n | failed | skipped | F1 | EM | ROUGE-1 | ROUGE-2 | ROUGE-L | acc | nodes | "
            "query TFLOPs (model) | "
            "prefix TFLOPs saved (model) | query TFLOPs (8B) | ratio | tokens/query | index TFLOPs/doc (model) | "
            "index TFLOPs/doc (8B) | index tokens/doc | index s/doc | fit s/fold | truncated | s to first token | "
            "s/query |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in sorted(summaries, key=lambda s: (s["dataset"], s.get("query_tflops_8b", 0))):
        def f(key, fmt="{:.1f}"):
            return fmt.format(s[key]) if key in s else "-"
        r = ref.get(s["dataset"])
        index_8b = f("index_tflops_doc_8b", "{:.2f}")
        if s.get("index_docs_8b", s["docs"]) < s["docs"]:
            index_8b += f" ({s['index_docs_8b']} of {s['docs']} docs)"
        ratio = f"{s['query_tflops_8b'] / r:.2f}" if r and "query_tflops_8b" in s else "-"
        rouge_l = f("rougeL") if "rougeL" in s else f("rouge_l")  # summaries' rouge-score name, QA's own
        lines.append(f"| {s['dataset']} | {s['method']} | {s['n']} | {s['errors']} | {s['skipped']} | {f('f1')} | "
                     f"{f('em')} | {f('rouge1')} | {f('rouge2')} | {rouge_l} | {f('accuracy')} | {f('nodes')} | "
                     f"{f('query_tflops', '{:.4f}')} | "
                     f"{f('saved_tflops', '{:.4f}')} | {f('query_tflops_8b', '{:.2f}')} | {ratio} | "
                     f"{f('query_tokens', '{:.0f}')} | {f('index_tflops_doc', '{:.4f}')} | {index_8b} | "
                     f"{f('index_tokens_doc', '{:.0f}')} | {f('index_s_doc', '{:.0f}')} | "
                     f"{f('fit_s', '{:.0f}')} | {s.get('truncated', '-')} | {f('prompt_s', '{:.2f}')} | "
                     f"{f('wall_s', '{:.2f}')} |")
    return "\n".join(lines)


def searches(summaries: list[dict]) -> str:
    """Markdown: per search run, its defaulted settings and where they came from, how its searches stopped, and how
    often z (Eq. 1) changed the similarity-only pick, with the ranges of both terms over the picks."""
    lines = ["| dataset | method | settings | stops | picks | z changed the pick | z range | similarity range |",
             "|---|---|---|---|---|---|---|---|"]
    for s in sorted(summaries, key=lambda s: (s["dataset"], s["method"])):
        if "stops" not in s:
            continue
        settings = "; ".join(f"{k}={v}" for k, v in s["settings"].items()) or "-"
        stops = ", ".join(f"{why} {n}" for why, n in sorted(s["stops"].items()))
        if "picks" in s:
            (z0, z1), (s0, s1) = s["z_range"], s["sim_range"]
            picks = f"{s['picks']} | {s['z_changed']} | {z0:.1e}..{z1:.1e} | {s0:.2f}..{s1:.2f}"
        else:
            picks = "0 | - | - | -"
        lines.append(f"| {s['dataset']} | {s['method']} | {settings} | {stops} | {picks} |")
    return "\n".join(lines)


def diagnostics(summaries: list[dict]) -> str:
    """Markdown: per run with marked support, support recall and the miss split; per multiple-choice run, raw and
    calibrated accuracy against the letter baselines, and the letters answered; per summarisation run, the
    summaries' lengths, how many ran to the budget, and GoR's share of responses among the retrieved nodes. A
    table without rows is left out."""
    runs = sorted(summaries, key=lambda s: (s["dataset"], s["method"]))
    support = [f"| {s['dataset']} | {s['method']} | {s.get('reader', '-')} | {s['support_n']} | "
               f"{s['support_recall']:.1f} | {s['support_n'] - s['retrieval_misses'] - s['reader_misses']} | "
               f"{s['retrieval_misses']} | {s['reader_misses']} |" for s in runs if "support_n" in s]
    choice = []
    for s in runs:
        if "mc_n" in s:
            raw, calibrated = (" ".join(f"{k}:{v}" for k, v in s[key].items())
                               for key in ("letters_raw", "letters_calibrated"))
            choice.append(f"| {s['dataset']} | {s['method']} | {s.get('reader', '-')} | {s['mc_n']} | "
                          f"{s['accuracy']:.1f} | {s['accuracy_calibrated']:.1f} | "
                          f"{s['majority_letter_acc']:.1f} ({s['majority_letter']}) | {s['content_free_acc']:.1f} | "
                          f"{raw} | {calibrated} |")
    summary = [f"| {s['dataset']} | {s['method']} | {s['n']} | {s['rougeL']:.1f} | {s['summary_tokens']:.0f} | "
               f"{s.get('at_limit', '-')} | {s.get('responses', '-')} |" for s in runs if "summary_tokens" in s]
    tables = [("| dataset | method | reader | n | support recall % | right | retrieval misses | reader misses |",
               support),
              ("| dataset | method | reader | n | accuracy | calibrated | always the majority letter | "
               "content-free answer | letters answered (raw) | letters answered (calibrated) |", choice),
              ("| dataset | method | n | ROUGE-L | generated tokens | at the token budget | responses among nodes |",
               summary)]
    return "\n\n".join("\n".join([head, "|" + "---|" * (head.count("|") - 1), *rows]) for head, rows in tables
                        if rows) or "(no run marks support, has options or summarises)"


def amortization(summaries: list[dict]) -> str:
    """Table A4: (index TFLOPs per document / q + query TFLOPs) for q = 1, 2, 4, 8 queries per document (8B)."""
    lines = ["| dataset | method | 1 | 2 | 4 | 8 |", "|---|---|---|---|---|---|"]
    for s in sorted(summaries, key=lambda s: (s["dataset"], s["method"])):
        if "query_tflops_8b" not in s or "index_tflops_doc_8b" not in s:
            continue
        cells = " | ".join(f"{s['index_tflops_doc_8b'] / q + s['query_tflops_8b']:.2f}" for q in (1, 2, 4, 8))
        lines.append(f"| {s['dataset']} | {s['method']} | {cells} |")
    return "\n".join(lines)


def point_styles(n: int) -> list[tuple[str, str]]:
    """`n` (colour, marker) pairs, no two alike for n <= 70: 10 colours against 7 markers, coprime periods (equal
    periods repeat a pair every 10 runs, and a panel holds more than 10)."""
    return [(f"C{i % 10}", "osD^v<>"[i % 7]) for i in range(n)]


def top_x_curves(rows: list[dict]) -> dict[str, list[dict]]:
    """One dataset's Top-X curves over k: retriever -> one run per k (fixed or matched; of two at the same k, the one
    with more records, then the fixed-k one), by k, of the runs that answered the most records (so that a run still
    in progress does not bend the line)."""
    curves = defaultdict(dict)
    for r in sorted(rows, key=lambda r: (r["n"], "topx" not in r["method"])):
        if "top_k" in r:
            curves[r["top_k"][0]][r["top_k"][1]] = r
    out = {}
    for retriever, by_k in curves.items():
        most = max(r["n"] for r in by_k.values())
        runs = [by_k[k] for k in sorted(by_k) if by_k[k]["n"] == most]
        if len(runs) > 1:
            out[retriever] = runs
    return out


def plot(summaries: list[dict], path: Path, columns: int = 3) -> bool:
    """Each dataset's `primary_metric` against projected query TFLOPs, one panel per dataset, `columns` a row."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import NullFormatter
    except ImportError:
        return False
    by_dataset = defaultdict(list)
    for s in summaries:
        if "query_tflops_8b" in s:
            by_dataset[s["dataset"]].append(s)
    # runs are told apart by marker and colour in a legend under each panel (long run labels overlap as
    # annotations), a run keeping its style in every panel
    methods = sorted({r["method"] for rows in by_dataset.values() for r in rows})
    style = dict(zip(methods, point_styles(len(methods))))
    most = max((len(rows) for rows in by_dataset.values()), default=1)
    ncols = max(1, min(columns, len(by_dataset)))
    nrows = max(1, -(-len(by_dataset) // ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, (4 + 0.22 * most) * nrows), squeeze=False)
    for ax in axes.flat[len(by_dataset):]:
        ax.axis("off")
    for ax, (dataset, rows) in zip(axes.flat, sorted(by_dataset.items())):
        key = primary_metric(rows[0])
        for retriever, runs in sorted(top_x_curves(rows).items()):
            ks = ", ".join(str(r["top_k"][1]) for r in runs)
            ax.plot([r["query_tflops_8b"] for r in runs], [r.get(key, 0) for r in runs],
                    "--" if retriever == "dense" else "-", lw=1, alpha=0.6, color="0.5",
                    label=f"{retriever} Top-k, k = {ks}")
        for r in sorted(rows, key=lambda r: r["method"]):
            color, marker = style[r["method"]]
            ax.scatter(r["query_tflops_8b"], r.get(key, 0), color=color, marker=marker, s=40,
                       label=f"{r['method']} (n={r['n']})")
        ax.set(title=dataset, xlabel="query TFLOPs (llama-3.1-8b projection)", ylabel=key.upper())
        xs = [r["query_tflops_8b"] for r in rows]
        if min(xs) > 0 and max(xs) > 10 * min(xs):  # within one decade a log axis has no labelled tick
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())  # else every minor tick is labelled, over each other
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), frameon=False)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format=path.suffix[1:])
    plt.close(fig)
    return True


def bootstrap_difference(a: list[float], b: list[float], resamples: int = 2000, seed: int = 0
                         ) -> tuple[float, float, float]:
    """The mean of a[i] - b[i] over paired records and its 95% percentile-bootstrap interval (records drawn with
    replacement, `resamples` times, seeded)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"a paired difference needs two equally long, non-empty lists (got {len(a)} and {len(b)})")
    diffs, rng, n = [x - y for x, y in zip(a, b)], random.Random(seed), len(a)
    means = [sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples)]
    cuts = quantiles(means, n=40, method="inclusive")  # cut points every 2.5%
    return mean(diffs), cuts[0], cuts[-1]


def paired(files: list[Path], against: list[str]) -> str:
    """Markdown: on each dataset, every run against each run of a method in `against`, over the records both
    answered: the mean difference of the primary metric (points) with its 95% bootstrap interval, and how many
    records it won, tied and lost. An interval that holds 0 is no evidence either way."""
    scores: dict[tuple[str, str], dict[str, float]] = {}  # (dataset, method) -> {record id: metric}
    for f in files:
        method, dataset, _ = run_meta(f)
        ok = [r for r in read_json_lines(f) if "error" not in r]
        if ok:
            key = primary_metric({k: 0 for r in ok for k in r["metrics"]})
            scores[dataset, method] = {r["id"]: 100 * r["metrics"].get(key, 0.0) for r in ok}
    missing = sorted(set(against) - {method for _, method in scores})
    if missing:
        raise ValueError(f"no answered run of {', '.join(missing)} to pair against (runs: "
                         f"{', '.join(sorted({method for _, method in scores}))})")
    lines = ["| dataset | method | against | records | mean difference | 95% interval | won / tied / lost |",
             "|---|---|---|---|---|---|---|"]
    for (dataset, base), theirs in sorted(scores.items()):
        if base not in against:
            continue
        for (d, method), ours in sorted(scores.items()):
            common = sorted(set(ours) & set(theirs))
            if d != dataset or method == base or not common:
                continue
            a, b = [ours[i] for i in common], [theirs[i] for i in common]
            diff, low, high = bootstrap_difference(a, b)
            won, lost = sum(x > y for x, y in zip(a, b)), sum(x < y for x, y in zip(a, b))
            lines.append(f"| {dataset} | {method} | {base} | {len(common)} | {diff:+.1f} | {low:+.1f} .. {high:+.1f} | "
                         f"{won} / {len(common) - won - lost} / {lost} |")
    return "\n".join(lines)


def run_files(runs: list[Path]) -> list[Path]:
    """The run files that `runs` name, files or directories of them, each once and sorted; a FileNotFoundError or
    ValueError naming a path that is missing or no run file, before any is read (a typo never passes unseen beside
    a good one)."""
    for p in runs:
        if not p.exists():
            raise FileNotFoundError(f"{p} does not exist")
        if p.is_file() and p.suffix != ".jsonl":
            raise ValueError(f"{p} is not a run file (a .jsonl; its .meta.json sits beside it)")
    found = {f.resolve(): f for p in runs for f in ([p] if p.is_file() else p.glob("*.jsonl"))
             if not f.name.endswith(SWEEPS_SUFFIX)}  # a file named twice (by two paths) is one run
    if not found:
        raise FileNotFoundError(f"no run files (*.jsonl) in {', '.join(map(str, runs))}")
    return sorted(found.values())


def report(runs: list[Path], out_dir: Path, reference: str | None = None, against: list[str] | None = None) -> str:
    """Summaries of run files (or directories of them) as Markdown, written to out_dir/report.md (+ report.png);
    with `against`, each run's paired differences from those methods' runs."""
    files = run_files(runs)
    summaries = [summarize(f) for f in files]
    seen: dict[tuple, Path] = {}
    for f, s in zip(files, summaries):  # rows, references and pairs are found by label: one run per label and dataset
        if (key := (s["dataset"], s["method"])) in seen:
            raise ValueError(f"{seen[key]} and {f} are both runs of {s['method']} on {s['dataset']} (other models, "
                             "precisions or folders): report them apart, or give one another --label")
        seen[key] = f
    methods = sorted({s["method"] for s in summaries})
    if reference is not None and reference not in methods:  # else its ratio column would be blank, unexplained
        raise ValueError(f"no run of {reference} to take the TFLOPs ratio against (runs: {', '.join(methods)})")
    text = ("## Quality and query cost\n\n" + table(summaries, reference) +
            "\n\n## What reached the reader, and why answers were wrong\n\n"
            "A wrong answer (primary metric below 0.5) is a retrieval miss when a supporting passage did not reach the "
            "reader (half of its word bigrams absent from what it read), else a reader miss.\n\n" +
            diagnostics(summaries) +
            "\n\n## How the searches went\n\n" + searches(summaries) +
            "\n\n## Index + query TFLOPs per query for 1, 2, 4, 8 queries per document (8B projection)\n\n" +
            amortization(summaries) + "\n")
    if against:
        text += ("\n## Paired differences in the primary metric (points; records both runs answered)\n\n" +
                 paired(files, against) + "\n")
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(out_dir / "report.md", text)
    if not plot(summaries, out_dir / "report.png"):
        text += "\n(no plot: matplotlib is not installed)\n"
    return text
