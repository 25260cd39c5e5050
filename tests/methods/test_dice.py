"""DICE: both algorithms' control flow against a scripted LLM (what is asked, retrieved and written into T, when
the loop ends, and how broken output ends it), retrieval (recall, re-rank, document order), chunking, and on the
real SmolLM2 the FLOPs of the shared few-shot prefix (charged once per engine, by the FLOP formula)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nodekv.engine.flops import FlopAccount, forward_flops
from nodekv.methods.dice.dice import Dice, word_chunks
from nodekv.methods.dice.dice_algorithms import (STOP_REASONS, Budget, Reasoning, Retrieved, constrained_decoding,
                                                iterative_qa)
from nodekv.methods.dice.dice_prompts import THOUGHTS, planning_turn
from conftest import bare_engine

BUDGET = Budget(max_iterations=5, step_tokens=16, answer_tokens=8, step_room=100)


class ScriptedThought:
    """T as a list of text pieces; every model output comes from `script`, in order."""

    def __init__(self, script, opening="", room=10_000):
        self.pieces, self.script, self.room_left, self.closed, self.inserts = [opening], iter(script), room, False, []

    def choose(self, labels):
        label = next(self.script)
        assert label in labels, f"scripted {label!r} is not one of {labels}"
        self.pieces.append(label)
        return label

    def generate(self, max_tokens, stop):
        text, ended = next(self.script)
        self.pieces.append(text + (stop[0] if ended else ""))
        return text, ended

    def generate_after(self, insert, max_tokens, stop):
        self.inserts.append(insert)
        return next(self.script)

    def write(self, text):
        self.pieces.append(text)

    def ask(self, text):
        self.pieces.append(f"[user] {text} [model] ")

    def mark(self):
        return len(self.pieces)

    def rollback(self, mark):
        del self.pieces[mark:]

    def room(self):
        return self.room_left

    def close(self):
        self.closed = True

    @property
    def text(self):
        return "".join(self.pieces)


class ScriptedLM:
    def __init__(self, script, facts=None, room=10_000):
        self.script, self.facts, self.room, self.extracted, self.thoughts = script, facts or {}, room, [], []

    def thought(self, algorithm, question, opening=""):
        self.thoughts.append(ScriptedThought(self.script, opening, self.room))
        return self.thoughts[-1]

    def relevance(self, question, passages, stored=None):
        return [0.0] * len(passages)

    def extract(self, question, reference, max_tokens, stored=()):
        self.extracted.append((question, reference))
        return self.facts[question]


class Retriever:
    """Records each query; returns the chunk whose number is the query's length (something checkable)."""

    def __init__(self):
        self.queries = []

    def __call__(self, query):
        self.queries.append(query)
        return Retrieved([len(query)], f"passage for {query}", [{"chunk": len(query), "dense": 1.0}])


def test_algorithm1_plans_retrieves_extracts_and_writes_subquestion_and_fact_into_T():
    lm = ScriptedLM(["Subquestion:", (" Who is A's spouse?", True),
                     "Subquestion:", (" Where was B born?", True),
                     "Final answer:", (" Paris", True)],
                    facts={"Who is A's spouse?": "A's spouse is B.", "Where was B born?": "B was born in Paris."})
    retrieve = Retriever()
    run = iterative_qa(lm, retrieve, "Where was A's spouse born?", BUDGET)
    t = lm.thoughts[0]
    assert retrieve.queries == ["Who is A's spouse?", "Where was B born?"]  # each sub-question, as planned
    assert lm.extracted == [("Who is A's spouse?", "passage for Who is A's spouse?"),
                            ("Where was B born?", "passage for Where was B born?")]
    assert t.text == ("Subquestion: Who is A's spouse?\nFact: A's spouse is B.\n"
                      "Subquestion: Where was B born?\nFact: B was born in Paris.\nFinal answer: Paris\n")
    assert (run.answer, run.stop, run.chunks) == ("Paris", "terminated", [17, 18])
    assert [s.get("fact") for s in run.trace] == ["A's spouse is B.", "B was born in Paris.", None]
    assert run.trace[-1] == {"stop": "terminated", "answer": "Paris"} and t.closed


def test_algorithm2_retrieves_with_the_draft_and_writes_the_step_decoded_after_the_reference():
    lm = ScriptedLM(["Thought:", (" A's spouse is Carl.", True), (" A's spouse is B.", True),
                     "Thought:", (" B was born in Rome.", True), (" B was born in Paris.", True),
                     "Answer:", (" Paris", True)])
    retrieve = Retriever()
    run = constrained_decoding(lm, retrieve, "Where was A's spouse born?", BUDGET)
    t = lm.thoughts[0]
    assert retrieve.queries == ["A's spouse is Carl.", "B was born in Rome."]  # the drafts are the queries
    assert t.inserts == ["Reference: passage for A's spouse is Carl.\nThought:",
                         "Reference: passage for B was born in Rome.\nThought:"]
    # T keeps the edited thoughts only: the drafts are rolled back and no reference stays
    assert t.text == (f"{THOUGHTS}\nThought: A's spouse is B.#\nThought: B was born in Paris.#\nAnswer: Paris\n")
    assert (run.answer, run.stop) == ("Paris", "terminated")
    assert [s.get("thought") for s in run.trace[:2]] == ["A's spouse is B.", "B was born in Paris."]


@pytest.mark.parametrize("algorithm", [1, 2])
def test_endless_steps_stop_at_M_and_still_answer(algorithm):
    m = 3
    step = "Subquestion:" if algorithm == 1 else "Thought:"
    script = []
    for i in range(m):
        script += [step, (f" step {i}?", True)] + ([] if algorithm == 1 else [(f" edited {i}", True)])
    script += [(" 42", True)]
    lm = ScriptedLM(script, facts={f"step {i}?": f"fact {i}" for i in range(m)})
    retrieve = Retriever()
    run = (iterative_qa if algorithm == 1 else constrained_decoding)(
        lm, retrieve, "q?", Budget(m, 16, 8, 100))
    assert len(retrieve.queries) == m and (run.answer, run.stop) == ("42", "max_iterations")
    label = "Final answer:" if algorithm == 1 else "Answer:"
    assert lm.thoughts[0].text.endswith(f"{label} 42\n")  # the algorithm wrote the answer label itself


@pytest.mark.parametrize("algorithm", [1, 2])
@pytest.mark.parametrize("broken", [(" Whereabouts of", False), ("  ", True)], ids=["no line end or '#'", "empty"])
def test_a_step_that_breaks_the_format_is_rolled_back_and_the_answer_decoded(algorithm, broken):
    step = "Subquestion:" if algorithm == 1 else "Thought:"
    first = [step, (" Who is A?", True)] + ([] if algorithm == 1 else [(" A is B.", True)])
    lm = ScriptedLM(first + [step, broken, (" B", True)], facts={"Who is A?": "A is B."})
    retrieve = Retriever()
    run = (iterative_qa if algorithm == 1 else constrained_decoding)(lm, retrieve, "q?", BUDGET)
    assert (run.answer, run.stop) == ("B", "format") and len(retrieve.queries) == 1
    assert run.trace[1]["broken"] == "format"
    assert broken[0] not in lm.thoughts[0].text.replace(" B\n", "")  # the broken step is not in T


@pytest.mark.parametrize("algorithm", [1, 2])
def test_a_repeated_step_ends_the_loop(algorithm):
    step = "Subquestion:" if algorithm == 1 else "Thought:"
    edit = [] if algorithm == 1 else [(" A is B.", True)]
    lm = ScriptedLM([step, (" Who is A?", True), *edit, step, (" who is a", True), (" B", True)],
                    facts={"Who is A?": "A is B."})
    retrieve = Retriever()
    run = (iterative_qa if algorithm == 1 else constrained_decoding)(lm, retrieve, "q?", BUDGET)
    assert (run.answer, run.stop, len(retrieve.queries)) == ("B", "repeated", 1)


@pytest.mark.parametrize("algorithm", [1, 2])
def test_the_restated_answer_turn_replaces_the_answer_label(algorithm):
    step, answer = ("Subquestion:", "Final answer:") if algorithm == 1 else ("Thought:", "Answer:")
    edit = [] if algorithm == 1 else [(" A is B.", True)]
    lm = ScriptedLM([step, (" Who is A?", True), *edit, answer, (" B", True)], facts={"Who is A?": "A is B."})
    run = (iterative_qa if algorithm == 1 else constrained_decoding)(lm, Retriever(), "q?", BUDGET, "Q: who? A:")
    text = lm.thoughts[0].text
    assert (run.answer, run.stop) == ("B", "terminated")
    assert text.endswith("A is B.#\n[user] Q: who? A: [model]  B\n" if algorithm == 2 else
                         "Fact: A is B.\n[user] Q: who? A: [model]  B\n") and answer not in text


def test_no_answer_falls_back_to_the_last_fact_and_a_full_window_stops_before_a_step():
    lm = ScriptedLM(["Subquestion:", (" Who is A?", True), "Final answer:", ("", False)], facts={"Who is A?": "A is B."})
    run = iterative_qa(lm, Retriever(), "q?", BUDGET)
    assert (run.answer, run.stop) == ("A is B.", "terminated")
    lm = ScriptedLM([(" B", True)], room=50)  # less room than a step needs: no step, straight to the answer
    run = constrained_decoding(lm, Retriever(), "q?", BUDGET)
    assert (run.answer, run.stop, run.trace) == ("B", "window", [{"stop": "window", "answer": "B"}])


def test_an_edited_step_that_breaks_the_format_keeps_the_draft():
    lm = ScriptedLM(["Thought:", (" A is B.", True), (" A is", False), "Answer:", (" B", True)])
    run = constrained_decoding(lm, Retriever(), "q?", BUDGET)
    assert run.trace[0]["thought"] == "A is B." and run.trace[0]["unfinished_edit"] == "A is"
    assert "Thought: A is B.#\n" in lm.thoughts[0].text


KEYWORDS = ["alpha", "beta", "gamma", "delta", "epsilon"]


class KeywordEmbedder:
    """Bag of the five keywords: cosine similarity counts shared keywords."""

    def encode(self, texts, batch_size=64):  # 0.125 is exact in binary: equal cosines stay equal after rounding
        return torch.tensor([[float(t.split().count(k)) + 0.125 for k in KEYWORDS] for t in texts])


class RelevanceLM(ScriptedLM):
    def __init__(self, scores):
        super().__init__([])
        self.scores, self.asked = scores, []

    def relevance(self, question, passages, stored=None):
        self.asked.append(list(passages))
        return [self.scores[p.split()[0]] for p in passages]


def test_retrieval_recalls_by_bi_encoder_reranks_by_the_llm_and_keeps_document_order():
    engine = bare_engine(flops=FlopAccount(), config=SimpleNamespace(max_seq_len=4096))
    chunks = " ".join(f"{k} {i}" for i, k in enumerate(KEYWORDS))
    lm = RelevanceLM({"alpha": -2.0, "beta": -0.5, "gamma": -0.1, "delta": -0.2, "epsilon": -0.05})
    dice = Dice(engine, embedder=KeywordEmbedder(), lm=lm, chunk_words=2, recall_k=4, top_k=2)
    index = dice.index(chunks)
    assert index.chunks == ["alpha 0", "beta 1", "gamma 2", "delta 3", "epsilon 4"]
    got = dice.retrieve(index, "alpha beta gamma")
    assert lm.asked == [["alpha 0", "beta 1", "gamma 2", "delta 3"]]  # recall: the 4 closest (ties: index order)
    assert got.chunks == [2, 3] and got.text == "gamma 2\ndelta 3"    # re-ranked best 2, in document order
    assert [s["rerank"] for s in got.scores] == [-0.1, -0.2]
    assert [(s["chunk"], s["rerank"]) for s in got.recalled] == [(0, -2.0), (1, -0.5), (2, -0.1), (3, -0.2)]
    assert got.trace() == {"retrieved": got.scores, "recalled": got.recalled}
    dice = Dice(engine, embedder=KeywordEmbedder(), lm=lm, chunk_words=2, top_k=2, rerank=False)
    got = dice.retrieve(index, "gamma beta")
    assert got.chunks == [1, 2] and len(lm.asked) == 1 and got.trace() == {"retrieved": got.scores}


@pytest.mark.parametrize("notes", [True, False])
def test_the_reader_reads_the_retrieved_chunks_in_document_order_then_the_notes(notes):
    engine = bare_engine(flops=FlopAccount(), config=SimpleNamespace(max_seq_len=4096))
    dice = Dice(engine, embedder=KeywordEmbedder(), lm=ScriptedLM([]), chunk_words=2, notes=notes)
    index = dice.index(" ".join(f"{k} {i}" for i, k in enumerate(KEYWORDS)))
    run = Reasoning("x", "terminated", [1, 3], [{"draft": "d", "thought": "beta is 1"}, {"broken": "repeated"},
                                                {"subquestion": "s", "fact": "delta is 3"}, {"stop": "terminated"}])
    want = "beta 1\n\ndelta 3" + ("\n\nNotes:\n- beta is 1\n- delta is 3" if notes else "")
    assert dice.reader_context(index, run) == want


def test_hybrid_recall_finds_an_exact_token_the_bi_encoder_cannot_see():
    engine = bare_engine(flops=FlopAccount(), config=SimpleNamespace(max_seq_len=4096))
    chunks = "alpha 0 alpha 1 VAR QWERT beta 3"  # the keyword embedder sees no QWERT
    dice = Dice(engine, embedder=KeywordEmbedder(), lm=ScriptedLM([]), chunk_words=2, top_k=2, rerank=False)
    assert dice.retrieve(dice.index(chunks), "alpha QWERT").chunks == [0, 1]
    hybrid = Dice(engine, embedder=KeywordEmbedder(), lm=ScriptedLM([]), chunk_words=2, top_k=2, rerank=False,
                  recall="hybrid")
    got = hybrid.retrieve(hybrid.index(chunks), "alpha QWERT")
    assert got.chunks == [0, 2] and got.text == "alpha 0\nVAR QWERT" and set(got.scores[0]) == {"chunk", "hybrid"}


def test_the_variable_tracking_examples_replace_app_d_in_either_format():
    for algorithm in (1, 2):
        multihop, variables = planning_turn(algorithm), planning_turn(algorithm, "variables")
        assert "Rainn Wilson" in multihop and "VAR QWERT" not in multihop
        assert "VAR QWERT = 52817." in variables and "Rainn Wilson" not in variables
        assert variables.endswith("Question: {}")
    assert "Thought: VAR ZXCVB = VAR QWERT.#" in planning_turn(2, "variables")


def test_word_chunks_hold_at_most_n_words_and_never_cross_a_blank_line():
    doc = "Passage 1:\nTitle one\n" + " ".join(f"w{i}" for i in range(7)) + "\n\n  \nPassage 2:\nshort"
    assert word_chunks(doc, 4) == ["Passage 1: Title one", "w0 w1 w2 w3", "w4 w5 w6", "Passage 2: short"]
    # a Han or kana character is a word (a full stop is not): a paragraph without spaces is cut, kept as written
    assert word_chunks("東京は日本の首都です。 Tokyo 東京\n\n寿司", 4) == ["東京は日", "本の首都", "です。 Tokyo", "東京", "寿司"]


def test_bad_input_is_refused_with_a_message():
    engine = bare_engine(flops=FlopAccount(), config=SimpleNamespace(max_seq_len=4096))
    with pytest.raises(ValueError, match="DICE option algorithm must be one of 1, 2"):
        Dice(engine, algorithm=3)
    with pytest.raises(ValueError, match=r"top_k \(5\) must be at most recall_k \(2\) with rerank"):
        Dice(engine, top_k=5, recall_k=2)
    with pytest.raises(ValueError, match="top_k"):  # as the CLI checks options, before a model loads
        Dice.configure(top_k="5", recall_k="2")
    assert Dice(engine, top_k=5, recall_k=2, rerank=False).config.top_k == 5  # recall_k is unused without re-rank
    with pytest.raises(ValueError, match="document is empty"):
        Dice(engine, embedder=KeywordEmbedder(), lm=ScriptedLM([])).index("  \n ")
    dice = Dice(engine, embedder=KeywordEmbedder(), lm=ScriptedLM([]))
    with pytest.raises(ValueError, match="multiple-choice"):
        dice.answer(dice.index("alpha"), "q?", options=("a", "b"))


DOC = ("Passage 1:\nMarie Curie\nMarie Curie was born in Warsaw. She was married to Pierre Curie.\n\n"
       "Passage 2:\nPierre Curie\nPierre Curie was a French physicist born in Paris.\n\n"
       "Passage 3:\nWarsaw\nWarsaw is the capital of Poland.")


@pytest.mark.model
@pytest.mark.parametrize("algorithm", [1, 2])
def test_the_second_question_is_not_charged_for_the_shared_prefixes(algorithm):
    """Run the same question twice on one engine: the second run costs exactly the prefill FLOPs of the shared
    prefixes (by the FLOP formula, from their token counts) less, and gives the same answer."""
    import nodekv

    eng = nodekv.load_engine("smollm2-135m")
    dice = Dice(eng, algorithm=algorithm, max_iterations=2, recall_k=3, top_k=2, step_tokens=24)
    index = dice.index(DOC)
    first = dice.answer(index, "Where was Marie Curie's husband born?")
    prefixes = [len(s) for s in eng.prefixes._sessions.values()]
    assert len(prefixes) == (3 if algorithm == 1 else 2)  # planning, relevance (and extraction for Alg. 1)
    second = dice.answer(index, "Where was Marie Curie's husband born?")
    assert len(eng.prefixes) == len(prefixes)
    assert first.flops - second.flops == sum(forward_flops(eng.config, n) for n in prefixes)
    assert (second.text, second.trace[:-1]) == (first.text, first.trace[:-1])
    assert second.trace[-1]["prefix_flops_saved"] > first.trace[-1]["prefix_flops_saved"]
    assert second.trace[-1]["stop"] in STOP_REASONS


@pytest.mark.model
def test_a_question_the_planning_turn_cannot_hold_is_refused_before_any_forward():
    """As the other methods refuse a question the window cannot hold, with one line and no forward: the planning
    prefix (~500 tokens, cached per engine) is not prefilled first, for a question longer than the window or one
    that fits it alone."""
    import nodekv

    eng = nodekv.load_engine("smollm2-135m")
    dice = Dice(eng, embedder=KeywordEmbedder())
    index = dice.index(DOC)
    for words in (eng.config.max_seq_len, eng.config.max_seq_len - 300):
        with pytest.raises(ValueError, match="DICE's planning turn with this question takes .* more than the "
                                             "model's window of"):
            dice.answer(index, "word " * words)
    assert eng.flops.total == 0 and len(eng.prefixes) == 0


@pytest.mark.model
def test_stored_chunks_fully_repaired_give_the_prefilled_run(monkeypatch):
    """kv_reuse: the chunks' KV stored at indexing, placed in the re-rank, the fact extraction and the reader, and
    with every placed token recomputed (blend, repair=1) the run of kv_reuse=off: the same re-rank scores, facts
    and answer; pure reuse (no recompute) charges the query less. One chunk a step, so that the extraction's
    reference is one chunk, and every prompt's fills encoded apart from the template around them, as a placed
    chunk is: so that the prefilled run reads the placed run's tokens."""
    import nodekv
    from nodekv.methods.chat_prompt import ChatPrompt

    def fill_apart(prompt, slot, text):
        before, after = prompt.around(slot)
        return before + prompt.tokenizer.encode(text) + after

    monkeypatch.setattr(ChatPrompt, "fill", fill_apart)
    eng = nodekv.load_engine("smollm2-135m")
    question = "Where was Marie Curie's husband born?"
    runs = {}
    for kv in ({"kv_reuse": "off"}, {"kv_reuse": "blend", "repair": 1.0}, {"kv_reuse": "reuse"}):
        dice = Dice(eng, algorithm=1, max_iterations=2, recall_k=3, top_k=1, step_tokens=24, **kv)
        index = dice.index(DOC)
        assert (index.stored is None) == (kv["kv_reuse"] == "off")
        runs[kv["kv_reuse"]] = dice.answer(index, question)
    off, blend, reuse = runs["off"], runs["blend"], runs["reuse"]
    assert blend.text == off.text and blend.trace[:-2] == off.trace[:-1]  # the reader's placement record is extra
    placed = blend.trace[-1]
    assert placed["placed"] == placed["repaired"] > 0 and all(n["reused"] == 0 for n in placed["nodes"])
    assert reuse.trace[-1]["repaired"] == 0 and reuse.flops < off.flops


@pytest.mark.model
def test_dice_runs_through_ask_and_eval_on_variable_tracking(tmp_path, capsys):
    import json

    from nodekv.cli import main

    doc = tmp_path / "doc.txt"
    doc.write_text(DOC)
    assert main(["ask", str(doc), "Where was Marie Curie's husband born?", "--method", "dice", "--option",
                 "algorithm=1", "--option", "max_iterations=1", "--option", "prompt_style=restate", "--trace",
                 "--model", "smollm2-135m"]) == 0
    out = capsys.readouterr().out
    assert "A: " in out and "stopped: " in out and "method     dice" in out
    runs = tmp_path / "runs"
    assert main(["eval", "--method", "dice", "--dataset", "variable_tracking_2hop_2k", "--limit", "1", "--option",
                 "max_iterations=2", "--out", str(runs), "--model", "smollm2-135m"]) == 0
    row = json.loads((runs / "dice-max_iterations=2-variable_tracking_2hop_2k.jsonl").read_text())
    assert "error" not in row and set(row["metrics"]) == {"em", "f1", "recall"}
    assert row["trace"][-1]["stop"] in STOP_REASONS
    assert row["query_flops"] > 0 and row["query_flops_saved"] >= 0 and row["index_flops"] == 0
