"""What each `nodekv` subcommand does, given its parsed arguments (the parser is in cli.py): `index`, `index-corpus`,
`ask`, `eval` (and its report), `calibrate`, `flops`, `graph`, `bench`, `models`. Each returns the process's exit
status; input errors are ValueErrors naming the problem."""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

from nodekv.engine.engine import check_load
from nodekv.engine.models import CACHE_ENV, DEFAULT_MODEL, MODELS, model_cache_dir, model_status, resolve_model
from nodekv.methods.prompts import prompt_for
from nodekv.paths import check_input, check_output_file, check_output_folder, read_json_lines, read_text


def _saved_by(path: str | Path | None) -> str | None:
    """The method whose saved indexes `path` is named like (DOCUMENT.<method>, or an index store's
    <method>-<key>-<document>.idx), if any."""
    from nodekv.methods import get, names

    path = Path(path or "")
    name = path.stem.rsplit("-", 2)[0] if path.suffix == ".idx" else path.suffix[1:]  # names may hold "-"
    return name if name in names() and get(name).can_save else None


def _read_document(path: Path) -> str:
    from nodekv.methods.base import check_document

    return check_document(read_text(check_input(path, "document")), f"document {path}")


def _check_index_output(out: Path, name: str, doc: Path, exports: list[str]) -> None:
    """Refuse an index or export path that is the document itself, an index file named for another method, or an
    existing file neither named for this method nor a nodekv index (a rebuild replaces the method's own index;
    nothing else is lost)."""
    from nodekv.methods.index_file import saved_format

    for path in (out, *map(Path, exports)):
        if path.exists() and path.samefile(doc):
            raise ValueError(f"the output {path} is the document itself; choose another file")
    _check_export_targets(exports, out, "index -o")
    named_for = _saved_by(out)
    if named_for not in (None, name):
        raise ValueError(f"the output {out} is named like a {named_for} index, not a {name} one; name it "
                         f"DOCUMENT.{name} (`ask` picks the method by that suffix)")
    if out.exists() and named_for is None and saved_format(out) is None:
        raise ValueError(f"the output {out} exists and is not a nodekv index: not overwriting it (remove it, or "
                         "choose another -o)")


def _check_export_targets(exports: list[str], keep: Path, what: str) -> None:
    """Refuse an --export path that is `keep` (the index being written or read, `what`) or given twice: one write
    would replace the other."""
    targets = [Path(path).resolve() for path in exports]
    for path, target in zip(exports, targets):
        if target == keep.resolve():
            raise ValueError(f"--export {path} is the same file as the {what}: it would replace it; choose another")
        if targets.count(target) > 1:
            raise ValueError(f"--export {path} is given twice")


def _check_built_index(path: Path, method_class: type, model: str | None, kv: bool = False) -> None:
    """Refuse, before the model loads, a saved index the method would refuse once it had: unreadable, of another
    format, corrupt, or built with another model file (for a method that saves `index_file`s); kv: also its node
    store beside it, missing, bad or not its own."""
    from nodekv.methods.index_file import check_index_file

    if method_class.index_file_format is not None:
        check_index_file(path, method_class.index_file_format, resolve_model(model), f"{method_class.name} index",
                         kv=kv)


def _check_saved_index(doc: Path, name: str) -> None:
    """Refuse a saved index given as the document of a method that would read its JSON as text."""
    from nodekv.methods.index_file import saved_format

    found = saved_format(doc)
    if found is None:
        return
    saver = _saved_by(doc)
    if saver is not None:
        raise ValueError(f"{doc} is a saved {saver} index, which {name} cannot read; ask it with --method {saver} "
                         f"(or without --method), or give {name} the text file")
    raise ValueError(f"{doc} is a saved nodekv index ({found}), not a text file; name it DOCUMENT.<method> after "
                     "the method that saved it")


def _check_index_options(method_class: type, options: dict) -> None:
    """Refuse options that do not shape the index a method builds (its `index_key`, and `kv_reuse`, which stores
    its nodes' KV): `nodekv index` would drop them silently, and `ask` takes them per question. (`index-corpus`
    keeps taking them: its indexes are read by an `eval` that gives its own.)"""
    method_class.configure(**options)  # bad options first, with their own message
    shaping = set(method_class(None, **options).index_key()) | {"kv_reuse"}
    dropped = sorted(set(options) - shaping)
    if dropped:
        raise ValueError(f"{method_class.title} option{'s' if len(dropped) > 1 else ''} {', '.join(dropped)} "
                         f"{'do' if len(dropped) > 1 else 'does'} not change the index: give "
                         f"{'them' if len(dropped) > 1 else 'it'} to `nodekv ask` (or `nodekv eval`)")


def _check_exports(method_class: type, paths: list[str]) -> None:
    """Each --export file in a format the method writes, in a folder that exists (before any model work)."""
    for path in paths:
        if Path(path).suffix not in method_class.exports:
            raise ValueError(f"{method_class.name} cannot export its index as {path}; formats: "
                             f"{', '.join(method_class.exports) or 'none'}")
        check_output_file(path)


def index(args: argparse.Namespace) -> int:
    from nodekv import load_engine
    from nodekv.methods import get, names

    name = args.method or _saved_by(args.output)
    if name is None or not get(name).can_save:
        problem = "name a --method" if name is None else f"{name} cannot save an index"
        raise ValueError(f"{problem}; methods that can: {', '.join(n for n in names() if get(n).can_save)}")
    method_class, options = get(name), dict(args.option)
    _check_index_options(method_class, options)  # bad options, exports and paths fail before the model loads
    _check_exports(method_class, args.export)
    doc = Path(args.document)
    text = _read_document(doc)
    out = check_output_file(args.output or f"{doc}.{name}")
    _check_index_output(out, name, doc, args.export)
    eng = load_engine(args.model, threads=args.threads)
    method = method_class(eng, progress=True, **options)
    before, t = eng.flops.total, time.perf_counter()
    with eng.flops.scope("index"):
        index = method.index(text)
    method.save_index(index, out)
    summary, *notes = method.describe(index) or [""]
    print(f"indexed {doc.name}: {summary + ', ' if summary else ''}{(eng.flops.total - before) / 1e12:.3f} TFLOPs, "
          f"{time.perf_counter() - t:.1f}s -> {out}")
    for line in notes:
        print(f"  {line}")
    for path in args.export:
        method.export(index, path)
    return 0


def _ray_plan(args: argparse.Namespace):
    """The RayPlan that --ray, --workers and --threads describe (None without --ray)."""
    from nodekv.evaluation.ray_tasks import RayPlan, check_address

    if args.ray is None:
        if args.workers is not None:
            raise ValueError("--workers counts --ray's engine processes: give --ray too, or drop --workers")
        return None
    workers = 2 if args.workers is None else args.workers
    if workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    check_address(args.ray or None)
    return RayPlan(args.ray or None, workers, args.threads or 1)


def index_corpus(args: argparse.Namespace) -> int:
    from nodekv import load_engine
    from nodekv.methods import get
    from nodekv.evaluation.index_corpus import check_request
    from nodekv.evaluation.index_corpus import index_corpus as run

    options = dict(args.option)
    get(args.method).configure(**options)  # bad options, paths, requests and corpora fail before the model loads
    out = Path("runs/indexes") if args.out is None else check_output_folder(args.out)  # the default is made
    plan = _ray_plan(args)
    check_request(args.method, Path(args.directory))  # last: it reads the whole corpus
    manifest, failed = run(load_engine(args.model, threads=args.threads), args.method, options,
                           Path(args.directory), out, plan)
    print(f"wrote {manifest}" + (f"; {failed} document(s) failed (their lines say why), a rerun tries them again"
                                 if failed else ""))
    return 1 if failed else 0


def ask(args: argparse.Namespace) -> int:
    from nodekv import load_engine
    from nodekv.engine.loader import model_config
    from nodekv.methods import get
    from nodekv.methods.base import check_question
    from nodekv.methods.index_file import kv_path, saved_format
    from nodekv.methods.reader import check_room

    check_question(args.question)
    check_load(args.dtype, threads=args.threads, precision=args.precision, device=args.device, kv_dtype=args.kv_dtype)
    doc = check_input(args.document, "document")
    name = args.method if args.method is not None else _saved_by(doc) or "full"
    method_class, options = get(name), dict(args.option)
    prompt = replace(prompt_for(args.prompt), max_new_tokens=args.max_new_tokens)
    unloaded = method_class(None, prompt=prompt, **options)  # a method made without an engine does no model work
    unloaded.check_without_fit()  # ask fits nothing on other documents
    saved = method_class.can_save and _saved_by(doc) == name
    if saved and method_class.index_file_format is not None and saved_format(doc) is None:
        raise ValueError(f"{doc} is named like a saved {name} index but holds none (no nodekv header); to ask about "
                         "it as text, name a method, e.g. --method full")
    if saved:  # its index key names what shapes an index
        shaping = sorted(set(options) & set(unloaded.index_key()))
        if shaping:
            raise ValueError(f"{doc} is built already, and {', '.join(shaping)} would change how: rebuild it with "
                             f"`nodekv index` and {' '.join(f'--option {k}=...' for k in shaping)}, or leave them out")
    else:
        _check_saved_index(doc, name)
    text = None if saved else _read_document(doc)
    # last, the checks against the model's file (a registered model is assembled on first use)
    check_room(model_config(resolve_model(args.model)).max_seq_len, unloaded.answer_prompt, unloaded.reader_window())
    if saved:
        _check_built_index(doc, method_class, args.model, kv=getattr(unloaded.config, "kv_reuse", "off") != "off")
    t0 = time.perf_counter()
    eng = load_engine(args.model, dtype=args.dtype, threads=args.threads, precision=args.precision,
                      device=args.device, kv_dtype=args.kv_dtype)
    t1 = time.perf_counter()
    method = method_class(eng, prompt=prompt, **options)
    method.reader.check_question(args.question)  # before the index is built, not after
    before = eng.flops.total
    with eng.flops.scope("index"):
        index = method.load_index(doc) if saved else method.index(text)
    index_flops, t2 = eng.flops.total - before, time.perf_counter()
    answer = method.answer(index, args.question)
    t3 = time.perf_counter()
    cut = ", cut in the middle to fit" if answer.truncated else ""
    print(f"Q: {args.question}\nA: {answer.text}\n")
    dtype, kv = (str(d).removeprefix("torch.") for d in (eng.model.dtype, eng.pool.dtype))
    kv = f", KV cache {kv}" if kv != dtype else ""
    print(f"method     {name} on {eng.path.name} ({eng.config.n_layers} layers, d={eng.config.dim}, {dtype} on "
          f"{eng.device}{kv})")
    print(f"nodes      {len(answer.nodes)} used; prompt {answer.prompt_tokens:,} tokens{cut}, "
          f"generated {answer.generated_tokens}")
    print(f"FLOPs      {answer.flops:,} ({answer.flops / 1e12:.4f} TFLOPs, query only); "
          f"index {'loaded from ' + doc.name if saved else f'{index_flops / 1e12:.4f} TFLOPs'}")
    tokens = answer.prompt_tokens + answer.generated_tokens
    print(f"time       load {t1 - t0:.1f}s, index {t2 - t1:.1f}s, answer {t3 - t2:.2f}s "
          f"({tokens / max(t3 - t2, 1e-9):,.0f} tok/s)")
    if saved and getattr(method.config, "kv_reuse", None) == "off" and kv_path(doc).exists():
        print(f"note       {kv_path(doc).name} holds the KV of this index's chunks: --option kv_reuse=blend reads "
              "it rather than prefilling them")
    if args.trace:
        for line in method.trace_lines(index, answer.trace):
            print(line)
    return 0


def flops(args: argparse.Namespace) -> int:
    from nodekv.engine.config import preset
    from nodekv.engine.flops import format_report
    from nodekv.engine.loader import model_config

    try:
        config, name = preset(args.model), args.model
    except ValueError:
        looks_like_a_path = Path(args.model).suffix == ".gguf" or "/" in args.model
        if args.model not in MODELS and not Path(args.model).exists() and not looks_like_a_path:
            raise
        config, name = model_config(resolve_model(args.model)), args.model
    for flag, value in (("--tokens", args.tokens), ("--n-ctx", args.n_ctx)):
        if value is not None and value > config.max_seq_len:  # counts no model can run
            raise ValueError(f"{flag} {value} is above {name}'s context window of {config.max_seq_len} tokens")
    print(format_report(config, name, args.tokens, args.n_ctx))
    return 0


def evaluate(args: argparse.Namespace) -> int:
    if args.runs and args.runs[0] == "report":
        from nodekv.evaluation.report import report

        try:
            print(report([Path(r) for r in args.runs[1:]] or [Path(args.out)], check_output_folder(args.out),
                         args.reference, args.paired))
        except (FileNotFoundError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    if args.runs and args.runs[0] == "rescore":
        return _rescore([Path(r) for r in args.runs[1:]], args.data_dir)
    if args.runs:
        print(f"error: unexpected arguments {args.runs}; did you mean `nodekv eval report RUN...`?", file=sys.stderr)
        return 2
    if not args.method or not args.dataset:
        print("error: nodekv eval needs --method and --dataset (or `report RUN...`, `rescore RUN...`)",
              file=sys.stderr)
        return 2
    from nodekv import load_engine
    from nodekv.methods import get
    from nodekv.evaluation.datasets import DataNotFoundError, check_dataset
    from nodekv.evaluation.report import current_lines
    from nodekv.evaluation.runner import check_run, check_top_x, run

    try:
        cfg = run_config(args)
        plan = _ray_plan(args)
        get(cfg.method).configure(**cfg.options)  # bad options, data and paths fail before the model loads
        _, dtype, _ = check_load(args.dtype, threads=args.threads, precision=args.precision, device=args.device,
                                 kv_dtype=args.kv_dtype)
        check_dataset(cfg.dataset, cfg.data_dir)
        check_output_folder(cfg.out)
        if cfg.match is not None:
            check_top_x(cfg.method)
        if plan is not None and args.device not in ("auto", "cpu"):
            raise ValueError(f"--ray runs its workers on the CPU; drop --device {args.device} or --ray")
        check_run(cfg, args.model, args.precision, dtype, args.kv_dtype)
        engine = load_engine(args.model, dtype=dtype, threads=args.threads, precision=args.precision,
                             device=args.device, kv_dtype=args.kv_dtype)
        path = run(engine, cfg, ray=plan)
    except (DataNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    failed = sum("error" in line for line in current_lines(read_json_lines(path)))
    print(f"wrote {path}" + (f"; {failed} record(s) failed (their lines say why), a rerun tries them again"
                             if failed else ""))
    return 1 if failed else 0


def _rescore(runs: list[Path], data_dir: str | None) -> int:
    from nodekv.evaluation.datasets import DataNotFoundError
    from nodekv.evaluation.report import run_files
    from nodekv.evaluation.rescore import rescore

    try:
        files = run_files(runs)
        for f, changed in zip(files, rescore(files, data_dir)):
            print(f"{f}: {changed} line(s) rescored" if changed else f"{f}: unchanged")
    except (DataNotFoundError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def run_config(args: argparse.Namespace):
    """The RunConfig that `nodekv eval` arguments describe: --option pairs, then --k (one k, or --match's)."""
    from nodekv.evaluation.runner import RunConfig

    options = dict(args.option)
    if args.k is not None:
        if options.get("k", args.k) != args.k:
            raise ValueError(f"--k {args.k} and --option k={options['k']} disagree: give k once")
        options["k"] = args.k
    if args.match is not None and "k" in options:
        raise ValueError("--match picks k itself: drop --k and --option k")
    return RunConfig(args.method, args.dataset, args.limit, args.data_dir, args.out, options, args.match, args.label,
                     args.max_new_tokens)


def calibrate(args: argparse.Namespace) -> int:
    from nodekv import load_engine
    from nodekv.evaluation.datasets import DataNotFoundError, check_dataset
    from nodekv.evaluation.pecan_calibration import calibrate, check_calibration, check_objective

    try:
        check_objective(args.objective, args.target_nodes)  # bad requests, data and paths fail before the model loads
        if args.dev_start < 0:
            raise ValueError(f"--dev-start must be >= 0, got {args.dev_start}")
        check_dataset(args.dataset, args.data_dir)
        check_output_folder(args.out)
        check_calibration(args.dataset, (args.dev_start, args.dev), args.out, args.data_dir, dict(args.option),
                          args.model)
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


def models(args: argparse.Namespace) -> int:
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


def graph(args: argparse.Namespace) -> int:
    from nodekv import load_engine
    from nodekv.methods import get, names

    path = check_input(args.index, "index")
    name = args.method or _saved_by(path)
    if name is None or not get(name).can_save:
        raise ValueError(f"{path} is not named like a saved index (DOCUMENT.<method>); name a --method: "
                         f"{', '.join(n for n in names() if get(n).can_save)}")
    method_class = get(name)
    _check_exports(method_class, args.export)
    _check_export_targets(args.export, path, "index")
    _check_built_index(path, method_class, args.model)
    method = method_class(load_engine(args.model, threads=args.threads))
    index = method.load_index(path)
    for out in args.export:
        method.export(index, out)
        print(f"{path.name} -> {out} ({method_class.exports[Path(out).suffix]})")
    return 0


def benchmarks() -> dict[str, str]:
    """The runnable benchmarks under bench/ (modules with a `main`), each with its docstring's first sentence."""
    import ast
    import importlib.util

    found = {}
    for file in sorted(Path(importlib.util.find_spec("nodekv.bench").origin).parent.glob("*.py")):
        tree = ast.parse(file.read_text())
        if any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
            paragraph = " ".join((ast.get_docstring(tree) or "").split("\n\n")[0].split())
            found[file.stem] = paragraph.split(". ")[0].rstrip(".:") + "."
    return found


def bench(args: argparse.Namespace) -> int:
    import importlib

    found = benchmarks()
    if args.name is None:
        for name, doc in found.items():
            print(f"{name:<18}{doc}")
        print("run one: nodekv bench NAME [its arguments]; its --help says what it takes")
        return 0
    if args.name not in found:
        raise ValueError(f"unknown benchmark {args.name!r}; known: {', '.join(found)}")
    sys.argv = [f"nodekv bench {args.name}", *args.args]
    importlib.import_module(f"nodekv.bench.{args.name}").main()  # each `python -m` entry point calls just main()
    return 0
