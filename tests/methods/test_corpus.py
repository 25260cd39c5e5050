"""`nodekv index-corpus` on SmolLM2: every *.txt under a directory is indexed once (a file's index is byte for byte
the one `nodekv index` saves for it), identical texts share one index, empty and non-UTF-8 files are skipped by name,
a rerun builds nothing, the manifest maps every file to its index, and `nodekv ask` answers from a stored index."""
from __future__ import annotations

import json

import pytest

from nodekv.cli import main as cli_main

pytestmark = pytest.mark.model

MODEL = ["--model", "smollm2-135m", "--threads", "1"]
MILL = "The mill on the river Aven was built in 1821 by Tom Quill. It ground wheat for the town of Marlow.\n"
LAKE = "Lake Serin lies 4 km north of Marlow. Its tower was raised in 1850 by Ada Quill.\n"


def test_index_corpus_builds_each_text_once_and_resumes(tmp_path, capsys):
    corpus, store = tmp_path / "corpus", tmp_path / "store"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "mill.txt").write_text(MILL)
    (corpus / "mill copy.txt").write_text(MILL)
    (corpus / "sub" / "lake.txt").write_text(LAKE)
    (corpus / "empty.txt").write_text(" \n")
    (corpus / "latin1.txt").write_bytes("Caf\xe9".encode("latin-1"))
    (corpus / "notes.md").write_text(LAKE + "not a .txt file")
    argv = ["index-corpus", str(corpus), "--out", str(store), *MODEL]
    assert cli_main(argv) == 0
    out = capsys.readouterr()
    assert "skipped empty.txt: empty" in out.err and "skipped latin1.txt: not UTF-8" in out.err
    assert "3 files, 2 distinct documents, 0 already in" in out.out and out.out.count("indexed ") == 2
    (manifest,) = store.glob("*.corpus.jsonl")
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    assert [r["file"] for r in rows] == ["mill copy.txt", "mill.txt", "sub/lake.txt"]
    assert rows[0]["index"] == rows[1]["index"] != rows[2]["index"]
    assert all(r["tflops"] > 0 and r["tokens"] > 0 for r in rows)

    (corpus / "lake.txt").write_text(LAKE)
    assert cli_main(["index", str(corpus / "lake.txt"), "-o", str(tmp_path / "lake.pecan"), *MODEL]) == 0
    with open(rows[2]["index"], "rb") as stored:
        assert stored.read() == (tmp_path / "lake.pecan").read_bytes()

    capsys.readouterr()
    assert cli_main(argv) == 0  # lake.txt is new as a file, not as a text: nothing to build
    out = capsys.readouterr().out
    assert "4 files, 2 distinct documents, 2 already in" in out and "indexed " not in out
    assert json.loads(manifest.read_text().splitlines()[0]) == {**rows[2], "file": "lake.txt"}

    assert cli_main(["ask", rows[1]["index"], "Who built the mill?", *MODEL]) == 0
    assert "Tom Quill" in capsys.readouterr().out


def test_index_corpus_refuses_what_it_cannot_do(tmp_path, capsys):
    (tmp_path / "only.md").write_text(MILL)
    assert cli_main(["index-corpus", str(tmp_path / "nowhere"), *MODEL]) == 2
    assert "corpus directory" in capsys.readouterr().err
    assert cli_main(["index-corpus", str(tmp_path), *MODEL]) == 2
    assert "no non-empty *.txt files under" in capsys.readouterr().err
    assert cli_main(["index-corpus", str(tmp_path), "--method", "bm25", *MODEL]) == 2
    assert "bm25 cannot save an index" in capsys.readouterr().err
    assert cli_main(["index-corpus", str(tmp_path), "--ray", "--workers", "0", *MODEL]) == 2
    assert "--workers must be at least 1" in capsys.readouterr().err
