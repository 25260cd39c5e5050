"""Text normalisation shared by the methods (telling repeated sub-questions and simulated queries apart) and the
metrics: LongBench's / SQuAD's answer normalisation."""
from __future__ import annotations

import re
import string

_PUNCT = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_AN_THE = re.compile(r"\b(an|the)\b")


def normalize_answer(s: str, keep_a: bool = False) -> str:
    """LongBench/SQuAD normalisation: lower, remove punctuation, remove articles, fix whitespace. keep_a: keep the
    word "a" (where it is option letter A, not an article)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = (_AN_THE if keep_a else _ARTICLES).sub(" ", s)
    return " ".join(s.split())
