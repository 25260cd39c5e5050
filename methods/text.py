"""Text normalisation shared by the methods (telling repeated sub-questions and simulated queries apart) and the
metrics: LongBench's / SQuAD's answer normalisation."""
from __future__ import annotations

import re
import string

_PUNCT = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(s: str) -> str:
    """LongBench/SQuAD normalisation: lower, remove punctuation, remove articles, fix whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())
