"""Where nodekv finds what lives beside its code rather than in it: the source checkout (examples, results) and the
evaluation data. Defaults resolve from the checkout, or from the current folder outside one; nothing is ever
written inside the installed package."""
from __future__ import annotations

import os
from pathlib import Path

DATA_ENV = "NODEKV_DATA_DIR"


def _is_checkout(folder: Path) -> bool:
    project = folder / "pyproject.toml"
    return project.is_file() and 'name = "nodekv"' in project.read_text(errors="replace")


def checkout() -> Path | None:
    """The nodekv source checkout: the folder above this package when it is one (an editable install), else the
    current folder or the nearest one above it that is; None outside any."""
    here = Path(__file__).resolve().parents[1]
    if _is_checkout(here):
        return here
    cwd = Path.cwd().resolve()
    return next((p for p in (cwd, *cwd.parents) if _is_checkout(p)), None)


def base() -> Path:
    """The checkout, or the current folder outside one: where relative defaults (results/, build/) go."""
    return checkout() or Path.cwd()


def results_dir(*parts: str) -> Path:
    """results/<parts> of the checkout (or of the current folder)."""
    return base().joinpath("results", *parts)


def data_dir() -> Path:
    """The evaluation data: $NODEKV_DATA_DIR, else ../shared/data beside the checkout (or the current folder)."""
    env = os.environ.get(DATA_ENV)
    if env:
        return Path(env).expanduser().resolve()
    return (base() / ".." / "shared" / "data").resolve()


def example(name: str) -> Path:
    """A file of the checkout's examples/ (the benchmarks read its story; outside a checkout, ./examples/)."""
    return base() / "examples" / name
