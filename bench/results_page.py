"""One page with every result: quality against query TFLOPs for every method and baseline run under the results
folder, the engine's tokens/s and memory against prompt length (`nodekv bench engine_suite`'s engine.json), and the
paper-vs-ours tables (`nodekv bench paper --out`), as Markdown and a self-contained HTML page with PNG plots.

    nodekv bench results_page [--results results] [--out results/report]
"""
from __future__ import annotations

import argparse
import html
import json
import re
from pathlib import Path

from nodekv.bench import input_file, input_folder, output_folder
from nodekv.paths import atomic_path, results_dir, write_atomic

ENGINE_LABELS = {"nodekv": "nodekv", "hf": "HF sdpa", "hf-eager": "HF eager", "llama-cpp": "llama.cpp"}
# marks every image with its decoded size once the page has loaded (the browser test reads it from the DOM)
LOADED_SCRIPT = ("<script>addEventListener('load', () => { for (const i of document.images) "
                 "i.dataset.loaded = i.naturalWidth + 'x' + i.naturalHeight; });</script>")


def run_files(results: Path, out: Path) -> list[Path]:
    """Every eval run file (a .jsonl with its .meta.json) under `results`, the report's own folder excepted."""
    return sorted(f for f in results.rglob("*.jsonl")
                  if f.with_suffix(".meta.json").exists() and out.resolve() not in f.resolve().parents)


def quality_section(files: list[Path], out: Path) -> str:
    from nodekv.engine.models import model_name
    from nodekv.evaluation.report import plot, primary_metric, summarize

    if not files:
        return "No evaluation runs found."
    summaries = [summarize(f) for f in files]
    for s, f in zip(summaries, files):  # studies on two models share the tables: each run names its folder and model
        folder = f.parent.parent.name if f.parent.name == "runs" else f.parent.name
        model = model_name(json.loads(f.with_suffix(".meta.json").read_text()).get("model", ""))
        s["method"] = f"{s['method']} ({folder}, {model})"
    lines = ["| dataset | run (folder, model) | n | metric | score | query TFLOPs (model) | query TFLOPs (8B) | "
             "index TFLOPs/doc (8B) | s/query |", "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for s in sorted(summaries, key=lambda s: (s["dataset"], -s.get(primary_metric(s), 0))):
        if not s["n"]:
            continue
        key = primary_metric(s)
        lines.append(f"| {s['dataset']} | {s['method']} | {s['n']} | {key} | {s[key]:.1f} | "
                     f"{s['query_tflops']:.3f} | {s['query_tflops_8b']:.2f} | "
                     f"{s.get('index_tflops_doc_8b', 0):.1f} | {s['wall_s']:.1f} |")
    plotted = plot(summaries, out / "quality.png")
    return ("Each dataset's own metric (F1 for QA, accuracy for multiple choice, EM for variable tracking, ROUGE-L "
            "for summaries) against query TFLOPs projected to Llama-3.1-8B; each run's folder and model are in "
            "brackets; s/query is wall time on a shared core, not a speed figure.\n\n"
            + ("![quality against query TFLOPs](quality.png)\n\n" if plotted else "") + "\n".join(lines))


def _int_keys(d: dict) -> dict[int, float]:
    return {int(k): v for k, v in d.items()}


def speed_rows(engine: dict) -> list[tuple[str, str, int, float, float, float]]:
    """(model, engine, tokens, prefill tok/s, decode tok/s, peak RSS GiB) of every measured length."""
    rows = []
    for model, run in (engine.get("speed") or {}).items():
        if not run:
            continue
        for name, r in run["results"].items():
            prefill, decode, peak = (_int_keys(r[k]) for k in ("prefill_s", "decode_s", "peak_rss_gib_at"))
            for p, c in run["rounds"]:
                if p not in prefill:  # a round this engine did not run (HF eager beyond its limit)
                    continue
                rows.append((model, name, p, p / prefill[p], run["decode_tokens"] / decode[c], peak[c]))
    return rows


def engine_section(engine: dict, out: Path) -> str:
    rows = speed_rows(engine)
    if not rows:
        return "No engine benchmark found (run `nodekv bench engine_suite`)."
    lines = ["| model | engine | prompt tokens | prefill tok/s | decode tok/s after it | peak RSS GiB |",
             "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {m} | {ENGINE_LABELS.get(e, e)} | {t:,} | {p:,.1f} | {d:,.1f} | {g:.2f} |"
              for m, e, t, p, d, g in rows]
    text = "\n".join(lines)
    if engine.get("quick"):  # shown, not refused: a smoke run's page is how one previews the report
        text = ("**A `--quick` smoke run: these numbers check that the benchmark runs; they are not measurements.**"
                "\n\n" + text)
    if _plot_engine(rows, out):
        text = "![tokens/s against prompt length](speed.png)\n\n![memory against prompt length](memory.png)\n\n" + text
    peaks = [f"{m}: fp32 {run['fp32_peak_gflops']:.0f} GFLOP/s" for m, run in engine["speed"].items() if run]
    text += f"\n\ntorch.mm fp32 2048² in the same run ({'; '.join(peaks)})."
    if engine.get("batch"):
        b = engine["batch"]
        # per precision since the int8 path; older files hold the exact engine's seconds alone
        runs = b["decode_s"] if isinstance(next(iter(b["decode_s"].values())), dict) else {"exact": b["decode_s"]}
        rows = []
        for prec, seconds in runs.items():
            base = b["tokens"] / seconds["1"]
            rows += [f"| {prec} | {n} | {int(n) * b['tokens'] / s:.1f} | {int(n) * b['tokens'] / s / base:.2f}x |"
                     for n, s in seconds.items()]
        text += "\n\n| precision | sessions | aggregate decode tok/s | vs 1 |\n|---|---:|---:|---:|\n" + "\n".join(rows)
    if engine.get("append"):
        text += ("\n\n| cached tokens | append a 300-token node + probe + roll back, s | prefill it all again, s |"
                 "\n|---:|---:|---:|\n" + "\n".join(f"| {r['cached']:,} | {r['append_s']:.3f} | {r['prefill_s']:.3f} |"
                                                   for r in engine["append"]))
    if engine.get("node_mass"):
        text += ("\n\n| tokens | node-mass collection overhead | extra MiB | HF output_attentions s | HF extra MiB |"
                 "\n|---:|---:|---:|---:|---:|\n" + "\n".join(
                     f"| {r['tokens']:,} | {r['nodekv']['collect'] / r['nodekv']['plain'] - 1:.1%} | "
                     f"{r['nodekv']['extra_bytes'] / 2**20:.1f} | "
                     + (f"{r['hf']['seconds']:.2f} | {r['hf']['extra_bytes'] / 2**20:.0f} |" if r["hf"] else
                        f"not run | needs {r['hf_attention_bytes'] / 2**20:,.0f} |")
                     for r in engine["node_mass"]["rows"]))
    return text


def _plot_engine(rows, out: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    models = sorted({r[0] for r in rows})
    for name, panels in (("speed", ((3, "prefill tok/s"), (4, "decode tok/s"))), ("memory", ((5, "peak RSS GiB"),))):
        fig, axes = plt.subplots(len(models), len(panels), figsize=(6 * len(panels), 3.6 * len(models)),
                                 squeeze=False)
        for i, model in enumerate(models):
            for j, (col, label) in enumerate(panels):
                ax = axes[i][j]
                for engine in sorted({r[1] for r in rows if r[0] == model}):
                    pts = sorted((r[2], r[col]) for r in rows if r[:2] == (model, engine))
                    ax.plot(*zip(*pts), marker="o", label=ENGINE_LABELS.get(engine, engine))
                ax.set(title=f"{model}: {label}", xlabel="prompt tokens", ylabel=label, xscale="log")
                ax.legend(fontsize=8)
        fig.tight_layout()
        with atomic_path(out / f"{name}.png") as tmp:
            fig.savefig(tmp, dpi=110, format="png")
        plt.close(fig)
    return True


def markdown_to_html(text: str) -> str:
    """The Markdown this report writes (headings, pipe tables, lists, images, paragraphs, **bold**, `code`)."""
    def inline(s: str) -> str:
        s = html.escape(s)
        s = re.sub(r"!\[([^\]]*)\]\(([^)]+)\)", r'<img alt="\1" src="\2">', s)
        s = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", s)
        return re.sub(r"`([^`]+)`", r"<code>\1</code>", s)

    parts = []
    for block in re.split(r"\n\s*\n", text.strip()):
        lines = block.splitlines()
        if lines[0].startswith("#"):
            level = len(lines[0]) - len(lines[0].lstrip("#"))
            parts.append(f"<h{level}>{inline(lines[0][level:].strip())}</h{level}>")
            lines = lines[1:]
        if not lines:
            continue
        if all(x.startswith("|") for x in lines) and len(lines) > 1:
            cells = [[c.strip() for c in x.strip().strip("|").split("|")] for x in lines]
            head = "".join(f"<th>{inline(c)}</th>" for c in cells[0])
            body = "".join("<tr>" + "".join(f"<td>{inline(c)}</td>" for c in r) + "</tr>" for r in cells[2:])
            parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        elif all(x.startswith("- ") for x in lines):
            parts.append("<ul>" + "".join(f"<li>{inline(x[2:])}</li>" for x in lines) + "</ul>")
        else:
            parts.append(f"<p>{inline(' '.join(lines))}</p>")
    return "\n".join(parts)


def build(results: Path, out: Path, engine_json: Path, paper_md: Path) -> str:
    """Write out/report.md, out/index.html and the plots; returns the Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    engine = read_engine(engine_json) if engine_json.exists() else {}
    runs = [run for run in (engine.get("speed") or {}).values() if run]
    machine = (f"Measured on {runs[0]['cpu']}, {engine['threads']} threads, torch {runs[0]['torch']}, "
               f"{engine['date']}." if runs else "No engine benchmark yet: the machine is not recorded.")
    paper = paper_md.read_text() if paper_md.exists() else "No paper table yet (run `nodekv bench paper --out FILE`)."
    paper = re.sub(r"^## ", "### ", paper, flags=re.MULTILINE)
    text = (f"# nodekv benchmark report\n\n{machine}\n\n## Quality against query cost\n\n"
            f"{quality_section(run_files(results, out), out)}\n\n## Engine speed and memory\n\n"
            f"{engine_section(engine, out)}\n\n## The papers' numbers and ours\n\n{paper}\n")
    write_atomic(out / "report.md", text)
    style = ("body{font-family:sans-serif;max-width:1400px;margin:2em auto;padding:0 1em}table{border-collapse:"
             "collapse;font-size:12px;margin:1em 0}td,th{border:1px solid #ccc;padding:2px 6px}img{max-width:100%}")
    write_atomic(out / "index.html", f"<!doctype html><html><head><meta charset='utf-8'><title>nodekv benchmark "
                                     f"report</title><style>{style}</style></head><body>\n{markdown_to_html(text)}\n"
                                     f"{LOADED_SCRIPT}</body></html>\n")
    return text


def read_engine(path: Path) -> dict:
    """An engine_suite engine.json, or a ValueError naming the file and what is wrong with it."""
    try:
        engine = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"the engine benchmark {path} is not JSON ({e})") from None
    if not isinstance(engine, dict) or not isinstance(engine.get("speed"), dict):
        raise ValueError(f"the engine benchmark {path} is not an engine.json of `nodekv bench engine_suite` "
                         "(it has no \"speed\" table)")
    return engine


def main() -> None:
    p = argparse.ArgumentParser(prog="nodekv bench results_page", description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=input_folder, default=results_dir(), help="where the runs are")
    p.add_argument("--out", type=output_folder, default=None, help="default: RESULTS/report")
    p.add_argument("--engine", type=input_file("engine benchmark"), default=None,
                   help="default: RESULTS/engine/engine.json")
    p.add_argument("--paper", type=input_file("paper table"), default=None, help="default: RESULTS/paper.md")
    args = p.parse_args()
    if args.engine:  # the default may be missing (the page says so); a file named on purpose must be one
        try:
            read_engine(args.engine)
        except ValueError as e:
            p.error(str(e))
    out = args.out or args.results / "report"
    build(args.results, out, args.engine or args.results / "engine" / "engine.json",
          args.paper or args.results / "paper.md")
    print(f"wrote {out / 'index.html'} and {out / 'report.md'}")


if __name__ == "__main__":
    main()
