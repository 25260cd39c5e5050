"""The pytest-benchmark kernel suite runs: every tiny-shape case once, without timing (a smoke test)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nodekv.bench.kernel_bench as suite


def test_every_tiny_kernel_case_runs_once():
    proc = subprocess.run([sys.executable, "-m", "pytest", str(Path(suite.__file__)), "-p", "no:cacheprovider", "-q",
                           "--benchmark-disable", "-k", "tiny"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert "14 passed" in proc.stdout
