"""`nodekv bench results_page` from hand-written results: the numbers it derives, the page a headless browser renders
with every plot loaded, and a smoke run of `nodekv bench engine_suite --quick` feeding it."""
from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess

import pytest
import torch

from nodekv.bench.results_page import build, markdown_to_html

SPEED = {"cpu": "Test CPU", "torch": "2.x", "threads": 2, "decode_tokens": 8, "rounds": [[100, 100], [400, 400]],
         "fp32_peak_gflops": 100.0,
         "results": {"nodekv": {"prefill_s": {"100": 0.5, "400": 4.0}, "decode_s": {"100": 0.25, "400": 0.5},
                                "peak_rss_gib_at": {"100": 1.0, "400": 1.5}},
                     "hf": {"prefill_s": {"100": 1.0, "400": 5.0}, "decode_s": {"100": 1.0, "400": 2.0},
                            "peak_rss_gib_at": {"100": 2.0, "400": 3.0}}}}
ENGINE = {"date": "2026-11-23", "threads": 2, "speed": {"tiny": SPEED},
          "batch": {"tokens": 10, "decode_s": {"1": 1.0, "4": 2.0}},
          "append": [{"cached": 512, "node": 300, "append_s": 0.5, "prefill_s": 2.0}],
          "node_mass": {"rows": [{"tokens": 2048, "nodekv": {"plain": 1.0, "collect": 1.1, "extra_bytes": 2 ** 20},
                                  "hf": None, "hf_attention_bytes": 3 * 2 ** 30}]}}


def _results(root):
    runs = root / "issue99" / "runs"
    runs.mkdir(parents=True)
    rows = [{"id": str(i), "question": "q", "references": ["a"], "document": "d", "prediction": "a",
             "metrics": {"f1": f, "em": f, "rouge_l": f}, "nodes": [], "query_flops": 10 ** 12,
             "query_flops_8b": 2 * 10 ** 13, "index_flops": 0, "index_flops_8b": 0, "wall_s": 3.0, "trace": []}
            for i, f in enumerate([1.0, 0.5])]
    (runs / "full-hotpotqa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    meta = {"method": "full", "dataset": "hotpotqa", "model": "/cache/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"}
    (runs / "full-hotpotqa.meta.json").write_text(json.dumps(meta))
    (root / "engine").mkdir()
    (root / "engine" / "engine.json").write_text(json.dumps(ENGINE))
    (root / "paper.md").write_text("## PECAN Table 1\n\n| a | b |\n|---|---|\n| 1 | 2 |\n")


def test_report_derives_the_numbers(tmp_path):
    _results(tmp_path)
    text = build(tmp_path, tmp_path / "report", tmp_path / "engine" / "engine.json", tmp_path / "paper.md")
    assert "| hotpotqa | full (issue99, qwen2.5-1.5b) | 2 | f1 | 75.0 | 1.000 | 20.00 | 0.0 | 3.0 |" in text
    assert "| tiny | nodekv | 400 | 100.0 | 16.0 | 1.50 |" in text  # 400 / 4.0 s prefill, 8 / 0.5 s decode
    assert "| 4 | 20.0 | 2.00x |" in text  # 4 sessions x 10 tokens in 2 s against 10 tokens in 1 s
    assert "| 2,048 | 10.0% | 1.0 | not run | needs 3,072 |" in text
    assert "Measured on Test CPU, 2 threads, torch 2.x, 2026-11-23." in text and "### PECAN Table 1" in text
    assert {p.name for p in (tmp_path / "report").glob("*.png")} == {"quality.png", "speed.png", "memory.png"}


def test_markdown_to_html_tables_headings_lists():
    out = markdown_to_html("## T & U\n\n| a | **b** |\n|---|---|\n| `1` | 2 |\n\n- x\n- y\n\n![p](p.png)")
    assert out == ("<h2>T &amp; U</h2>\n<table><thead><tr><th>a</th><th><b>b</b></th></tr></thead><tbody><tr>"
                   "<td><code>1</code></td><td>2</td></tr></tbody></table>\n<ul><li>x</li><li>y</li></ul>\n"
                   '<p><img alt="p" src="p.png"></p>')


def _png_size(path):
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_page_renders_in_a_headless_browser_with_every_plot(tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        pytest.skip("no headless Chromium here (Debian: apt-get install chromium)")
    _results(tmp_path)
    out = tmp_path / "report"
    build(tmp_path, out, tmp_path / "engine" / "engine.json", tmp_path / "paper.md")
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000"]
    page = (out / "index.html").as_uri()
    dom = subprocess.run([*flags, "--dump-dom", page], capture_output=True, text=True, timeout=120).stdout
    loaded = dict(re.findall(r'<img alt="[^"]*" src="([^"]+)" data-loaded="(\d+x\d+)"', dom))
    assert set(loaded) == {"quality.png", "speed.png", "memory.png"}
    assert all(int(size.split("x")[0]) > 100 for size in loaded.values()), loaded  # decoded, not broken images
    subprocess.run([*flags, f"--screenshot={tmp_path / 'shot.png'}", "--window-size=1200,2000", page],
                   capture_output=True, timeout=120)
    assert _png_size(tmp_path / "shot.png") == (1200, 2000)


@pytest.mark.model
def test_engine_bench_quick_run_feeds_the_report(tmp_path, monkeypatch):
    from nodekv.cli import main

    monkeypatch.setattr("sys.argv", ["x"])
    # its children take this worker's share of the cores (conftest), not 2 threads each beside the other workers
    assert main(["bench", "engine_suite", "--quick", "--models", "smollm2-135m", "--engines", "nodekv",
                 "--threads", str(torch.get_num_threads()), "--out", str(tmp_path / "engine")]) == 0
    engine = json.loads((tmp_path / "engine" / "engine.json").read_text())
    assert set(engine["speed"]["smollm2-135m"]["results"]) == {"nodekv"}
    assert [r["cached"] for r in engine["append"]] == [64, 128] and engine["batch"] and engine["node_mass"]
    text = build(tmp_path, tmp_path / "report", tmp_path / "engine" / "engine.json", tmp_path / "paper.md")
    assert "| smollm2-135m | nodekv | 128 |" in text
