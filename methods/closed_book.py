"""Closed book: answer from the question alone, never reading the document. The floor a method that reads the
document must beat, and the smallest whole method (README, "Writing a method")."""
from __future__ import annotations

from .base import Answer, Method


class ClosedBook(Method, name="closed-book"):
    """The question alone in the prompt (the shared reader's closed-book read: the dataset's answer budget and
    stop strings; multiple choice scored over the option letters)."""

    def index(self, document: str) -> None:
        return None  # nothing to read

    def answer(self, index: None, question: str, options: tuple[str, ...] = ()) -> Answer:
        return self.reader.read(None, question, options)
