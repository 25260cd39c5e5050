"""`nodekv` command line: `index` (a method's saved index of a text file), `ask` (a method's answer to a question
about a text file or a saved index), `eval` (methods on datasets, and their report), `calibrate` (PECAN's t_p on
dev records), `flops` (exact and paper-style counts) and `models` (the registered models and where they stand).
`index`, `ask` and `eval` take any registered method (`--method`, options as `--option KEY=VALUE`); their --help
lists the methods and options."""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from nodekv.engine.registry import CACHE_ENV, DEFAULT_MODEL, MODELS, model_cache_dir, model_status, resolve_model
from nodekv.methods.prompts import PROMPTS, prompt_for

MODEL_HELP = f"a registered name (`nodekv models`), HF directory or .gguf file (default: {DEFAULT_MODEL})"


def _saved_by(path: str | Path | None) -> str | None:
    """The method whose saved indexes `path` is named like (DOCUMENT.<method>), if any."""
    from nodekv.methods import get, names

    name = Path(path).suffix[1:] if path else ""
    return name if name in names() and get(name).can_save else None


def _read_document(path: Path) -> str:
    if not path.is_file():
        raise ValueError(f"document {path} does not exist")
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError(f"document {path} is empty (nothing to read)")
    return text


def _index(args: argparse.Namespace) -> int:
    from nodekv import load_engine
    from nodekv.methods import get, names

    name = args.method or _saved_by(args.output)
    if name is None or not get(name).can_save:
        problem = "name a --method" if name is None else f"{name} cannot save an index"
        raise ValueError(f"{problem}; methods that can: {', '.join(n for n in names() if get(n).can_save)}")
    method_class, options = get(name), dict(args.option)
    method_class.configure(**options)  # bad options and exports fail before the model loads
    for path in args.export:
        if Path(path).suffix not in method_class.exports:
            raise ValueError(f"{name} cannot export its index as {path}; formats: "
                             f"{', '.join(method_class.exports) or 'none'}")
    doc = Path(args.document)
    text = _read_document(doc)
    eng = load_engine(args.model, threads=args.threads)
    method = method_class(eng, progress=True, **options)
    before, t = eng.flops.total, time.perf_counter()
    with eng.flops.scope("index"):
        index = method.index(text)
    out = Path(args.output or f"{doc}.{name}")
    method.save_index(index, out)
    summary, *notes = method.describe(index) or [""]
    print(f"indexed {doc.name}: {summary + ', ' if summary else ''}{(eng.flops.total - before) / 1e12:.3f} TFLOPs, "
          f"{time.perf_counter() - t:.1f}s -> {out}")
    for line in notes:
        print(f"  {line}")
    for path in args.export:
        method.export(index, path)
    return 0


def _ask(args: argparse.Namespace) -> int:
    from nodekv import load_engine
    from nodekv.methods import get

    doc = Path(args.document)
    if not doc.is_file():
        raise ValueError(f"document {doc} does not exist")
    name = args.method or _saved_by(doc) or "full"
    method_class, options = get(name), dict(args.option)
    method_class.configure(**options)
    saved = method_class.can_save and doc.suffix == f".{name}"
    text = None if saved else _read_document(doc)
    t0 = time.perf_counter()
    eng = load_engine(args.model, dtype=args.dtype, threads=args.threads)
    t1 = time.perf_counter()
    prompt = replace(prompt_for(args.prompt), max_new_tokens=args.max_new_tokens)
    method = method_class(eng, prompt=prompt, **options)
    before = eng.flops.total
    with eng.flops.scope("index"):
        index = method.load_index(doc) if saved else method.index(text)
    index_flops, t2 = eng.flops.total - before, time.perf_counter()
    answer = method.answer(index, args.question)
    t3 = time.perf_counter()
    cut = ", cut in the middle to fit" if answer.truncated else ""
    print(f"Q: {args.question}\nA: {answer.text}\n")
    print(f"method     {name} on {eng.path.name} ({eng.config.n_layers} layers, d={eng.config.dim}, {args.dtype})")
    print(f"nodes      {len(answer.nodes)} used; prompt {answer.prompt_tokens:,} tokens{cut}, "
          f"generated {answer.generated_tokens}")
    print(f"FLOPs      {answer.flops:,} ({answer.flops / 1e12:.4f} TFLOPs, query only); "
          f"index {'loaded from ' + doc.name if saved else f'{index_flops / 1e12:.4f} TFLOPs'}")
    tokens = answer.prompt_tokens + answer.generated_tokens
    print(f"time       load {t1 - t0:.1f}s, index {t2 - t1:.1f}s, answer {t3 - t2:.2f}s "
          f"({tokens / max(t3 - t2, 1e-9):,.0f} tok/s)")
    if args.trace:
        for line in method.trace_lines(index, answer.trace):
            print(line)
    return 0


def methods_help(saving_only: bool = False) -> str:
    """The registered methods (those that can save an index, with `saving_only`), each with its options."""
    from nodekv.methods import get, names

    lines = ["methods (--method NAME; options: --option KEY=VALUE):"]
    for name in names():
        method_class = get(name)
        if saving_only and not method_class.can_save:
            continue
        doc = (method_class.__doc__ or "").strip().split("\n")[0]
        lines.append(f"  {name:<13}{doc}")
        for o in method_class.options:
            default = str(o.default).lower() if o.type is bool else o.default
            lines.append(f"      {f'{o.name}={default}':<22}{o.allowed()}; {o.help}")
        if method_class.exports:
            lines.append(f"      --export FILE: {', '.join(f'{k} {v}' for k, v in method_class.exports.items())}")
    return "\n".join(lines)


class _CommandParser(argparse.ArgumentParser):
    """A subcommand's parser; with `methods` ("all" or "saving"), its --help ends with those registered methods,
    imported only then (so that a method plugin that fails to load cannot break other commands)."""

    def __init__(self, *args, methods: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.methods = methods

    def format_help(self) -> str:
        text = super().format_help()
        return text if self.methods is None else f"{text}\n{methods_help(self.methods == 'saving')}\n"


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
    from nodekv.methods import get
    from nodekv.methods.data import DataNotFoundError
    from nodekv.methods.evaluate import run

    cfg = run_config(args)
    try:
        get(cfg.method).configure(**cfg.options)  # before the model loads
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
    auc = result["probe_auc"]
    print(f"\np(Yes) tells a right answer (F1 >= 0.5) from a wrong one with AUC "
          f"{'-' if auc is None else f'{auc:.2f}'} (0.5: no signal)")
    print(f"t_p = {result['t_p']} for {args.dataset} ({args.objective}) -> {result['path']}")
    print(f"`nodekv eval --method pecan --dataset {args.dataset} --out {args.out}` with the same options uses it")
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
    sub = p.add_subparsers(dest="command", required=True, parser_class=_CommandParser)

    ix = sub.add_parser("index", methods="saving", help="save a method's index of a text file (PECAN's graph)")
    ix.add_argument("document")
    ix.add_argument("-o", "--output", default=None, help="index file (default DOCUMENT.<method>)")
    ix.add_argument("--method", default=None, help="a method that can save its index (default: the one -o's "
                                                      "suffix names, e.g. story.pecan)")
    ix.add_argument("--option", action="append", default=[], type=_option, metavar="KEY=VALUE",
                    help="a method option, repeatable, e.g. --option chunk_tokens=200")
    ix.add_argument("--export", action="append", default=[], metavar="FILE",
                    help="also write the index for inspection, in the format FILE's suffix names (the methods' "
                         "formats are listed below), repeatable")
    ix.add_argument("--model", default=None, help=MODEL_HELP)
    ix.add_argument("--threads", type=int, default=None)
    ix.set_defaults(func=_index)

    ask = sub.add_parser("ask", methods="all", help="answer a question about a text file or a saved index")
    ask.add_argument("--method", default=None, help="default: the method whose saved index DOCUMENT is (e.g. "
                                                    "story.pecan), else full (the whole document in context)")
    ask.add_argument("--option", action="append", default=[], type=_option, metavar="KEY=VALUE",
                     help="a method option, repeatable, e.g. --option t_p=0.4 --option node_budget=6")
    ask.add_argument("--trace", action="store_true", help="print the answer's trace, one line per step (e.g. "
                                                          "PECAN's visited nodes, their scores and p(Yes))")
    ask.add_argument("document", help="a text file, or an index file a method saved (DOCUMENT.<method>)")
    ask.add_argument("question")
    ask.add_argument("--model", default=None, help=MODEL_HELP)
    ask.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ask.add_argument("--prompt", default="", choices=sorted(PROMPTS), metavar="DATASET",
                     help="answer in this dataset's prompt, e.g. narrativeqa for a story (default: the generic "
                          "document-QA one)")
    ask.add_argument("--max-new-tokens", type=int, default=64)
    ask.add_argument("--threads", type=int, default=None)
    ask.set_defaults(func=_ask)

    ev = sub.add_parser("eval", methods="all",
                        help="evaluate a method on a dataset (resumable), or `eval report RUN...`")
    ev.add_argument("runs", nargs="*", help="`report` followed by run files or directories")
    ev.add_argument("--method", help="a registered method (listed below)")
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
