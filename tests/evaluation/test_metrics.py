"""Metrics against values computed by hand (LongBench QA F1, exact match, ROUGE, option-letter parsing)."""
from __future__ import annotations

import pytest

from nodekv.evaluation.datasets import Record
from nodekv.evaluation.metrics import (choice_accuracy, exact_match, normalize_answer, parse_choice, qa_f1_score,
                                    rouge, score)


# ------------------------------------------------------------------------------------------- normalisation

@pytest.mark.parametrize("text, expected", [
    ("The Cat sat.", "cat sat"),
    ("  a   B,  an\tapple!  ", "b apple"),
    ("The theatre, an Anthem", "theatre anthem"),  # only whole-word articles go
    ("U.S.A.", "usa"),
    ("rock 'n' roll", "rock n roll"),
    ("the", ""),
    ("", ""),
])
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


# ------------------------------------------------------------------------------------------------- QA F1

@pytest.mark.parametrize("prediction, reference, expected", [
    ("The cat sat", "a cat sat down", 0.8),  # [cat, sat] vs [cat, sat, down]: P=1, R=2/3
    ("Rush!", "rush", 1.0),                   # punctuation and case
    ("an apple", "The apple", 1.0),           # articles
    ("Yes.", "yes", 1.0),
    ("no", "yes", 0.0),
    ("Yes, it is.", "yes", 0.5),              # P=1/3, R=1
    ("", "yes", 0.0),                          # empty prediction
    ("the", "the", 0.0),                       # normalises to nothing on both sides
    ("paris", "", 0.0),
    ("paris paris paris", "paris", 0.5),      # Counter overlap: 1 common, P=1/3, R=1
    ("paris paris paris", "paris paris", 0.8),  # 2 common, P=2/3, R=1
    ("Barack Obama was born in Hawaii", "Hawaii", 2 / 7),  # P=1/6, R=1: 2*(1/6)/(7/6)
])
def test_qa_f1_score(prediction, reference, expected):
    assert qa_f1_score(prediction, reference) == pytest.approx(expected)


@pytest.mark.parametrize("prediction, reference, expected", [
    ("The Cat.", "cat", 1.0),
    ("cat sat", "cat", 0.0),
    ("No", "no.", 1.0),
    ("", "", 0.0),  # nothing to match: never a hit
])
def test_exact_match(prediction, reference, expected):
    assert exact_match(prediction, reference) == expected


# -------------------------------------------------------------------------------------------------- ROUGE

def test_rouge_hand_values():
    # stemmed tokens [the, cat, sat] vs [the, cat, sat, down]
    r = rouge("the cats sat", "the cat sat down")
    assert r["rouge1"] == pytest.approx(6 / 7)  # 3 common unigrams: P=1, R=3/4
    assert r["rouge2"] == pytest.approx(0.8)    # bigrams {the cat, cat sat} vs 3: P=1, R=2/3
    assert r["rougeL"] == pytest.approx(6 / 7)  # LCS = 3
    # same bag of words, different order: rouge1 = 1; one of two bigrams; LCS "the cat" = 2 of 3
    r = rouge("sat the cat", "the cat sat")
    assert r == pytest.approx({"rouge1": 1.0, "rouge2": 0.5, "rougeL": 2 / 3})


def test_rouge_stemming_empty_and_max_over_references():
    assert rouge("running dogs", "run dog")["rouge1"] == pytest.approx(1.0)  # Porter stems
    assert rouge("", ["the cat"]) == {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}
    # each metric is its own max: rouge1 from the first reference, rouge2 and rougeL from the second
    r = rouge("a b c d", ["d c b a", "a b x y"])
    assert r["rouge1"] == pytest.approx(1.0)     # first: all 4 unigrams (second: 2 of 4 -> 0.5)
    assert r["rouge2"] == pytest.approx(1 / 3)   # second: bigram "a b" of 3 each side (first: none)
    assert r["rougeL"] == pytest.approx(0.5)     # second: LCS "a b" = 2 of 4 (first: LCS 1 -> 0.25)


# ------------------------------------------------------------------------------------------ choice parsing

@pytest.mark.parametrize("text, expected", [
    ("(B)", "B"),
    ("B.", "B"),
    ("B", "B"),
    ("b", "B"),
    ("c) the third one", "C"),
    ("[D] foo", "D"),
    ("**C**", "C"),
    ('"B"', "B"),
    ("A. Hunting rifles", "A"),
    ("Answer: B", "B"),
    ("ANSWER: c", "C"),
    ("the answer is (c)", "C"),
    ("The correct option is D", "D"),
    ("My answer: option (c).", "C"),
    ("I would choose option B.", "B"),
    ("(B) Their subconscious knew that Korvin was an insoluble problem.", "B"),  # L-Eval's own format
    # several letters: an answer statement beats mentions; the last statement wins
    ("The answer is B. Option A is wrong.", "B"),
    ("Option A is wrong; the answer is C", "C"),
    ("The answer is A, no wait, the answer is D", "D"),
    # markdown and quotes around the cue or the letter
    ("Answer: **C**", "C"),
    ("**Answer:** C", "C"),
    ("The correct answer is: **B**", "B"),
    ('The answer is "D"', "D"),
    ("The answer is 'b'.", "B"),
    # no statement, no leading letter: the first parenthesised letter / option mention wins
    ("I think (A) or maybe (B)", "A"),
    ("the answer is E, so (C)", "C"),   # E is out of range: ignored
    # not a choice
    ("A cat sat on the mat", None),
    ("A's bike", None),
    ("the answer is a cat", None),      # lower-case "a" followed by a word is the article
    ("b because", None),
    ("E", None),
    ("(E)", None),
    ("", None),
])
def test_parse_choice(text, expected):
    assert parse_choice(text, 4) == expected


def test_parse_choice_range_follows_n_options():
    assert parse_choice("(E)", 5) == "E"
    assert parse_choice("(C)", 2) is None


def test_choice_accuracy():
    assert choice_accuracy("the answer is (b)", "B") == 1.0
    assert choice_accuracy("the answer is (b)", "c") == 0.0
    assert choice_accuracy("no idea", "A") == 0.0


# ------------------------------------------------------------------------------------------------ by task

def _rec(task, references, options=()):
    return Record(id="x", dataset="d", document="doc", question="q", references=tuple(references),
                  options=tuple(options), task=task)


def test_score_qa_takes_max_over_references():
    s = score(_rec("qa", ["Stanley", "Stanley, North Dakota"]), "stanley north dakota")
    assert s["f1"] == pytest.approx(1.0)   # second reference
    assert s["em"] == 1.0
    assert s["rouge_l"] == pytest.approx(1.0)
    s = score(_rec("qa", ["a cat sat down", "dog"]), "The cat sat")
    # ROUGE keeps articles: [the, cat, sat] vs [a, cat, sat, down], LCS 2: P=2/3, R=1/2, F=4/7
    assert s == pytest.approx({"f1": 0.8, "em": 0.0, "rouge_l": 4 / 7})
    assert set(score(_rec("qa", ["x"]), "")) == {"f1", "em", "rouge_l"}


def test_score_summary():
    assert score(_rec("summary", ["the cat sat down"]), "the cats sat") == pytest.approx(
        {"rouge1": 6 / 7, "rouge2": 0.8, "rougeL": 6 / 7})


def test_score_multiple_choice():
    rec = _rec("multiple_choice", ["B"], ["Hunting rifles", "Cannons", "Catapults", "Spears"])
    assert score(rec, "(B) Cannons") == {"accuracy": 1.0, "f1": 1.0}
    assert score(rec, "B") == {"accuracy": 1.0, "f1": 1.0}
    assert score(rec, "Cannons") == {"accuracy": 0.0, "f1": 1.0}  # right text, no letter: f1 only
    s = score(rec, "The answer is (C) Catapults")
    assert s["accuracy"] == 0.0 and s["f1"] == 0.0
    a = _rec("multiple_choice", ["A"], ["Hunting rifles", "Cannons", "Catapults", "Spears"])
    for answer in ("A", "(A)", "a."):  # the letter A is no article: it scores as B does
        assert score(a, answer) == {"accuracy": 1.0, "f1": 1.0}, answer
    assert score(a, "A. The rifles")["f1"] == score(rec, "B. The rifles")["f1"] == 2 / 3  # "the" goes, the letter stays
    assert score(a, "B")["f1"] == 0.0 and score(rec, "A")["f1"] == 0.0
    # an "a" in an answer that does not choose A stays an article: no credit against the letter A
    for wrong in ("(C) green fish, a fish", "C, a", "(D) It was a white horse"):
        assert score(a, wrong) == {"accuracy": 0.0, "f1": 0.0}, wrong
