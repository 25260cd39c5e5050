"""Bad input is refused before any model work, in one line naming the problem (exit status 2 from the CLI, a
ValueError from the Python API), and every file nodekv writes is written atomically: a write killed midway leaves
the previous file whole and byte for byte the same."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import nodekv
from nodekv.cli import main
from nodekv.engine.config import preset
from nodekv.engine.node_store import write_node_store
from nodekv.methods import get, names
from nodekv.methods.index_file import _checksum, read_index_file, write_index_file
from nodekv.paths import STALE_TEMPORARY_S, NotUTF8Error, atomic_path, read_json_lines, read_text, write_atomic


@pytest.fixture
def no_model(monkeypatch):
    """Any model load fails the test: a refusal must come before it."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded for input that should have been refused")

    monkeypatch.setattr(nodekv, "load_engine", refuse)


@pytest.fixture
def files(tmp_path, monkeypatch):
    """A folder (the current one) with a document, a latin-1 file, an empty file, data folders of hotpotqa (one
    record; none readable; empty; one id twice), saved-index stand-ins and a FIFO."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "doc.txt").write_text("The mill was built in 1821.")
    (tmp_path / "latin.txt").write_bytes(b"x" * 1234 + "Caf\xe9".encode("latin-1"))
    (tmp_path / "empty.txt").write_text(" \n")
    (tmp_path / "invisible.txt").write_text("\ufeff\u200b \u2060\n")  # a BOM and zero-width characters only
    (tmp_path / "notes.dense").write_text("Notes, named like a dense index.")
    (tmp_path / "data" / "multihop").mkdir(parents=True)
    record = {"_id": "q1", "question": "Who built it?", "answer": "Ann", "context": [["Mill", ["Ann built it."]]]}
    (tmp_path / "data" / "multihop" / "hotpotqa.jsonl").write_text(json.dumps(record) + "\n")
    (tmp_path / "run.jsonl").write_text("")
    (tmp_path / "run.meta.json").write_text('{\n "method": "bm25",\n "dataset": "hotpotqa"\n}')
    for folder, text in (("nul", b"\xe9\n"), ("empty", b""), ("twice", f"{json.dumps(record)}\n\n".encode() * 2)):
        (tmp_path / folder / "multihop").mkdir(parents=True)
        (tmp_path / folder / "multihop" / "hotpotqa.jsonl").write_bytes(text)
    (tmp_path / "nul.txt").write_text("abc\0def")
    saved = '{"format": "nodekv-topk-index", "version": 1}'  # a header is all the refusals read
    (tmp_path / "saved.txt.bm25").write_text(saved)
    (tmp_path / "renamed.json").write_text(saved)
    other = {"format": "nodekv-topk-index", "version": 1, "model": {"name": "other.gguf", "config": "0" * 64}}
    (tmp_path / "other.txt.bm25").write_text(json.dumps({**other, "checksum": _checksum(other)}))
    smol = {**other, "model": {"name": "SmolLM2-135M-Instruct.Q4_1.gguf", "config": "0" * 64}}
    write_node_store(tmp_path / "foreign.txt.bm25.kv", {}, smol["model"])  # not the store its index was saved with
    for name, stored_kv in (("plain.txt.bm25", None), ("stored.txt.bm25", "0" * 64), ("foreign.txt.bm25", "0" * 64)):
        (tmp_path / name).write_text(json.dumps({**smol, "stored_kv": stored_kv,
                                                 "checksum": _checksum({**smol, "stored_kv": stored_kv})}))
    (tmp_path / "view.html").write_text("{}")
    os.mkfifo(tmp_path / "fifo")
    return tmp_path


EVAL = ["eval", "--method", "bm25", "--dataset", "hotpotqa", "--data-dir", "data"]
CASES = [  # argv, the one line on stderr
    (["ask", "doc.txt", ""], "error: the question is empty"),
    (["ask", "doc.txt", "  \n"], "error: the question is empty"),
    (["ask", "doc.txt", "what \udcff is"], "error: the question holds the lone surrogate U+DCFF at offset 5"),
    (["ask", "{tmp}", "q"], "error: {tmp} is a directory, not a document file"),
    (["index", "{tmp}", "--method", "pecan"], "error: {tmp} is a directory, not a document file"),
    (["graph", "{tmp}", "-o", "x.html"], "error: {tmp} is a directory, not an index file"),
    (["index-corpus", "doc.txt"], "error: doc.txt is a file, not a corpus directory"),
    (["ask", "latin.txt", "q"], "error: latin.txt is not UTF-8 text (byte 0xe9 at offset 1237); convert it, e.g. "
                                "iconv -f latin1 -t utf-8 latin.txt > latin.utf8.txt"),
    (["index", "latin.txt", "--method", "pecan"], "error: latin.txt is not UTF-8 text (byte 0xe9 at offset 1237)"),
    (["ask", "empty.txt", "q"], "error: document empty.txt is empty"),
    (["ask", "invisible.txt", "q"], "error: document invisible.txt is empty"),
    (["ask", "doc.txt", "\u200b\ufeff"], "error: the question is empty"),
    (["ask", "missing.pecan", "q"], "error: document missing.pecan does not exist"),
    (["ask", "fifo", "q"], "error: fifo is a device, a pipe or a socket, not a document file"),
    (["ask", "nul.txt", "q"], "error: document nul.txt holds NUL characters (the first at character 3)"),
    (["index", "nul.txt", "--method", "bm25"], "error: document nul.txt holds NUL characters"),
    (["ask", "--method", "full", "saved.txt.bm25", "q"],
     "error: saved.txt.bm25 is a saved bm25 index, which full cannot read; ask it with --method bm25"),
    (["ask", "--method", "pecan", "saved.txt.bm25", "q"], "error: saved.txt.bm25 is a saved bm25 index"),
    (["ask", "renamed.json", "q"], "error: renamed.json is a saved nodekv index (nodekv-topk-index), not a text file"),
    (["ask", "notes.dense", "q"], "error: notes.dense is named like a saved dense index but holds none (no nodekv "
                                  "header); to ask about it as text, name a method, e.g. --method full"),
    (["ask", "saved.txt.bm25", "q", "--option", "chunk_tokens=50", "--option", "k=2"],
     "error: saved.txt.bm25 is built already, and chunk_tokens would change how: rebuild it with `nodekv index` and "
     "--option chunk_tokens=..."),
    (["ask", "--method", "bm25", "--option", "k=2", "--option", "k=1", "doc.txt", "q"],
     "error: --option k given more than once"),
    (["ask", "--method", "pecan", "--option", "t_p=NaN", "doc.txt", "q"], "error: PECAN option t_p must be a finite number"),
    (["ask", "--method", "gor", "--option", "lr=inf", "doc.txt", "q"], "error: GoR option lr must be a finite number"),
    (["index", "doc.txt", "--method", "bm25", "-o", "doc.txt"], "error: the output doc.txt is the document itself"),
    (["index", "doc.txt", "--method", "pecan", "--export", "doc.txt"], "error: pecan cannot export its index as"),
    (["index", "doc.txt", "--method", "bm25", "-o", "doc.pecan"],
     "error: the output doc.pecan is named like a pecan index, not a bm25 one"),
    (["index", "doc.txt", "--method", "bm25", "-o", "run.jsonl"],
     "error: the output run.jsonl exists and is not a nodekv index: not overwriting it"),
    ([*EVAL, "--limit", "-3"], "error: --limit must be >= 1, got -3"),
    ([*EVAL, "--limit", "0"], "error: --limit must be >= 1, got 0"),
    ([*EVAL, "--limit", "three"], "error: argument --limit: invalid int value: 'three' (see nodekv eval --help)"),
    (["ask", "--threads", "0", "doc.txt", "q"], "error: --threads must be an int from 1 to "),
    (["index", "doc.txt", "--threads", "100000"], "error: --threads must be an int from 1 to "),  # torch crashed
    (["index", "doc.txt", "--method", "bm25", "-o", "/proc/x.bm25"], "error: the output folder /proc is not writable"),
    (["ask", "--max-new-tokens", "0", "doc.txt", "q"], "error: --max-new-tokens must be >= 1, got 0"),
    (["flops", "--model", "smollm2-135m", "--tokens", "0"], "error: --tokens must be >= 1, got 0"),
    (["flops", "--model", "smollm2-135m", "--tokens", "9000"],
     "error: --tokens 9000 is above smollm2-135m's context window of 8192 tokens"),
    (["flops", "--model", "smollm2-135m", "--tokens", "10", "--n-ctx", "8193"],
     "error: --n-ctx 8193 is above smollm2-135m's context window of 8192 tokens"),
    (["ask", "--prompt", "nope", "doc.txt", "q"], "error: argument --prompt: invalid choice: 'nope'"),
    (["ask", "--precision", "fp8", "doc.txt", "q"], "error: argument --precision: invalid choice: 'fp8'"),
    (["ask", "doc.txt", "q", "--model", "/no/such.gguf", "--kv-dtype", "float16", "--dtype", "bfloat16"],
     "error: kv_dtype 'float16' with a torch.bfloat16 model on cpu and backend 'auto'"),
    ([*EVAL, "--model", "/no/such.gguf", "--kv-dtype", "float16", "--dtype", "bfloat16"],
     "error: kv_dtype 'float16' with a torch.bfloat16 model on cpu and backend 'auto'"),
    ([*EVAL, "--model", "/no/such.gguf", "--precision", "int8", "--dtype", "bfloat16"],
     "error: precision 'int8' runs float32 models on the CPU only"),
    (["ask", "--method", "bm25", "--option", "k=three", "doc.txt", "q"], "error: bm25 option k must be int"),
    (["index", "doc.txt", "-o", "/no/such/dir/x.pecan"], "error: the output folder /no/such/dir does not exist"),
    (["index", "doc.txt", "--method", "pecan", "-o", "{tmp}"], "error: the output {tmp} is a directory, not a file"),
    (["index", "doc.txt", "--method", "pecan", "--export", "/no/such/dir/x.html"],
     "error: the output folder /no/such/dir does not exist"),
    (["graph", "doc.txt.pecan", "-o", "/no/such/dir/x.html"], "error: the output folder /no/such/dir does not exist"),
    ([*EVAL, "--out", "/no/such/dir"], "error: cannot make the output folder /no/such/dir: /no/such does not exist"),
    ([*EVAL, "--out", "doc.txt"], "error: the output folder doc.txt is a file, not a folder"),
    (["eval", "report", "run.jsonl", "--out", "/no/such/dir"], "error: cannot make the output folder /no/such/dir"),
    (["index-corpus", ".", "--out", "/no/such/dir"], "error: cannot make the output folder /no/such/dir"),
    (["calibrate", "--dataset", "hotpotqa", "--data-dir", "data", "--out", "/no/such/dir"],
     "error: cannot make the output folder /no/such/dir"),
    (["eval", "--method", "bm25", "--dataset", "nope"], "error: unknown dataset 'nope'"),
    (["eval", "--method", "bm25", "--dataset", "hotpotqa", "--data-dir", "nowhere"],
     "error: data directory nowhere does not exist"),
    ([*EVAL, "--match", "nope.jsonl"], "error: reference run nope.jsonl does not exist"),
    ([*EVAL, "--ray", "127.0.0.1:1"], "error: --ray 127.0.0.1:1: no Ray cluster answers there ("),
    (["index-corpus", "data", "--ray", "127.0.0.1:1"], "error: --ray 127.0.0.1:1: no Ray cluster answers there ("),
    ([*EVAL, "--ray", "no-port"], "error: --ray no-port: an address is HOST:PORT, auto or ray://HOST:PORT"),
    ([*EVAL, "--k", "3", "--option", "k=4"], "error: --k 3 and --option k=4 disagree: give k once"),
    ([*EVAL, "--k", "3", "--match", "run.jsonl"], "error: --match picks k itself: drop --k and --option k"),
    (["eval", "--method", "pecan", "--dataset", "hotpotqa", "--data-dir", "data", "--match", "run.jsonl"],
     "error: --match picks k for bm25 or dense, not 'pecan'"),
    (["eval", "report", "run.jsonl", "typo.jsonl"], "error: typo.jsonl does not exist"),
    (["eval", "report", "run.meta.json"], "error: run.meta.json is not a run file (a .jsonl"),
    (["eval", "report", "data/multihop/hotpotqa.jsonl"],
     "error: data/multihop/hotpotqa.jsonl does not read as a nodekv run file (KeyError: 'index_flops')"),
    ([*EVAL, "--label", "../elsewhere"], "error: the run's label '../elsewhere' must be a plain file name"),
    ([*EVAL, "--data-dir", "doc.txt"], "error: data directory doc.txt is not a directory"),
    ([*EVAL, "--data-dir", "nul"], "error: nul/multihop/hotpotqa.jsonl has no usable record (1 malformed: the "
                                   "first, 0, not UTF-8 (byte 0xe9))"),
    (["eval", "--method", "bm25", "--dataset", "hotpotqa", "--data-dir", "empty"],
     "error: empty/multihop/hotpotqa.jsonl has no usable record (0 malformed)"),
    (["calibrate", "--dataset", "hotpotqa", "--data-dir", "nowhere"], "error: data directory nowhere does not exist"),
    (["calibrate", "--dataset", "hotpotqa", "--data-dir", "data", "--objective", "f1", "--target-nodes", "5"],
     "error: --target-nodes is the 'nodes' objective's; the 'f1' objective does not use it"),
    (["calibrate", "--dataset", "hotpotqa", "--data-dir", "data", "--objective", "nodes", "--target-nodes", "nan"],
     "error: the 'nodes' objective needs a positive target number of nodes"),
    (["calibrate", "--dataset", "hotpotqa", "--data-dir", "data", "--option", "t_p=0.3"],
     "error: t_p is what a calibration chooses: drop --option t_p"),
    (["eval", "report", "run.jsonl", "--reference", "nope"], "error: no run of nope to take the TFLOPs ratio against"),
    (["eval", "report", "run.jsonl", "--limit", "5"], "error: --limit is not `eval report`'s: it reads the run files"),
    (["eval", "report", "run.jsonl", "--method", "bm25", "--option", "k=3", "--threads", "1", "--precision", "int8"],
     "error: --method, --option, --precision, --threads are not `eval report`'s"),
    (["eval", "report", "--method", "bm25", "run.jsonl", "--limit", "5"],  # flags on either side of the run files
     "error: --method, --limit are not `eval report`'s"),
    (["eval", "report", "run.jsonl", "--reference", "full", "typo.jsonl"], "error: typo.jsonl does not exist"),
    ([*EVAL, "--paired", "full"], "error: --paired is `eval report`'s, not a run's: report the run with"),
    (["eval", "rescore", "run.jsonl", "--paired", "full"], "error: --paired is not `eval rescore`'s: it reads the run"),
    (["eval", "rescore", "typo.jsonl"], "error: typo.jsonl does not exist"),
    ([*EVAL, "--workers", "3"], "error: --workers counts --ray's engine processes: give --ray too, or drop --workers"),
    (["index-corpus", "data", "--workers", "3"], "error: --workers counts --ray's engine processes"),
    (["calibrate", "--dataset", "hotpotqa", "--data-dir", "data", "--dev-start", "-1"],
     "error: --dev-start must be >= 0, got -1"),
    (["calibrate", "--dataset", "hotpotqa", "--data-dir", "data", "--dev-start", "1"],
     "error: the dev records start at index 1 (--dev-start), but hotpotqa has 1 record(s)"),
    (["calibrate", "--dataset", "hotpotqa", "--data-dir", "twice"],
     "error: twice/multihop/hotpotqa.jsonl has the record id 'q1' twice (lines 1 and 3): a run keys its answers by id"),
    ([*EVAL[:-1], "twice"], "error: twice/multihop/hotpotqa.jsonl has the record id 'q1' twice (lines 1 and 3)"),
    ([*EVAL, "--match", "run.jsonl"], "error: reference run run.jsonl has no answered records to match"),
    (["index-corpus", "data", "--method", "bm25"], "error: no usable *.txt files under data"),
    (["ask", "other.txt.bm25", "q", "--model", "smollm2-135m"],
     "error: other.txt.bm25 was built with model other.gguf (config 000000000000), not "
     "SmolLM2-135M-Instruct.Q4_1.gguf: load that model (--model) or build the index again"),
    (["ask", "plain.txt.bm25", "q", "--model", "smollm2-135m", "--option", "kv_reuse=blend"],
     "error: plain.txt.bm25 was indexed with kv_reuse=off: it has no stored KV to reuse"),
    (["ask", "stored.txt.bm25", "q", "--model", "smollm2-135m", "--option", "kv_reuse=reuse"],
     "error: stored.txt.bm25.kv is not a readable node store"),
    (["ask", "foreign.txt.bm25", "q", "--model", "smollm2-135m", "--option", "kv_reuse=blend"],
     "error: foreign.txt.bm25.kv is not the node store written with foreign.txt.bm25: build the index again"),
    (["graph", "doc.txt.pecan", "-o", "x.html", "--model", "smollm2-135m"],
     "error: doc.txt.pecan is not a pecan index file (no 'nodekv-pecan-index' header)"),
    (["ask", "doc.txt", "q", "--model", "smollm2-135m", "--max-new-tokens", "100000000"],
     "error: an answer of up to 100000000 tokens (max_new_tokens) leaves no room for a prompt in a window of"),
    (["ask", "doc.txt", "q", "--model", "smollm2-135m", "--option", "window=10"],
     "error: an answer of up to 64 tokens (max_new_tokens) leaves no room for a prompt in a window of 10 tokens"),
    (["ask", "--method", "", "doc.txt", "q"], "error: unknown method ''"),
    (["ask", "doc.txt", "q", "--method", "gor", "--option", "supervision=summary"],
     "error: GoR supervision=summary trains on other documents' summaries: it needs a fit"),
    (["index", "doc.txt", "--method", "pecan", "--option", "dynamic=false", "--option", "chunk_tokens=200"],
     "error: PECAN option dynamic does not change the index: give it to `nodekv ask` (or `nodekv eval`)"),
    (["index", "doc.txt", "--method", "jerr", "--option", "depth=2", "--option", "iterations=5"],
     "error: JERR options depth, iterations do not change the index: give them to `nodekv ask`"),
    (["index", "doc.txt", "--method", "gor", "--option", "chunk_overlap=300"],
     "error: GoR option chunk_overlap (300) must be below chunk_tokens (256)"),
    (["index", "doc.txt", "--method", "pecan", "-o", "x.html", "--export", "x.html"],
     "error: --export x.html is the same file as the index -o: it would replace it"),
    (["index", "doc.txt", "--method", "pecan", "--export", "a.html", "--export", "a.html"],
     "error: --export a.html is given twice"),
    (["graph", "view.html", "--method", "pecan", "-o", "view.html"],
     "error: --export view.html is the same file as the index: it would replace it"),
    (["flops", "--model", "missing.gguf", "--tokens", "10"], "error: model 'missing.gguf' is neither a registered name"),
]


@pytest.mark.parametrize("argv, message", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_the_cli_refuses_bad_input_in_one_line_before_any_model_work(argv, message, files, no_model, capsys):
    (files / "doc.txt.pecan").write_text("{}")
    t = time.process_time()  # this process's CPU time: work done, not how busy the machine is
    try:
        status = main([a.format(tmp=files) for a in argv])
    except SystemExit as e:  # argparse's own refusals (types, choices) exit from the parser
        status = e.code
    assert status == 2 and time.process_time() - t < 5
    err = capsys.readouterr().err
    assert err.startswith(message.format(tmp=files)) and err.count("\n") == 1, err


def test_a_reader_that_stops_reading_is_no_error():
    """`nodekv ... | head`: stdout's reader gone before the output is written ends the command quietly, with the
    shell's status for a broken pipe, not an error line."""
    cli = subprocess.Popen([sys.executable, "-m", "nodekv", "flops", "--model", "smollm2-135m", "--tokens", "10"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    cli.stdout.close()
    assert (cli.stderr.read(), cli.wait()) == (b"", 128 + signal.SIGPIPE)


def test_files_written_under_other_settings_are_refused_before_the_model_loads(files, no_model, capsys):
    """A run file resumed, or a calibration's sweeps extended, under other settings: refused by what changed, with
    the files left as they were."""
    from dataclasses import asdict

    config = asdict(get("bm25").configure())
    run, meta = files / "runs" / "bm25-hotpotqa.jsonl", files / "runs" / "bm25-hotpotqa.meta.json"
    run.parent.mkdir()
    run.write_text('{"id": "q1", "error": "ValueError: x"}\n')
    meta.write_text(json.dumps({"options": {"k": config["k"] + 1}, "config": {**config, "k": config["k"] + 1}}))
    sweeps = files / "runs" / "pecan-calibration-hotpotqa-paper.sweeps.jsonl"
    sweeps.write_text(json.dumps({"model": "other.gguf", "config": {}}) + "\n")
    written = {path: path.read_bytes() for path in (run, meta, sweeps)}
    assert main([*EVAL, "--model", "smollm2-135m"]) == 2
    assert capsys.readouterr().err == (f"error: {run.relative_to(files)} was written under other settings; resume it "
                                       "with the code and options that wrote it, or give this run another --label:\n"
                                       f"  k={config['k'] + 1} now {config['k']}\n")
    assert main(["calibrate", "--dataset", "hotpotqa", "--data-dir", "data", "--dev-start", "0", "--dev", "1",
                 "--model", "smollm2-135m"]) == 2
    assert capsys.readouterr().err.startswith(f"error: {sweeps.relative_to(files)} holds sweeps made under another "
                                              "config and model")
    assert {path: path.read_bytes() for path in written} == written
    meta.write_text(json.dumps({"options": {}, "config": config}))  # the settings this eval runs under
    run.write_text('{"id": "q1", "error": "ValueError: x"}\n{"id": "q9", "prediction": "x"}\n')
    assert main([*EVAL, "--model", "smollm2-135m"]) == 2  # q9: from another data file, or a larger --limit
    assert capsys.readouterr().err == (f"error: {run.relative_to(files)} holds answers to 1 record(s) that this run "
                                       "does not load (e.g. 'q9'): it was written from another data file or with a "
                                       "larger --limit; resume it with the data and --limit that wrote it, or give "
                                       "this run another --label\n")


@pytest.mark.parametrize("name", names())
def test_every_method_refuses_an_empty_question_before_any_prefill(name):
    method = get(name)(None)  # no engine: any model work would fail on it
    for question in ("", "  \n\t"):
        with pytest.raises(ValueError, match="^the question is empty"):
            method.answer(None, question)
    with pytest.raises(ValueError, match="^the question must be text, got NoneType"):
        method.answer(None, None)


@pytest.mark.parametrize("name", names())
@pytest.mark.parametrize("options, message", [
    ("AB", "options must be a list of strings, got the one string 'AB'"),  # not the options 'A' and 'B'
    ("", "options must be a list of strings, got the one string ''"),
    (None, "options must be a list of strings, got None"),
    (("A", 2), "options must be a list of strings, got ('A', 2)"),
    (("", ""), "options must be non-empty strings, got ['', '']"),
    (("yes", " "), "options must be non-empty strings, got ['yes', ' ']"),
    (["x", "y", "x"], "options must be distinct, got 'x' more than once"),
    ([f"o{i}" for i in range(27)], "options must be at most 26 (one per answer letter), got 27"),
    (("a", "b\udcff"), "option B holds the lone surrogate U+DCFF"),
])
def test_every_method_refuses_bad_options_before_any_prefill(name, options, message):
    method = get(name)(None)  # no engine: any model work would fail on it
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        method.answer(None, "Which?", options=options)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        method.answer(None, "Which?", options)


@pytest.mark.parametrize("name", names())
def test_every_method_refuses_a_model_name_for_an_engine_and_a_dataset_name_for_a_prompt(name):
    with pytest.raises(ValueError, match=r"^engine must be an Engine \(nodekv.load_engine\(model\) loads one\) or "
                                         "None, got str 'smollm2-135m'$"):
        get(name)("smollm2-135m")
    with pytest.raises(ValueError, match=r"^prompt must be a PromptSpec \(nodekv.methods.prompts.prompt_for\(dataset\) "
                                         "gives one\\) or None, got str 'hotpotqa'$"):
        get(name)(None, prompt="hotpotqa")


INDEX_TYPES = {"bm25": "a ChunkIndex", "closed-book": "None", "dense": "a ChunkIndex", "dice": "a DiceIndex",
               "full": "a str", "gor": "a GorIndex", "jerr": "a JerrIndex", "pecan": "a PecanIndex"}


@pytest.mark.parametrize("name", INDEX_TYPES)
def test_every_method_refuses_an_index_its_index_does_not_return_before_any_prefill(name):
    from nodekv.methods.baselines import ChunkIndex
    from nodekv.methods.retrieval import BM25Index

    method = get(name)(None)  # no engine: any model work would fail on it
    bm25 = ChunkIndex(["a chunk"], BM25Index(["a chunk"]))  # another method's index
    for index in ("the document itself", None, bm25, 0):
        if ("None" if index is None else f"a {type(index).__name__}") == INDEX_TYPES[name]:
            continue  # what this method's index returns
        with pytest.raises(ValueError, match=rf"^the index must be {INDEX_TYPES[name]} \(what the method's index or "
                                             rf"load_index returns\), got {type(index).__name__}$"):
            method.answer(index, "Who?")


def test_a_plugin_method_gets_the_same_check(registry):
    from nodekv.methods.base import Answer, Method

    class Echo(Method, name="test-echo-check"):
        def index(self, document):
            return None

        def answer(self, index, question, options=()):
            return Answer(question, [])

    assert Echo(None).answer(None, question="echo?").text == "echo?"
    with pytest.raises(ValueError, match="the question is empty"):
        Echo(None).answer(None, question=" ")


def test_a_method_whose_answer_is_no_answer_is_refused_naming_it(registry):
    from nodekv.methods.base import Method

    class Plain(Method, name="test-plain"):
        def index(self, document):
            return None

        def answer(self, index, question, options=()):
            return question  # an Answer's text alone: its .text would fail later, far from here

    with pytest.raises(ValueError, match="^test-plain's answer returned str, not Answer$"):
        Plain(None).answer(None, "q?")


def test_the_python_api_refuses_a_limit_below_one():
    from nodekv.evaluation.datasets import load_dataset

    for limit in (0, -3):
        with pytest.raises(ValueError, match=f"limit must be >= 1, got {limit}"):
            load_dataset("variable_tracking_2hop_2k", limit=limit)


@pytest.mark.parametrize("kwargs, message", [
    ({"precision": "fp8"}, "precision must be one of exact, int8, bf16, got 'fp8'"),
    ({"precision": "int8", "dtype": "bfloat16"}, "precision 'int8' runs float32 models on the CPU only"),
    ({"precision": "bf16", "dtype": "bfloat16"}, "precision 'bf16' runs float32 models on the CPU only"),
    ({"device": "gpu"}, "device must be one of auto, cpu, cuda or cuda:<index>, got 'gpu'"),
    ({"backend": "fpga"}, "backend must be one of auto, torch, cpu, triton, got 'fpga'"),
    ({"backend": "cpu", "dtype": "bfloat16"}, "the cpu backend runs float32 CPU tensors only"),
    ({"backend": "triton"}, r"the triton backend runs on CUDA, or on the CPU under Triton's interpreter"),
    ({"page_size": 0}, "page_size must be an int >= 1, got 0"),
    ({"kv_tokens": -5}, "kv_tokens must be an int >= 1, got -5"),
    ({"threads": 0}, "threads must be an int from 1 to .*, got 0"),
    ({"threads": 1.5}, "threads must be an int from 1 to .*, got 1.5"),
    ({"threads": True}, "threads must be an int from 1 to .*, got True"),
    ({"threads": 10 ** 5}, r"threads must be an int from 1 to \d+ \(4x the \d+ CPUs this process may use\), "
                           "got 100000"),
    ({"kv_tokens": True}, "kv_tokens must be an int >= 1, got True"),
])
def test_load_engine_refuses_bad_settings_before_reading_the_model(kwargs, message, monkeypatch):
    from nodekv.engine import engine

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # without it, Triton has no CPU to run on
    monkeypatch.setattr(engine, "load_checkpoint", lambda *a: pytest.fail("the model was read"))
    with pytest.raises(ValueError, match=message):
        engine.load_engine("no-such-model.gguf", **kwargs)


@pytest.mark.model
@pytest.mark.parametrize("kwargs, message", [
    ({"kv_tokens": 10 ** 15}, r"kv_tokens 1,000,000,000,000,000 in pages of page_size 64 need "
                              r"46,080,000,000,000,000,000 bytes of KV pages, more than the [\d,]+ bytes of memory on "
                              r"cpu$"),
    ({"page_size": 10 ** 9}, r"kv_tokens [\d,]+ in pages of page_size 1,000,000,000 need [\d,]+ bytes of KV pages, "
                             r"more than the [\d,]+ bytes of memory on cpu$"),
])
def test_load_engine_refuses_a_page_pool_larger_than_memory_before_converting_the_weights(kwargs, message,
                                                                                          monkeypatch):
    from nodekv.engine import engine

    monkeypatch.setattr(engine, "Llama", lambda *a: pytest.fail("the weights were converted"))
    with pytest.raises(ValueError, match=f"^{message}"):
        engine.load_engine("smollm2-135m", device="cpu", **kwargs)


def test_a_page_pool_on_a_gpu_fits_its_free_memory_in_whole_pages(monkeypatch):
    import torch

    from nodekv.engine.page_pool import default_pool_pages

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1 << 30, 8 << 30))
    config = preset("smollm2-135m")  # 23,040 bytes per bf16 position: 728 pages of 64 take 1,073,479,680 bytes
    assert default_pool_pages(config, torch.bfloat16, 64, 728 * 64 - 1, "cuda") == 728
    with pytest.raises(ValueError, match="^kv_tokens 46,593 in pages of page_size 64 need 1,074,954,240 bytes of KV "
                                         "pages, more than the 1,073,741,824 bytes of free memory on cuda$"):
        default_pool_pages(config, torch.bfloat16, 64, 728 * 64 + 1, "cuda")


@pytest.mark.parametrize("precision", ["int8", "bf16"])
def test_a_cpu_precision_on_auto_takes_the_cpu_where_a_gpu_is_seen(monkeypatch, precision):
    from nodekv.engine import engine, model

    class Loaded(Exception):
        pass

    def load(*args):
        raise Loaded

    monkeypatch.setattr(engine.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(engine, "resolve_model", load)
    monkeypatch.setattr(model, "native_bf16_matmul", lambda: True)
    with pytest.raises(Loaded):  # past every check, on the CPU
        engine.load_engine("no-such-model.gguf", precision=precision)
    with pytest.raises(ValueError, match=f"precision '{precision}' runs float32 models on the CPU only"):
        engine.load_engine("no-such-model.gguf", precision=precision, device="cuda")


def test_bf16_precision_is_refused_without_bf16_matrix_units(monkeypatch):
    """Where torch's bf16 GEMM has no hardware under it (~100x slower than fp32), precision "bf16" would be the slow
    path: refused in one line, before the model is read."""
    from nodekv.engine import engine, model

    monkeypatch.setattr(model, "native_bf16_matmul", lambda: False)
    monkeypatch.setattr(engine, "load_checkpoint", lambda *a: pytest.fail("the model was read"))
    with pytest.raises(ValueError, match=r"precision 'bf16' needs a CPU with bf16 matrix units \(AMX or AVX512-BF16\)"):
        engine.load_engine("no-such-model.gguf", precision="bf16")


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="needs Linux's /proc/cpuinfo for the CPU's flags")
def test_bf16_matrix_units_are_the_cpus_bf16_instructions():
    """native_bf16_matmul against the flags the kernel reads from the CPU: oneDNN calls bf16 supported on any AVX-512
    CPU, and emulates the products there at a third of fp32's speed (a Cascade Lake Xeon)."""
    from nodekv.engine.cpu import native_bf16_matmul

    flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split(":", 1)[1].split()
    assert native_bf16_matmul() == bool({"avx512_bf16", "amx_bf16"} & set(flags))


def test_an_empty_model_name_is_refused_by_name():
    from nodekv.engine.models import resolve_model

    with pytest.raises(ValueError, match="the model is an empty name; registered: qwen2.5-0.5b"):
        resolve_model("")


@pytest.mark.parametrize("name", names())
def test_every_method_refuses_a_document_that_is_not_text_before_any_prefill(name):
    method = get(name)(None)  # no engine: any model work would fail on it
    for document, message in ((b"bytes", "the document must be text, got bytes"), (" \n", "the document is empty"),
                              ("ab\0c", "the document holds NUL characters \\(the first at character 2\\)")):
        with pytest.raises(ValueError, match=f"^{message}"):
            method.index(document)
    with pytest.raises(ValueError, match="the document must be text, got NoneType"):
        method.index(document=None)


def test_a_json_lines_reader_never_writes_and_a_resuming_writer_cuts_only_a_torn_last_line(tmp_path):
    path, good = tmp_path / "run.jsonl", '{"id": "a", "t": "caf\u00e9"}\n{"id":"b"}\n'  # kept byte for byte
    path.write_text(good + '{"id": "c", "t')  # killed mid-line
    assert [r["id"] for r in read_json_lines(path)] == ["a", "b"] and path.read_text() == good + '{"id": "c", "t'
    assert [r["id"] for r in read_json_lines(path, cut_torn_tail=True)] == ["a", "b"] and path.read_text() == good
    for text, message in (('{"id": "a"}\nGARBAGE\n{"id": "c"}\n', "line 2, is not JSON"),
                          ('{"id": "a"}\n[1, 2]\n', "line 2, is a JSON list, not an object")):
        path.write_text(text)
        for cut in (False, True):  # nothing is dropped from the middle, by a reader or a writer
            with pytest.raises(ValueError, match=f"run.jsonl, {message}"):
                read_json_lines(path, cut_torn_tail=cut)
            assert path.read_text() == text


def test_not_utf8_names_the_file_byte_and_offset_past_the_first_read_chunk(tmp_path):
    path = tmp_path / "big.txt"
    path.write_bytes(b"a\r\n" * 30_000 + b"\xff tail")  # text mode reads in chunks: the offset is still the file's
    with pytest.raises(NotUTF8Error, match=r"big.txt is not UTF-8 text \(byte 0xff at offset 90000\)") as e:
        read_text(path)
    assert (e.value.byte, e.value.offset) == (0xFF, 90_000)
    path.write_bytes("line\r\nnext".encode())
    assert read_text(path) == path.read_text(encoding="utf-8") == "line\nnext"  # newlines as before
    path.write_bytes("\ufeffline".encode())  # a byte-order mark (Notepad's UTF-8) is not text: 3 tokens of junk
    assert read_text(path) == "line"


def _index_engine():
    return SimpleNamespace(config=preset("smollm2-135m"), path=Path("model.gguf"),
                           model_id={"name": "model.gguf", "config": "0" * 64})


def _hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("failure", ["serializer", "replace"])
def test_an_index_write_that_fails_midway_leaves_the_old_file_whole(tmp_path, monkeypatch, failure):
    path, engine = tmp_path / "doc.txt.pecan", _index_engine()
    write_index_file(path, "nodekv-test-index", 1, engine, {"words": [1, 2, 3]})
    old = path.read_bytes()

    if failure == "serializer":  # half the bytes written, then the process is interrupted
        def half_then_interrupt(self, data):
            with open(self, "wb") as f:
                f.write(data[: len(data) // 2])
            raise KeyboardInterrupt

        monkeypatch.setattr(Path, "write_bytes", half_then_interrupt)
        with pytest.raises(KeyboardInterrupt):
            write_index_file(path, "nodekv-test-index", 1, engine, {"words": list(range(10_000))})
    else:
        def full_disk(src, dst):
            assert Path(src).stat().st_size > len(old)  # the new index was written whole, under another name
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(os, "replace", full_disk)
        with pytest.raises(OSError, match="No space"):
            write_index_file(path, "nodekv-test-index", 1, engine, {"words": list(range(10_000))})
    monkeypatch.undo()
    assert path.read_bytes() == old
    assert read_index_file(path, "nodekv-test-index", 1, engine, "test index") == {"words": [1, 2, 3]}
    assert _hidden(tmp_path) == []  # the temporary file went with the failure


KILLED_WRITER = """
import sys, time
from pathlib import Path
from nodekv.paths import write_atomic

def half_then_hang(self, data):
    with open(self, "wb") as f:
        f.write(data[: len(data) // 2])
        f.flush()
    print("half written", flush=True)
    time.sleep(60)

Path.write_bytes = half_then_hang
write_atomic(sys.argv[1], "new " * 100_000)
"""


def test_a_killed_writer_leaves_the_old_file_byte_identical(tmp_path):
    path = tmp_path / "report.md"
    write_atomic(path, "old report\n")
    old = path.read_bytes()
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline() == "half written\n"
    finally:
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
    assert path.read_bytes() == old
    (left,) = _hidden(tmp_path)  # what the kill left is hidden and no *.md: globs for reports skip it
    assert left.startswith(".report.md.") and left.endswith(".tmp") and list(tmp_path.glob("*.md")) == [path]
    write_atomic(path, "next report\n")  # and does not stand in the way of the next write
    assert path.read_text() == "next report\n" and _hidden(tmp_path) == [left]  # young: perhaps another machine's
    alive = tmp_path / f".report.md.{os.getpid()}-0123abcd.tmp"
    alive.write_text("a write in progress")
    for old_file in (tmp_path / left, alive):
        os.utime(old_file, (time.time() - STALE_TEMPORARY_S - 1,) * 2)
    write_atomic(path, "third report\n")  # removes what the dead writer left an hour ago, not a live one's
    assert _hidden(tmp_path) == [alive.name]


def test_atomic_writes_keep_ordinary_permissions_and_replace_whole(tmp_path):
    path = tmp_path / "meta.json"
    write_atomic(path, json.dumps({"a": 1}))
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # as open() would make it, not mkstemp's 0600
    with atomic_path(path) as tmp:
        tmp.write_bytes(b"partial")
        assert path.read_text() == '{"a": 1}'  # the old file stays until the block ends
    assert path.read_bytes() == b"partial" and _hidden(tmp_path) == []


def test_an_atomic_write_that_cannot_start_names_the_path_asked_for(tmp_path):
    """Not the hidden temporary: a folder that is missing or takes no new file is a ValueError naming it (/proc takes
    none, whoever asks: root ignores permission bits)."""
    with pytest.raises(ValueError, match=f"^the output folder {tmp_path / 'nowhere'} does not exist$"):
        write_atomic(tmp_path / "nowhere" / "x.bm25", "index")
    with pytest.raises(ValueError, match=r"^the output folder /proc is not writable \(.+\)$"):
        write_atomic("/proc/x.bm25", "index")


def test_a_file_the_cli_cannot_write_is_one_line(monkeypatch, capsys):
    """An OSError (a full disk, a folder removed meanwhile) ends a command with one line and status 1."""
    from nodekv import commands

    def full_disk(args):
        raise OSError(28, "cannot write x.bm25: No space left on device")

    monkeypatch.setattr(commands, "flops", full_disk)
    assert main(["flops", "--model", "smollm2-135m", "--tokens", "8"]) == 1
    assert capsys.readouterr().err == "error: [Errno 28] cannot write x.bm25: No space left on device\n"
