"""Variable tracking (RULER, Hsieh et al. 2024; dice.txt §4.2): chains of variable assignments hidden in padding text.

A chain of h hops is "VAR X0 = 12345", "VAR X1 = VAR X0", ..., "VAR Xh = VAR X(h-1)": h + 1 names (five capital
letters) that all hold the value. The statements are put, in chain order, between repetitions of RULER's padding
("The grass is green. ..."), at random places; other chains add distractors with values of their own. The
question asks for every variable of the first chain's value. A dataset name says the shape:
``variable_tracking_<h>hop_<n>k`` (about n thousand tokens: n·1000 / PADDING_TOKENS paddings), optionally
``_<c>chain``; records are drawn from a generator seeded by the name and index, so a name always gives the same
records.
"""
from __future__ import annotations

import random
import re
import string

from .records import Record

PREFIX = "variable_tracking"
NAME = re.compile(rf"{PREFIX}_(\d+)hop_(\d+)k(?:_(\d+)chain)?")
PADDING = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PADDING_TOKENS = 24  # one padding and its joining space, in Qwen2.5 and SmolLM2 tokens alike
RECORDS = 50  # per configuration, as in the paper (§5.2)


def is_variable_tracking(name: str) -> bool:
    return NAME.fullmatch(name) is not None


def shape(name: str) -> tuple[int, int, int]:
    """(hops, padding tokens, chains) of a dataset name, or a ValueError saying the pattern."""
    m = NAME.fullmatch(name)
    if m is None:
        raise ValueError(f"{name!r} is not a variable tracking dataset: "
                         f"{PREFIX}_<hops>hop_<thousand tokens>k[_<chains>chain], e.g. {PREFIX}_2hop_8k")
    hops, k, chains = int(m[1]), int(m[2]), int(m[3] or 1)
    if hops < 1 or k < 1 or chains < 1:
        raise ValueError(f"{name!r}: hops, length and chains must be at least 1")
    return hops, 1000 * k, chains


def record(name: str, index: int) -> Record:
    """Record `index` of dataset `name`; the same name and index always give the same record."""
    hops, tokens, chains = shape(name)
    rng = random.Random(f"{name}/{index}")
    names = set()
    while len(names) < chains * (hops + 1):
        names.add("".join(rng.choices(string.ascii_uppercase, k=5)))
    names = rng.sample(sorted(names), len(names))
    values = rng.sample(range(10000, 100000), chains)
    statements = []
    for c in range(chains):
        v = names[c * (hops + 1):(c + 1) * (hops + 1)]
        statements.append([f"VAR {v[0]} = {values[c]}."] + [f"VAR {v[j + 1]} = VAR {v[j]}." for j in range(hops)])
    pads = max(1, tokens // PADDING_TOKENS)
    # each chain's statements at sorted random gaps between paddings, so a chain reads in order
    slots: dict[int, list[str]] = {}
    for chain in statements:
        for gap, statement in zip(sorted(rng.sample(range(pads + 1), len(chain))), chain):
            slots.setdefault(gap, []).append(statement)
    parts = []
    for gap in range(pads + 1):
        parts += slots.get(gap, [])
        if gap < pads:
            parts.append(PADDING)
    question = f"Find all variables that are assigned the value {values[0]}."
    return Record(id=f"{name}-{index}", dataset=name, document=" ".join(parts), question=question,
                  references=tuple(names[:hops + 1]), task="variables")


def records(name: str, limit: int | None = None) -> list[Record]:
    """The first `limit` records of `name` (default: RECORDS)."""
    return [record(name, i) for i in range(RECORDS if limit is None else limit)]
