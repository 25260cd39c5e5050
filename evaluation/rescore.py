"""Run files rescored by the current metrics, without the model: after a metric changes, each answered line's
`metrics` (and `miss`) are computed again from its prediction, the calibrated letter and the supporting passages
it read, against its record in the run's dataset (`nodekv eval rescore RUN...`). Costs, traces and every other
field stay as the run wrote them."""
from __future__ import annotations

import contextlib
import fcntl
import json
from pathlib import Path

from ..paths import read_json_lines, write_atomic
from .datasets import load_dataset
from .eval_line import scored
from .report import run_meta


def rescore(paths: list[Path], data_dir: str | Path | None = None) -> list[int]:
    """Rescore the answered lines of the run files `paths` against their datasets (named by their meta files) under
    `data_dir`, each dataset read once; rewrite each file whole (atomically) where a line changed, and return how
    many did in each. Every file is scored before any is written: a ValueError names the first answered record a
    dataset no longer holds (or whose question differs), a file that is no run, or one a run is writing."""
    datasets: dict[str, dict] = {}
    scored_now = []
    for path in paths:
        _, dataset, _ = run_meta(path)
        if dataset not in datasets:
            datasets[dataset] = {r.id: r for r in load_dataset(dataset, data_dir).records}
        lines = read_json_lines(path)
        scored_now.append((lines, _rescored_lines(path, lines, datasets[dataset], dataset)))
    counts = [sum(a != b for a, b in zip(lines, new)) for lines, new in scored_now]
    with contextlib.ExitStack() as held:  # the lock a run takes to append: every changed file's, before any write
        for path, (lines, _), n in zip(paths, scored_now, counts):
            if n:
                _lock(held.enter_context(path.open("a")), path)
                if read_json_lines(path) != lines:
                    raise ValueError(f"{path} changed while it was rescored: rescore it again")
        for path, (_, new), n in zip(paths, scored_now, counts):
            if n:
                write_atomic(path, "".join(json.dumps(line) + "\n" for line in new))
    return counts


def _rescored_lines(path: Path, lines: list[dict], records: dict, dataset: str) -> list[dict]:
    try:
        return [line if "error" in line else _rescored(line, records.get(line["id"]), dataset) for line in lines]
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path} does not read as a nodekv run file ({type(e).__name__}: {e})") from None
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def _rescored(line: dict, record, dataset: str) -> dict:
    if record is None or record.question != line["question"]:
        raise ValueError(f"record {line['id']!r} is {'not in' if record is None else 'another question in'} {dataset} "
                         "under this data directory: rescore it against the data it was run on")
    return {**line, **scored(record, line["prediction"], line.get("calibrated"), line.get("support"))}


def _lock(held, path: Path) -> None:
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ValueError(f"{path} is being written by a nodekv eval: rescore it when that run ends") from None
