"""DICE's two algorithms (dice.txt §3.2, §3.3) as control flow over an LLM interface (`LM`: `dice_lm.EngineLM` on
the engine, a scripted fake in tests) and a retrieval function; `Dice` (dice.py) binds them to a document.

Algorithm 1, iterative QA with fact extraction: T ← Q; for i = 1..M: the model either ends (a constrained choice
between the labels "Subquestion:" and "Final answer:") or plans q_i; c_i* = Retrieve(q_i); f_i = LLM(P_e + q_i +
c_i*); T ← T + q_i + f_i; the answer is LLM(T).
Algorithm 2, knowledge-constrained decoding: T ← Q; for i = 1..M: the model either answers (a constrained choice
between "Thought:" and "Answer:") or drafts a step s_i; the draft is the retrieval query; the draft is dropped and
the step decoded again with the retrieved passages inserted before it (in a fork, so T keeps only thoughts, as in
Fig. 4b); decoding then goes on from T.

Both end cleanly on broken output: a step that does not end (no line break; for a thought, neither "#" nor a line
break) or is empty ("format"), a step equal to an earlier one up to case, punctuation and articles ("repeated"), M
reached ("max_iterations") or a window too full for another step ("window"); T is rolled back to before the broken
step and the answer decoded from there. The answer follows T's answer label, or, with an `answer_turn`, is the reply
to that user turn (the question restated with the dataset's instruction).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from .dice_prompts import (ANSWER, FACT, FINAL_ANSWER, REFERENCE, STEP_END, SUBQUESTION, THOUGHT, THOUGHTS)
from ..text import normalize_answer

STOP_REASONS = ("terminated", "max_iterations", "format", "repeated", "window")
STEP_ENDS = [STEP_END, "\n"]  # a thought ends at its "#"; small models often end the line without it


class ThoughtLike(Protocol):
    """A question's reasoning thread T (`dice_lm.Thought`): labels chosen, text generated or written into it, marks
    to roll back to, and a new user turn (`ask`) for a restated answer turn."""

    def choose(self, labels: Sequence[str]) -> str: ...
    def generate(self, max_tokens: int, stop: Sequence[str]) -> tuple[str, bool]: ...
    def generate_after(self, insert: str, max_tokens: int, stop: Sequence[str]) -> tuple[str, bool]: ...
    def write(self, text: str) -> None: ...
    def ask(self, text: str) -> None: ...
    def mark(self): ...
    def rollback(self, mark) -> None: ...
    def room(self) -> int: ...
    def close(self) -> None: ...


class LM(Protocol):
    """What the algorithms ask of the LLM (`dice_lm.EngineLM` on the engine; a scripted fake in tests)."""

    def thought(self, algorithm: int, question: str, opening: str = "") -> ThoughtLike: ...
    def relevance(self, question: str, passages: Sequence[str], stored: Sequence | None = None) -> list[float]: ...
    def extract(self, question: str, reference: str, max_tokens: int, stored: Sequence = ()) -> str: ...


@dataclass
class Retrieved:
    """The chunks that feed one step, in document order, with their bi-encoder and re-rank scores; with a re-rank,
    every chunk recall gave it (`recalled`, in recall order), so a trace tells a passage the recall missed from one
    the re-rank dropped. With `kv_reuse`, `stored` holds the chunks' KV (empty without)."""

    chunks: list[int]
    text: str
    scores: list[dict] = field(default_factory=list)
    recalled: list[dict] = field(default_factory=list)
    stored: list = field(default_factory=list)

    def trace(self) -> dict:
        """The step trace's record of it."""
        return {"retrieved": self.scores, **({"recalled": self.recalled} if self.recalled else {})}


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


def iterative_qa(lm: LM, retrieve: Callable[[str], Retrieved], question: str, budget: Budget,
                 answer_turn: str | None = None) -> Reasoning:
    """Algorithm 1; `answer_turn`: as in `_reason`."""

    def step(t: ThoughtLike, mark, seen: set) -> dict:
        sub, ended = t.generate(budget.step_tokens, ["\n"])
        sub = sub.strip()
        broken = _broken(sub, ended, seen)
        if broken:
            t.rollback(mark)
            return {"subquestion": sub, "broken": broken}
        seen.add(normalize_answer(sub))
        got = retrieve(sub)
        fact = lm.extract(sub, got.text, budget.step_tokens, got.stored)
        t.write(f"{FACT} {fact}\n")
        return {"subquestion": sub, **got.trace(), "fact": fact}

    return _reason(lm.thought(1, question), (SUBQUESTION, FINAL_ANSWER), step, budget, answer_turn)


def constrained_decoding(lm: LM, retrieve: Callable[[str], Retrieved], question: str, budget: Budget,
                         answer_turn: str | None = None) -> Reasoning:
    """Algorithm 2; `answer_turn`: as in `_reason`."""

    def step(t: ThoughtLike, mark, seen: set) -> dict:
        draft, ended = t.generate(budget.step_tokens, STEP_ENDS)
        draft = draft.strip()
        t.rollback(mark)  # the draft only queries; the step is decoded again with what it retrieves
        broken = _broken(draft, ended, seen)
        if broken:
            return {"draft": draft, "broken": broken}
        got = retrieve(draft)
        edited, ended = t.generate_after(REFERENCE.format(got.text) + THOUGHT, budget.step_tokens, STEP_ENDS)
        edited = edited.strip()
        entry = {"draft": draft, **got.trace()}
        if not ended or not edited:  # the edited step broke the format: keep the draft
            entry["unfinished_edit"] = edited
        thought = edited if "unfinished_edit" not in entry else draft
        seen.update((normalize_answer(draft), normalize_answer(thought)))
        t.write(f"{THOUGHT} {thought}{STEP_END}\n")
        return {**entry, "thought": thought}

    return _reason(lm.thought(2, question, opening=f"{THOUGHTS}\n"), (THOUGHT, ANSWER), step, budget, answer_turn)


ALGORITHMS = {1: iterative_qa, 2: constrained_decoding}


def _reason(t: ThoughtLike, labels: tuple[str, str], step: Callable[[ThoughtLike, object, set], dict],
            budget: Budget, answer_turn: str | None = None) -> Reasoning:
    """The loop both algorithms share: up to M times, stop if the window is too full, let the model choose between
    another step and the answer (labels), take the step (`step(t, mark before its label, keys of earlier steps)`,
    a trace entry, "broken" in it when the step broke); then decode the answer after the answer label, or, given an
    `answer_turn` (a user turn that restates the question), in the reply to that turn after T."""
    go_on, answer_label = labels
    trace, seen, stop = [], set(), "max_iterations"
    try:
        for i in range(1, budget.max_iterations + 1):
            if t.room() < budget.step_room:
                stop = "window"
                break
            mark = t.mark()
            if t.choose([go_on, answer_label]) == answer_label:
                stop = "terminated"
                if answer_turn is not None:
                    t.rollback(mark)
                break
            trace.append({"step": i, **step(t, mark, seen)})
            if "broken" in trace[-1]:
                stop = trace[-1]["broken"]
                break
        if answer_turn is not None:
            t.ask(answer_turn)
        elif stop != "terminated":
            t.write(answer_label)
        said = [s[k] for s in trace for k in ("fact", "thought") if k in s]
        answer = _final(t, budget, fallback=said[-1] if said else "")
    finally:
        t.close()
    return _reasoning(answer, stop, trace)


def _broken(step: str, ended: bool, seen: set) -> str | None:
    """Why a generated step cannot be used: "format" (it did not end, or is empty), "repeated"; None if it can."""
    return "format" if not ended or not step else "repeated" if normalize_answer(step) in seen else None


def _final(t: ThoughtLike, budget: Budget, fallback: str) -> str:
    """The answer decoded after the answer label, up to the line's end; `fallback` if nothing fits or comes."""
    text, _ = t.generate(budget.answer_tokens, ["\n"]) if t.room() > 0 else ("", False)
    return text.strip() or fallback


def _reasoning(answer: str, stop: str, trace: list[dict]) -> Reasoning:
    chunks = sorted({s["chunk"] for step in trace for s in step.get("retrieved", ())})
    return Reasoning(answer, stop, chunks, trace + [{"stop": stop, "answer": answer}])
