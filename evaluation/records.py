"""What a dataset gives the runner: one record per question (its document, references, options and supporting
text), and what loading a file found."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Task = Literal["qa", "summary", "multiple_choice", "variables"]  # variables: variable tracking


@dataclass(frozen=True)
class Record:
    """One question about one document, as every dataset is read."""

    id: str
    dataset: str
    document: str
    question: str
    references: tuple[str, ...]
    options: tuple[str, ...] = ()  # multiple choice only: option texts, in letter order A, B, C, ...
    task: Task = "qa"
    supports: tuple[str, ...] = ()  # the text that holds the answer, one entry per supporting passage, where marked


@dataclass
class LoadResult:
    """The good records of a dataset file and the (id, reason) of each one skipped."""

    records: list[Record] = field(default_factory=list)
    problems: list[tuple[str, str]] = field(default_factory=list)  # (record id, reason), in file order
