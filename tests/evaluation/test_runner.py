"""`nodekv eval` end to end on SmolLM2 over a small hotpotqa-format directory: output fields, one index per
document, malformed records skipped and counted, resume after a kill gives the uninterrupted run's file, and
the report."""
from __future__ import annotations

import fcntl
import json

import pytest

from nodekv.cli import main as cli_main

pytestmark = pytest.mark.model

PARAS = [["Alpha", ["The Alpha river flows north.", " It is 40 km long."]],
         ["Beta", ["Beta town was founded in 1802 by Mara Quill.", " Its mayor is Tom Reed."]],
         ["Gamma", ["Gamma is a lake near Beta town."]]]


def _write_data(root):
    records = [
        {"_id": "q1", "question": "Who founded Beta town?", "answer": "Mara Quill", "context": PARAS},
        {"_id": "q2", "question": "How long is the Alpha river?", "answer": "40 km", "context": PARAS},
        {"_id": "bad", "question": "", "answer": "x", "context": PARAS},  # empty question: skipped
        {"_id": "q3", "question": "What is Gamma?", "answer": "a lake", "context": PARAS[2:] + PARAS[:1]},
    ]
    (root / "multihop").mkdir(parents=True)
    (root / "multihop" / "hotpotqa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _eval(data, out, *extra):
    return cli_main(["eval", "--method", "bm25", "--k", "2", "--dataset", "hotpotqa", "--data-dir", str(data),
                     "--out", str(out), "--model", "smollm2-135m", *extra])


def test_run_resume_and_report(tmp_path, capsys):
    data = tmp_path / "data"
    _write_data(data)
    assert _eval(data, tmp_path / "a") == 0
    full = (tmp_path / "a" / "bm25-top2-hotpotqa.jsonl").read_text().splitlines()
    rows = [json.loads(x) for x in full]
    assert [r["id"] for r in rows] == ["q1", "q2", "q3"]
    for r in rows:
        assert {"id", "question", "prediction", "references", "metrics", "nodes", "query_flops", "index_flops",
                "wall_s", "query_flops_8b"} <= set(r)
        assert r["query_flops"] > 0 and r["query_flops_8b"] > 40 * r["query_flops"]  # 8B vs 135M
        # the model ran the prompt and every generated token (each stays cached), and nothing at index time
        assert (r["query_tokens"], r["index_tokens"]) == (r["prompt_tokens"] + r["generated_tokens"], 0)
        assert set(r["metrics"]) >= {"f1", "rouge_l"}
    assert rows[0]["document"] == rows[1]["document"] != rows[2]["document"]
    meta = json.loads((tmp_path / "a" / "bm25-top2-hotpotqa.meta.json").read_text())
    assert meta["skipped"][0]["id"] == "bad"

    # a run killed after its first record, mid-way through writing the second line (its meta written first)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "bm25-top2-hotpotqa.jsonl").write_text(full[0] + "\n" + full[1][: len(full[1]) // 2])
    (tmp_path / "b" / "bm25-top2-hotpotqa.meta.json").write_text(json.dumps(meta))
    assert _eval(data, tmp_path / "b") == 0
    resumed = [json.loads(x) for x in (tmp_path / "b" / "bm25-top2-hotpotqa.jsonl").read_text().splitlines()]
    strip = lambda r: {k: v for k, v in r.items() if k not in ("wall_s", "index_s", "prompt_s")}  # noqa: E731
    assert [strip(r) for r in resumed] == [strip(r) for r in rows]

    capsys.readouterr()
    assert cli_main(["eval", "report", str(tmp_path / "a"), "--out", str(tmp_path / "rep")]) == 0
    text = capsys.readouterr().out
    assert "| hotpotqa | bm25-top2 | 3 | 0 | 1 |" in text
    assert (tmp_path / "rep" / "report.md").read_text() in text
    assert (tmp_path / "rep" / "report.png").stat().st_size > 1000  # matplotlib comes with the bench extra


def test_a_resumed_run_charges_a_shared_prefix_as_the_uninterrupted_run_did(tmp_path):
    """Full context forks the prompt up to the question for q2 from the prefix q1 paid for. A run stopped after q1
    starts a new process whose prefix cache is empty: it prefills that prefix again, but q2 is charged as it was in
    the uninterrupted run (the prefill booked as saved), so a resumed run costs what an uninterrupted one does."""
    data = tmp_path / "data"
    _write_data(data)
    argv = ["eval", "--method", "full", "--dataset", "hotpotqa", "--data-dir", str(data), "--model", "smollm2-135m"]
    assert cli_main([*argv, "--out", str(tmp_path / "a")]) == 0
    whole = [json.loads(x) for x in (tmp_path / "a" / "full-hotpotqa.jsonl").read_text().splitlines()]
    assert whole[0]["prefixes_paid"] and whole[1]["prefixes_paid"] == [] and whole[1]["query_flops_saved"] > 0
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "full-hotpotqa.jsonl").write_text(json.dumps(whole[0]) + "\n")
    (tmp_path / "b" / "full-hotpotqa.meta.json").write_text((tmp_path / "a" / "full-hotpotqa.meta.json").read_text())
    assert cli_main([*argv, "--out", str(tmp_path / "b")]) == 0
    resumed = [json.loads(x) for x in (tmp_path / "b" / "full-hotpotqa.jsonl").read_text().splitlines()]
    cost = ("query_flops", "query_flops_8b", "query_flops_saved", "query_tokens", "prefixes_paid")
    assert [[r[k] for k in cost] for r in resumed] == [[r[k] for k in cost] for r in whole]


@pytest.mark.parametrize("argv, label, options", [
    (["--method", "bm25", "--k", "3"], "bm25-top3", {"k": 3}),
    (["--method", "pecan", "--option", "attention=false"], "pecan-attention=False", {"attention": False}),
    (["--method", "pecan", "--option", "t_p=0.4", "--option", "mode=fast", "--label", "p4"], "p4",
     {"t_p": 0.4, "mode": "fast"}),
    (["--method", "bm25", "--match", "runs/pecan-hotpotqa.jsonl"], "bm25-topx-pecan", {}),  # the reference's label
    (["--method", "bm25", "--k", "3", "--max-new-tokens", "16"], "bm25-top3-max_new_tokens=16", {"k": 3}),
    (["--method", "bm25", "--match", "runs/pecan-hotpotqa.jsonl", "--max-new-tokens", "16"],
     "bm25-topx-pecan-max_new_tokens=16", {}),
    (["--method", "bm25", "--match", "runs/pecan-hotpotqa.jsonl", "--option", "chunk_tokens=200"],
     "bm25-topx-pecan-chunk_tokens=200", {"chunk_tokens": 200}),  # two chunkings matched: two files
])
def test_options_and_labels(argv, label, options):
    from nodekv.cli import build_parser
    from nodekv.commands import run_config

    cfg = run_config(build_parser().parse_args(["eval", "--dataset", "hotpotqa", *argv]))
    assert (cfg.label, cfg.options, cfg.path.name) == (label, options, f"{label}-hotpotqa.jsonl")


def test_a_run_file_has_one_writer_at_a_time(tmp_path, capsys, monkeypatch):
    import nodekv

    data, run_file = tmp_path / "data", tmp_path / "out" / "bm25-top2-hotpotqa.jsonl"
    _write_data(data)
    run_file.parent.mkdir()
    monkeypatch.setattr(nodekv, "load_engine", lambda *a, **k: pytest.fail("refused only after the model loaded"))
    with run_file.open("a") as held:  # another eval appending to it
        fcntl.flock(held, fcntl.LOCK_EX)
        assert _eval(data, tmp_path / "out") == 2
    assert "is being written by another nodekv eval" in capsys.readouterr().err
    assert run_file.read_text() == ""


def test_missing_data_dir_exits_nonzero(tmp_path, capsys):
    assert _eval(tmp_path / "nowhere", tmp_path / "out") == 2
    assert "nowhere" in capsys.readouterr().err


def test_top_x_matches_a_reference_runs_flops(tmp_path):
    import nodekv
    from nodekv.evaluation.runner import RunConfig, match_k, run

    data = tmp_path / "data"
    _write_data(data)
    eng = nodekv.load_engine("smollm2-135m")
    ref = run(eng, RunConfig("bm25", "hotpotqa", data_dir=str(data), out=str(tmp_path),
                             options={"k": 3, "chunk_tokens": 16}), progress=False)
    cfg = RunConfig("dense", "hotpotqa", data_dir=str(data), out=str(tmp_path), options={"chunk_tokens": 16},
                    match=str(ref))
    k, info = match_k(eng, cfg, ref)
    assert k == 3 and abs(info["predicted_query_flops"] / info["target_query_flops"] - 1) < 0.02
    with pytest.raises(ValueError, match="bm25 or dense"):
        match_k(eng, RunConfig("full", "hotpotqa", data_dir=str(data), match=str(ref)), ref)


def test_a_run_file_is_resumed_only_under_its_own_settings(tmp_path, capsys, monkeypatch):
    """A run file whose meta names other options or another config (a changed default) is refused before any work
    and left as it was, unless the option is newer than the file and declares the value that ran before it; a meta
    written before the config was kept is checked on what it has."""
    data = tmp_path / "data"
    _write_data(data)
    assert _eval(data, tmp_path, "--label", "run", "--limit", "1") == 0
    path, meta_path = tmp_path / "run-hotpotqa.jsonl", tmp_path / "run-hotpotqa.meta.json"
    written, meta = path.read_text(), json.loads(meta_path.read_text())
    assert meta["config"]["k"] == 2 and meta["config"]["kv_reuse"] == "off" and meta["dtype"] == "float32"
    assert meta["kv_dtype"] == "float32"

    capsys.readouterr()
    assert _eval(data, tmp_path, "--label", "run", "--k", "3") == 2  # other options under the same label
    err = capsys.readouterr().err
    assert "run-hotpotqa.jsonl was written under other settings" in err and "k=2 now 3" in err
    assert path.read_text() == written and json.loads(meta_path.read_text()) == meta
    assert _eval(data, tmp_path, "--label", "run", "--dtype", "bfloat16") == 2  # a bf16 model's answers differ
    assert "  dtype float32 now bfloat16\n" in capsys.readouterr().err
    assert _eval(data, tmp_path, "--label", "run", "--kv-dtype", "float16") == 2  # nor does a cache of halves
    assert "  kv_dtype float32 now float16\n" in capsys.readouterr().err

    meta["config"]["chunk_tokens"] = 200  # as if the default had been 200 when the file was written
    meta_path.write_text(json.dumps(meta))
    assert _eval(data, tmp_path, "--label", "run") == 2
    assert "chunk_tokens=200 now 300" in capsys.readouterr().err
    assert path.read_text() == written

    meta["config"]["chunk_tokens"] = 300
    del meta["config"]["kv_reuse"]  # as if written before kv_reuse existed
    meta_path.write_text(json.dumps(meta))
    assert _eval(data, tmp_path, "--label", "run") == 2
    assert "kv_reuse=(unset) now off" in capsys.readouterr().err
    monkeypatch.setattr("nodekv.evaluation.runner.added_options", lambda method_class: {"kv_reuse": "off"})
    assert _eval(data, tmp_path, "--label", "run", "--limit", "1") == 0  # "off" ran as the code before it did
    assert path.read_text() == written
    monkeypatch.undo()

    del meta["config"], meta["precision"], meta["dtype"]  # an older meta: checked on model and options only
    meta["model"] = "/elsewhere/" + meta["model"].rsplit("/", 1)[-1]  # the same file on another machine
    meta_path.write_text(json.dumps(meta))
    assert _eval(data, tmp_path, "--label", "run") == 0
    assert len(path.read_text().splitlines()) == 3


def test_an_answer_budget_cuts_each_greedy_answer_and_a_run_resumes_only_under_its_own(tmp_path, capsys):
    """--max-new-tokens N: each greedy answer is the one the prompt's budget gives, cut after N tokens (a prefix of
    it); the label and meta say N, a run file is resumed only under the budget that wrote it, and N < 1 is refused
    before any work."""
    from nodekv.evaluation.runner import RunConfig

    data = tmp_path / "data"
    _write_data(data)
    assert _eval(data, tmp_path, "--limit", "2") == 0
    assert _eval(data, tmp_path, "--limit", "2", "--max-new-tokens", "2") == 0
    full, cut = ([json.loads(x) for x in (tmp_path / f"{label}-hotpotqa.jsonl").read_text().splitlines()]
                 for label in ("bm25-top2", "bm25-top2-max_new_tokens=2"))
    assert any(r["generated_tokens"] > 2 for r in full)  # the budget cuts something
    for f, c in zip(full, cut, strict=True):
        assert c["generated_tokens"] == min(f["generated_tokens"], 2)
        assert f["prediction"].startswith(c["prediction"])
    meta = json.loads((tmp_path / "bm25-top2-hotpotqa.meta.json").read_text())
    assert meta["generation"]["max_new_tokens"] > 2
    assert json.loads((tmp_path / "bm25-top2-max_new_tokens=2-hotpotqa.meta.json").read_text())["generation"] == \
        {**meta["generation"], "max_new_tokens": 2}

    capsys.readouterr()
    assert _eval(data, tmp_path, "--label", "bm25-top2") == 0  # its own budget: resumed
    assert _eval(data, tmp_path, "--label", "bm25-top2", "--max-new-tokens", "2") == 2
    assert f"  max_new_tokens={meta['generation']['max_new_tokens']} now 2\n" in capsys.readouterr().err
    assert _eval(data, tmp_path, "--max-new-tokens", "0") == 2
    assert "--max-new-tokens must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        RunConfig("bm25", "hotpotqa", max_new_tokens=True)


def test_a_run_with_a_cache_of_halves_says_so_and_resumes_only_under_halves(tmp_path):
    """`eval --kv-dtype float16` answers from a KV cache of halves (its meta reads the engine's page pool) and
    resumes only under halves."""
    data = tmp_path / "data"
    _write_data(data)
    assert _eval(data, tmp_path, "--label", "half", "--limit", "1", "--kv-dtype", "float16") == 0
    meta = json.loads((tmp_path / "half-hotpotqa.meta.json").read_text())
    assert (meta["dtype"], meta["kv_dtype"]) == ("float32", "float16")
    assert _eval(data, tmp_path, "--label", "half", "--limit", "2") == 2
    assert _eval(data, tmp_path, "--label", "half", "--limit", "2", "--kv-dtype", "float16") == 0
    assert len((tmp_path / "half-hotpotqa.jsonl").read_text().splitlines()) == 2


def test_a_meta_from_before_the_cache_dtype_was_kept_held_the_models_dtype(tmp_path):
    """A run file's meta written before `kv_dtype` was kept resumes under the model's dtype only: its KV cache held
    that dtype."""
    from nodekv.evaluation.runner import check_resumable

    path = tmp_path / "run-hotpotqa.jsonl"
    path.with_suffix(".meta.json").write_text(json.dumps({"model": "m.gguf", "dtype": "float32"}))
    check_resumable(path, {"model": "m.gguf", "dtype": "float32", "kv_dtype": "float32"}, resuming=True)
    with pytest.raises(ValueError, match="\n  kv_dtype float32 now float16$"):
        check_resumable(path, {"model": "m.gguf", "dtype": "float32", "kv_dtype": "float16"}, resuming=True)


def test_a_config_from_before_an_option_was_added_reads_as_the_value_that_ran_then(tmp_path):
    """An option declared with `before` (the value that runs as the code before it did) lets a run file written
    before it existed resume under that value and no other; an option without one is refused as unset."""
    from nodekv.evaluation.runner import added_options, check_resumable
    from nodekv.methods import get

    path = tmp_path / "run-multi_news.jsonl"
    path.with_suffix(".meta.json").write_text(json.dumps({"config": {"alpha": 0.7}}))
    assert added_options(get("gor"))["recipe"] == "paper"
    assert added_options(get("pecan"))["search_tokens"] == 0  # the model's window, as before the search had its own
    check_resumable(path, {"config": {"alpha": 0.7, "recipe": "paper"}}, True, added={"recipe": "paper"})
    with pytest.raises(ValueError, match="\n  recipe=paper now public$"):
        check_resumable(path, {"config": {"alpha": 0.7, "recipe": "public"}}, True, added={"recipe": "paper"})
    with pytest.raises(ValueError, match=r"\n  recipe=\(unset\) now paper$"):
        check_resumable(path, {"config": {"alpha": 0.7, "recipe": "paper"}}, True)


def test_a_run_resumes_on_its_model_file_by_name_through_a_link_or_from_another_machine(tmp_path):
    """The model is compared by file name, a link's by its target's: a run written with /elsewhere/m.gguf resumes with
    ./m.gguf or a link to it, not with another file."""
    from nodekv.evaluation.runner import check_resumable

    path = tmp_path / "run-hotpotqa.jsonl"
    path.with_suffix(".meta.json").write_text(json.dumps({"model": "/elsewhere/m.gguf"}))
    (tmp_path / "m.gguf").write_bytes(b"")
    (tmp_path / "current.gguf").symlink_to(tmp_path / "m.gguf")
    for same in ("m.gguf", "current.gguf"):
        check_resumable(path, {"model": str(tmp_path / same)}, resuming=True)
    with pytest.raises(ValueError, match="model"):
        check_resumable(path, {"model": str(tmp_path / "other.gguf")}, resuming=True)


def test_a_run_file_without_its_meta_or_with_a_broken_one_is_not_resumed(tmp_path):
    """Answers whose settings are unknown (the meta file gone) or unreadable are not appended to."""
    from nodekv.evaluation.runner import check_resumable

    path, new = tmp_path / "run-hotpotqa.jsonl", {"model": "m.gguf", "dtype": "float32", "kv_dtype": "float32"}
    check_resumable(path, new, resuming=False)  # a new run writes its meta first
    with pytest.raises(ValueError, match=f"^{path} holds answers but run-hotpotqa.meta.json, the settings that wrote "
                                         "them, is missing: restore it, or give this run another --label$"):
        check_resumable(path, new, resuming=True)
    path.with_suffix(".meta.json").write_text('{"model": ')
    with pytest.raises(ValueError, match=f"^{path.with_suffix('.meta.json')} is not JSON \\(Expecting value"):
        check_resumable(path, new, resuming=True)


def test_top_x_refuses_a_reference_run_of_another_dataset_or_model(tmp_path):
    """Its FLOPs are another prompt's, or another model's: no k of this run matches them."""
    from nodekv.evaluation.runner import _answered

    ref = tmp_path / "pecan-hotpotqa.jsonl"
    ref.write_text(json.dumps({"id": "q1", "query_flops": 10, "prediction": "x"}) + "\n")
    assert len(_answered(ref, "musique", "/any/m.gguf")) == 1  # no meta: nothing to compare
    ref.with_suffix(".meta.json").write_text(json.dumps({"dataset": "hotpotqa", "model": "/a/m.gguf"}))
    assert len(_answered(ref, "hotpotqa", "/b/m.gguf")) == 1  # the same file on another machine
    with pytest.raises(ValueError, match="is a run on dataset hotpotqa, not musique: match a run of the same dataset"):
        _answered(ref, "musique", "/a/m.gguf")
    with pytest.raises(ValueError, match="is a run on model m.gguf, not other.gguf"):
        _answered(ref, "hotpotqa", "/a/other.gguf")


def test_a_resume_refusal_names_each_changed_setting_once(tmp_path):
    """An option is kept twice in a run's meta (as given, and in the method config): a change is named once, on a
    line of its own."""
    from nodekv.evaluation.runner import check_resumable

    path = tmp_path / "run-hotpotqa.jsonl"
    path.with_suffix(".meta.json").write_text(json.dumps(
        {"model": "/a/m.gguf", "precision": "exact", "options": {"k": 2}, "config": {"k": 2, "chunk_tokens": 200}}))
    new = {"model": "/b/m.gguf", "precision": "int8", "options": {"k": 3}, "config": {"k": 3, "chunk_tokens": 300}}
    with pytest.raises(ValueError) as refused:
        check_resumable(path, new, resuming=True)
    assert str(refused.value).splitlines() == [
        f"{path} was written under other settings; resume it with the code and options that wrote it, or give this "
        "run another --label:", "  precision exact now int8", "  k=2 now 3", "  chunk_tokens=200 now 300"]


def test_a_resumed_run_retries_its_error_lines_and_a_kill_keeps_the_retries(tmp_path, engine, saver, capsys,
                                                                             monkeypatch):
    """A record whose line is an error is answered again when the run resumes: its new line is appended at once, so
    a run killed before it ends keeps it (the report already skips the error line it answers), and the run that
    ends drops the error line (the file written whole, each id once); a run with no error lines rewrites nothing."""
    from nodekv.evaluation import report, runner

    def write_data(broken: str):
        records = [{"_id": f"q{i}", "question": "How many words?", "answer": "3",
                    "context": [["T", [f"{text} document number {i}."]]]}
                   for i, text in enumerate(["A", broken, "C"], 1)]
        (tmp_path / "data" / "multihop").mkdir(parents=True, exist_ok=True)
        (tmp_path / "data" / "multihop" / "hotpotqa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    run_file = tmp_path / "runs" / "test-saver-hotpotqa.jsonl"

    def lines():
        return [json.loads(x) for x in run_file.read_text().splitlines()]

    argv = ["eval", "--method", "test-saver", "--dataset", "hotpotqa", "--data-dir", str(tmp_path / "data"),
            "--out", str(tmp_path / "runs"), "--model", str(engine.path)]
    write_data("FAIL")
    assert cli_main(argv) == 1  # a record failed: the status says so, as the last line
    assert capsys.readouterr().out.endswith("; 1 record(s) failed (their lines say why), a rerun tries them again\n")
    first = lines()
    assert [(r["id"], "error" in r) for r in first] == [("q1", False), ("q2", True), ("q3", False)]
    assert report.summarize(run_file)["errors"] == 1
    assert cli_main(argv) == 1  # tried again, failed again: still one line for it
    assert [(r["id"], "error" in r) for r in lines()] == [("q1", False), ("q3", False), ("q2", True)]
    first = lines()
    capsys.readouterr()
    write_data("B")  # mended

    def killed(path, *args, write=runner.write_atomic):
        if path == run_file:
            raise KeyboardInterrupt
        return write(path, *args)

    with monkeypatch.context() as m:  # killed as it ends, before the error line is dropped
        m.setattr(runner, "write_atomic", killed)
        with pytest.raises(KeyboardInterrupt):
            runner.run(engine, runner.RunConfig("test-saver", "hotpotqa", data_dir=str(tmp_path / "data"),
                                                out=tmp_path / "runs"), progress=False)
    assert "retrying 1 record(s) whose lines are errors" in capsys.readouterr().err
    assert [(r["id"], "error" in r) for r in lines()] == [("q1", False), ("q3", False), ("q2", True), ("q2", False)]
    summary = report.summarize(run_file)
    assert (summary["n"], summary["errors"]) == (3, 0)
    assert cli_main(argv) == 0  # nothing left to answer; the run that ends drops the answered error line
    assert "retrying" not in capsys.readouterr().err
    retried = lines()
    assert [r["id"] for r in retried] == ["q1", "q3", "q2"] and retried[2]["prediction"] == "7"
    assert retried[:2] == first[:2]
    written = run_file.stat()
    assert cli_main(argv) == 0
    assert run_file.stat().st_ino == written.st_ino  # not rewritten
