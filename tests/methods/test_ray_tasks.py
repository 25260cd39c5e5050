"""`nodekv eval --ray` on SmolLM2: 20 records over 2 local workers give the lines a local run gives (wall times
aside, same order); a worker killed mid-run restarts, and the run, then a rerun, lose and duplicate nothing."""
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
    drop = ("wall_s", "index_s")
    return [{k: v for k, v in json.loads(x).items() if k not in drop}
            for x in (out / "bm25-top2-hotpotqa.jsonl").read_text().splitlines()]


def test_ray_run_equals_local_and_survives_a_killed_worker(tmp_path):
    data = tmp_path / "data"
    _write_data(data)
    assert cli_main(_argv(data, tmp_path / "local")) == 0
    local = _lines(tmp_path / "local")
    assert len(local) == 20

    assert cli_main(_argv(data, tmp_path / "ray", "--ray", "--workers", "2")) == 0
    assert _lines(tmp_path / "ray") == local

    run = subprocess.Popen([sys.executable, "-m", "nodekv", *_argv(data, tmp_path / "killed", "--ray")],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    path, deadline = tmp_path / "killed" / "bm25-top2-hotpotqa.jsonl", time.time() + 1800
    while not (path.exists() and path.read_text().count("\n") >= 2) and time.time() < deadline:
        time.sleep(0.2)
    workers = subprocess.run(["pgrep", "-f", "ray::_Worker"], capture_output=True, text=True).stdout.split()
    assert workers, "no Ray worker process to kill"
    os.kill(int(workers[0]), signal.SIGKILL)
    assert run.wait(timeout=1800) == 0  # a restarted worker loads its engine again
    assert cli_main(_argv(data, tmp_path / "killed", "--ray")) == 0  # the rerun finds nothing left to do
    assert _lines(tmp_path / "killed") == local
