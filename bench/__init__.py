"""Benchmarks: speed and memory against peers, FLOP tables against the papers.

The argparse `type=` functions below check arguments as they are parsed, so that a bad value is one `error:` line
before any model loads or any child starts, never a traceback (or a silently wrong table) after the work."""
from __future__ import annotations

import argparse
from pathlib import Path


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


def _checked(check, text: str) -> Path:
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


def input_file(what: str):
    """An argparse type for an existing file holding `what` (`check_input`)."""
    from nodekv.paths import check_input

    def existing(text: str) -> Path:
        return _checked(lambda t: check_input(t, what), text)

    return existing
