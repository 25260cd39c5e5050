"""JERR as a method: the index built from scripted replies (entities merged, edges with attributes, a build-log line
for a reply without atoms), its file round trip, the search and the multiple-choice answer with a scripted LLM, and
on SmolLM2 `nodekv index` / `ask` end to end."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from nodekv.engine.flops import FlopAccount
from nodekv.methods.index_file import IndexFileError
from nodekv.methods.jerr.jerr import Jerr, _ranked_pages
from nodekv.methods.jerr.jerr_graph import Entity, EntityGraph
from conftest import bare_engine

DOC = ("Korvin was held by the Tr'en in a cell.\n\nThe Tr'en never understood democracy or any of it.\n\n"
       "Korvin found the door unlocked and a weapon nearby.")


class WordTokenizer:
    """A token per word and per run of whitespace."""

    def __init__(self):
        self.vocab: list[str] = []

    def encode(self, text):
        pieces = re.findall(r"\S+|\s+", text)
        for w in pieces:
            if w not in self.vocab:
                self.vocab.append(w)
        return [self.vocab.index(w) for w in pieces]

    def decode(self, ids):
        return "".join(self.vocab[i] for i in ids)

    def chat(self, messages):
        return self.encode(messages[0]["content"])


class ScriptedLM:
    """Replies by prompt kind; elements are the chunk's capitalised words, edges 'holds' unless told otherwise."""

    def __init__(self, edge_reply="holds"):
        self.turns, self.edge_reply, self.letters = [], edge_reply, []

    def replies(self, turns, max_tokens):
        self.turns += list(turns)
        out = []
        for t in turns:
            body = t.split("Paragraph: ")[-1].split("Passage: ")[-1]
            if t.startswith("Please transfer"):
                out.append(f"Synopsis: {body}")
            elif t.startswith("You are a summarizing agent"):
                out.append("" if "democracy" in body else f"1. {body.split('.')[0]}.")
            elif t.startswith("You are a keyword"):
                names = [w.strip(".,") for w in body.split() if w[:1].isupper() and w not in ("Synopsis:", "The")]
                out.append(", ".join(dict.fromkeys(names)) or "none")
            elif t.startswith("Based on the atomic facts"):
                out.append(self.edge_reply)
            elif t.startswith("List the keywords"):
                out.append("Korvin, door")
            else:  # the look-up of pages to re-read
                out.append("2")
        return out

    def relevance(self, question, passages):
        return [0.0] * len(passages)

    def letter(self, ids, letters):
        self.letters.append(list(letters))
        return "B", {x: 0.7 if x == "B" else 0.1 for x in letters}


@dataclass
class TinyConfig:
    max_seq_len: int = 4096


def _engine():
    return bare_engine(tokenizer=WordTokenizer(), config=TinyConfig(), path=Path("tiny.gguf"), flops=FlopAccount(),
                       model_id={"name": "tiny.gguf", "config": "0" * 64})


def _jerr(eng, lm=None, **options):
    return Jerr(eng, lm=lm or ScriptedLM(), **{"chunk_tokens": 18, **options})  # a paragraph a chunk


def test_the_index_merges_entities_links_them_and_logs_a_reply_without_atoms():
    jerr = _jerr(_engine())
    index = jerr.index(DOC)
    assert len(index.chunks) == 3 and index.synopses[1].startswith("Synopsis: The Tr'en")
    names = [e.name for e in index.graph.entities]
    assert names[:2] == ["Korvin", "Tr'en"] and names.count("Korvin") == 1
    korvin = index.graph.entities[0]
    assert korvin.chunks == [0, 2]
    assert index.graph.edges[(0, 1)] == "holds"  # Korvin and Tr'en share chunk 0
    assert "chunk 1: no information atoms in the reply; its synopsis' sentences stand in" in index.graph.log
    assert index.atoms[1] == ["Synopsis: The Tr'en never understood democracy or any of it."]


def test_the_index_file_round_trips_and_refuses_tampering(tmp_path):
    eng = _engine()
    jerr = _jerr(eng)
    index = jerr.index(DOC)
    path = tmp_path / "doc.jerr"
    jerr.save_index(index, path)
    back = jerr.load_index(path)
    assert (back.chunks, back.synopses, back.atoms) == (index.chunks, index.synopses, index.atoms)
    assert back.graph == index.graph
    data = json.loads(path.read_text())
    data["edges"][0][2] = "betrays"
    path.write_text(json.dumps(data))
    with pytest.raises(IndexFileError, match="corrupt"):
        jerr.load_index(path)


@pytest.mark.parametrize("search", ["mcts", "pagerank"])
def test_the_answer_reads_the_chosen_entities_pages_and_picks_a_letter(search):
    """The paper's A.5 step; the shared reader reads the same context (`test_reader`)."""
    eng = _engine()
    lm = ScriptedLM()
    jerr = _jerr(eng, lm, search=search, top_k=2, reader="paper")
    index = jerr.index(DOC)
    answer = jerr.answer(index, "Why was the door of Korvin unlocked?", options=("w", "x", "y", "z"))
    trace = answer.trace[0]
    assert answer.text == "(B)" and lm.letters == [["A", "B", "C", "D"]]
    assert trace["keywords"] == ["korvin", "door"] and "Korvin" in trace["nodes"]
    assert trace["pages"] == sorted({c for e in index.graph.entities if e.name in trace["nodes"] for c in e.chunks})
    assert trace["reread"] == ([2] if 2 in trace["pages"] else [])
    assert "Korvin, door" not in lm.turns[-1] and lm.turns[-1].startswith("The following are numbered synopses")


def test_a_choice_questions_letter_prior_is_not_charged_to_the_answer():
    """The shared reader charges a question's content-free letter prior once, to the "calibration" scope, and not
    to the answer: JERR's answer FLOPs (every step's) leave it out as `Reader.read`'s do."""
    from nodekv.methods.base import Answer

    eng = _engine()
    jerr = _jerr(eng)

    class CountingReader:  # `Reader`'s accounting: the prior once per question (7 FLOPs), then the read (10)
        spec, window, priors = jerr.answer_prompt, None, set()

        def letter_prior(self, question, options):
            if (question, options) not in self.priors:
                self.priors.add((question, options))
                with eng.flops.scope("calibration"):
                    eng.flops.add(7, 1)

        def read(self, context, question, options, nodes, trace):
            self.letter_prior(question, options)
            with eng.flops.scope("query"):
                eng.flops.add(10, 1)
            return Answer("(A)", list(nodes), trace, 10)

    jerr._reader = CountingReader()
    answer = jerr.answer(jerr.index(DOC), "Why was the door of Korvin unlocked?", ("w", "x"))
    assert (answer.flops, eng.flops.scopes["calibration"], eng.flops.total) == (10, 7, 17)


def test_read_pages_ranks_pages_by_how_many_chosen_entities_hold_them():
    graph = EntityGraph([Entity("A", [], [0, 3]), Entity("B", [], [3, 1]), Entity("C", [], [2]), Entity("D", [], [1])])
    # pages 3 and 1 are held by two chosen entities (3 by the best), then 0 and 2 by one each, in the entities' order
    assert _ranked_pages(graph, [0, 1, 2, 3]) == [3, 1, 0, 2]
    assert _ranked_pages(graph, [2, 0]) == [2, 0, 3]


def test_read_pages_reads_the_pages_in_full_with_no_look_up_turn():
    lm = ScriptedLM()
    jerr = _jerr(_engine(), lm, read="pages", full_pages=1, top_k=2, reader="paper")
    index = jerr.index(DOC)
    answer = jerr.answer(index, "Why was the door of Korvin unlocked?", options=("w", "x", "y", "z"))
    trace = answer.trace[0]
    chosen = [i for name in trace["nodes"] for i, e in enumerate(index.graph.entities) if e.name == name]
    assert trace["pages"] == trace["reread"] == _ranked_pages(index.graph, chosen)[:1]
    assert not any(t.startswith("The following are numbered synopses") for t in lm.turns)
    assert index.chunks[trace["pages"][0]].strip() in answer.context
    assert all(s not in answer.context for s in index.synopses)


@pytest.mark.parametrize("liked, best", [("weapon", "Korvin"), ("never understood", "Tr'en")])
def test_the_model_reward_scores_walks_by_p_yes_in_one_call_per_expansion(liked, best):
    class JudgeLM(ScriptedLM):
        def __init__(self):
            super().__init__()
            self.calls = []

        def relevance(self, question, passages):  # log p(Yes): high for walks whose texts hold `liked`
            self.calls.append(list(passages))
            return [math.log(0.9 if liked in p else 0.2) for p in passages]

    lm = JudgeLM()
    jerr = _jerr(_engine(), lm, reward="model", iterations=4, top_k=1, depth=1)  # a walk is its start
    index = jerr.index(DOC)
    chosen, how = jerr.select(index, "Who was held?", ["held"])
    assert [index.graph.entities[i].name for i in chosen] == [best] and how["starts"] == 2
    assert len(lm.calls[0]) == 2  # the root's two start entities, judged together


def test_keywords_are_the_questions_own_words():
    class EchoLM(ScriptedLM):
        def __init__(self, reply):
            super().__init__()
            self.reply = reply

        def replies(self, turns, max_tokens):
            return [self.reply]

    question = "Why did the Tr'en leave Korvin's door unlocked?"
    assert _jerr(_engine(), EchoLM("Tr'en, door, things, comma-separated")).keywords(question) == ["tr'en", "door"]
    assert _jerr(_engine(), EchoLM("things, actions")).keywords(question) == ["leave", "korvin", "door", "unlocked"]
    assert _jerr(_engine(), EchoLM("-, **\n...,door")).keywords(question) == ["door"]


@pytest.mark.parametrize("search", ["mcts", "pagerank"])
def test_a_graph_without_entities_selects_none(search):
    class NoElementsLM(ScriptedLM):
        def replies(self, turns, max_tokens):
            return ["none" if t.startswith("You are a keyword") else r
                    for t, r in zip(turns, super().replies(turns, max_tokens))]

    jerr = _jerr(_engine(), NoElementsLM(), search=search)
    index = jerr.index(DOC)
    assert index.graph.entities == [] and "chunk 0: no core elements in the reply; the chunk adds no entity" in \
        index.graph.log
    assert jerr.select(index, "Why was the door of Korvin unlocked?", ["door"])[0] == []


def test_an_edge_reply_naming_no_relation_leaves_no_edge_and_a_log_line():
    index = _jerr(_engine(), ScriptedLM(edge_reply="None.")).index(DOC)
    assert index.graph.edges == {} and any("names no relation" in line for line in index.graph.log)
    with pytest.raises(ValueError, match="document is empty"):
        _jerr(_engine()).index(" ")
    assert Jerr.dataset_defaults("quality") == {"chunk_tokens": (600, "jerr.txt §4.1")}


def test_a_simhash_threshold_past_the_fingerprints_bits_is_refused_when_the_method_is_made():
    assert _jerr(_engine(), simhash_threshold=63).config.simhash_threshold == 63
    with pytest.raises(ValueError, match=r"^JERR option simhash_threshold must be in \[0, 63\], got 64$"):
        _jerr(_engine(), simhash_threshold=64)


@pytest.mark.model
def test_index_and_ask_on_smollm2(tmp_path, capsys):
    from nodekv.cli import main as cli_main

    doc = tmp_path / "doc.txt"
    doc.write_text(DOC * 3)
    opts = ["--option", "chunk_tokens=60", "--option", "synopsis_tokens=24", "--option", "atom_tokens=24",
            "--option", "element_tokens=12"]
    assert cli_main(["index", str(doc), "--method", "jerr", "--model", "smollm2-135m", *opts,
                     "--export", str(tmp_path / "graph.html"), "--export", str(tmp_path / "graph.graphml")]) == 0
    assert "<svg" in (tmp_path / "graph.html").read_text() and "<graphml" in (tmp_path / "graph.graphml").read_text()
    assert cli_main(["ask", str(doc) + ".jerr", "Who was held in a cell?", "--model", "smollm2-135m", "--trace",
                     "--max-new-tokens", "8", "--option", "iterations=5"]) == 0  # a search option: ask's, not index's
    out = capsys.readouterr().out
    assert "A:" in out and '"keywords"' in out and '"nodes"' in out
