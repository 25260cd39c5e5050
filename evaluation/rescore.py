"""Run files rescored by the current metrics, without the model: after a metric changes, each answered line's
`metrics` (and `miss`) are computed again from its prediction, the calibrated letter and the supporting passages
it read, against its record in the run's dataset (`nodekv eval rescore RUN...`). Costs, traces and every other
field stay as the run wrote them."""
from __future__ import annotations

import fcntl
import json
from pathlib import Path

from ..paths import read_json_lines, write_atomic
from .datasets import load_dataset
from .eval_line import scored
from .report import run_meta


def rescore(path: Path, data_dir: str | Path | None = None, write: bool = True) -> int:
    """Rescore the answered lines of run file `path` against its dataset (named by its meta file) under
    `data_dir`, and rewrite the file whole (atomically) if any line changed and `write`; returns how many did. A
    ValueError naming the first answered record the dataset no longer holds, or whose question differs, before
    anything is written."""
    _, dataset, _ = run_meta(path)
    records = {r.id: r for r in load_dataset(dataset, data_dir).records}
    with path.open("a") as held:  # the lock a run takes to append to it: lines it appends meanwhile are not lost
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"{path} is being written by a nodekv eval: rescore it when that run ends") from None
        lines = read_json_lines(path)
        try:
            new = [line if "error" in line else _rescored(line, records.get(line["id"]), dataset) for line in lines]
        except (KeyError, TypeError) as e:
            raise ValueError(f"{path} does not read as a nodekv run file ({type(e).__name__}: {e})") from None
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        changed = sum(a != b for a, b in zip(lines, new))
        if changed and write:
            write_atomic(path, "".join(json.dumps(line) + "\n" for line in new))
    return changed


def _rescored(line: dict, record, dataset: str) -> dict:
    if record is None or record.question != line["question"]:
        raise ValueError(f"record {line['id']!r} is {'not in' if record is None else 'another question in'} {dataset} "
                         "under this data directory: rescore it against the data it was run on")
    return {**line, **scored(record, line["prediction"], line.get("calibrated"), line.get("support"))}
