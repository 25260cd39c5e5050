"""The records of a `nodekv eval` run as Ray tasks (`--ray [ADDRESS]`): one engine per worker process, loaded once;
one task per document (its records in order, so the worker builds or loads that document's index once); the
driver writes the lines in record order through the run's own resumable writer. A worker that dies restarts and
its task runs again; a driver that dies resumes like a local run, since finished records are skipped. With no
address a local Ray runtime is started for the run and stopped after it. Ray is an optional extra (`.[ray]`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass(frozen=True)
class RayPlan:
    """Where and how wide: `address` of an existing cluster (None: a local runtime for this run), `workers`
    engine processes of `threads` threads each."""

    address: str | None
    workers: int
    threads: int


class _Worker:
    """One engine and one method instance, kept for every task this worker process runs."""

    def __init__(self, model: str, dtype: str, threads: int, dataset: str, method: str, options: dict,
                 store_root: str):
        from ..engine.config import preset
        from ..engine.engine import load_engine
        from .index_store import PROJECT_TO, IndexStore
        from .prompts import prompt_for
        from .registry import get

        self.engine = load_engine(model, dtype=dtype, threads=threads)
        self.engine.flops.project_to.setdefault(PROJECT_TO, preset(PROJECT_TO))
        self.method = get(method)(self.engine, prompt=prompt_for(dataset), **options)
        self.store = IndexStore.for_method(Path(store_root), self.engine, self.method)
        self.indexes: dict = {}

    def evaluate(self, records: list) -> list[dict]:
        from .evaluate import evaluate_record

        return [evaluate_record(self.engine, self.method, r, self.indexes, self.store) for r in records]


def evaluate_on_ray(plan: RayPlan, model: str, dtype: str, dataset: str, method: str, options: dict,
                    store_root: Path, todo: list, write: Callable[[dict], None]) -> None:
    """Evaluate `todo` (records, in run order) on Ray and `write` each line in that order."""
    try:
        import ray
    except ImportError:
        raise ValueError("--ray needs Ray: pip install 'nodekv[ray]' (or pip install ray)") from None
    started = not ray.is_initialized()
    if started:
        ray.init(address=plan.address, include_dashboard=False, log_to_driver=False,
                 **({} if plan.address else {"num_cpus": plan.workers * plan.threads}))
    try:
        worker = ray.remote(num_cpus=plan.threads, max_restarts=-1, max_task_retries=-1)(_Worker)
        actors = [worker.remote(model, dtype, plan.threads, dataset, method, options, str(store_root))
                  for _ in range(plan.workers)]
        groups: dict[str, list] = {}
        for r in todo:
            groups.setdefault(r.document, []).append(r)
        pending = {actors[i % len(actors)].evaluate.remote(records): records
                   for i, records in enumerate(groups.values())}
        lines: dict[str, dict] = {}
        order, written = [r.id for r in todo], 0
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for future in done:
                for record, line in zip(pending.pop(future), ray.get(future)):
                    lines[record.id] = line
            while written < len(order) and order[written] in lines:
                write(lines.pop(order[written]))
                written += 1
    finally:
        if started:
            ray.shutdown()
