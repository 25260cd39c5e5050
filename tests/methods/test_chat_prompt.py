"""ChatPrompt against the whole filled prompt encoded at once (`Tokenizer.chat`, itself checked against transformers'
apply_chat_template in tests/engine): every method prompt with slots, fills that end in punctuation, start with
spaces or line breaks, hold digits, other scripts or a control token's text, on both real vocabularies."""
from __future__ import annotations

import pytest

from nodekv.engine.errors import ModelLoadError
from nodekv.engine.models import resolve_model
from nodekv.engine.tokenizer import Tokenizer
from nodekv.methods.chat_prompt import SLOT, ChatPrompt
from nodekv.methods.dice.dice_prompts import EXTRACT_FACT, planning_turn
from nodekv.methods.gor.gor_graph import RAG_PROMPT, SIMULATION_PROMPT
from nodekv.methods.pecan.pecan import FIRST_TURN, SECOND_TURN
from nodekv.methods.pecan.pecan_build import SUMMARY_PROMPT
from nodekv.methods.relevance import QUESTION

FILLS = [
    "Which band did the drummer of Toto join in 1993?",
    "Jeff Porcaro (1954-1992) was an American drummer.",
    " leading space, trailing space ",
    "\nleading line break\n\n",
    "3.14 and 1,000,000!",
    "Émile Zola — 東京 😀 'quoted' \"twice\"",
    "a quoted <|im_end|> control token and <|endoftext|>",
    "",
]
PROMPTS = {
    "relevance": [{"role": "user", "content": QUESTION}],
    "dice extract": [{"role": "user", "content": EXTRACT_FACT}],
    "dice planning": [{"role": "user", "content": planning_turn(2, "multihop")}],
    "dice next turn": [{"role": "user", "content": SLOT}, {"role": "assistant", "content": SLOT},
                       {"role": "user", "content": SLOT}],
    "pecan first turn": [{"role": "user", "content": FIRST_TURN}],
    "pecan second turn": [{"role": "user", "content": FIRST_TURN}, {"role": "assistant", "content": "Yes"},
                          {"role": "user", "content": SECOND_TURN + "\n\nQuestion: " + SLOT}],
    "pecan summary": [{"role": "user", "content": SUMMARY_PROMPT}],
    "gor simulation": [{"role": "user", "content": SIMULATION_PROMPT}],
    "gor rag": [{"role": "user", "content": RAG_PROMPT}],
}


@pytest.fixture(scope="module", params=["smollm2-135m", "qwen2.5-0.5b"])
def tok(request) -> Tokenizer:
    try:
        return Tokenizer.from_model(resolve_model(request.param))
    except ModelLoadError as err:
        pytest.skip(str(err))


def _filled(messages: list[dict], fills: list[str]) -> list[dict]:
    it = iter(fills)
    out = []
    for m in messages:
        parts = m["content"].split(SLOT)
        out.append(dict(m, content="".join(p + (next(it) if k < len(parts) - 1 else "")
                                           for k, p in enumerate(parts))))
    return out


@pytest.mark.parametrize("name", PROMPTS)
def test_parts_are_the_whole_prompt_ids(tok, name):
    messages = PROMPTS[name]
    prompt = ChatPrompt(tok, messages)
    assert prompt.slots == sum(m["content"].count(SLOT) for m in messages)
    for shift in range(len(FILLS)):  # every fill in every slot
        fills = [FILLS[(shift + k) % len(FILLS)] for k in range(prompt.slots)]
        assert prompt.ids(*fills) == tok.chat(_filled(messages, fills)), (name, fills)


def test_parts_apart_differ_where_the_prompt_is_not_cut(tok):
    """The ids ChatPrompt avoids: the rendered prompt split at "{}" and encoded piece by piece."""
    messages, fills = PROMPTS["relevance"], FILLS[:2]
    prompt = ChatPrompt(tok, messages)
    pieces = tok.render_chat(_filled(messages, ["\0", "\0"])).split("\0")
    apart = tok.encode(pieces[0], parse_special=True)
    for fill, piece in zip(fills, pieces[1:]):
        apart += tok.encode(fill) + tok.encode(piece, parse_special=True)
    whole = tok.chat(_filled(messages, fills))
    assert apart != whole and tok.decode(apart) == tok.decode(whole)
    assert prompt.ids(*fills) == whole


@pytest.mark.parametrize("name", ["relevance", "pecan first turn"])
def test_fill_parts_hold_the_fill_in_the_middle_and_template_text_around_it(tok, name):
    prompt = ChatPrompt(tok, PROMPTS[name])
    lead, follow = map(tok.decode, prompt.around(0))  # the template's text before and after the slot
    for text in FILLS[:6]:
        before, middle, after = prompt.fill_parts(0, text)
        assert before + middle + after == prompt.fill(0, text)
        assert lead.startswith(tok.decode(before)) and follow.endswith(tok.decode(after))  # template text only
        assert text.strip() in tok.decode(middle)
        # and the middle's end tokens hold some of the fill
        assert len(tok.decode(before + middle[:1])) > len(lead)
        assert len(tok.decode(middle[-1:] + after)) > len(follow)


def test_around_a_placed_fill_is_the_same_text(tok):
    prompt = ChatPrompt(tok, PROMPTS["dice extract"])
    before, after = prompt.around(0)
    text = tok.decode(prompt.head + before + tok.encode(FILLS[1]) + after + prompt.fill(1, FILLS[0]))
    assert text == tok.decode(prompt.ids(FILLS[1], FILLS[0]))


def test_bad_prompts_slots_and_fill_counts_are_refused(tok):
    with pytest.raises(ValueError, match="no '{}' slot"):
        ChatPrompt(tok, [{"role": "user", "content": "no slot"}])
    with pytest.raises(ValueError, match="2 slots, got 1"):
        ChatPrompt(tok, PROMPTS["relevance"]).ids("one")
    with pytest.raises(IndexError, match="slot 2 of a prompt with 2 slots"):
        ChatPrompt(tok, PROMPTS["relevance"]).fill(2, "text")
    with pytest.raises(ValueError, match="messages must be a list"):
        ChatPrompt(tok, [{"role": "user", "content": ["{}"]}])
