"""DICE, dynamic in-context editing (dice.txt §3): plan, retrieve and edit the reasoning thread T step by step.

Retrieval (§3.1): the document is cut into chunks of at most 80 words; a sub-question or drafted step recalls the
top chunks by bi-encoder (all-MiniLM-L6-v2), the LLM re-ranks them (log p("Yes") that the passage is relevant:
the engine replaces the paper's cross-encoder) and the best `top_k` feed the step, in document order.

Algorithm 1 (§3.2), iterative QA with fact extraction: T ← Q; for i = 1..M: the model either ends (a constrained
choice between the labels "Subquestion:" and "Final answer:") or plans q_i; c_i* = Retrieve(q_i); f_i =
LLM(P_e + q_i + c_i*); T ← T + q_i + f_i; the answer is LLM(T).
Algorithm 2 (§3.3), knowledge-constrained decoding: T ← Q; for i = 1..M: the model either answers (a constrained
choice between "Thought:" and "Answer:") or drafts a step s_i; the draft is the retrieval query; the draft is
dropped and the step decoded again with the retrieved passages inserted before it (in a fork, so T keeps only
thoughts, as in Fig. 4b); decoding then goes on from T.

Both end cleanly on broken output: a step that does not end (no line break; for a thought, neither "#" nor a line
break) or is empty ("format"), a step
equal to an earlier one ("repeated"), M reached ("max_iterations") or a window too full for another step
("window"); T is rolled back to before the broken step and the answer decoded from there.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from ..engine.engine import Engine
from .base import Answer, Method
from .dice_prompts import (ANSWER, FACT, FINAL_ANSWER, REFERENCE, STEP_END, SUBQUESTION, THOUGHT, THOUGHTS)
from .options import Option
from .prompts import PromptSpec
from .retrieval import DenseIndex

STOP_REASONS = ("terminated", "max_iterations", "format", "repeated", "window")
STEP_ENDS = [STEP_END, "\n"]  # a thought ends at its "#"; small models often end the line without it


class ThoughtLike(Protocol):
    def choose(self, labels: Sequence[str]) -> str: ...
    def generate(self, max_tokens: int, stop: Sequence[str]) -> tuple[str, bool]: ...
    def generate_after(self, insert: str, max_tokens: int, stop: Sequence[str]) -> tuple[str, bool]: ...
    def write(self, text: str) -> None: ...
    def mark(self): ...
    def rollback(self, mark) -> None: ...
    def room(self) -> int: ...
    def close(self) -> None: ...


class LM(Protocol):
    """What the algorithms ask of the LLM (`dice_lm.EngineLM` on the engine; a scripted fake in tests)."""

    def thought(self, algorithm: int, question: str, opening: str = "") -> ThoughtLike: ...
    def relevance(self, question: str, passages: Sequence[str]) -> list[float]: ...
    def extract(self, question: str, reference: str, max_tokens: int) -> str: ...


@dataclass
class Retrieved:
    """The chunks that feed one step, in document order, with their bi-encoder and re-rank scores."""

    chunks: list[int]
    text: str
    scores: list[dict] = field(default_factory=list)


@dataclass
class Reasoning:
    """How one question went: the answer, why the loop stopped, the chunks read and one trace entry per step."""

    answer: str
    stop: str
    chunks: list[int]
    trace: list[dict]


@dataclass
class Budget:
    """Limits of one run: M, tokens of a step (sub-question, thought, fact), of the answer, and the window room a
    step needs before it starts."""

    max_iterations: int
    step_tokens: int
    answer_tokens: int
    step_room: int


def iterative_qa(lm: LM, retrieve: Callable[[str], Retrieved], question: str, budget: Budget) -> Reasoning:
    """Algorithm 1."""
    t = lm.thought(1, question)
    trace, seen, stop = [], set(), "max_iterations"
    try:
        for i in range(1, budget.max_iterations + 1):
            if t.room() < budget.step_room:
                stop = "window"
                break
            mark = t.mark()
            if t.choose([SUBQUESTION, FINAL_ANSWER]) == FINAL_ANSWER:
                stop = "terminated"
                break
            sub, ended = t.generate(budget.step_tokens, ["\n"])
            sub = sub.strip()
            broken = "format" if not ended or not sub else "repeated" if _key(sub) in seen else None
            if broken:
                t.rollback(mark)
                stop = broken
                trace.append({"step": i, "subquestion": sub, "broken": broken})
                break
            seen.add(_key(sub))
            got = retrieve(sub)
            fact = lm.extract(sub, got.text, budget.step_tokens)
            t.write(f"{FACT} {fact}\n")
            trace.append({"step": i, "subquestion": sub, "retrieved": got.scores, "fact": fact})
        if stop != "terminated":
            t.write(FINAL_ANSWER)
        answer = _final(t, budget, fallback=next((s["fact"] for s in reversed(trace) if "fact" in s), ""))
    finally:
        t.close()
    return _reasoning(answer, stop, trace)


def constrained_decoding(lm: LM, retrieve: Callable[[str], Retrieved], question: str, budget: Budget) -> Reasoning:
    """Algorithm 2."""
    t = lm.thought(2, question, opening=f"{THOUGHTS}\n")
    trace, seen, stop = [], set(), "max_iterations"
    try:
        for i in range(1, budget.max_iterations + 1):
            if t.room() < budget.step_room:
                stop = "window"
                break
            mark = t.mark()
            if t.choose([THOUGHT, ANSWER]) == ANSWER:
                stop = "terminated"
                break
            draft, ended = t.generate(budget.step_tokens, STEP_ENDS)
            draft = draft.strip()
            t.rollback(mark)  # the draft only queries; the step is decoded again with what it retrieves
            broken = "format" if not ended or not draft else "repeated" if _key(draft) in seen else None
            if broken:
                stop = broken
                trace.append({"step": i, "draft": draft, "broken": broken})
                break
            got = retrieve(draft)
            step, ended = t.generate_after(REFERENCE.format(got.text) + THOUGHT, budget.step_tokens, STEP_ENDS)
            step = step.strip()
            entry = {"step": i, "draft": draft, "retrieved": got.scores}
            if not ended or not step:  # the edited step broke the format: keep the draft
                step, entry["unfinished_edit"] = draft, step
            seen.update((_key(draft), _key(step)))
            t.write(f"{THOUGHT} {step}{STEP_END}\n")
            trace.append({**entry, "thought": step})
        if stop != "terminated":
            t.write(ANSWER)
        answer = _final(t, budget, fallback=next((s["thought"] for s in reversed(trace) if "thought" in s), ""))
    finally:
        t.close()
    return _reasoning(answer, stop, trace)


ALGORITHMS = {1: iterative_qa, 2: constrained_decoding}


def _final(t: ThoughtLike, budget: Budget, fallback: str) -> str:
    """The answer decoded after the answer label, up to the line's end; `fallback` if nothing fits or comes."""
    text, _ = t.generate(budget.answer_tokens, ["\n"]) if t.room() > 0 else ("", False)
    return text.strip() or fallback


def _reasoning(answer: str, stop: str, trace: list[dict]) -> Reasoning:
    chunks = sorted({s["chunk"] for step in trace for s in step.get("retrieved", ())})
    return Reasoning(answer, stop, chunks, trace + [{"stop": stop, "answer": answer}])


def _key(text: str) -> str:
    """A step's identity for the repeat check: words, lower-cased."""
    return " ".join(re.findall(r"\w+", text.lower()))


def word_chunks(document: str, words: int) -> list[str]:
    """Chunks of at most `words` whitespace-separated words; a chunk never spans a blank line (a passage break)."""
    chunks = []
    for paragraph in re.split(r"\n\s*\n", document):
        w = paragraph.split()
        chunks += [" ".join(w[i:i + words]) for i in range(0, len(w), words)]
    return chunks


@dataclass
class DiceIndex:
    """The document's chunks and their bi-encoder index."""

    chunks: list[str]
    search: DenseIndex


class Dice(Method, name="dice", title="DICE"):
    """DICE: the LLM plans sub-questions (Alg. 1) or reasoning steps (Alg. 2), each answered from retrieved chunks.

    index(document) cuts and embeds the chunks; answer(index, question) runs the chosen algorithm. `embedder`
    replaces the packaged all-MiniLM-L6-v2; `lm` replaces the engine-backed LLM calls (tests script it)."""

    options = (
        Option("algorithm", int, 2, "1: iterative QA with fact extraction; 2: knowledge-constrained decoding",
               choices=(1, 2)),
        Option("max_iterations", int, 5, "M: sub-questions or steps at most", low=1),
        Option("chunk_words", int, 80, "words per chunk at most", low=1),
        Option("top_k", int, 3, "chunks that feed each step", low=1),
        Option("recall_k", int, 10, "bi-encoder candidates re-ranked by the LLM", low=1),
        Option("rerank", bool, True, "re-rank the recalled chunks by the LLM's relevance probe"),
        Option("step_tokens", int, 64, "token budget of a sub-question, a thought or a fact", low=1),
    )

    def __init__(self, engine: Engine, prompt: PromptSpec | None = None, progress: bool = False, embedder=None,
                 lm: LM | None = None, **options):
        super().__init__(engine, prompt, progress, **options)
        self._embedder, self._lm = embedder, lm

    @property
    def lm(self) -> LM:
        if self._lm is None:
            from .dice_lm import EngineLM

            self._lm = EngineLM(self.engine)
        return self._lm

    def index(self, document: str) -> DiceIndex:
        from .embedder import Embedder

        if not isinstance(document, str) or not document.strip():
            raise ValueError("the document is empty: nothing to index")
        chunks = word_chunks(document, self.config.chunk_words)
        return DiceIndex(chunks, DenseIndex(chunks, self._embedder or Embedder.shared()))

    def retrieve(self, index: DiceIndex, query: str) -> Retrieved:
        """The `top_k` chunks for `query`: bi-encoder recall, LLM re-rank (ties: the bi-encoder's order), then
        document order."""
        c = self.config
        hits = index.search.search(query, c.recall_k if c.rerank else c.top_k)
        rerank = self.lm.relevance(query, [index.chunks[i] for i, _ in hits]) if c.rerank else [None] * len(hits)
        ranked = sorted(range(len(hits)), key=lambda j: -rerank[j] if c.rerank else j)[:c.top_k]
        chosen = sorted(ranked, key=lambda j: hits[j][0])
        scores = [{"chunk": hits[j][0], "dense": round(hits[j][1], 4),
                   **({"rerank": round(rerank[j], 4)} if c.rerank else {})} for j in chosen]
        return Retrieved([hits[j][0] for j in chosen], "\n".join(index.chunks[hits[j][0]] for j in chosen), scores)

    def answer(self, index: DiceIndex, question: str, options: tuple[str, ...] = ()) -> Answer:
        if options:
            raise ValueError("DICE answers open questions; multiple-choice options are not supported")
        c, acc = self.config, self.engine.flops
        before, saved, prefill, decode = acc.total, acc.saved, acc.prefill_tokens, acc.decode_tokens
        answer_tokens = self.answer_prompt.max_new_tokens
        budget = Budget(c.max_iterations, c.step_tokens, answer_tokens,
                        step_room=3 * c.step_tokens + answer_tokens + 2 * c.top_k * c.chunk_words)
        run = ALGORITHMS[c.algorithm](self.lm, lambda q: self.retrieve(index, q), question, budget)
        run.trace[-1]["prefix_flops_saved"] = acc.saved - saved
        return Answer(run.answer, run.chunks, run.trace, acc.total - before, acc.prefill_tokens - prefill,
                      acc.decode_tokens - decode)

    def trace_lines(self, index: DiceIndex, trace: list[dict]) -> list[str]:
        lines = []
        for step in trace:
            if "stop" in step:
                lines.append(f"stopped: {step['stop']}; answer: {step['answer']!r}")
                continue
            asked = step.get("subquestion", step.get("draft"))
            got = ", ".join(f"{s['chunk']}" + (f" ({s['rerank']:.2f})" if "rerank" in s else "")
                            for s in step.get("retrieved", ()))
            said = step.get("fact", step.get("thought", f"[{step.get('broken')}]"))
            lines.append(f"{step['step']}. {asked}\n   chunks {got or '-'}\n   -> {said}")
        return lines
