"""`nodekv eval --ray` and `nodekv index-corpus --ray` on SmolLM2 with 2 local workers, one of them killed mid-run:
the worker restarts, its task runs again, and the run ends with what a local run gives (eval: the same lines in the
same order, wall times aside; index-corpus: byte-identical indexes and the same manifest, times aside); a rerun
finds nothing left to do (and starts no Ray runtime), so nothing is lost or duplicated."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from nodekv.cli import main as cli_main

pytestmark = pytest.mark.model
ray = pytest.importorskip("ray", reason="the ray extra is not installed")

WORDS = ["river", "town", "lake", "mill", "bridge", "tower", "forest", "road"]


def _write_data(root):
    """20 questions over 5 documents of 4 named places each."""
    records = []
    for d in range(5):
        places = [f"{WORDS[(d + i) % 8].title()}{d}" for i in range(4)]
        context = [[p, [f"{p} was founded in {1800 + 7 * d + i} by {WORDS[i].title()} Quill.",
                        f" It lies {3 + i} km from {places[(i + 1) % 4]}."]] for i, p in enumerate(places)]
        records += [{"_id": f"d{d}q{i}", "question": f"Who founded {p}?", "answer": f"{WORDS[i].title()} Quill",
                     "context": context} for i, p in enumerate(places)]
    (root / "multihop").mkdir(parents=True)
    (root / "multihop" / "hotpotqa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _argv(data, out, *extra):
    return ["eval", "--method", "bm25", "--k", "2", "--dataset", "hotpotqa", "--data-dir", str(data), "--out",
            str(out), "--model", "smollm2-135m", "--threads", "1", *extra]


def _lines(out):
    drop = ("wall_s", "index_s", "prompt_s")
    return [{k: v for k, v in json.loads(x).items() if k not in drop}
            for x in (out / "bm25-top2-hotpotqa.jsonl").read_text().splitlines()]


def _ray_workers_of(pid: int) -> list[int]:
    """The Ray task workers among `pid`'s descendants (its raylet forks them), not another run's on this machine."""
    table = subprocess.run(["ps", "-e", "-o", "pid=,ppid=,args="], capture_output=True, text=True).stdout
    rows = [line.split(None, 2) for line in table.splitlines()]
    children: dict[int, list[int]] = {}
    for row in rows:
        children.setdefault(int(row[1]), []).append(int(row[0]))
    ours, todo = set(), [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        ours.update(kids)
        todo += kids
    return [int(row[0]) for row in rows if int(row[0]) in ours and len(row) == 3 and row[2].startswith("ray::_Worker")]


def _kill_a_worker_when(ready, run: subprocess.Popen) -> None:
    """SIGKILL one Ray worker of `run` as soon as `ready()` holds (the run is under way, not finished)."""
    deadline = time.time() + 1800
    while not ready() and run.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    workers = _ray_workers_of(run.pid)
    assert workers and run.poll() is None, "the run ended before a worker could be killed mid-run"
    os.kill(workers[0], signal.SIGKILL)
    assert run.wait(timeout=1800) == 0  # a restarted worker loads its engine again


def _no_ray_runtime(monkeypatch) -> None:
    """ray.init fails the test: a rerun with nothing left to do must not start (or join) a Ray runtime."""
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: pytest.fail("a rerun with nothing to do started Ray"))


def test_ray_eval_equals_local_despite_a_killed_worker(tmp_path, monkeypatch):
    data = tmp_path / "data"
    _write_data(data)
    assert cli_main(_argv(data, tmp_path / "local")) == 0
    local = _lines(tmp_path / "local")
    assert len(local) == 20

    run = subprocess.Popen([sys.executable, "-m", "nodekv", *_argv(data, tmp_path / "ray", "--ray", "--workers", "2")],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    path = tmp_path / "ray" / "bm25-top2-hotpotqa.jsonl"
    _kill_a_worker_when(lambda: path.exists() and path.read_text().count("\n") >= 2, run)
    assert _lines(tmp_path / "ray") == local
    _no_ray_runtime(monkeypatch)
    assert cli_main(_argv(data, tmp_path / "ray", "--ray")) == 0  # the rerun finds nothing left to do
    assert _lines(tmp_path / "ray") == local


def _manifest(store):
    (path,) = store.glob("*.corpus.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{**r, "index": os.path.basename(r["index"]), "seconds": None} for r in rows]


def test_ray_index_corpus_equals_local_despite_a_killed_worker(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for d in range(3):
        (corpus / f"doc{d}.txt").write_text(" ".join(f"{WORDS[(d + i) % 8].title()}{d} was founded in {1800 + i} by "
                                                     f"{WORDS[i].title()} Quill." for i in range(3)))
    # summaries of 64 tokens at most: SmolLM2 fills the default 512 here, 16 s a document
    argv = ["index-corpus", str(corpus), "--model", "smollm2-135m", "--threads", "1", "--option", "summary_tokens=64",
            "--out"]
    assert cli_main([*argv, str(tmp_path / "local")]) == 0
    local = _manifest(tmp_path / "local")
    assert len(local) == 3

    store = tmp_path / "ray"
    run = subprocess.Popen([sys.executable, "-m", "nodekv", *argv, str(store), "--ray", "--workers", "2"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _kill_a_worker_when(lambda: any(store.glob("pecan-*.json")), run)
    _no_ray_runtime(monkeypatch)
    assert cli_main([*argv, str(store), "--ray"]) == 0  # the rerun finds nothing left to do
    assert _manifest(store) == local
    assert len(list(store.glob("pecan-*.json"))) == 3
    for row in local:
        assert (store / row["index"]).read_bytes() == (tmp_path / "local" / row["index"]).read_bytes()
