"""`nodekv eval`: run a method over a dataset, one JSON line per record, resumable.

Each line holds the record's id, question, prediction, references, metrics, the nodes the answer used, the
query-dependent and indexing FLOPs measured on the model (and projected to the llama-3.1-8b preset for the same
token counts), the prefill FLOPs that shared prompt prefixes saved the query, wall time, and the document's hash
(so a report counts each document's index once). A document is indexed once however many questions it has;
methods that can save indexes (PECAN) keep them under <out>/indexes, keyed by document, method, model and the
options the index depends on, so a rerun, a resumed run or a run that changes only search options (PECAN's search
ablations) reuses them. A method that learns across documents (GoR) has every document indexed first; the documents
are dealt into 5 folds and the method is fit on the other folds' documents before a fold's questions, so no
document trains the model that answers it (`fit_s` in its lines); with --ray the documents are indexed on the
workers and the fits and answers run in this process.
Killing a run and starting it again skips the records already written (a torn last line is dropped), so the final
file is the same as an uninterrupted run's; records whose lines are errors are tried again, their error lines dropped
once the run ends. A run file is resumed only under the model, precision, dtype, KV cache dtype, options, method
config and answer decoding (budget, stops, penalty) that wrote it (`check_resumable`), and a cross-fitted run only
over the same records: a changed default, a calibration written since or a longer cross-fitted run is refused, not
mixed in, and before the model loads (`check_run`). `--max-new-tokens` sets the answer's budget for a run (in its
label), e.g. to read short summaries at a fraction of the 512 tokens the summary prompts allow.
"""
from __future__ import annotations

import fcntl
import json
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..engine.engine import DTYPES, KV_DTYPES, Engine
from ..engine.models import model_file_name, resolve_model
from ..methods.base import Method
from ..methods.baselines import TopK
from ..methods.prompts import PromptSpec, prompt_for
from ..methods.registry import get, names
from ..paths import check_input, read_json_lines, write_atomic
from .datasets import LoadResult, load_dataset
from .eval_line import evaluate_record
from .index_store import BuiltIndex, IndexStore, document_hash
from .pecan_calibration import with_calibration
from .ray_tasks import RayPlan, WorkerSpec, evaluate_on_ray, index_on_ray
from .report import current_lines, read_meta


@dataclass
class RunConfig:
    """What identifies a run: its output file is <out>/<label>-<dataset>.jsonl."""

    method: str
    dataset: str
    limit: int | None = None
    data_dir: str | None = None
    out: str = "runs"
    options: dict = field(default_factory=dict)  # method config, e.g. {"k": 3}
    match: str | None = None  # a reference run file: pick k so that query FLOPs match its mean (Top-X)
    name: str | None = None   # the run's label; by default the method and its options (e.g. bm25-top3)
    max_new_tokens: int | None = None  # the answer's token budget; None: the dataset prompt's (512 for summaries)

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        budget = [] if self.max_new_tokens is None else [f"max_new_tokens={self.max_new_tokens}"]
        options = sorted(self.options.items())
        if self.match is not None:  # named after the reference (runs matched to two methods keep two files) and the
            reference = Path(self.match).stem.removesuffix(f"-{self.dataset}")  # options but k, which the match picks
            return "-".join([f"{self.method}-topx-{reference}", *(f"{k}={v}" for k, v in options if k != "k"), *budget])
        return "-".join([self.method, *(f"top{v}" if k == "k" else f"{k}={v}" for k, v in options), *budget])

    def __post_init__(self):
        n = self.max_new_tokens
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"max_new_tokens must be an int >= 1 (the answer's token budget), got {n!r}")
        label = self.label  # a run's index store and calibration are found beside it in <out>
        if "/" in label or "\\" in label or label.startswith("."):
            raise ValueError(f"the run's label {label!r} must be a plain file name (no '/', not starting with '.'); "
                             "set --label")

    @property
    def prompt(self) -> PromptSpec:
        """The dataset's prompt, with the run's answer budget where it sets one."""
        return prompt_for(self.dataset, self.max_new_tokens)

    @property
    def path(self) -> Path:
        return Path(self.out) / f"{self.label}-{self.dataset}.jsonl"


def check_top_x(method: str) -> None:
    """A ValueError unless `method` picks k chunks (what --match matches)."""
    if not issubclass(get(method), TopK):
        top_k = " or ".join(n for n in names() if issubclass(get(n), TopK))
        raise ValueError(f"--match picks k for {top_k}, not {method!r}")


def match_k(engine: Engine, cfg: RunConfig, reference: Path, k_max: int = 32, sample: int = 10) -> tuple[int, dict]:
    """Top-X: the k whose predicted mean query FLOPs on cfg's records come closest to the mean of a reference run
    (as Table 1 matches BM25/dense to PECAN). A prediction is one exact prefill of the k-chunk prompt plus as many
    decoded tokens as the reference's answers hold on average, at most the run's budget (their tokens and the line
    break that ends them: not the reference's own generated tokens, which for DICE include its sub-questions and
    facts), over the first `sample` records."""
    from ..engine.flops import forward_flops

    check_top_x(cfg.method)
    ref = _answered(reference, cfg.dataset, str(engine.path))
    target = sum(r["query_flops"] for r in ref) / len(ref)
    gen = min(round(sum(len(engine.tokenizer.encode(r["prediction"])) + 1 for r in ref) / len(ref)),
              cfg.prompt.max_new_tokens)  # a run's budget below the reference's answers cuts them
    records = load_dataset(cfg.dataset, cfg.data_dir, cfg.limit).records[:sample]
    method = get(cfg.method)(engine, prompt=cfg.prompt, **{**cfg.options, "k": k_max})
    c = engine.config
    predicted = {k: 0.0 for k in range(1, k_max + 1)}
    for record in records:
        built = method.index(record.document)
        for k in predicted:
            method.config = replace(method.config, k=k)
            context = method.context(built, record.question)[0]
            n = len(method.reader.prompt_ids(context, record.question, record.options)[0])
            predicted[k] += (forward_flops(c, n) + sum(forward_flops(c, 1, n + i) for i in range(gen))) / len(records)
    k = min(predicted, key=lambda k: (abs(predicted[k] - target), k))
    return k, {"matched_to": str(reference), "target_query_flops": target, "predicted_query_flops": predicted[k]}


def _answered(reference: Path, dataset: str, model: str) -> list[dict]:
    """The answered lines of a Top-X reference run file of `dataset` on the model file `model` (as its meta names
    them), or a ValueError naming what it lacks: the FLOPs of another dataset's or model's run match nothing here."""
    ref = [r for r in read_json_lines(check_input(reference, "reference run")) if "error" not in r]
    if not ref:
        raise ValueError(f"reference run {reference} has no answered records to match")
    meta_path = reference.with_suffix(".meta.json")
    meta = read_meta(meta_path) if meta_path.is_file() else {}
    for key, ours in (("dataset", dataset), ("model", model_file_name(model))):
        theirs = meta.get(key) and (model_file_name(meta[key]) if key == "model" else meta[key])
        if theirs and theirs != ours:
            raise ValueError(f"reference run {reference} is a run on {key} {theirs}, not {ours}: match a run of "
                             "the same dataset and model")
    return ref


def dtype_name(engine: Engine) -> str:
    """The `load_engine` dtype name of the engine's model ("float32", "bfloat16")."""
    return next(name for name, d in DTYPES.items() if d == engine.model.dtype)


def kv_dtype_name(engine: Engine) -> str:
    """The `load_engine` kv_dtype name of what the engine's KV pages hold ("float32", "bfloat16", "float16")."""
    return next(name for name, d in KV_DTYPES.items() if d == engine.pool.dtype)


RESUMED_AS_WRITTEN = ("model", "precision", "dtype", "kv_dtype", "options", "config", "generation")  # kept on resume


def check_resumable(path: Path, meta: dict, resuming: bool, across_documents: bool = False,
                    added: dict[str, Any] | None = None) -> None:
    """Refuse (ValueError, before any work) to append to a run file that was written under another model file,
    precision, dtype, KV cache dtype, option set, method config or answer decoding (`generation`): a calibration
    file written since (PECAN's t_p), a method default or a prompt's budget changed since would otherwise mix two
    settings in one file under one label; and to append to one whose meta file is gone, which says nothing of its
    settings. A method that learns across documents (`across_documents`) also keeps the run's record count: its
    folds are dealt over the run's documents, so a run extended from 10 records to 30 would mix answers fitted on 8
    other documents with answers fitted on 24. Keys an older meta file lacks are not checked, but a method config
    written before an option was added reads as that option's `before` value (`added`: name -> value), the value
    that runs as the code did then; the model is compared by file name (`model_file_name`), so a run moves between
    machines."""
    meta_path = path.with_suffix(".meta.json")
    if not resuming:
        return
    if not meta_path.is_file():
        raise ValueError(f"{path} holds answers but {meta_path.name}, the settings that wrote them, is missing: "
                         "restore it, or give this run another --label")
    old, new = read_meta(meta_path), json.loads(json.dumps(meta))  # tuples as lists, as written
    if "dtype" in old:  # written before the KV cache's dtype was kept: the cache held the model's dtype
        old.setdefault("kv_dtype", old["dtype"])
    if "model" in old:
        old["model"], new["model"] = model_file_name(old["model"]), model_file_name(new["model"])
    if "config" in old:
        old["config"] = {**(added or {}), **old["config"]}
    keys = RESUMED_AS_WRITTEN + (("records",) if across_documents else ())
    changes: dict[str, str] = {}  # one line per changed setting or option
    for key in (key for key in keys if key in old and old[key] != new[key]):
        if isinstance(new[key], dict):  # an option is in both options and config: the config's typed value wins
            changes.update(_differences(old[key], new[key]))
        else:
            changes[key] = f"{key} {old[key]} now {new[key]}" + (" (the folds are dealt over the run's records)"
                                                                 if key == "records" else "")
    if changes:
        raise ValueError(f"{path} was written under other settings; resume it with the code and options that wrote "
                         "it, or give this run another --label:" + "".join(f"\n  {line}" for line in changes.values()))


def added_options(method_class: type[Method]) -> dict[str, Any]:
    """The options of `method_class` added since some run files were written, with the value that runs as before."""
    return {o.name: o.before for o in method_class.options if o.before is not None}


def check_answered_records(path: Path, lines: list[dict], loaded: LoadResult) -> None:
    """Refuse (ValueError, before any work) to resume a run file that holds answers to records this run does not
    load: written from another data file (--data-dir, $NODEKV_DATA_DIR) or with a larger --limit, it would end
    holding more records than asked for, some of them from another file, under one label."""
    loaded_ids = {r.id for r in loaded.records}
    foreign = [r["id"] for r in lines if r.get("id") not in loaded_ids]
    if foreign:
        raise ValueError(f"{path} holds answers to {len(foreign)} record(s) that this run does not load (e.g. "
                         f"{foreign[0]!r}): it was written from another data file or with a larger --limit; resume it "
                         "with the data and --limit that wrote it, or give this run another --label")


def _differences(old: dict, new: dict) -> dict[str, str]:
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return {k: f"{k}={old.get(k, '(unset)')} now {new.get(k, '(unset)')}" for k in keys}


def _run_meta(cfg: RunConfig, model: str, precision: str, dtype: str, kv_dtype: str, loaded: LoadResult) -> dict:
    """What a run of cfg over `loaded` on the model file `model` at `precision`, `dtype` and `kv_dtype` is written
    and resumed under (its .meta.json, less a Top-X run's match): the options with where each comes from (a
    calibration's t_p when one holds for this model, `with_calibration`), the method config, the generation settings
    and the records."""
    method_class = get(cfg.method)
    defaults = with_calibration(method_class, method_class.dataset_defaults(cfg.dataset), cfg.dataset,
                                cfg.path.parent, cfg.options, model, [r.id for r in loaded.records])
    options = {**{k: v for k, (v, _) in defaults.items()}, **cfg.options}
    prompt = cfg.prompt
    return {"method": cfg.label, "dataset": cfg.dataset, "model": model, "precision": precision, "dtype": dtype,
            "kv_dtype": kv_dtype, "options": options,
            "config": asdict(method_class.configure(**options)),
            "option_sources": {k: "--option" if k in cfg.options else source for k, (_, source) in defaults.items()},
            "generation": {k: getattr(prompt, k) for k in ("max_new_tokens", "stop", "repetition_penalty")},
            "records": len(loaded.records), "skipped": [{"id": i, "reason": why} for i, why in loaded.problems]}


def check_run(cfg: RunConfig, model: str | None, precision: str, dtype: str = "float32",
              kv_dtype: str | None = None) -> None:
    """Refuse (ValueError) before `model` (as `load_engine` takes it, with `kv_dtype` as it does: None for the
    model's dtype) loads what `run` would refuse after: a run file that does not read as JSON lines, that another
    eval is writing, that was written under other settings (`check_resumable`) or that holds records this run does
    not load (`check_answered_records`); a Top-X reference run without answers. A Top-X run (--match) picks its k on
    the model, so its settings are checked only then."""
    lines = read_json_lines(cfg.path)
    if cfg.path.is_file():
        with cfg.path.open("a") as run_file:  # the lock is let go at once: `run` takes it for the run
            _lock(run_file, cfg.path)
    loaded = load_dataset(cfg.dataset, cfg.data_dir, cfg.limit)
    if cfg.match is not None:
        _answered(Path(cfg.match), cfg.dataset, str(resolve_model(model)))
    else:
        meta = _run_meta(cfg, str(resolve_model(model)), precision, dtype, kv_dtype or dtype, loaded)
        method_class = get(cfg.method)
        check_resumable(cfg.path, meta, bool(lines), method_class.learns_across_documents, added_options(method_class))
    check_answered_records(cfg.path, lines, loaded)  # after: a cross-fitted run's own refusal says more


def run(engine: Engine, cfg: RunConfig, progress: bool = True, ray: RayPlan | None = None) -> Path:
    """Evaluate cfg.method on cfg.dataset, appending to (and resuming) cfg.path; returns the path. With `ray`, the
    records run as Ray tasks (`ray_tasks`), the lines the same. Records whose lines are errors are tried again: each
    new line is appended as it comes, and once the run ends the error lines it answers are dropped, the file replaced
    whole (until then readers skip them: `report.current_lines`)."""
    loaded = load_dataset(cfg.dataset, cfg.data_dir, cfg.limit)
    matched = {}
    if cfg.match is not None:
        cfg.options["k"], matched = match_k(engine, cfg, Path(cfg.match))
    meta = {**_run_meta(cfg, str(engine.path), engine.model.precision, dtype_name(engine), kv_dtype_name(engine),
                        loaded), **matched}
    options, method_class = meta["options"], get(cfg.method)
    for k, source in meta["option_sources"].items():
        print(f"{cfg.label} {cfg.dataset}: {k}={options[k]} ({source})", file=sys.stderr)
    method = method_class(engine, prompt=cfg.prompt, **options)
    cfg.path.parent.mkdir(parents=True, exist_ok=True)
    with cfg.path.open("a") as out:  # held to the end: the lock is on it, and the lines go to it
        _lock(out, cfg.path)
        lines = current_lines(read_json_lines(cfg.path, cut_torn_tail=True))
        check_resumable(cfg.path, meta, bool(lines), method_class.learns_across_documents, added_options(method_class))
        check_answered_records(cfg.path, lines, loaded)
        write_atomic(cfg.path.with_suffix(".meta.json"), json.dumps(meta, indent=1))
        for rid, why in loaded.problems:
            print(f"skipped record {rid}: {why}", file=sys.stderr)
        # the shared prefixes an earlier process paid for are not charged again (`PrefixCache.prepaid`)
        engine.prefixes.prepaid.update(d for r in lines for d in r.get("prefixes_paid", ()))
        done = {r["id"] for r in lines if "error" not in r}
        todo = [r for r in loaded.records if r.id not in done]
        errored = {r["id"] for r in lines if "error" in r} & {r.id for r in todo}
        if errored:
            print(f"{cfg.label} {cfg.dataset}: retrying {len(errored)} record(s) whose lines are errors",
                  file=sys.stderr)
        store = IndexStore.for_method(cfg.path.parent / "indexes", engine, method)
        indexes: dict[str, BuiltIndex] = {}  # doc hash -> its index and what building it cost
        bar = tqdm(total=len(loaded.records), initial=len(loaded.records) - len(todo), unit="rec",
                   desc=f"{cfg.label} {cfg.dataset}", disable=not progress)

        def write(line: dict) -> None:
            out.write(json.dumps(line) + "\n")
            out.flush()
            bar.update()

        spec = None if ray is None else WorkerSpec(
            str(engine.path), dtype_name(engine), cfg.method,
            options, str(store.root), cfg.dataset, engine.model.precision, kv_dtype_name(engine), cfg.max_new_tokens)
        if method_class.learns_across_documents:
            # every fit needs all the indexes, each one independent work: with Ray they are built on the workers
            # (one that fails there fails again in _cross_fit, which writes its error lines)
            docs = {document_hash(r.document): r.document for r in loaded.records} if spec and todo else {}
            missing = {doc: text for doc, text in docs.items() if store.cost(doc) is None}
            if missing:
                index_on_ray(ray, spec, missing, lambda doc, cost: None)
            _cross_fit(engine, method, loaded.records, todo, store, write, progress)
        elif spec is not None:
            evaluate_on_ray(ray, spec, todo, write)
        else:
            for record in todo:
                write(evaluate_record(engine, method, record, indexes, store))
        bar.close()
        rows = read_json_lines(cfg.path)
        kept = current_lines(rows)
        if len(kept) < len(rows):  # retries answered: their error lines go, the file replaced whole
            write_atomic(cfg.path, "".join(json.dumps(r) + "\n" for r in kept))
    return cfg.path


def _lock(run_file, path: Path) -> None:
    """Take the run file for this process alone (an advisory lock, released when the file closes), or a ValueError:
    two runs appending to one file would answer every record twice."""
    try:
        fcntl.flock(run_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ValueError(f"{path} is being written by another nodekv eval: let it finish, or give this run another "
                         "--label") from None


FOLDS = 5  # documents are split into this many folds for methods that learn across documents


def document_folds(records: list, folds: int = FOLDS) -> dict[str, int]:
    """Each document's fold: documents in order of first appearance, dealt round-robin into `folds` folds."""
    order: dict[str, int] = {}
    for r in records:
        order.setdefault(document_hash(r.document), len(order))
    return {doc: i % folds for doc, i in order.items()}


def _cross_fit(engine: Engine, method: Method, records: list, todo: list, store: IndexStore, write,
               progress: bool) -> None:
    """Index every document of the run, then for each fold of documents (`document_folds`) with records to do: fit
    the method on the (index, record) pairs of the documents outside the fold, answer the fold's records. A
    document whose index fails gets an error line per record and is left out of every fit."""
    built, failed = {}, {}
    for r in tqdm(records, unit="rec", desc="indexing every document first", disable=not progress):
        doc = document_hash(r.document)
        if doc not in built and doc not in failed:
            try:
                built[doc] = store.build_or_load(method, r.document)
            except Exception as e:  # as in evaluate_record: one bad document never stops the run
                failed[doc] = f"{type(e).__name__}: {e}"
    fold_of = document_folds(records)
    pending: dict[int, list] = {}
    for r in todo:
        pending.setdefault(fold_of[document_hash(r.document)], []).append(r)
    for fold, mine in sorted(pending.items()):
        t = time.perf_counter()
        try:
            method.fit([(built[d].index, r) for r in records
                        if fold_of[d := document_hash(r.document)] != fold and d in built])
        except Exception as e:  # the fold's records fail, the run goes on
            failed.update({document_hash(r.document): f"fit: {type(e).__name__}: {e}" for r in mine})
        fit_s = round(time.perf_counter() - t, 3)
        for r in mine:
            doc = document_hash(r.document)
            if doc in failed:
                write({"id": r.id, "question": r.question, "references": list(r.references), "document": doc,
                       "error": failed[doc]})
            else:
                write({**evaluate_record(engine, method, r, {doc: built[doc]}, store), "fit_s": fit_s})
