"""DICE's calls to the LLM, on the engine: a question's reasoning thread T (`Thought`), the re-ranker and fact
extraction (`EngineLM`). Every fixed prompt part (the few-shot planning turn, the relevance and extraction
instructions) is prefilled once per engine and forked (`Engine.prefixes`); what depends on the question is cached
once per question and forked per candidate passage."""
from __future__ import annotations

from typing import Hashable, Sequence

from ...engine.engine import Engine
from ...engine.node_store import StoredNode
from ...engine.session import Session
from ..base import chat_pieces
from .dice_prompts import EXTRACT_FACT, planning_turn
from ..reader import Repair, check_prompt_fits
from ..relevance import RelevanceProbe


class Thought:
    """One question's reasoning T as a KV-cached session: the planning turn with its examples, the question, then
    the lines the algorithm writes and the model generates, each a node that can be rolled back."""

    def __init__(self, session: Session, next_turn: tuple[list[int], list[int]]):
        self.session = session
        self._next_turn = next_turn  # chat tokens closing the reply and opening a user turn; closing that turn

    def choose(self, labels: Sequence[str]) -> str:
        """The label the model puts next, constrained to `labels` (its tokens stay in T)."""
        return self.session.generate(max(len(self._encode(x)) for x in labels), choices=list(labels)).text

    def generate(self, max_tokens: int, stop: Sequence[str]) -> tuple[str, bool]:
        """Decode into T until a `stop` string (kept in T, cut from the text) or `max_tokens`; (text, whether it
        stopped)."""
        gen = self.session.generate(min(max_tokens, self.room()), stop=stop)
        return gen.text, gen.finish_reason == "stop"

    def generate_after(self, insert: str, max_tokens: int, stop: Sequence[str]) -> tuple[str, bool]:
        """As `generate`, with `insert` prefilled first, in a fork: T is unchanged."""
        with self.session.fork() as fork:
            fork.append(self._encode(insert))
            gen = fork.generate(min(max_tokens, self.engine.config.max_seq_len - len(fork)), stop=stop)
        return gen.text, gen.finish_reason == "stop"

    def write(self, text: str) -> None:
        self.session.append(self._encode(text))

    def ask(self, text: str) -> None:
        """End the model's turn with T and add a user turn `text`; the model's reply comes next."""
        open_turn, close_turn = self._next_turn
        self.session.append(open_turn + self._encode(text) + close_turn)

    def mark(self) -> Hashable:
        return self.session.nodes[-1].node_id

    def rollback(self, mark: Hashable) -> None:
        self.session.truncate(mark)

    def room(self) -> int:
        """Tokens left in the context window."""
        return self.engine.config.max_seq_len - len(self.session)

    def close(self) -> None:
        self.session.release()

    @property
    def engine(self) -> Engine:
        return self.session.engine

    def _encode(self, text: str) -> list[int]:
        return self.engine.tokenizer.encode(text)


class EngineLM:
    """The LLM of both DICE algorithms, on `engine`. Passages given with their stored KV (`kv_reuse`) are placed, not
    prefilled, with `repair`'s share of their tokens recomputed in place."""

    def __init__(self, engine: Engine, examples: str = "multihop", repair: Repair = Repair()):
        self.engine, self.repair = engine, repair
        tok = engine.tokenizer
        user = lambda text: chat_pieces(engine, [{"role": "user", "content": text}])  # noqa: E731
        self._planning = {a: [tok.encode(p, parse_special=True) for p in user(planning_turn(a, examples))]
                          for a in (1, 2)}
        self._relevance = RelevanceProbe(engine)
        self._extract = [tok.encode(p, parse_special=True) for p in user(EXTRACT_FACT)]
        turns = [{"role": "user", "content": "{}"}, {"role": "assistant", "content": "{}"},
                 {"role": "user", "content": "{}"}]
        self._next_turn = tuple(tok.encode(p, parse_special=True) for p in chat_pieces(engine, turns)[2:])

    def thought(self, algorithm: int, question: str, opening: str = "") -> Thought:
        """T for `question`: the algorithm's planning turn (shared prefix), the question, the reply's `opening`."""
        head, tail = self._planning[algorithm]
        rest = self._encode(question) + tail + self._encode(opening)
        check_prompt_fits(len(head) + len(rest), self.engine.config.max_seq_len,
                          "DICE's planning turn with this question")
        s = self.engine.prefixes.fork(head, node_id=f"dice-plan-{algorithm}")
        try:
            s.append(rest, node_id="question")
        except BaseException:
            s.release()
            raise
        return Thought(s, self._next_turn)

    def relevance(self, question: str, passages: Sequence[str], stored: Sequence[StoredNode] | None = None
                  ) -> list[float]:
        """log p("Yes") of each passage's relevance to `question` (`relevance.RelevanceProbe`); `stored`: the
        passages' KV."""
        return self._relevance(question, passages, stored, self.repair)

    def extract(self, question: str, reference: str, max_tokens: int, stored: Sequence[StoredNode] = ()) -> str:
        """P_e's reply: the fact in `reference` that answers `question`, up to the first line break. `stored`: the
        KV of the passages `reference` joins with line breaks, placed with those line breaks between them."""
        head, between, tail = self._extract
        with self.engine.prefixes.fork(head, node_id="dice-extract") as s:
            if stored:
                spans = []
                for j, node in enumerate(stored):
                    if j:
                        s.append(self._encode("\n"))
                    spans.append(s.append_stored(node))
                worst = self.repair.positions(s, spans)
                if worst:
                    s.repair(worst)
                s.append(between + self._encode(question) + tail)
            else:
                s.append(self._encode(reference) + between + self._encode(question) + tail)
            return s.generate(max_tokens, stop="\n").text.strip()

    def _encode(self, text: str) -> list[int]:
        return self.engine.tokenizer.encode(text)

