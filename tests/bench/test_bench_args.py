"""The benchmarks refuse bad arguments before any work, and a failed run leaves the results it would replace."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from nodekv.bench import engine_suite


def _main(module, monkeypatch, *argv) -> int:
    """`module.main()` as `python -m` would run it: its exit status (0 when it returns)."""
    monkeypatch.setattr(sys, "argv", [module.__name__, *argv])
    try:
        module.main()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    return 0


def _fake_children(monkeypatch, fail: str | None = None) -> None:
    """engine_suite's children, instant: each writes a small JSON where --json says; the `fail` module exits 1."""
    def run(cmd, **kwargs):
        module = cmd[2].rsplit(".", 1)[-1]
        if module == fail:
            return subprocess.CompletedProcess(cmd, 1, "", "error: it broke\n")
        if "--json" in cmd:
            open(cmd[cmd.index("--json") + 1], "w").write(json.dumps({"piece": module}))
        return subprocess.CompletedProcess(cmd, 0, "[]\n", "")
    monkeypatch.setattr(engine_suite.subprocess, "run", run)


@pytest.mark.parametrize("argv", [["--models", "smollm2"], ["--threads", "0"], ["--engines", "foo"],
                                  ["--out", "afile"], ["--out", "nodir/sub"]])
def test_engine_suite_refuses_bad_arguments_before_any_piece(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    _fake_children(monkeypatch, fail="engine_speed")  # a piece started would say "failed", not "argument"
    # an --out of its own first: without the checks, the pieces would run and write there, not into results/
    assert _main(engine_suite, monkeypatch, "--quick", "--models", "smollm2-135m", "--out", "o", *argv) == 2
    assert f"error: argument {argv[0]}" in capsys.readouterr().err


def test_engine_suite_failed_piece_keeps_the_previous_results(tmp_path, monkeypatch, capsys):
    (tmp_path / "engine.json").write_text("previous")
    (tmp_path / "node_mass.json").write_text("previous")
    _fake_children(monkeypatch, fail="node_mass")
    assert _main(engine_suite, monkeypatch, "--quick", "--models", "smollm2-135m", "--out", str(tmp_path)) == 1
    assert "node_mass failed" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine.json", "node_mass.json"]
    assert {p.read_text() for p in tmp_path.iterdir()} == {"previous"}


def test_engine_suite_quick_writes_under_build_and_says_quick(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_suite, "base", lambda: tmp_path)
    monkeypatch.setattr(engine_suite, "results_dir", lambda *parts: tmp_path.joinpath("results", *parts))
    _fake_children(monkeypatch)
    assert _main(engine_suite, monkeypatch, "--quick", "--models", "smollm2-135m") == 0
    out = tmp_path / "build" / engine_suite.QUICK_OUT
    assert json.loads((out / "engine.json").read_text())["quick"] is True
    assert json.loads((out / "batch.json").read_text()) == {"piece": "batch"}
    assert not (tmp_path / "results").exists()


def test_results_page_marks_a_quick_run_and_refuses_a_file_that_is_no_engine_json(tmp_path, monkeypatch, capsys):
    from nodekv.bench import results_page

    run = {"cpu": "c", "torch": "t", "decode_tokens": 4, "rounds": [[64, 64]], "fp32_peak_gflops": 1.0,
           "results": {"nodekv": {"prefill_s": {"64": 1.0}, "decode_s": {"64": 1.0}, "peak_rss_gib_at": {"64": 1.0}}}}
    engine = tmp_path / "engine.json"
    engine.write_text(json.dumps({"date": "d", "threads": 2, "quick": True, "speed": {"m": run}}))
    text = results_page.build(tmp_path, tmp_path / "report", engine, tmp_path / "paper.md")
    assert "they are not measurements" in text
    engine.write_text("[]")
    assert _main(results_page, monkeypatch, "--results", str(tmp_path), "--engine", str(engine)) == 2
    assert f"{engine} is not an engine.json" in capsys.readouterr().err


# the smallest run of each, so that without the check the work runs (fast) and fails only when it writes
SMALL = {"engine_speed": ["--model", "smollm2-135m", "--engines", "nodekv", "--rounds", "8:8", "--decode", "1",
                          "--repeats", "1", "--json"],
         "batch": ["--model", "smollm2-135m", "--batches", "1", "--tokens", "1", "--rounds", "1", "--prefill-prompts",
                   "1", "--precisions", "exact", "--json"],
         "node_mass": ["--tokens", "16", "--node", "16", "--hf-max", "0", "--json"],
         "paper": ["--model", "smollm2-135m", "--skip-latency", "--limit", "1", "--out"]}


@pytest.mark.parametrize("name", SMALL)
@pytest.mark.parametrize("where", ["nodir/x.json", "."])
def test_output_paths_are_checked_before_the_work(name, where, tmp_path, monkeypatch, capsys):
    import importlib

    monkeypatch.chdir(tmp_path)
    module = importlib.import_module(f"nodekv.bench.{name}")
    assert _main(module, monkeypatch, *SMALL[name], where) == 2
    err = capsys.readouterr().err
    assert ("folder nodir does not exist" if where != "." else ". is a directory") in err


def test_a_failed_child_stops_the_run_with_its_own_error_line():
    from nodekv.bench import run_child

    with pytest.raises(SystemExit) as e:
        run_child([sys.executable, "-c", "raise ValueError('--node 0 makes no nodes')"], "the nodekv forward")
    assert e.value.code == "error: the nodekv forward failed: ValueError: --node 0 makes no nodes"


def test_batch_refuses_prompts_longer_than_the_story_allows(monkeypatch, capsys):
    from nodekv.bench import batch

    monkeypatch.setattr("nodekv.engine.engine.load_engine", lambda *a, **k: pytest.fail("the model loaded"))
    assert _main(batch, monkeypatch, "--model", "smollm2-135m", "--prompt-tokens", "1000") == 2
    assert "need 8,000 tokens" in capsys.readouterr().err


def test_engine_speed_refuses_bf16_prompts_without_bf16_matrix_units(monkeypatch, capsys):
    from nodekv.bench import engine_speed

    monkeypatch.setattr("nodekv.engine.cpu.native_bf16_matmul", lambda: False)
    _fake_children(monkeypatch, fail="engine_speed")  # a child started would say "failed"
    argv = [*SMALL["engine_speed"][:-1]]
    argv[argv.index("nodekv")] = "nodekv,nodekv-bf16-prompts"
    assert _main(engine_speed, monkeypatch, *argv) == 2
    assert "nodekv-bf16-prompts needs a CPU with bf16 matrix units" in capsys.readouterr().err


@pytest.mark.parametrize("name, argv, message", [
    ("cpu_kernels", ["--threads", "0"], "argument --threads: must be at least 1, got 0"),
    ("prefill_attention", ["--seq", "8", "--reps", "0"], "argument --reps: must be at least 1, got 0"),
    ("prefill_attention", ["--seq", "8", "--heads", "12", "5", "128"],
     "--heads: 5 KV heads do not divide 12 query heads"),
    ("decode_attention", ["--seq", "8", "--rounds", "0"], "argument --rounds: must be at least 1, got 0"),
    ("decode_attention", ["--seq", "8", "--heads", "12", "5", "128"],
     "--heads: 5 KV heads do not divide 12 query heads"),
    ("decode_attention", ["--queries", "17"], "--queries: at most 16 (more take the prefill kernel)"),
    ("decode_attention", ["--model", "smollm2-135m", "--seq", "8190"],
     "a context of 8190 and 16 decoded tokens exceed the model's 8192"),
    ("gor_sampling", ["--model", "smollm2-135m", "--draws", "0"], "argument --draws: must be at least 1, got 0"),
    ("engine_speed", SMALL["engine_speed"][:-1] + ["--decode", "0"], "argument --decode: must be at least 1, got 0"),
    ("batch", ["--model", "smollm2-135m", "--precisions", "exact,fp8"],
     "argument --precisions: precision must be one of exact, int8, bf16, got 'fp8'"),
    ("answer_memory", ["--model", "nosuch"], "argument --model: model 'nosuch' is neither a registered name"),
    ("gpu_engine", ["--preset", "tiny", "--device", "cuda:99"], "argument --device: device 'cuda:99': torch"),
])
def test_bad_values_are_one_error_line_before_any_work(name, argv, message, monkeypatch, capsys):
    import importlib

    module = importlib.import_module(f"nodekv.bench.{name}")
    if name == "gpu_engine":
        monkeypatch.setattr(module, "hf_model", lambda *a, **k: pytest.fail("a model was built"))
    assert _main(module, monkeypatch, *argv) == 2
    assert message in capsys.readouterr().err


def test_engine_speed_columns_name_each_prefill_and_context_once():
    """Rounds that share a prefill size time it alike: the table has one column for it, and each cell is read from
    the round its column names."""
    from nodekv.bench.engine_speed import sizes, speeds

    rounds = ((512, 512), (512, 2048), (2048, 8192))
    result = {"prefill_s": {512: 2.0, 2048: 16.0}, "decode_s": {512: 1.0, 2048: 2.0, 8192: 4.0},
              "rss_after_load_gib": 1.5, "peak_rss_gib": 2.5}
    assert sizes(rounds) == ([512, 2048], [512, 2048, 8192])
    assert speeds(result, 8, rounds) == [256.0, 128.0, 8.0, 4.0, 2.0, 1.5, 2.5]
