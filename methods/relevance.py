"""The engine as a relevance judge: log p("Yes") (normalised over "Yes"/"No") that a passage is relevant to a
question. DICE re-ranks its recalled chunks with it (in place of the paper's cross-encoder) and JERR can reward its
MCTS walks with it. The instruction is a prefix prefilled once per engine (`Engine.prefixes`), the question is
prefilled once per call, and every passage is a fork of it, all appended in one batched forward."""
from __future__ import annotations

import math
from typing import Sequence

from ..engine.engine import Engine
from .base import chat_pieces

QUESTION = ("Is this passage relevant to the question? Answer \"Yes\" or \"No\" in one word.\n\n"
            "Question: {}\n\nPassage: {}")


class RelevanceProbe:
    """log p("Yes") of each passage for a question, on `engine`."""

    def __init__(self, engine: Engine):
        self.engine = engine
        tok = engine.tokenizer
        self._head, self._between, self._tail = (
            tok.encode(p, parse_special=True) for p in chat_pieces(engine, [{"role": "user", "content": QUESTION}]))

    def __call__(self, question: str, passages: Sequence[str]) -> list[float]:
        if not passages:
            return []
        encode = self.engine.tokenizer.encode
        with self.engine.prefixes.fork(self._head, node_id="relevance") as s:
            s.append(encode(question) + self._between, node_id="question")
            forks = [s.fork() for _ in passages]
            try:
                self.engine.append_batch(forks, [encode(p) + self._tail for p in passages])
                probs = [f.probe(["Yes", "No"])["Yes"] for f in forks]
            finally:
                for f in forks:
                    f.release()
        return [math.log(p) if p > 0 else float("-inf") for p in probs]
