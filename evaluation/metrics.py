"""Evaluation metrics: LongBench's QA F1, exact match, ROUGE-1/2/L, multiple-choice accuracy.

``normalize_answer`` / ``qa_f1_score`` are LongBench's (itself SQuAD's): lowercase, drop ASCII punctuation,
drop the articles a/an/the, collapse whitespace; F1 over whitespace tokens with multiset (Counter) overlap.
Like LongBench there is no special case for "yes"/"no" answers (HotpotQA's official script scores a
yes/no mismatch 0, which token F1 already does for one-word answers). A prediction or reference that
normalises to nothing scores 0.

ROUGE is Google's ``rouge-score`` package with the Porter stemmer: F-measures of rouge1, rouge2 and rougeL
(summary-level LCS without sentence splitting, i.e. not rougeLsum), each the maximum over the references.

Variable tracking (RULER) scores the set of variable names (five capital letters) in the prediction against the
chain's: em when the sets are equal, f1 of the two sets, recall as RULER's string_match_all (the share of the
chain's names the prediction contains).

``parse_choice`` reads the chosen option letter from free text; the rule is in its docstring.
``score(record, prediction)`` picks the metrics by ``record.task``.

Reader-independent diagnostics (``support_read``, ``miss``): a supporting passage reached the reader when at least
half of its word bigrams (after ``normalize_answer``) occur in the text the reader read; bigrams rather than words
so that common words scattered over unrelated passages do not count, a half so that a passage cut by a chunk
boundary, or restated in a summary, still counts when most of it is there. A wrong answer (``CORRECT``: the primary
metric below 0.5) is a *retrieval miss* when some supporting passage was not read, else a *reader miss*.
"""
from __future__ import annotations

import re
from collections import Counter
from functools import lru_cache
from typing import Iterable, Sequence

from ..methods.text import normalize_answer

__all__ = ["choice_accuracy", "exact_match", "miss", "normalize_answer", "parse_choice", "qa_f1_score", "rouge",
           "score", "support_read", "variables_score"]


def _token_f1(prediction: Sequence[str], reference: Sequence[str]) -> float:
    common = Counter(prediction) & Counter(reference)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction), same / len(reference)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, reference: str) -> float:
    """LongBench ``qa_f1_score``: token F1 of the normalised strings."""
    return _token_f1(normalize_answer(prediction).split(), normalize_answer(reference).split())


def exact_match(prediction: str, reference: str) -> float:
    """1.0 when the normalised strings are equal (and not empty), else 0.0."""
    p = normalize_answer(prediction)
    return float(bool(p) and p == normalize_answer(reference))


@lru_cache(maxsize=1)
def _scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)


def rouge(prediction: str, references: str | Iterable[str]) -> dict[str, float]:
    """ROUGE-1/2/L F-measures (rouge-score, stemmed), each the max over `references`."""
    if isinstance(references, str):
        references = [references]
    best = {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}
    for ref in references:
        scores = _scorer().score(ref, prediction)  # score(target, prediction)
        for key in best:
            best[key] = max(best[key], scores[key].fmeasure)
    return best


# ------------------------------------------------------------------------------------------ multiple choice

# A letter token: "(B)", "[B]", a capital standing alone ("B", "B." "B,"), or a lower-case letter followed by
# punctuation or the end of the text ("b.", "b)", "b") -- so the article in "the answer is a cat" is no letter.
# Markdown emphasis and quotes may close a lower-case letter ("'b'.") and wrap a cue's separator or letter.
_LETTER = r"(?:\(\s*([A-Za-z])\s*\)|\[\s*([A-Za-z])\s*\]|\b([A-Z])\b|\b([a-z])(?=[*\"'`]*\s*(?:[.,;:!?)]|$)))"
# Cue words match in any case ((?i:...)); the letter token keeps its case rules.
_CUE = re.compile(
    r"(?i:\b(?:answer|(?:correct|right|best)\s+(?:option|choice))\b"
    r"(?:\s+(?:is|was|would\s+be|will\s+be|should\s+be))?[\s*\"'`]*[:=\-]?[\s*\"'`]*(?:(?:option|choice)\s*)?)"
    + _LETTER)
_LEADING = re.compile(r"^[\s*\"'`]*(?:\(\s*([A-Za-z])\s*\)|\[\s*([A-Za-z])\s*\]|([A-Za-z])(?=\s*(?:[.,;:)\-*\"`]|$)))")
_MENTION = re.compile(r"\(\s*([A-Za-z])\s*\)|(?i:\b(?:option|choice)\s+)" + _LETTER)


def _letter(match: re.Match, n_options: int) -> str | None:
    letter = next((g for g in match.groups() if g), None)
    if letter is None:
        return None
    letter = letter.upper()
    return letter if ord(letter) - ord("A") < n_options else None


def parse_choice(text: str, n_options: int = 4) -> str | None:
    """The option letter ("A", "B", ...) that `text` chooses among `n_options`, or None.

    Tiers, tried in order; the first that yields a valid letter (A up to the n_options-th) wins:
      1. an answer statement -- "answer", "correct/right/best option|choice", optionally followed by
         is/was/would be/should be, ":", "=" or "-", optionally "option"/"choice", then a letter token, with
         markdown "*" and quotes allowed around the separator ("Answer: B", "the answer is (c)", "The correct
         option is D", "**Answer:** C", 'The answer is "D"'). If there are several, the LAST
         wins: a final statement overrides earlier reasoning ("answer is A... no, the answer is C" -> C).
      2. a leading letter: the text (after spaces, quotes and markdown "*") starts with "(B)", "[B]", or
         a letter followed by . , ; : ) - * " ` or the end ("B", "B.", "b) ...", "**C**", '"D"');
         "A cat sat" and "A's ..." are not a choice.
      3. the FIRST mention anywhere of a parenthesised letter or "option/choice <letter>"
         ("I'd go with (B) because..." -> B; "(A) or maybe (B)" -> A).
    Letter tokens: "(x)" / "[x]" in either case; a bare letter only if it is a capital standing alone, or
    a lower-case letter followed by punctuation or the end. Letters beyond the options are ignored.
    Bare capitals in prose without a cue ("B is right") are not parsed: too easily an article or initial.
    """
    for m in reversed(list(_CUE.finditer(text))):
        if (letter := _letter(m, n_options)) is not None:
            return letter
    m = _LEADING.match(text)
    if m and (letter := _letter(m, n_options)) is not None:
        return letter
    for m in _MENTION.finditer(text):
        if (letter := _letter(m, n_options)) is not None:
            return letter
    return None


def choice_accuracy(prediction: str, answer: str, n_options: int = 4) -> float:
    """1.0 when the letter parsed from `prediction` is `answer` (a letter, any case), else 0.0."""
    return float(parse_choice(prediction, n_options) == answer.strip().upper())


_VARIABLE = re.compile(r"\b[A-Z]{5}\b")


def variables_score(prediction: str, names: Sequence[str]) -> dict[str, float]:
    """em, f1 and recall of the variable names in `prediction` against `names` (rule in the module docstring)."""
    found, want = set(_VARIABLE.findall(prediction)), set(names)
    hit = len(found & want)
    return {"em": float(found == want), "f1": 2 * hit / (len(found) + len(want)),
            "recall": sum(n in prediction for n in want) / len(want)}


# ----------------------------------------------------------------------------------------------- by record

def score(record, prediction: str) -> dict[str, float]:
    """Metrics for one prediction on a ``nodekv.evaluation.datasets.Record``, chosen by ``record.task``.

    qa: f1 and em (max over references), rouge_l (max over references).
    summary: rouge1, rouge2, rougeL (each max over references).
    variables: em, f1, recall (`variables_score`).
    multiple_choice: accuracy (parsed letter vs the reference letter) and, for comparability with QA,
    f1 = max qa_f1_score of the prediction against the letter (where the prediction chooses A, its "a" is that
    letter, not an article), the correct option's text, and "(<letter>) <text>" (L-Eval's answer format).
    """
    refs = record.references
    if record.task == "qa":
        return {"f1": max(qa_f1_score(prediction, r) for r in refs),
                "em": max(exact_match(prediction, r) for r in refs),
                "rouge_l": rouge(prediction, refs)["rougeL"]}
    if record.task == "summary":
        return rouge(prediction, refs)
    if record.task == "multiple_choice":
        letter = refs[0].strip().upper()
        idx = ord(letter) - ord("A")
        targets = [record.options[idx], f"({letter}) {record.options[idx]}"] if 0 <= idx < len(record.options) else []
        # the letter itself: in an answer that chooses A, "a" is no article (SQuAD's rule would normalise an answer
        # "A" to nothing, and score it 0); in any other answer it is one, or "C, a" would score against A
        n_options = len(record.options) or 4
        keep_a = letter == "A" and parse_choice(prediction, n_options) == "A"
        f1_letter = _token_f1(normalize_answer(prediction, keep_a=keep_a).split(), [letter.lower()])
        return {"accuracy": choice_accuracy(prediction, letter, n_options),
                "f1": max([f1_letter] + [qa_f1_score(prediction, t) for t in targets])}
    if record.task == "variables":
        return variables_score(prediction, refs)
    raise ValueError(f"record {record.id!r}: unknown task {record.task!r}")


# ------------------------------------------------------------------------------------- support and misses

SUPPORT_COVERAGE = 0.5  # share of a supporting passage's word bigrams the reader's text must hold
CORRECT = 0.5           # an answer whose primary metric reaches this is right (F1 for QA)
PRIMARY = {"qa": "f1", "summary": "rougeL", "multiple_choice": "accuracy", "variables": "em"}


def _bigrams(text: str) -> set[tuple[str, ...]]:
    words = normalize_answer(text).split()
    return set(zip(words, words[1:])) if len(words) > 1 else {tuple(words)} if words else set()


def support_read(supports: Sequence[str], context: str | None) -> list[bool]:
    """For each supporting passage, whether the reader's `context` holds at least SUPPORT_COVERAGE of its word
    bigrams (None, a closed-book read, holds none)."""
    have = _bigrams(context or "")
    found = []
    for text in supports:
        want = _bigrams(text)
        found.append(bool(want) and len(want & have) >= SUPPORT_COVERAGE * len(want))
    return found


def miss(task: str, metrics: dict[str, float], read: Sequence[bool]) -> str | None:
    """None for a right answer; else "retrieval" (a supporting passage was not read) or "reader" (all were)."""
    if metrics[PRIMARY[task]] >= CORRECT:
        return None
    return "reader" if all(read) else "retrieval"
