"""JERR's calls to the LLM on the engine: chat turns answered in batches (one prefill and one decode forward per step
for a batch of turns), the relevance probe, and a multiple-choice letter chosen by the model's probabilities."""
from __future__ import annotations

from typing import Sequence

from ...engine.engine import Engine
from ..relevance import RelevanceProbe


class JerrLM:
    """The LLM of JERR, on `engine`; `batch` turns share each forward."""

    def __init__(self, engine: Engine, batch: int = 4):
        self.engine, self.batch = engine, batch
        self._relevance: RelevanceProbe | None = None

    def replies(self, turns: Sequence[str], max_tokens: int) -> list[str]:
        """The greedy reply to each user turn, `batch` at a time."""
        tok, out = self.engine.tokenizer, []
        for start in range(0, len(turns), self.batch):
            group = turns[start:start + self.batch]
            sessions = [self.engine.session() for _ in group]
            try:
                self.engine.append_batch(sessions, [tok.chat([{"role": "user", "content": t}]) for t in group])
                out += [g.text.strip() for g in self.engine.generate_batch(sessions, max_tokens)]
            finally:
                for s in sessions:
                    s.release()
        return out

    def relevance(self, question: str, passages: Sequence[str]) -> list[float]:
        """log p("Yes") that each passage is relevant to `question`."""
        if self._relevance is None:
            self._relevance = RelevanceProbe(self.engine)
        return self._relevance(question, passages)

    def letter(self, ids: list[int], letters: Sequence[str]) -> tuple[str, dict[str, float]]:
        """After the prompt `ids` and "Answer: (", the most probable of `letters`, and every letter's probability."""
        with self.engine.session() as s:
            s.append(list(ids) + self.engine.tokenizer.encode("Answer: ("))
            probs = s.probe(list(letters))
        return max(letters, key=lambda x: probs[x]), probs
