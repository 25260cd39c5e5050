"""Benchmarks: speed and memory against peers, FLOP tables against the papers.

The argparse `type=` functions below check arguments as they are parsed, so that a bad value is one `error:` line
before any model loads or any child starts, never a traceback (or a silently wrong table) after the work."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from nodekv.paths import keep_checkout_off_sys_path

# benchmarks run as `python -m nodekv.bench.NAME`, and start their children so, from the checkout
keep_checkout_off_sys_path()


def count(text: str) -> int:
    """An int >= 1: a count of tokens, rounds, repeats or threads (0 would measure nothing, or divide by it)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def counts(text: str) -> list[int]:
    """Comma-separated counts: "1,2,4" -> [1, 2, 4]."""
    return [count(part) for part in text.split(",")]


def model(text: str) -> str:
    """A registered model name or an existing model path, as `load_engine` would accept it (checked before a child
    process or a load finds out)."""
    from nodekv.engine.models import resolve_model

    try:
        resolve_model(text)
    except ValueError as e:  # ModelLoadError: an unknown name, or a registered model whose package is missing
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def models(text: str) -> list[str]:
    """Comma-separated models, each checked as `model`."""
    return [model(name) for name in text.split(",")]


def _checked(check, text: str):
    try:
        return check(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def output_file(text: str) -> Path:
    """A file path that can be written (`check_output_file`): a typo fails now, not after the run."""
    from nodekv.paths import check_output_file

    return _checked(check_output_file, text)


def output_folder(text: str) -> Path:
    """A folder that exists or can be made (`check_output_folder`)."""
    from nodekv.paths import check_output_folder

    return _checked(check_output_folder, text)


def device(text: str):
    """The torch device `load_engine(device=...)` would use (`resolve_device`): a CUDA device torch cannot see is one
    line naming it, not an AssertionError from the first kernel."""
    from nodekv.engine.engine import resolve_device

    return _checked(resolve_device, text)


def input_folder(text: str) -> Path:
    """An existing folder to read from (a missing one would read as a folder of nothing: an empty report)."""
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is not a folder" if path.exists() else f"{path} does not exist")
    return path


def input_file(what: str):
    """An argparse type for an existing file holding `what` (`check_input`)."""
    from nodekv.paths import check_input

    def existing(text: str) -> Path:
        return _checked(lambda t: check_input(t, what), text)

    return existing


def window(model_name: str) -> int:
    """The context window of a model `model` accepted, read from its config (no weights loaded)."""
    from nodekv.engine.loader import model_config
    from nodekv.engine.models import resolve_model

    return model_config(resolve_model(model_name)).max_seq_len


def run_child(cmd: list[str], what: str) -> dict:
    """The JSON a benchmark's child process prints last. A child that fails stops the benchmark with a non-zero exit
    and the child's last error line (its traceback's message) under `what`: the reason shows, and no table is
    printed as if the piece had run."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}, no error output"])[-1]
        sys.exit(f"error: {what} failed: {last}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
