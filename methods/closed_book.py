"""Closed book: answer from the question alone, never reading the document. The floor a method that reads the
document must beat, and the smallest whole method (README, "Writing a method")."""
from __future__ import annotations

from dataclasses import replace

from .base import Answer, Method, generate_answer, prompt_ids

QUESTION_ONLY = ("Answer the question as concisely as you can. Do not provide any explanation.\n\n"
                 "Question: {question}\n{options}\nAnswer:")


class ClosedBook(Method, name="closed-book"):
    """The question alone in the prompt (with the dataset's answer budget and stop strings)."""

    def index(self, document: str) -> None:
        return None  # nothing to read

    def answer(self, index: None, question: str, options: tuple[str, ...] = ()) -> Answer:
        prompt = replace(self.answer_prompt, template=QUESTION_ONLY)
        ids, truncated = prompt_ids(self.engine, prompt, "", question, options)
        return generate_answer(self.engine, ids, prompt, [], truncated)
