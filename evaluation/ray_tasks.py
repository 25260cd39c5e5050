"""nodekv's work as Ray tasks: the records of `nodekv eval --ray [ADDRESS]` and the documents of `nodekv index-corpus
DIR --ray [ADDRESS]`. One engine per worker process, loaded once; one task per document (for eval, its records in
order, so the worker builds or loads that document's index once). Results go through the same resumable writer and
index store as a local run: a worker that dies restarts and its task runs again; a driver that dies resumes like a
local run, since finished records and stored indexes are skipped. With no address a local Ray runtime is started
for the command and stopped after it. The store must be a directory every worker can write. Ray is an optional
extra (`.[ray]`).
"""
from __future__ import annotations

import socket
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator


@dataclass(frozen=True)
class RayPlan:
    """Where and how wide: `address` of an existing cluster (None: a local runtime for this run), `workers`
    engine processes of `threads` threads each."""

    address: str | None
    workers: int
    threads: int


def check_address(address: str | None) -> None:
    """A ValueError unless the host:port of an existing cluster accepts a connection within 3 s, tried before any
    work (ray.init would try for ~20 s after the model loaded); a local runtime (None), "auto" and ray:// client
    addresses are left to ray.init."""
    if address is None or address == "auto" or "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not (host and port.isdigit()):
        raise ValueError(f"--ray {address}: an address is HOST:PORT, auto or ray://HOST:PORT")
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
    except OSError as e:
        raise ValueError(f"--ray {address}: no Ray cluster answers there ({e})") from None


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker loads: the model file, its dtype, the method with its options, the prompt of `dataset`
    ("" for the generic one), the index store's root directory, the engine's precision, what its KV cache holds
    (None: the model's dtype) and the answer's token budget (None: the prompt's)."""

    model: str
    dtype: str
    method: str
    options: dict
    store_root: str
    dataset: str = ""
    precision: str = "exact"
    kv_dtype: str | None = None
    max_new_tokens: int | None = None


class _Worker:
    """One engine and one method instance, kept for every task this worker process runs."""

    def __init__(self, spec: WorkerSpec, threads: int):
        from ..engine.engine import load_engine
        from .index_store import IndexStore
        from ..methods.prompts import prompt_for
        from ..methods.registry import get

        self.engine = load_engine(spec.model, dtype=spec.dtype, threads=threads, precision=spec.precision,
                                  kv_dtype=spec.kv_dtype)
        prompt = prompt_for(spec.dataset, spec.max_new_tokens)
        self.method = get(spec.method)(self.engine, prompt=prompt, **spec.options)
        self.store = IndexStore.for_method(Path(spec.store_root), self.engine, self.method)
        self.indexes: dict = {}

    def evaluate(self, records: list) -> list[dict]:
        from .eval_line import evaluate_record

        return [evaluate_record(self.engine, self.method, r, self.indexes, self.store) for r in records]

    def index(self, document: str) -> tuple | str:
        """Build and store `document`'s index; its cost, or the error that stopped it (`IndexStore.build_cost`)."""
        return self.store.build_cost(self.method, document)


@contextmanager
def ray_workers(plan: RayPlan, spec: WorkerSpec) -> Iterator[list]:
    """`plan.workers` worker actors on `plan.address` (or a local runtime started here and stopped on exit)."""
    try:
        import ray
    except ImportError:
        raise ValueError("--ray needs Ray: pip install 'nodekv[ray]' (or pip install ray)") from None
    started = not ray.is_initialized()
    if started:
        try:
            ray.init(address=plan.address, include_dashboard=False, log_to_driver=False,
                     **({} if plan.address else {"num_cpus": plan.workers * plan.threads}))
        except ConnectionError as e:  # a cluster gone since check_address, or one behind "auto"
            raise ValueError(f"--ray {plan.address or ''}: cannot join the Ray cluster ({e})") from None
    try:
        worker = ray.remote(num_cpus=plan.threads, max_restarts=-1, max_task_retries=-1)(_Worker)
        yield [worker.remote(spec, plan.threads) for _ in range(plan.workers)]
    finally:
        if started:
            ray.shutdown()


def _spread(actors: list, items: list, call: Callable) -> Iterator[tuple]:
    """(item, result) for each of `items` as it finishes, each run as `call(actor, item)` on the next idle actor (a
    long document does not hold up the queue behind it)."""
    import ray

    idle, queue, running = list(actors), list(items), {}
    while queue or running:
        while idle and queue:
            actor, item = idle.pop(), queue.pop(0)
            running[call(actor, item)] = actor, item
        (future,), _ = ray.wait(list(running), num_returns=1)
        actor, item = running.pop(future)
        idle.append(actor)
        yield item, ray.get(future)


def evaluate_on_ray(plan: RayPlan, spec: WorkerSpec, todo: list, write: Callable[[dict], None]) -> None:
    """Evaluate `todo` (records, in run order) on Ray and `write` each line in that order; with nothing to do, Ray is
    not started."""
    if not todo:
        return
    groups: dict[str, list] = {}
    for r in todo:
        groups.setdefault(r.document, []).append(r)
    with ray_workers(plan, spec) as actors:
        lines: dict[str, dict] = {}
        order, written = [r.id for r in todo], 0
        for records, results in _spread(actors, list(groups.values()), lambda a, rs: a.evaluate.remote(rs)):
            lines.update((record.id, line) for record, line in zip(records, results))
            while written < len(order) and order[written] in lines:
                write(lines.pop(order[written]))
                written += 1


def index_on_ray(plan: RayPlan, spec: WorkerSpec, documents: dict[str, str],
                 built: Callable[[str, tuple | str], None]) -> None:
    """Index `documents` ({key: text}) on Ray into the spec's store; `built(key, cost or error)` as each one ends.
    With nothing to index, Ray is not started."""
    if not documents:
        return
    with ray_workers(plan, spec) as actors:
        for key, cost in _spread(actors, list(documents), lambda a, key: a.index.remote(documents[key])):
            built(key, cost)
