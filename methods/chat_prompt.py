"""Chat prompts with slots, tokenised slot by slot into the ids of the whole filled prompt.

A method that appends a prompt to a session in parts (an instruction prefilled once and shared, then the question,
then each passage in a fork of its own) cannot encode the parts apart at the slots: byte-level BPE pre-tokenises
across them. "Question: " and "What ...?" encoded apart give a lone "Ġ" before "What", where the filled prompt has
"ĠWhat"; "?" before "\\n\\nPassage:" is one pre-token with it. The model would read token sequences no tokenizer
writes. `ChatPrompt` cuts the rendered prompt only where the pre-tokeniser cuts anyway: after a slot's template
text's last letter or digit (the punctuation and spaces between it and the slot go with the fill), and before a
control token. Each fill is encoded with the template text that follows it up to the next such cut, so

    prompt.head + prompt.fill(0, a) + prompt.fill(1, b) == tokenizer.chat(the messages with a and b filled in)

for the byte-level BPE pre-tokenisers (GPT-2's, Llama 3's, Qwen2's), none of whose pre-tokens runs on from a letter or
digit into punctuation or space, or across a control token (tests/methods/test_chat_prompt.py checks every method
prompt on two vocabularies; SentencePiece merges are not bound so). Only a fill that is itself cut (a passage whose
KV is stored and placed, `around`) is read apart from its neighbours.
"""
from __future__ import annotations

import re
from typing import Mapping, Sequence

from ..engine.tokenizer import Tokenizer
from .reader import common_prefix

SLOT = "{}"
_MARK = "nodekvslot"  # letters, which no chat template escapes or trims, to find the slots after rendering
_TRAILING_NON_WORD = re.compile(r"[\W_]*\Z")


class ChatPrompt:
    """The chat prompt `messages` render to, their contents holding `SLOT` ("{}") where text goes, in the parts a
    session appends: `head` (up to the first slot's template text's last letter), then `fill(k, text)` for each slot
    in order."""

    def __init__(self, tokenizer: Tokenizer, messages: Sequence[Mapping[str, str]],
                 add_generation_prompt: bool = True):
        self.tokenizer = tokenizer
        if not all(isinstance(m, Mapping) and isinstance(m.get("content"), str) for m in messages):
            raise ValueError("messages must be a list of {'role': ..., 'content': text} dicts")
        marked = [dict(m, content=m["content"].replace(SLOT, _MARK)) for m in messages]
        pieces = tokenizer.render_chat(marked, add_generation_prompt).split(_MARK)
        if len(pieces) < 2:
            raise ValueError(f"the prompt has no {SLOT!r} slot")
        # cut each piece before a slot after its last letter or digit (never inside a control token)
        cut = []
        for piece in pieces[:-1]:
            controls = tokenizer.split_special(piece)
            start = len(piece) - len(controls[-1])  # where the text after the piece's last control token begins
            cut.append(max(start, _TRAILING_NON_WORD.search(piece).start()))
        self._lead = [piece[c:] for piece, c in zip(pieces, cut)]
        follows = [piece[:c] for piece, c in zip(pieces[1:], cut[1:])] + [pieces[-1]]
        self._follow = []  # per slot: (its template text up to the first control token, the rest)
        for text in follows:
            plain, *rest = tokenizer.split_special(text)
            self._follow.append((plain, "".join(rest)))
        self.head: list[int] = tokenizer.encode(pieces[0][:cut[0]], parse_special=True)

    @property
    def slots(self) -> int:
        """How many slots the prompt has."""
        return len(self._lead)

    def fill(self, slot: int, text: str) -> list[int]:
        """The ids of `text` in `slot`, with the template text around it up to the next slot's cut (or the prompt's
        end): control tokens written in `text` stay text, as `Tokenizer.chat` leaves them."""
        plain, rest = self._follow[self._check(slot)]
        tok = self.tokenizer
        return tok.encode(self._lead[slot] + text + plain) + tok.encode(rest, parse_special=True)

    def fill_parts(self, slot: int, text: str) -> tuple[list[int], list[int], list[int]]:
        """`fill(slot, text)` in three: the tokens that hold template text only before `text`, the tokens that hold
        any of `text` (a token the pre-tokeniser joins across its edge, such as "?" and the line breaks after it,
        included), the tokens that hold template text only after it: for a method that wants the fill as a node of
        its own (attention to the question alone)."""
        ids = self.fill(slot, text)
        before, after = self.around(slot)
        first = common_prefix(ids, before)
        last = len(ids) - common_prefix(ids[first:][::-1], after[::-1])
        return ids[:first], ids[first:last], ids[last:]

    def around(self, slot: int) -> tuple[list[int], list[int]]:
        """(before, after): the ids of `slot`'s template text before and after a fill placed as ids of its own (a
        stored passage's KV), each encoded apart."""
        plain, rest = self._follow[self._check(slot)]
        tok = self.tokenizer
        return tok.encode(self._lead[slot]), tok.encode(plain) + tok.encode(rest, parse_special=True)

    def ids(self, *fills: str) -> list[int]:
        """The whole prompt with `fills` in its slots."""
        if len(fills) != self.slots:
            raise ValueError(f"the prompt has {self.slots} slots, got {len(fills)} fills")
        return self.head + [i for k, text in enumerate(fills) for i in self.fill(k, text)]

    def _check(self, slot: int) -> int:
        if not isinstance(slot, int) or not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot!r} of a prompt with {self.slots} slots (0..{self.slots - 1})")
        return slot
