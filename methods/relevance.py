"""The engine as a relevance judge: log p("Yes") (normalised over "Yes"/"No") that a passage is relevant to a
question. DICE re-ranks its recalled chunks with it (in place of the paper's cross-encoder) and JERR can reward its
MCTS walks with it. The instruction is a prefix prefilled once per engine (`Engine.prefixes`), the question is
prefilled once per call, and every passage is a fork of it, all appended in one batched forward."""
from __future__ import annotations

import math
from typing import Sequence

from ..engine.engine import Engine
from ..engine.node_store import StoredNode
from .chat_prompt import ChatPrompt
from .reader import Repair

QUESTION = ("Is this passage relevant to the question? Answer \"Yes\" or \"No\" in one word.\n\n"
            "Question: {}\n\nPassage: {}")


class RelevanceProbe:
    """log p("Yes") of each passage for a question, on `engine`."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._prompt = ChatPrompt(engine.tokenizer, [{"role": "user", "content": QUESTION}])

    def __call__(self, question: str, passages: Sequence[str], stored: Sequence[StoredNode] | None = None,
                 repair: Repair = Repair()) -> list[float]:
        """stored: each passage's KV (`Engine.store_node` of its plain ids), placed in its fork instead of prefilled
        (`repair`: the placed tokens recomputed with the question before them)."""
        if not passages:
            return []
        prompt = self._prompt
        before, after = prompt.around(1)  # a stored passage's neighbours
        with self.engine.prefixes.fork(prompt.head, node_id="relevance") as s:
            s.append(prompt.fill(0, question) + (before if stored is not None else []), node_id="question")
            forks = [s.fork() for _ in passages]
            try:
                if stored is None:
                    self.engine.append_batch(forks, [prompt.fill(1, p) for p in passages])
                else:
                    for f, node in zip(forks, stored):
                        worst = repair.positions(f, [f.append_stored(node)])
                        if worst:
                            f.repair(worst)
                    self.engine.append_batch(forks, [after] * len(forks))
                probs = [f.probe(["Yes", "No"])["Yes"] for f in forks]
            finally:
                for f in forks:
                    f.release()
        return [math.log(p) if p > 0 else float("-inf") for p in probs]
