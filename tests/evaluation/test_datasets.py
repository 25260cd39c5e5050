"""Dataset loaders: every shared data file, field checks on real records, malformed records, missing data.

Real counts on ../shared/data (records / problems): hotpotqa 150/0, musique 150/0, 2wikimqa 131/19 (no
context), quality 130/0, scientific_qa 133/0, multidoc_qa 119/0, natural_question 88/0, gov_report_summ 10/0,
meeting_summ 135/0, news_summ 9/0, tv_show_summ 10/0, multi_news 150/0, qmsum 272/0, qmsum_general 35/0,
narrativeqa 40/0.
"""
from __future__ import annotations

import json
from functools import lru_cache

import pytest

from nodekv.evaluation.datasets import (DATASETS, DataNotFoundError, LoadResult, Record, default_data_dir,
                                 find_dataset_file, load_dataset)

DATA = default_data_dir()

EXPECTED = {  # name: (task, records, problems)
    "hotpotqa": ("qa", 150, 0), "musique": ("qa", 150, 0), "2wikimqa": ("qa", 131, 19),
    "quality": ("multiple_choice", 130, 0), "scientific_qa": ("qa", 133, 0), "multidoc_qa": ("qa", 119, 0),
    "natural_question": ("qa", 88, 0), "gov_report_summ": ("summary", 10, 0),
    "meeting_summ": ("summary", 135, 0), "news_summ": ("summary", 9, 0), "tv_show_summ": ("summary", 10, 0),
    "multi_news": ("summary", 150, 0), "qmsum": ("summary", 272, 0), "qmsum_general": ("summary", 35, 0), "narrativeqa": ("qa", 40, 0),
}

needs_data = pytest.mark.skipif(not DATA.is_dir(), reason=f"shared data not found at {DATA}")


@lru_cache(maxsize=None)
def _load(name: str) -> LoadResult:
    return load_dataset(name)


def test_dataset_names():
    assert set(DATASETS) == set(EXPECTED)


@needs_data
@pytest.mark.parametrize("name", DATASETS)
def test_every_dataset_loads(name):
    task, n_records, n_problems = EXPECTED[name]
    res = _load(name)
    assert (len(res.records), len(res.problems)) == (n_records, n_problems)
    ids = [r.id for r in res.records]
    assert len(set(ids)) == len(ids)
    for r in res.records:
        assert isinstance(r, Record) and r.dataset == name and r.task == task
        assert r.document.strip() and r.question.strip() and r.references
        assert all(isinstance(x, str) and x.strip() for x in r.references)
        assert bool(r.options) == (task == "multiple_choice")
    assert load_dataset(name, limit=3).records == res.records[:3]


@needs_data
def test_first_records():
    r = _load("hotpotqa").records[0]
    assert r.id == "5a7f6fd75542992e7d278cfa" and r.references == ("Rush",)
    assert r.document.startswith("Passage 1:\nJeff Porcaro\nJeffrey Thomas Porcaro (April 1, 1954")
    assert "record producer. In a career" in r.document  # sentences joined with one space
    assert "\n\nPassage 10:\n" in r.document and "Passage 11:" not in r.document

    r = _load("musique").records[0]
    assert r.id == "2hop__574419_270105" and r.references == ("Stanley",)
    assert r.document.startswith("Passage 1:\nPort Blair\nPort Blair") and "\n\nPassage 20:\n" in r.document
    assert any(len(x.references) > 1 for x in _load("musique").records)  # answer + aliases

    res = _load("2wikimqa")
    assert res.records[0].references == ("Free Guy",) and res.records[0].document.startswith("Passage 1:\nPál Gábor\n")
    assert ("13c1565a087311ebbd66ac1f6bf848b6", "missing 'context'") in res.problems

    r = _load("quality").records[0]
    assert r.id == "0-0" and r.question == "Why did the Tr'en leave Korvin's door unlocked and a weapon nearby?"
    assert len(r.options) == 4 and r.options[1].startswith("Their subconscious knew") and r.references == ("B",)
    assert r.document.startswith("LOST    IN    TRANSLATION")

    r = _load("natural_question").records[0]
    assert (r.id, r.question, r.references) == ("0-0", "when did season 2 of handmaid's tale start", ("April 25 , 2018",))
    assert _load("gov_report_summ").records[0].question == "Please help me summarize this government report."

    r = _load("multi_news").records[0]
    assert r.question == "Write a one-page summary of all the news." and r.document.startswith("Passage 1:\n")

    r = _load("qmsum").records[0]
    assert r.id == "0-g0" and r.question == "What were the main discussion points of the meeting?"
    assert r.document.startswith("Professor E: So . OK .")
    assert _load("qmsum").records[1].id == "0-s0"
    general = [x for x in _load("qmsum").records if x.id.split("-")[1].startswith("g")]
    assert [(x.id, x.question, x.references, x.document) for x in _load("qmsum_general").records] == \
        [(x.id, x.question, x.references, x.document) for x in general]  # one general query per meeting, only

    r = _load("narrativeqa").records[0]
    assert r.id == "0" and r.references == ("They set up a school.", "They are schoolmistresses.")


# ------------------------------------------------------------------------------------ malformed and missing

def _hotpot(id, question="Q?", context=(("T", ["S1.", " S2."]),), answer="A"):
    """A HotpotQA-schema record; a field given as ... is left out."""
    if isinstance(context, tuple):
        context = [list(c) for c in context]
    rec = {"_id": id, "question": question, "answer": answer, "context": context}
    return {k: v for k, v in rec.items() if v is not ...}


def _write(path, lines):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))


def test_malformed_records_are_reported_and_skipped(tmp_path):
    good = _hotpot("good")
    lines = [good, _hotpot("noq", question=...), _hotpot("emptydoc", context=()), _hotpot("blankq", question="  "),
             _hotpot("intanswer", answer=42), _hotpot("badctx", context=(("T", "not a list"),)),
             _hotpot("strctx", context="text"), "{not json", "[1, 2]", "",
             _hotpot("good2", context=(("T1", ["a"]), ("T2", ["b", "c"])))]
    _write(tmp_path / "multihop" / "hotpotqa.jsonl", lines)
    res = load_dataset("hotpotqa", tmp_path)
    assert [r.id for r in res.records] == ["good", "good2"]
    assert res.records[0].document == "Passage 1:\nT\nS1. S2."
    assert res.records[1].document == "Passage 1:\nT1\na\n\nPassage 2:\nT2\nb c"
    assert res.problems == [
        ("noq", "missing 'question'"), ("emptydoc", "empty document"), ("blankq", "empty 'question'"),
        ("intanswer", "'answer' is int, not str"), ("badctx", "context entry is not [title, [sentences]]"),
        ("strctx", "'context' is str, not list"), ("7", res.problems[6][1]), ("8", "record is list, not an object")]
    assert res.problems[6][1].startswith("invalid JSON")
    # limit counts good records only; problems met on the way are still reported
    res = load_dataset("hotpotqa", tmp_path, limit=1)
    assert [r.id for r in res.records] == ["good"] and res.problems == []


def test_a_record_id_twice_is_refused_by_id_and_lines(tmp_path):
    """Runs key their answers by record id: a second record under one id would be skipped or counted twice."""
    from nodekv.evaluation.datasets import check_dataset

    _write(tmp_path / "multihop" / "hotpotqa.jsonl", [_hotpot("a"), _hotpot("b"), "", _hotpot("a")])
    path = tmp_path / "multihop" / "hotpotqa.jsonl"
    with pytest.raises(ValueError, match=f"^{path} has the record id 'a' twice \\(lines 1 and 4\\)"):
        load_dataset("hotpotqa", tmp_path)
    with pytest.raises(ValueError, match="'a' twice"):
        check_dataset("hotpotqa", tmp_path)  # the CLI's check before a model loads reads the whole file
    assert [r.id for r in load_dataset("hotpotqa", tmp_path, limit=2).records] == ["a", "b"]


def test_malformed_leval_and_qmsum(tmp_path):
    opts = "Which?\n\n (A) one\n (B) two \n (C) three"
    _write(tmp_path / "quality.jsonl", [
        {"input": "doc", "instructions": [opts, "no options here", opts, 7], "outputs": ["(B) two", "(A)", "(D) x", "(A)"]},
        {"input": "", "instructions": [opts], "outputs": ["(A) one"]},
        {"input": "doc", "instructions": [opts], "outputs": []},
    ])
    res = load_dataset("quality", tmp_path)
    assert [(r.id, r.question, r.options, r.references) for r in res.records] == [
        ("0-0", "Which?", ("one", "two", "three"), ("B",))]
    assert res.problems == [("0-1", "options not found as (A), (B), ... lines"),
                            ("0-2", "answer '(D) x' is not one of the option letters"),
                            ("0-3", "instruction/output is not str"), ("1", "empty 'input'"),
                            ("2", "1 instructions but 0 outputs")]

    _write(tmp_path / "qmsum" / "qmsum.jsonl", [
        {"meeting_transcripts": [{"speaker": "A", "content": "hi"}, {"speaker": "B", "content": "yo"}],
         "general_query_list": [{"query": "Sum?", "answer": "ok"}],
         "specific_query_list": [{"query": "", "answer": "x"}, {"answer": "x"}, "bad", {"query": "Q", "answer": "y"}]},
        {"meeting_transcripts": [], "general_query_list": [{"query": "Q", "answer": "y"}], "specific_query_list": []},
    ])
    res = load_dataset("qmsum", tmp_path)
    assert [(r.id, r.document, r.question, r.task) for r in res.records] == [
        ("0-g0", "A: hi\nB: yo", "Sum?", "summary"), ("0-s3", "A: hi\nB: yo", "Q", "summary")]
    assert res.problems == [("0-s0", "empty 'query'"), ("0-s1", "missing 'query'"), ("0-s2", "query is not an object"),
                            ("1-g0", "empty document")]


@needs_data
def test_real_file_copy_with_injected_bad_records(tmp_path):
    lines = find_dataset_file("musique", DATA).read_text().splitlines()[:3]
    bad = json.loads(lines[1])
    bad["question"] = None
    worse = json.loads(lines[2])
    worse["paragraphs"] = []
    _write(tmp_path / "musique.jsonl", [lines[0], json.dumps(bad), json.dumps(worse)])
    res = load_dataset("musique", tmp_path)
    assert [r.id for r in res.records] == [json.loads(lines[0])["id"]]
    assert res.problems == [(bad["id"], "missing 'question'"), (worse["id"], "empty document")]


def test_missing_data_dir_names_the_path(tmp_path, monkeypatch):
    missing = tmp_path / "nowhere"
    with pytest.raises(DataNotFoundError, match=str(missing)):
        load_dataset("hotpotqa", missing)
    monkeypatch.setenv("NODEKV_DATA_DIR", str(missing))
    assert default_data_dir() == missing
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_dataset("hotpotqa")
    with pytest.raises(DataNotFoundError, match="no musique.jsonl under"):
        find_dataset_file("musique", tmp_path)
    with pytest.raises(ValueError, match="unknown dataset 'squad'; known: hotpotqa, .*, and the generated "
                                         "variable_tracking_<hops>hop_<thousand tokens>k\\[_<chains>chain\\]$"):
        find_dataset_file("squad", tmp_path)
