"""What every method shares: the Answer it returns, the prompt it ends with, and the chat-wrapped, middle-truncated
token ids it feeds the engine."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Protocol

from ..engine.engine import Engine
from .prompts import PromptSpec


@dataclass
class Answer:
    """A method's answer to one question, with what it cost and what it looked at."""

    text: str
    nodes: list[Hashable]            # ids of the nodes (chunks, IPs) the answer was conditioned on
    trace: list[dict] = field(default_factory=list)
    flops: int = 0                   # query-dependent FLOPs by the engine's account
    prompt_tokens: int = 0
    generated_tokens: int = 0
    truncated: bool = False          # the prompt was cut in the middle to fit the window


class Method(Protocol):
    """A long-document QA policy on the engine: index a document once, answer many questions about it."""

    name: str

    def index(self, document: str) -> Any: ...

    def answer(self, index: Any, question: str) -> Answer: ...


def prompt_ids(engine: Engine, spec: PromptSpec, context: str, question: str,
               options: tuple[str, ...] = ()) -> tuple[list[int], bool]:
    """The chat-templated prompt, cut in the middle (as LongBench does) so that it plus the answer fits the window.
    Returns (ids, truncated)."""
    ids = engine.tokenizer.chat([{"role": "user", "content": spec.render(context, question, options)}])
    room = engine.config.max_seq_len - spec.max_new_tokens
    if len(ids) <= room:
        return ids, False
    half = room // 2
    return ids[:half] + ids[len(ids) - (room - half):], True


def generate_answer(engine: Engine, ids: list[int], spec: PromptSpec, nodes: list, truncated: bool,
                    trace: list[dict] | None = None) -> Answer:
    """Prefill `ids` as one node, decode greedily, and charge it all to the engine's "query" scope."""
    before = engine.flops.scopes["query"]
    with engine.flops.scope("query"), engine.session() as s:
        s.append(ids, node_id="prompt")
        text = s.generate(spec.max_new_tokens, stop=spec.stop)
        generated = len(s) - len(ids)
    return Answer(text.strip(), nodes, trace or [], engine.flops.scopes["query"] - before, len(ids), generated,
                  truncated)


def chat_pieces(engine: Engine, messages: list[dict], add_generation_prompt: bool = True) -> list[str]:
    """The rendered chat prompt of `messages`, split at each "{}" in their contents: pieces[0] is the text before
    the first "{}", pieces[-1] the text after the last one (end of turn, assistant header). Lets a method append a
    prompt to a session node by node (encode each piece with parse_special=True)."""
    mark = "\x00\x01\x00"
    filled = [dict(m, content=m["content"].replace("{}", mark)) for m in messages]
    return engine.tokenizer.render_chat(filled, add_generation_prompt).split(mark)
