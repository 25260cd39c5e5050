"""Reader-independent diagnostics, on records built by hand: the supporting passages a record marks, which of them
reached the reader, the retrieval/reader miss of a wrong answer, calibrated accuracy in an eval line, and the
report's counts."""
from __future__ import annotations

import json
from types import SimpleNamespace

from nodekv.engine.flops import FlopAccount
from nodekv.evaluation.datasets import load_dataset
from nodekv.evaluation.eval_line import evaluate_record
from nodekv.evaluation.index_store import BuiltIndex
from nodekv.evaluation.metrics import miss, support_read
from nodekv.methods.reader import Answer
from nodekv.evaluation.report import summarize

SUPPORT = "Beta town was founded in 1802 by Mara Quill."  # normalised: 9 words, 8 bigrams


def test_a_passage_is_read_when_half_its_word_bigrams_are_there():
    assert support_read([SUPPORT], "Passage 2: Beta\n" + SUPPORT + " Its mayor is Tom Reed.") == [True]
    assert support_read([SUPPORT], "beta town was founded in 1802") == [True]  # 5 of 8 bigrams
    assert support_read([SUPPORT], "beta town was founded") == [False]  # 3 of 8
    # every word, no bigram: words scattered over other text do not count
    assert support_read([SUPPORT], "Quill Mara by 1802 in founded was town Beta") == [False]
    assert support_read([SUPPORT, "Gamma is a lake."], None) == [False, False]  # closed book reads nothing


def test_a_wrong_answer_is_a_retrieval_miss_unless_all_support_was_read():
    assert miss("qa", {"f1": 0.5}, [False]) is None  # right: no miss
    assert miss("qa", {"f1": 0.4}, [True, False]) == "retrieval"
    assert miss("qa", {"f1": 0.0}, [True, True]) == "reader"
    assert miss("multiple_choice", {"accuracy": 0.0}, []) == "reader"


def test_records_carry_their_marked_supporting_text(tmp_path):
    paras = [["Alpha", ["The Alpha river flows north.", "It is 40 km long."]],
             ["Beta", ["Beta town was founded in 1802.", "Its mayor is Tom Reed.", "It has a mill."]]]
    hotpot = {"_id": "h", "question": "Who?", "answer": "x", "context": paras,
              "supporting_facts": [["Beta", 2], ["Alpha", 1], ["Beta", 0], ["Nowhere", 0], ["Alpha", 9]]}
    musique = {"id": "m", "question": "Who?", "answer": "x", "paragraphs": [
        {"idx": 0, "title": "A", "paragraph_text": "First text.", "is_supporting": False},
        {"idx": 1, "title": "B", "paragraph_text": "Second text.", "is_supporting": True}]}
    (tmp_path / "multihop").mkdir()
    (tmp_path / "multihop" / "hotpotqa.jsonl").write_text(json.dumps(hotpot) + "\n")
    (tmp_path / "multihop" / "musique.jsonl").write_text(json.dumps(musique) + "\n")
    # per passage, in the order the facts first name it; its marked sentences in passage order; bad facts dropped
    assert load_dataset("hotpotqa", tmp_path).records[0].supports == (
        "Beta town was founded in 1802. It has a mill.", "It is 40 km long.")
    assert load_dataset("musique", tmp_path).records[0].supports == ("Second text.",)


class ReadsGiven:
    """A method stub whose answer read `context` and said `text`."""

    config = SimpleNamespace()

    def __init__(self, text, context, probs=None, prior=None):
        self.answer_args = (text, context, probs, prior)
        self.reader = SimpleNamespace(letter_prior=lambda question, options: None)

    def answer(self, index, question, options=()):
        text, context, probs, prior = self.answer_args
        return Answer(text, [], context=context, choice_probs=probs, choice_prior=prior)


def _line(method, record):
    engine = SimpleNamespace(flops=FlopAccount(), prefixes=SimpleNamespace(paid=[]))
    engine.flops.projected["llama-3.1-8b"] = 0
    store = SimpleNamespace(build_or_load=lambda m, doc: BuiltIndex(None, 0, 0, 0.0, 0))
    return evaluate_record(engine, method, record, {}, store)


def _record(**kw):
    from nodekv.evaluation.datasets import Record

    return Record(**{"id": "r", "dataset": "hotpotqa", "document": "d", "question": "q", "references": ("Mara Quill",),
                     **kw})


def test_eval_lines_carry_support_and_the_miss(tmp_path):
    rec = lambda i: _record(id=f"r{i}", supports=(SUPPORT, "Gamma is a lake near Beta town."))  # noqa: E731
    lines = [_line(ReadsGiven("Mara Quill", SUPPORT), rec(0)),   # right, half the support read
             _line(ReadsGiven("Tom Reed", SUPPORT), rec(1)),     # wrong, a passage missing
             _line(ReadsGiven("Tom Reed", SUPPORT + " Gamma is a lake near Beta town."), rec(2)),  # wrong, all read
             _line(ReadsGiven("Tom", None), _record(id="r3"))]   # nothing marked: no diagnostics
    assert [(x.get("support"), x.get("support_recall"), x.get("miss")) for x in lines] == [
        ([True, False], 0.5, None), ([True, False], 0.5, "retrieval"), ([True, True], 1.0, "reader"),
        (None, None, None)]
    assert "support" not in lines[3] and lines[0]["reader"] == "shared"
    path = tmp_path / "m-hotpotqa.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    s = summarize(path)
    assert (s["support_n"], s["retrieval_misses"], s["reader_misses"]) == (3, 1, 1)
    assert abs(s["support_recall"] - 100 * 2 / 3) < 1e-9  # (0.5 + 0.5 + 1) / 3


def test_multiple_choice_lines_are_scored_raw_and_calibrated(tmp_path):
    rec = _record(dataset="quality", task="multiple_choice", references=("B",), options=("w", "x", "y", "z"))
    probs, prior = [0.40, 0.35, 0.15, 0.10], [0.60, 0.20, 0.10, 0.10]
    line = _line(ReadsGiven("A", "story", probs, prior), rec)
    assert line["metrics"]["accuracy"] == 0.0 and line["metrics"]["accuracy_calibrated"] == 1.0
    assert line["calibrated"] == "B" and line["choice_prior"] == prior
    other = _line(ReadsGiven("C", "story", [0.2, 0.2, 0.5, 0.1], prior), _record(
        id="r2", dataset="quality", task="multiple_choice", references=("C",), options=("w", "x", "y", "z")))
    path = tmp_path / "m-quality.jsonl"
    path.write_text(json.dumps(line) + "\n" + json.dumps(other) + "\n")
    s = summarize(path)
    assert (s["accuracy"], s["accuracy_calibrated"]) == (50.0, 100.0)
    # gold letters B, C: a constant answer gets one of two; the content-free prompts answer A both times: none
    assert (s["majority_letter_acc"], s["content_free_acc"]) == (50.0, 0.0)
    assert s["letters_raw"] == {"A": 1, "C": 1} and s["letters_calibrated"] == {"B": 1, "C": 1}
