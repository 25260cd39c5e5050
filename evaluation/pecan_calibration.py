"""Pick PECAN's confidence threshold t_p for a dataset from dev records (small models are poorly calibrated on the
Yes/No probe: on HotpotQA, SmolLM2's p(Yes) stays between about 0.2 and 0.75 whatever the prompt holds).

The visit order does not depend on t_p (the next node is chosen from attention and similarity only), so one search
per dev record, run to the node budget with a probe after every node, shows what any threshold would do: at each
probed step the answer is also decoded and rolled back, with its quality (F1; ROUGE-L for summaries) and the
query FLOPs a search stopping there costs by the engine's account. A threshold's outcome on a record is the step
where p(Yes) > t_p for the t_n-th time, or the last step when that never happens (the budget).

Objectives: "nodes" (mean nodes visited closest to a target), "f1" (best mean quality, fewer FLOPs on ties) and
"f1-per-tflop" (best mean quality per mean query TFLOP, better quality on ties).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

from tqdm import tqdm

from ..engine.engine import Engine
from ..engine.models import model_file_name, resolve_model
from .datasets import Record, load_dataset
from .metrics import score
from .index_store import IndexStore
from .report import SWEEPS_SUFFIX
from ..methods.pecan.pecan import INDEX_OPTIONS, Pecan
from ..methods.pecan.pecan_store import PecanIndex
from ..methods.prompts import prompt_for
from ..methods.reader import GrowingPrompt
from ..paths import read_json_lines, write_atomic

OBJECTIVES = ("nodes", "f1", "f1-per-tflop")


def calibration_path(runs: str | Path, dataset: str, prompt_style: str) -> Path:
    """Where `nodekv calibrate` keeps the t_p of a dataset and prompt style (probes differ between styles)."""
    return Path(runs) / f"pecan-calibration-{dataset}-{prompt_style}.json"


def with_calibration(method_class: type, defaults: dict, dataset: str, runs: Path, options: dict,
                     model: str | None, ids: Iterable[str] = ()) -> dict:
    """A method's `defaults` for `dataset`, with PECAN's t_p taken from `nodekv calibrate`'s file in the run directory
    `runs` when there is one made for this dataset, model file (`model_file_name`), prompt style, patience, search
    window and index options (explicit options win over both, in the runner). A file made for other settings is named
    in the default's source, and so are the run's record `ids` that were the calibration's dev records (t_p was chosen
    on them: not held out)."""
    if not issubclass(method_class, Pecan):
        return defaults
    run = Pecan.configure(**{k: v for k, v in options.items() if k != "t_p"})
    path = calibration_path(runs, dataset, run.prompt_style)
    if not path.is_file():
        return defaults
    calibration = json.loads(path.read_text())
    made_for = Pecan.configure(**{k: v for k, v in calibration["options"].items() if k != "t_p"})
    differ = [k for k in (*INDEX_OPTIONS, "prompt_style", "t_n", "search_tokens")
              if getattr(run, k) != getattr(made_for, k)]
    made_with = calibration.get("model")
    if model is not None and (made_with is None or model_file_name(made_with) != model_file_name(model)):
        differ.append("model")
    if differ:
        why = f"{path} was made for another {', '.join(differ)}"
        return {k: (v, f"{source}; {why}") for k, (v, source) in defaults.items()}
    source = f"calibrated on {len(calibration['dev_ids'])} dev records ({path})"
    dev_ids = set(calibration["dev_ids"])
    dev = [i for i in ids if i in dev_ids]
    if dev:
        source += (f"; warning: {len(dev)} of this run's records were among them ({', '.join(dev[:3])}"
                   f"{', ...' if len(dev) > 3 else ''}), so their scores are not held out")
    return {**defaults, "t_p": (calibration["t_p"], source)}


@dataclass
class Point:
    """What a search stopping after this step would give."""

    nodes: int          # nodes visited (top level included)
    p_yes: float
    flops: int          # query FLOPs: the search so far, its probes, and this answer
    quality: float      # F1 (ROUGE-L for summaries) of this answer


def sweep(method: Pecan, index: PecanIndex, record: Record) -> list[Point]:
    """The probed steps of one search run to the node budget, each with the answer it would end in. The answers'
    prompts grow by a node a step, so they are read through one `GrowingPrompt` (the nodes prefilled about once,
    not once an answer: a MuSiQue dev sweep on qwen2.5-1.5b, 12 answers, took 5 minutes, not 15 to 18); a
    point still counts the FLOPs of a fresh read, what a search stopping there runs."""
    eng = method.search_engine
    account, points, visited, rolled_back = eng.flops, [], 0, 0
    start = account.total
    trace = []
    with eng.session() as s, GrowingPrompt(eng) as growing:
        for step in method.search(s, index, record.question, record.options, probe=True):
            trace.append(step)
            visited += "node" in step
            if "p_yes" not in step:
                continue
            before, saved = account.total, account.saved
            text = method.conclude(s, index, trace, record.question, record.options, growing).text
            metrics = score(record, text)
            skipped = account.saved - saved  # the prefill the growing prompt spared this answer
            points.append(Point(visited, step["p_yes"], account.total - start - rolled_back + skipped,
                                metrics.get("f1", metrics.get("rougeL", metrics.get("accuracy", 0.0)))))
            rolled_back += account.total - before  # this answer is rolled back: later stops do not pay for it
            s.truncate(step["node"])  # takes back the paper's second turn (the shared reader reads apart)
    return points


def outcome(points: list[Point], t_p: float, t_n: int = 1) -> Point:
    """The point where a search with threshold t_p (patience t_n) stops."""
    seen = 0
    for p in points:
        seen += p.p_yes > t_p
        if seen >= t_n:
            return p
    return points[-1]


def thresholds(sweeps: list[list[Point]]) -> list[float]:
    """Thresholds that cover every distinct outcome: 0, the midpoints between consecutive observed p(Yes), and 1
    (neighbours may share an outcome)."""
    seen = sorted({p.p_yes for points in sweeps for p in points})
    return [0.0] + [round((a + b) / 2, 6) for a, b in zip(seen, seen[1:])] + [1.0]


def table(sweeps: list[list[Point]], t_n: int = 1) -> list[dict]:
    """Mean nodes, quality and query TFLOPs over the dev records for each threshold."""
    rows = []
    for t in thresholds(sweeps):
        stops = [outcome(points, t, t_n) for points in sweeps]
        rows.append({"t_p": t, "nodes": sum(p.nodes for p in stops) / len(stops),
                     "f1": 100 * sum(p.quality for p in stops) / len(stops),
                     "query_tflops": sum(p.flops for p in stops) / len(stops) / 1e12})
    return rows


def probe_auc(sweeps: list[list[Point]], right: float = 0.5) -> float | None:
    """How well p(Yes) tells a step whose answer is right (quality >= `right`) from one whose answer is wrong: the
    probability that a right step's p(Yes) is above a wrong step's (ties count half). 0.5 is no signal; None when
    every step is right or every step is wrong."""
    points = [p for sweep in sweeps for p in sweep]
    good = [p.p_yes for p in points if p.quality >= right]
    bad = [p.p_yes for p in points if p.quality < right]
    if not good or not bad:
        return None
    return sum((g > b) + 0.5 * (g == b) for g in good for b in bad) / (len(good) * len(bad))


def check_objective(objective: str, target_nodes: float | None) -> None:
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown calibration objective {objective!r}; known: {', '.join(OBJECTIVES)}")
    if objective == "nodes" and (target_nodes is None or not target_nodes > 0):  # not > 0: NaN too
        raise ValueError("the 'nodes' objective needs a positive target number of nodes (--target-nodes)")
    if objective != "nodes" and target_nodes is not None:
        raise ValueError(f"--target-nodes is the 'nodes' objective's; the {objective!r} objective does not use it")


def choose(rows: list[dict], objective: str, target_nodes: float | None = None) -> dict:
    """The row that best meets `objective`; ties go to the lower threshold."""
    check_objective(objective, target_nodes)
    if objective == "nodes":
        return min(rows, key=lambda r: (abs(r["nodes"] - target_nodes), -r["f1"], r["t_p"]))
    if objective == "f1":
        return min(rows, key=lambda r: (-r["f1"], r["query_tflops"], r["t_p"]))
    return min(rows, key=lambda r: (-r["f1"] / r["query_tflops"], -r["f1"], r["t_p"]))


def _sweep_settings(model: str | Path, config: object) -> dict:
    """What a calibration's sweeps are made under, as its log's header holds it: the model file's name and the PECAN
    config (tuples as lists, as written)."""
    return json.loads(json.dumps({"model": model_file_name(model), "config": asdict(config)}))


def _logged(log: Path, settings: dict, cut_torn_tail: bool = False) -> list[dict]:
    """The lines of a calibration's sweep log (`read_json_lines`): a header line with its settings, then one line per
    dev record. Refused (ValueError, before any work) when the header names other settings: mixing sweeps made under
    another model or config would choose t_p for neither."""
    lines = read_json_lines(log, cut_torn_tail)
    if lines and lines[0] != settings:
        changed = sorted(k for k in set(lines[0]) | set(settings) if lines[0].get(k) != settings.get(k))
        raise ValueError(f"{log} holds sweeps made under another {' and '.join(changed)}: calibrate into another "
                         "--out, or delete it to sweep again")
    return lines


def _swept(log: Path, settings: dict) -> dict[str, list[Point]]:
    """The sweeps a calibration that was stopped already wrote to `log` (`_logged`), by record id; a new log gets
    the header."""
    lines = _logged(log, settings, cut_torn_tail=True)
    if not lines:
        log.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(log, json.dumps(settings) + "\n")
    return {line["id"]: [Point(**p) for p in line["points"]] for line in lines[1:]}


def dev_records(dataset: str, data_dir: str | None, dev: tuple[int, int]) -> list[Record]:
    """The dev records `dev` = (first, count) of `dataset` (fewer where the file ends first), or a ValueError naming
    the problem (a start past the last record, among others)."""
    first, count = dev
    if first < 0 or count < 1:
        raise ValueError(f"dev records must be a start >= 0 and a count >= 1, got {dev}")
    records = load_dataset(dataset, data_dir, first + count).records
    if len(records) <= first:
        raise ValueError(f"the dev records start at index {first} (--dev-start), but {dataset} has {len(records)} "
                         "record(s)")
    return records[first:]


def _configure(options: dict):
    """The PECAN config a calibration holds for; t_p, what it chooses, is refused (it would be swept over anyway)."""
    if "t_p" in options:
        raise ValueError("t_p is what a calibration chooses: drop --option t_p (the others say what it holds for)")
    return Pecan.configure(**options)


def check_calibration(dataset: str, dev: tuple[int, int], out: str | Path, data_dir: str | None, options: dict,
                      model: str | None) -> None:
    """Refuse (ValueError) before `model` (as `load_engine` takes it) loads what `calibrate` would refuse after: bad
    PECAN options, a dev range without records, sweeps logged under another model or config."""
    config = _configure(options)
    dev_records(dataset, data_dir, dev)
    _logged(calibration_path(out, dataset, config.prompt_style).with_suffix(SWEEPS_SUFFIX),
            _sweep_settings(resolve_model(model), config))


def calibrate(engine: Engine, dataset: str, dev: tuple[int, int], objective: str = "f1-per-tflop",
              target_nodes: float | None = None, out: str | Path = "runs", data_dir: str | None = None,
              options: dict | None = None, progress: bool = True) -> dict:
    """Sweep the dev records `dev` = (first, count) of `dataset` (by default after the 30 an evaluation uses),
    choose t_p for `objective`, and write <out>/pecan-calibration-<dataset>-<prompt style>.json with the choice, the
    options it holds for, the dev record ids and the whole table; `nodekv eval` in <out> then uses it by default.
    Indexes are shared with `nodekv eval` (<out>/indexes). Each record's sweep is logged as it ends (beside the
    calibration file, `.sweeps.jsonl`, with the seconds it took), so a stopped calibration resumes where it stopped
    and another objective over the same records costs no model work."""
    check_objective(objective, target_nodes)
    records = dev_records(dataset, data_dir, dev)
    options = dict(options or {})
    _configure(options)
    method = Pecan(engine, prompt=prompt_for(dataset), **options)
    path = calibration_path(out, dataset, method.config.prompt_style)
    log = path.with_suffix(SWEEPS_SUFFIX)
    swept = _swept(log, _sweep_settings(engine.path, method.config))
    store = IndexStore.for_method(Path(out) / "indexes", engine, method)
    sweeps = []
    with log.open("a") as written:
        for record in tqdm(records, unit="rec", desc=f"calibrate {dataset}", disable=not progress):
            points = swept.get(record.id)
            if points is None:
                index = store.build_or_load(method, record.document).index
                start = time.perf_counter()
                points = sweep(method, index, record)
                written.write(json.dumps({"id": record.id, "points": [asdict(p) for p in points],
                                          "seconds": round(time.perf_counter() - start, 1)}) + "\n")
                written.flush()
            if points:
                sweeps.append(points)
    if not sweeps:
        raise ValueError("no dev record reached a probe (each top level used the whole node budget)")
    rows = table(sweeps, method.config.t_n)
    best = choose(rows, objective, target_nodes)
    result = {"dataset": dataset, "t_p": best["t_p"], "objective": objective, "target_nodes": target_nodes,
              "chosen": best, "probe_auc": probe_auc(sweeps), "options": {**options, "t_p": best["t_p"]},
              "dev_ids": [r.id for r in records],
              "model": str(engine.path), "table": rows,
              "sweeps": [[asdict(p) for p in points] for points in sweeps]}
    write_atomic(path, json.dumps(result, indent=1))
    result["path"] = str(path)
    return result
