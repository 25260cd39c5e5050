"""The method interface: the registry (built-in names, unknown names, entry points), declared options (typing and
the errors that name the problem), the CLI generic over methods (index, ask, eval, --help), closed-book on
SmolLM2, and evaluate's index reuse through save_index / load_index / index_key."""
from __future__ import annotations

import importlib.metadata
import json
import re
import sys
from pathlib import Path

import pytest

from nodekv.cli import main
from nodekv.methods import get, names
from nodekv.methods.base import Method
from nodekv.methods.options import Option

PARAS = [["Alpha", ["The Alpha river flows north.", " It is 40 km long."]],
         ["Beta", ["Beta town was founded in 1802 by Mara Quill."]]]


def _write_data(root: Path) -> Path:
    records = [{"_id": "q1", "question": "Who founded Beta town?", "answer": "Mara Quill", "context": PARAS},
               {"_id": "q2", "question": "How long is the river?", "answer": "40 km", "context": PARAS},
               {"_id": "q3", "question": "Where does it flow?", "answer": "north", "context": PARAS[:1]}]
    (root / "multihop").mkdir(parents=True)
    (root / "multihop" / "hotpotqa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root


def test_builtin_methods_are_registered_by_name():
    assert {"pecan", "full", "bm25", "dense", "closed-book"} <= set(names())
    for name in ("pecan", "full", "bm25", "dense", "closed-book"):
        assert issubclass(get(name), Method) and get(name).name == name
    assert get("pecan").can_save and get("bm25").can_save and not get("full").can_save


def test_an_unknown_method_is_refused_with_the_known_ones():
    known = "bm25, closed-book, dense, dice, full, gor, jerr, pecan"
    with pytest.raises(ValueError, match=rf"unknown method 'nope'; known: {known}"):
        get("nope")


@pytest.mark.parametrize("name, options, typed", [
    ("bm25", {"k": "3"}, {"k": 3, "chunk_tokens": 300}),
    ("pecan", {"t_p": "0.25", "attention": "false", "node_budget": "6"}, {"t_p": 0.25, "attention": False,
                                                                            "node_budget": 6}),
    ("pecan", {"t_p": 1}, {"t_p": 1.0}),
    ("pecan", {"attention": 0, "dynamic": 1}, {"attention": False, "dynamic": True}),  # --option attention=0
])
def test_options_are_typed_by_their_declaration(name, options, typed):
    config = vars(get(name)(None, **options).config)
    assert {k: config[k] for k in typed} == typed
    assert all(type(config[k]) is type(v) for k, v in typed.items())


@pytest.mark.parametrize("name, options, message", [
    ("bm25", {"k": "three"}, "bm25 option k must be int, got 'three'"),
    ("dense", {"k": 2.5}, "dense option k must be int, got 2.5"),
    ("bm25", {"k": True}, "bm25 option k must be int, got True"),
    ("pecan", {"attention": 2}, r"PECAN option attention must be bool \(true, 1, false, 0\), got 2"),
    ("bm25", {"chunk_tokens": 0}, "bm25 option chunk_tokens must be >= 1, got 0"),
    ("pecan", {"t_p": "2"}, r"PECAN option t_p must be in \[0, 1\], got '2'"),
    ("pecan", {"attention": "yes"}, r"PECAN option attention must be bool \(true, 1, false, 0\), got 'yes'"),
    ("pecan", {"prompt_style": "terse"}, "PECAN option prompt_style must be one of paper, restate, got 'terse'"),
    ("gor", {"lr": "inf"}, "GoR option lr must be a finite number, got 'inf'"),
    ("gor", {"lr": "1e999"}, "GoR option lr must be a finite number, got '1e999'"),
    ("gor", {"tau": float("inf")}, "GoR option tau must be a finite number, got inf"),
    ("gor", {"dropout": 2}, r"GoR option dropout must be in \[0, 1\], got 2"),  # torch refuses it after the build
    ("dense", {"kk": 1}, r"unknown dense option\(s\) kk; known: k, chunk_tokens"),
    ("closed-book", {"k": 1}, r"unknown closed-book option\(s\) k; known: none"),
])
def test_bad_options_are_refused_naming_the_method_option_and_allowed_values(name, options, message):
    with pytest.raises(ValueError, match=message):
        get(name)(None, **options)


def test_declarations_are_checked_when_the_class_is_made(registry):
    with pytest.raises(ValueError, match="option k must be >= 1, got 0"):
        class BadDefault(Method):
            options = (Option("k", int, 0, "a default out of its own range", low=1),)
    names()
    with pytest.raises(ValueError, match="'pecan' is taken by nodekv.methods.pecan.pecan.Pecan"):
        class Impostor(Method, name="pecan"):
            pass
    with pytest.raises(ValueError, match="lower-case"):
        class Shouting(Method, name="LOUD NAME"):
            pass


@pytest.mark.parametrize("declared, message", [
    (["engine"], "Clash: option name 'engine' is one of Clash(...)'s own keyword arguments: "
                "embedder, engine, progress, prompt, self"),
    (["prompt"], "option name 'prompt' is one of"),  # else: "got multiple values for keyword argument 'prompt'"
    (["progress"], "option name 'progress' is one of"),  # else: silently taken for Method's progress
    (["embedder"], "option name 'embedder' is one of"),  # a keyword of the subclass's own __init__
    (["class"], "Clash: option name 'class' is a Python keyword"),
    (["my-opt"], "Clash: option name 'my-opt' is not a Python identifier"),
    (["k", "k"], "Clash: option name 'k' is declared twice"),
])
def test_option_names_that_cannot_reach_the_config_are_refused_with_the_class(registry, declared, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        class Clash(Method, name="test-clash"):
            options = tuple(Option(name, int, 1, "") for name in declared)

            def __init__(self, engine, prompt=None, progress=False, embedder=None, **options):
                super().__init__(engine, prompt, progress, **options)
    assert "test-clash" not in names()


def test_a_class_that_can_save_must_override_save_and_load(registry):
    with pytest.raises(ValueError, match=r"\.NoSave sets can_save but does not override save_index and load_index$"):
        class NoSave(Method, name="test-no-save"):
            can_save = True

    with pytest.raises(ValueError, match=r"\.NoLoad sets can_save but does not override load_index$"):
        class NoLoad(Method):
            can_save = True

            def save_index(self, index, path):
                pass
    assert "test-no-save" not in names()

def test_a_class_that_fails_its_checks_is_not_registered(registry):
    with pytest.raises(ValueError, match="option k must be >= 1, got 0"):
        class Broken(Method, name="test-broken"):
            options = (Option("k", int, 0, "a default out of its own range", low=1),)
    assert "test-broken" not in names()

    class Fixed(Method, name="test-broken"):  # the corrected class takes the name the failed one never held
        options = (Option("k", int, 1, "in range", low=1),)
    assert get("test-broken") is Fixed


def test_an_entry_point_method_is_found(registry, tmp_path, monkeypatch):
    (tmp_path / "nodekv_test_plugin.py").write_text(
        "from nodekv.methods.base import Answer, Method\n\n"
        "class Echo(Method, name='test-echo'):\n"
        "    '''Answers with the question.'''\n"
        "    def index(self, document):\n        return None\n"
        "    def answer(self, index, question, options=()):\n        return Answer(question, [])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "nodekv_test_plugin", raising=False)
    points = [importlib.metadata.EntryPoint("test-echo", "nodekv_test_plugin", "nodekv.methods"),
              importlib.metadata.EntryPoint("broken", "nodekv_no_such_module", "nodekv.methods")]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: points if group == "nodekv.methods" else [])
    with pytest.warns(UserWarning, match="method plugin broken .* failed to load"):
        method = get("test-echo")(None)
    assert method.answer(method.index("text"), "echo?").text == "echo?"
    with pytest.warns(UserWarning):
        assert "test-echo" in names() and "pecan" in names()


@pytest.mark.parametrize("command", ["eval", "ask", "index"])
def test_help_lists_the_registered_methods_and_their_options(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    assert "pecan" in out and "t_p=0.5" in out and "float in [0, 1]" in out
    assert ("closed-book" in out) == (command != "index")  # index lists only the methods that can save


def test_cli_refuses_bad_methods_and_options_before_loading_a_model(tmp_path, capsys):
    doc = tmp_path / "doc.txt"
    doc.write_text("Some text.")
    cases = [(["ask", "--method", "nope", str(doc), "q"], "unknown method 'nope'"),
             (["ask", "--method", "bm25", "--option", "k=0", str(doc), "q"], "bm25 option k must be >= 1"),
             (["index", "--method", "full", str(doc)],
              "full cannot save an index; methods that can: bm25, dense, gor, jerr, pecan"),
             (["index", str(doc)], "name a --method"),
             (["index", "--method", "pecan", "--export", "g.png", str(doc)],
              "pecan cannot export its index as g.png; formats: .graphml, .html"),
             (["eval", "--method", "dense", "--option", "kk=1", "--dataset", "hotpotqa"], "unknown dense option"),
             (["ask", str(tmp_path / "missing.txt"), "q"], "does not exist")]
    for argv, message in cases:
        assert main(argv + ["--model", str(tmp_path / "no-model")]) == 2, argv
        assert message in capsys.readouterr().err


def test_cli_index_and_ask_work_for_any_method_that_saves(saver, engine, tmp_path, capsys):
    doc = tmp_path / "doc.txt"
    doc.write_text("one two three")
    assert main(["index", "--method", "test-saver", str(doc), "--option", "width=2"]) == 0
    assert "indexed doc.txt: 3 words, 0.000 TFLOPs" in capsys.readouterr().out
    saved = tmp_path / "doc.txt.test-saver"
    assert json.loads(saved.read_text()) == {"words": 3}
    assert main(["ask", str(saved), "How many words?", "--trace"]) == 0  # the method is the file's suffix
    out = capsys.readouterr().out
    assert "A: 3" in out and "method     test-saver" in out and "index loaded from doc.txt.test-saver" in out
    assert '{"words": 3}' in out  # the default trace lines
    assert main(["ask", "--method", "test-saver", str(doc), "How many words?"]) == 0  # indexed on the fly
    assert "A: 3" in capsys.readouterr().out and saver.built == 2


@pytest.mark.model
def test_ask_refuses_a_question_with_no_room_for_a_context_before_building_the_index(saver, tmp_path, capsys):
    doc = tmp_path / "doc.txt"
    doc.write_text("one two three")
    question = "How many words? " * 3000  # ~12K tokens: SmolLM2's window is 8K
    assert main(["ask", "--method", "test-saver", str(doc), question, "--model", "smollm2-135m"]) == 2
    assert capsys.readouterr().err.startswith("error: the prompt takes ") and saver.built == 0


def test_evaluate_reuses_saved_indexes_by_index_key(saver, engine, tmp_path):
    from nodekv.evaluation.runner import RunConfig, run

    data = str(_write_data(tmp_path / "data"))
    runs = tmp_path / "runs"
    first = run(engine, RunConfig("test-saver", "hotpotqa", data_dir=data, out=str(runs)), progress=False)
    rows = [json.loads(line) for line in first.read_text().splitlines()]
    assert [r["prediction"] for r in rows] == ["25", "25", "13"] and saver.built == 2  # two documents
    run(engine, RunConfig("test-saver", "hotpotqa", data_dir=data, out=str(runs), options={"search": 5}),
        progress=False)
    assert saver.built == 2  # a search option: the same index key, the saved indexes
    run(engine, RunConfig("test-saver", "hotpotqa", data_dir=data, out=str(runs), options={"width": 2}),
        progress=False)
    assert saver.built == 4
    assert len(list((runs / "indexes").glob("test-saver-*.idx"))) == 4


@pytest.mark.model
def test_closed_book_runs_through_eval_and_ask(tmp_path, capsys):
    data = _write_data(tmp_path / "data")
    argv = ["eval", "--method", "closed-book", "--dataset", "hotpotqa", "--data-dir", str(data), "--out",
            str(tmp_path / "runs"), "--model", "smollm2-135m"]
    assert main(argv) == 0
    rows = [json.loads(x) for x in (tmp_path / "runs" / "closed-book-hotpotqa.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["q1", "q2", "q3"]
    for r in rows:
        assert "error" not in r and r["nodes"] == [] and r["index_flops"] == 0 < r["query_flops"]
    doc = tmp_path / "doc.txt"
    doc.write_text("The lighthouse keeper of Port Ellen was named Agnes Morrow.")
    capsys.readouterr()
    assert main(["ask", "--method", "closed-book", str(doc), "Who kept the lighthouse?", "--max-new-tokens", "8",
                 "--model", "smollm2-135m"]) == 0
    out = capsys.readouterr().out
    assert "A: " in out and "method     closed-book" in out and "generated" in out
    assert "layers, d=576, float32 on cpu)" in out  # the dtype chosen by the device, not the flag's None
    assert main(["ask", "--method", "closed-book", str(doc), "Who kept the lighthouse?", "--max-new-tokens", "8",
                 "--model", "smollm2-135m", "--kv-dtype", "float16"]) == 0
    assert "float32 on cpu, KV cache float16)" in capsys.readouterr().out


def test_cli_graph_exports_a_saved_index_and_refuses_what_it_cannot(saver, engine, tmp_path, capsys):
    saver.exports = {".txt": "the word count"}
    saver.export = lambda self, index, path: Path(path).write_text(f"{index['words']} words")
    saved = tmp_path / "doc.txt.test-saver"
    saved.write_text(json.dumps({"words": 4}))
    assert main(["graph", str(saved), "-o", str(tmp_path / "view.txt")]) == 0
    assert (tmp_path / "view.txt").read_text() == "4 words" and "view.txt (the word count)" in capsys.readouterr().out
    assert main(["graph", str(saved), "-o", str(tmp_path / "view.html")]) == 2
    assert "test-saver cannot export its index as" in capsys.readouterr().err
    assert main(["graph", str(tmp_path / "missing.test-saver"), "-o", str(tmp_path / "v.txt")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_bench_lists_the_benchmarks_and_refuses_an_unknown_one(capsys):
    assert main(["bench"]) == 0
    out = capsys.readouterr().out
    assert "engine_speed" in out and "pecan_search" in out and "engine_runners" not in out  # helpers have no main
    assert main(["bench", "nope"]) == 2
    assert "unknown benchmark 'nope'; known: answer_memory, batch" in capsys.readouterr().err


def test_help_keeps_a_space_after_long_method_and_option_names(registry):
    from nodekv.cli import methods_help

    class Long(Method, name="a-very-long-method-name"):
        """Does nothing."""
        options = (Option("an_unusually_long_option", int, 1, "a long name", low=1),)
    lines = methods_help().splitlines()
    assert "  a-very-long-method-name Does nothing." in lines
    assert "      an_unusually_long_option=1 int >= 1; a long name" in lines
