"""DICE's calls to the LLM, on the engine: a question's reasoning thread T (`Thought`), the re-ranker and fact
extraction (`EngineLM`). Every fixed prompt part (the few-shot planning turn, the relevance and extraction
instructions) is prefilled once per engine and forked (`Engine.prefixes`); what depends on the question is cached
once per question and forked per candidate passage."""
from __future__ import annotations

from typing import Hashable, Sequence

from ...engine.engine import Engine
from ...engine.node_store import StoredNode
from ...engine.session import Session
from ..chat_prompt import SLOT, ChatPrompt
from .dice_prompts import EXTRACT_FACT, planning_turn
from ..reader import Repair, check_prompt_fits
from ..relevance import RelevanceProbe


class Thought:
    """One question's reasoning T as a KV-cached session: the planning turn with its examples, the question, then
    the lines the algorithm writes and the model generates, each a node that can be rolled back."""

    def __init__(self, session: Session, next_turn: ChatPrompt):
        self.session = session
        self._next_turn = next_turn  # user, assistant and user turns, each one slot: the reply, then the user's text

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
        turns = self._next_turn
        self.session.append(turns.around(1)[1] + turns.fill(2, text))

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
        user = lambda text: ChatPrompt(engine.tokenizer, [{"role": "user", "content": text}])  # noqa: E731
        self._planning = {a: user(planning_turn(a, examples)) for a in (1, 2)}
        self._relevance = RelevanceProbe(engine)
        self._extract = user(EXTRACT_FACT)
        self._next_turn = ChatPrompt(engine.tokenizer, [{"role": role, "content": SLOT}
                                                        for role in ("user", "assistant", "user")])

    def thought(self, algorithm: int, question: str, opening: str = "") -> Thought:
        """T for `question`: the algorithm's planning turn (shared prefix), the question, the reply's `opening`."""
        turn = self._planning[algorithm]
        rest = turn.fill(0, question) + self._encode(opening)
        check_prompt_fits(len(turn.head) + len(rest), self.engine.config.max_seq_len,
                          "DICE's planning turn with this question")
        s = self.engine.prefixes.fork(turn.head, node_id=f"dice-plan-{algorithm}")
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
        prompt = self._extract
        with self.engine.prefixes.fork(prompt.head, node_id="dice-extract") as s:
            if stored:
                before, after = prompt.around(0)
                spans = []
                for j, node in enumerate(stored):
                    separator = self._encode("\n") if j else before
                    if separator:
                        s.append(separator)
                    spans.append(s.append_stored(node))
                worst = self.repair.positions(s, spans)
                if worst:
                    s.repair(worst)
                s.append(after + prompt.fill(1, question))
            else:
                s.append(prompt.fill(0, reference) + prompt.fill(1, question))
            return s.generate(max_tokens, stop="\n").text.strip()

    def _encode(self, text: str) -> list[int]:
        return self.engine.tokenizer.encode(text)

