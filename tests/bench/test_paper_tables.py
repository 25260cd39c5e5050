"""`nodekv bench paper`'s arithmetic against brute force and the paper's own tables, and a smoke run."""
from __future__ import annotations

import statistics

import pytest

from nodekv.bench import paper_tables as pt
from nodekv.engine.config import preset
from nodekv.evaluation.datasets import default_data_dir

LLAMA = preset("llama-3.1-8b")
DATA = default_data_dir()


@pytest.mark.parametrize("conv", pt.CONVENTIONS, ids=lambda c: c.name)
def test_mean_from_mean_and_spread_equals_brute_force(conv):
    lengths = [700, 1000, 1500, 2000, 3500, 9000]
    mean = statistics.mean(lengths)
    want = statistics.mean(conv.flops(LLAMA, t) for t in lengths)
    got = pt.mean_flops(conv, LLAMA, mean, statistics.pstdev(lengths) / mean)
    assert got == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("conv", pt.CONVENTIONS, ids=lambda c: c.name)
def test_implied_tokens_inverts_the_mean(conv):
    t = pt.implied_tokens(conv, LLAMA, 40.6e12, 0.2)
    assert pt.mean_flops(conv, LLAMA, t, 0.2) == pytest.approx(40.6e12, rel=1e-4)


def test_square_attention_by_hand():
    # Llama-3.1-8B: 8,030,261,248 weights with embeddings (Meta's 8.03B), 32 layers of width 4096
    assert pt.CONVENTIONS[3].flops(LLAMA, 1000) == 2 * 8_030_261_248 * 1000 + 4 * 32 * 4096 * 1000 ** 2


def test_table_a4_rows_are_construction_shared_by_the_queries_plus_search():
    for i, name in enumerate(pt.PECAN_FULL_TFLOPS):
        for queries, row in pt.PECAN_AMORTISED.items():
            assert pt.amortised(pt.PECAN_CONSTRUCTION[name], pt.PECAN_SEARCH[name], queries) == pytest.approx(
                row[i], abs=0.051)


@pytest.mark.parametrize("root", [0, 1])
def test_modelled_lengths_keep_the_mean_and_the_share_above_the_cut(root):
    lengths = pt.modelled_lengths(79_457, 0, float("inf"), 0.223, 100_000, n=20_000)[root]
    assert statistics.mean(lengths) == pytest.approx(79_457, rel=0.01)
    assert sum(t > 100_000 for t in lengths) / len(lengths) == pytest.approx(0.223, abs=0.001)


def test_impossible_length_model_is_refused():
    with pytest.raises(ValueError, match="no log-normal"):
        pt.modelled_lengths(1_000, 0, 1e9, 0.49, 100_000)  # mean far below the cut, half the mass above it


@pytest.mark.model
@pytest.mark.skipif(not DATA.is_dir(), reason=f"shared data not found at {DATA} (the tables measure prompts on it)")
def test_bench_paper_runs_and_names_the_convention(tmp_path, capsys, monkeypatch):
    from nodekv.cli import main

    monkeypatch.setattr("sys.argv", ["x"])
    assert main(["bench", "paper", "--model", "smollm2-135m", "--limit", "6", "--skip-latency",
                 "--runs", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "The paper's convention: square attention" in out
    assert "| hotpotqa | pecan-prompt_style=restate: no run |" in out and "## DICE Table 4" in out  # the default run
