"""`nodekv index-corpus`: every *.txt under a directory is indexed once per distinct text, empty and non-UTF-8 files
are skipped by name, a document that fails does not stop the others and is tried again by the rerun (which builds
nothing else), the manifest maps every file to its index; on SmolLM2 a stored PECAN index is byte for byte the one
`nodekv index` saves, and `nodekv ask` answers from it."""
from __future__ import annotations

import json

import pytest

from nodekv.cli import main as cli_main

MODEL = ["--model", "smollm2-135m", "--threads", "1"]
MILL = "The mill on the river Aven was built in 1821 by Tom Quill. It ground wheat for the town of Marlow.\n"


def _manifest(store):
    (path,) = store.glob("*.corpus.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_text_once_failures_apart_and_a_rerun_resumes(tmp_path, engine, saver, capsys):
    corpus, store = tmp_path / "corpus", tmp_path / "store"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "mill.txt").write_text("one two three")
    (corpus / "mill copy.txt").write_text("one two three")
    (corpus / "sub" / "lake.txt").write_text("four five")
    (corpus / "broken.txt").write_text("FAIL now")
    (corpus / "empty.txt").write_text(" \n")
    (corpus / "latin1.txt").write_bytes("Caf\xe9".encode("latin-1"))
    (corpus / "binary.txt").write_bytes(b"ab\0cd")
    (corpus / "notes.md").write_text("not a .txt file")
    argv = ["index-corpus", str(corpus), "--method", "test-saver", "--out", str(store)]
    assert cli_main(argv) == 1
    out = capsys.readouterr()
    assert "skipped empty.txt: it is empty" in out.err and "skipped latin1.txt: not UTF-8" in out.err
    assert "skipped binary.txt: it holds NUL characters (the first at character" in out.err
    assert "4 files, 3 distinct documents, 0 already in" in out.out and out.out.count("indexed ") == 2
    assert "FAILED broken.txt: ValueError: this document asks to fail" in out.out and saver.built == 2
    rows = _manifest(store)
    assert [r["file"] for r in rows] == ["broken.txt", "mill copy.txt", "mill.txt", "sub/lake.txt"]
    assert rows[0]["error"] == "ValueError: this document asks to fail" and "index" not in rows[0]
    assert rows[1]["index"] == rows[2]["index"] != rows[3]["index"]
    assert [json.loads(open(r["index"]).read()) for r in rows[1:]] == [{"words": 3}] * 2 + [{"words": 2}]

    (corpus / "broken.txt").write_text("mended")
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "4 files, 3 distinct documents, 2 already in" in out and out.count("indexed ") == 1 and saver.built == 3
    assert [json.loads(open(r["index"]).read()) for r in _manifest(store)] == [{"words": 1}, *[{"words": 3}] * 2,
                                                                               {"words": 2}]

    assert cli_main(["ask", rows[3]["index"], "how many words?"]) == 0  # the method comes from the file name
    assert "A: 2" in capsys.readouterr().out

    assert cli_main([*argv, "--option", "width=2"]) == 0  # an option of the index key: a store key of its own
    assert saver.built == 6 and len(list(store.glob("*.corpus.jsonl"))) == 2
    other = tmp_path / "elsewhere" / "corpus"  # a folder of the same name: a manifest of its own
    other.mkdir(parents=True)
    (other / "pond.txt").write_text("six")
    assert cli_main(["index-corpus", str(other), "--method", "test-saver", "--out", str(store)]) == 0
    assert len(list(store.glob("*.corpus.jsonl"))) == 3


def test_a_document_another_process_is_building_is_left_to_it_till_last(tmp_path, engine, saver, monkeypatch):
    """Two `index-corpus` runs on one store split the work: a document the other holds a claim on is taken last, and
    then waited for, not built again."""
    import threading
    import time

    from nodekv.evaluation import index_store
    from nodekv.evaluation.index_corpus import index_corpus
    from nodekv.evaluation.index_store import IndexStore, document_hash

    monkeypatch.setattr(index_store, "WAIT_POLL_S", 0.01)
    corpus, root = tmp_path / "corpus", tmp_path / "store"
    corpus.mkdir()
    for name, text in [("a.txt", "one"), ("b.txt", "two words"), ("c.txt", "three words here")]:
        (corpus / name).write_text(text)
    store = IndexStore.for_method(root, engine, saver(engine))
    root.mkdir()
    taken = store.index_path(document_hash("one")).with_suffix(".building")
    taken.write_text(json.dumps({"host": "other-host", "pid": 4242}))  # the other run is building a.txt's index
    order = []

    def other_run_finishes():
        deadline = time.monotonic() + 2  # a run that waited for a.txt first would log nothing meanwhile
        while len(order) < 3 and time.monotonic() < deadline:  # once this run has built b and c
            time.sleep(0.01)
        saver(engine).save_index({"words": 99}, store.index_path(document_hash("one")))
        store.index_path(document_hash("one")).with_suffix(".json").write_text(json.dumps([5, 0, 1.0, 1]))
        taken.unlink()

    threading.Thread(target=other_run_finishes).start()
    manifest, failed = index_corpus(engine, "test-saver", {}, corpus, root, log=order.append)
    assert failed == 0 and saver.built == 2
    assert [line.split()[1] for line in order[1:]] == ["indexed"] * 3 and order[-1].startswith("[3/3] indexed a.txt")
    assert [json.loads(line)["file"] for line in manifest.read_text().splitlines()] == ["a.txt", "b.txt", "c.txt"]
    assert json.loads(open(store.index_path(document_hash("one"))).read()) == {"words": 99}


def test_index_corpus_refuses_what_it_cannot_do(tmp_path, engine, saver, capsys):
    (tmp_path / "only.md").write_text(MILL)
    assert cli_main(["index-corpus", str(tmp_path / "nowhere"), "--method", "test-saver"]) == 2
    assert "corpus directory" in capsys.readouterr().err
    assert cli_main(["index-corpus", str(tmp_path), "--method", "test-saver"]) == 2
    assert "no usable *.txt files under" in capsys.readouterr().err
    assert cli_main(["index-corpus", str(tmp_path), "--method", "full"]) == 2
    assert "full cannot save an index" in capsys.readouterr().err
    assert cli_main(["index-corpus", str(tmp_path), "--ray", "--workers", "0"]) == 2
    assert "--workers must be at least 1" in capsys.readouterr().err
    assert cli_main(["index-corpus", str(tmp_path), "--method", "test-saver", "--option", "width=0"]) == 2
    assert "width" in capsys.readouterr().err


@pytest.mark.model
def test_a_stored_pecan_index_is_the_one_nodekv_index_saves_and_answers(tmp_path, capsys):
    corpus, store = tmp_path / "corpus", tmp_path / "store"
    corpus.mkdir()
    (corpus / "mill.txt").write_text(MILL)
    short = ["--option", "summary_tokens=64"]  # SmolLM2 would fill the default 512 tokens of a summary here
    assert cli_main(["index-corpus", str(corpus), "--out", str(store), *MODEL, *short]) == 0
    (row,) = _manifest(store)
    assert row["tflops"] > 0 and row["tokens"] > 0
    (cost_file,) = store.glob("pecan-*.json")  # what a later eval charges the index: also projected to the 8B
    flops, flops_8b = json.loads(cost_file.read_text())[:2]
    assert flops_8b > 40 * flops > 0
    assert cli_main(["index", str(corpus / "mill.txt"), "-o", str(tmp_path / "mill.pecan"), *MODEL, *short]) == 0
    with open(row["index"], "rb") as stored:
        assert stored.read() == (tmp_path / "mill.pecan").read_bytes()
    capsys.readouterr()
    assert cli_main(["ask", row["index"], "Who built the mill?", *MODEL]) == 0
    assert "Tom Quill" in capsys.readouterr().out
