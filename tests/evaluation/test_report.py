"""`nodekv eval report`'s search table from hand-written run files: stop reasons, how often z changed the pick,
the ranges of z and similarity, and where a defaulted setting came from."""
import json
from pathlib import Path

import pytest

from nodekv.evaluation.report import report


def _record(rid, trace):
    return {"id": rid, "question": "q", "references": ["a"], "document": "d", "prediction": "a",
            "metrics": {"f1": 1.0}, "nodes": [s["node"] for s in trace if "node" in s], "query_flops": 10 ** 12,
            "query_flops_8b": 2 * 10 ** 12, "index_flops": 0, "index_flops_8b": 0, "wall_s": 1.0, "trace": trace}


def test_search_table_counts_stops_and_picks_that_z_changed(tmp_path):
    rows = [_record("1", [{"node": 0}, {"node": 3, "z": 0.002, "sim": 0.4, "by_sim": 3}, {"stop": "yes"}]),
            _record("2", [{"node": 0}, {"node": 5, "z": 0.02, "sim": 0.1, "by_sim": 4},
                          {"node": 4, "z": 0.0, "sim": 0.3, "by_sim": 4}, {"stop": "graph exhausted"}]),
            _record("3", [{"node": 0}, {"stop": "yes"}])]
    (tmp_path / "pecan-hotpotqa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "pecan-hotpotqa.meta.json").write_text(json.dumps(
        {"method": "pecan", "dataset": "hotpotqa", "options": {"t_p": 0.42},
         "option_sources": {"t_p": "calibrated on 10 dev records"}}))
    text = report([tmp_path], tmp_path / "out")
    assert ("| hotpotqa | pecan | t_p=0.42 (calibrated on 10 dev records) | graph exhausted 1, yes 2 | 3 | 1 | "
            "0.0e+00..2.0e-02 | 0.10..0.40 |") in text


def test_a_calibration_log_beside_the_runs_is_not_read_as_a_run(tmp_path):
    """`nodekv calibrate --out DIR` logs its sweeps in DIR, where `nodekv eval --out DIR` writes the runs it
    calibrates: a report over DIR reads the runs only."""
    (tmp_path / "pecan-hotpotqa.jsonl").write_text(json.dumps(_record("1", [{"node": 0}, {"stop": "yes"}])) + "\n")
    (tmp_path / "pecan-calibration-hotpotqa-paper.sweeps.jsonl").write_text(
        json.dumps({"model": "m.gguf", "config": {"t_p": 0.5}}) + "\n" +
        json.dumps({"id": "9", "points": [{"nodes": 1, "p_yes": 0.7, "f1": 1.0}]}) + "\n")
    text = report([tmp_path], tmp_path / "out")
    assert "| hotpotqa | pecan | 1 |" in text and "calibration" not in text


def test_runs_of_one_label_are_refused_apart_and_one_file_named_twice_is_one_run(tmp_path, monkeypatch):
    """Rows, the TFLOPs reference and pairs are found by label: two runs of one label on one dataset (two models,
    say, in two folders) would print two rows no one can tell apart and pair one of them silently."""
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "full-hotpotqa.jsonl").write_text(json.dumps(_record("1", [])) + "\n")
    with pytest.raises(ValueError, match="full-hotpotqa.jsonl and .*b/full-hotpotqa.jsonl are both runs of full on "
                                         "hotpotqa"):
        report([tmp_path / "a", tmp_path / "b"], tmp_path / "out")
    monkeypatch.chdir(tmp_path)
    text = report([tmp_path / "a" / "full-hotpotqa.jsonl", Path("a/full-hotpotqa.jsonl")], tmp_path / "out")
    assert text.count("| hotpotqa | full | 1 |") == 1


def test_an_index_without_a_projected_cost_is_left_out_of_the_8b_mean(tmp_path):
    rows = [{**_record("1", []), "document": "a", "index_flops": 10 ** 12, "index_flops_8b": 2 * 10 ** 13},
            {**_record("2", []), "document": "b", "index_flops": 10 ** 12, "index_flops_8b": 0}]
    (tmp_path / "pecan-musique.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = report([tmp_path], tmp_path / "out")
    assert "| 1.0000 | 20.00 (1 of 2 docs) |" in text  # model cost over both documents, 8B over the one projected


def test_summaries_show_rouge_1_2_l_and_each_task_is_plotted_by_its_own_metric(tmp_path):
    from nodekv.evaluation.report import primary_metric

    rows = [{**_record(str(i), []), "metrics": {"rouge1": r1, "rouge2": r2, "rougeL": rl}}
            for i, (r1, r2, rl) in enumerate([(0.4, 0.1, 0.3), (0.2, 0.05, 0.1)])]
    (tmp_path / "gor-qmsum_general.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = report([tmp_path], tmp_path / "out")
    assert "| qmsum_general | gor | 2 | 0 | 0 | - | - | 30.0 | 7.5 | 20.0 | - |" in text
    assert [primary_metric(s) for s in ({"f1": 1, "em": 1, "rouge_l": 1}, {"accuracy": 1, "f1": 1},
                                        {"em": 1, "f1": 1, "recall": 1}, {"rouge1": 1, "rougeL": 1})] == \
        ["f1", "accuracy", "em", "rougeL"]


def test_index_seconds_are_per_document_and_fit_seconds_per_fold(tmp_path):
    rows = [{**_record("1", []), "document": "a", "index_s": 100.0, "fit_s": 30.0},
            {**_record("2", []), "document": "a", "index_s": 100.0, "fit_s": 30.0},
            {**_record("3", []), "document": "b", "index_s": 400.0, "fit_s": 60.0}]
    (tmp_path / "gor-qmsum_general.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = report([tmp_path], tmp_path / "out")
    assert "| 250 | 45 | 0 | - | 1.00 |" in text  # (100 + 400) / 2 documents, (30 + 60) / 2 folds; no
    # seconds to first token (the rows predate it); s/query


def test_tokens_are_per_query_and_per_document_and_absent_when_a_line_lacks_them(tmp_path):
    rows = [{**_record("1", []), "document": "a", "query_tokens": 300, "index_tokens": 5000},
            {**_record("2", []), "document": "a", "query_tokens": 500, "index_tokens": 5000},
            {**_record("3", []), "document": "b", "query_tokens": 100, "index_tokens": 2000}]
    (tmp_path / "jerr-quality.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "old-quality.jsonl").write_text(json.dumps(_record("1", [])) + "\n")
    text = report([tmp_path], tmp_path / "out")
    assert "| 2.00 | - | 300 | 0.0000 | 0.00 | 3500 |" in text  # (300+500+100)/3 queries; (5000+2000)/2 documents
    assert "| 2.00 | - | - | 0.0000 | 0.00 | - |" in text


def test_bootstrap_interval_matches_the_exact_bootstrap_distribution():
    from itertools import product
    from statistics import quantiles

    from nodekv.evaluation.report import bootstrap_difference

    a, b = [13.0, 1.0, 0.0, -9.0, 31.0], [1.0, 1.0, 3.0, 1.0, 1.0]  # differences 12, 0, -3, -10, 30
    diffs = [x - y for x, y in zip(a, b)]
    exact = quantiles([sum(s) / 5 for s in product(diffs, repeat=5)], n=40, method="inclusive")  # all 3125 draws
    mean_diff, low, high = bootstrap_difference(a, b, resamples=20000)
    assert mean_diff == pytest.approx(5.8)
    assert low == pytest.approx(exact[0], abs=0.5) and high == pytest.approx(exact[-1], abs=0.5)  # 5%/95%: 1.2, 2.4 off
    assert bootstrap_difference([5.0, 7.0], [2.0, 4.0]) == (3.0, 3.0, 3.0)  # a constant difference has no spread


def test_paired_rows_count_common_records_by_hand(tmp_path):
    scores = {"gor": {"1": 0.3, "2": 0.2, "3": 0.5, "4": 0.9}, "bm25": {"1": 0.2, "2": 0.2, "3": 0.3}}
    for method, by_id in scores.items():
        rows = [{**_record(rid, []), "metrics": {"rougeL": v, "rouge1": 0.0}} for rid, v in by_id.items()]
        (tmp_path / f"{method}-qmsum.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = report([tmp_path], tmp_path / "out", against=["bm25"])
    row = next(line for line in text.splitlines() if line.startswith("| qmsum | gor | bm25 |"))
    assert row.startswith("| qmsum | gor | bm25 | 3 | +10.0 |") and row.endswith("| 2 / 1 / 0 |")  # record 4 unpaired
    assert "| qmsum | bm25 |" not in text.split("## Paired")[1]  # no run is set against itself
    with pytest.raises(ValueError, match="no answered run of dense"):
        report([tmp_path], tmp_path / "out", against=["dense"])


def test_no_two_points_of_a_panel_share_colour_and_marker():
    from nodekv.evaluation.report import point_styles

    assert len(set(point_styles(70))) == 70  # a panel of HotpotQA rows held 14 runs; 10 and 10 repeated at the 11th


@pytest.mark.filterwarnings("ignore:No artists with labels:UserWarning")  # the stubbed scatter draws nothing
def test_a_run_keeps_its_colour_and_marker_in_every_panel(tmp_path, monkeypatch):
    """Full context is the same point style on a panel where a run sorts before it and on one where none does."""
    import matplotlib.axes
    from nodekv.evaluation.report import plot

    drawn = []
    monkeypatch.setattr(matplotlib.axes.Axes, "scatter",
                        lambda ax, x, y, color, marker, label, **kw: drawn.append((label, color, marker)))
    summaries = [{"dataset": d, "method": m, "n": 1, "query_tflops_8b": 1.0 + i, "f1": 10.0}
                 for d, runs in (("hotpotqa", ["bm25-top3", "full"]), ("musique", ["full"]))
                 for i, m in enumerate(runs)]
    assert plot(summaries, tmp_path / "plot.png")
    full = [(color, marker) for label, color, marker in drawn if label.startswith("full")]
    assert len(full) == 2 and full[0] == full[1]
    assert len({(c, m) for _, c, m in drawn}) == 2  # and bm25-top3 has a style of its own


def test_the_top_x_curve_joins_fixed_and_matched_runs_by_k_leaving_out_partial_ones(tmp_path):
    """Matched Top-X runs fix one k for the run, so they join the fixed-k runs on the curve, read from their meta:
    one run per k (the fixed-k one where both exist), in order of k, and a run with fewer records than the others
    (still in progress) left off; a retriever with a single point draws no line; a fixed-k run without a meta is
    placed by its label; runs under other options or an answer budget are points of their own."""
    from nodekv.evaluation.report import summarize, top_x_curves

    runs = {"bm25-top1": (1, 4), "bm25-top3": (3, 4), "bm25-topx-pecan": (3, 4), "bm25-topx-jerr": (7, 4),
            "bm25-topx-gor": (9, 2), "dense-topx-pecan": (5, 4), "full": (None, 4),
            "bm25-top5-chunk_tokens=200": (5, 4), "bm25-topx-pecan-max_new_tokens=16": (6, 4)}
    for label, (k, n) in runs.items():
        lines = [json.dumps(_record(f"r{i}", [])) for i in range(n)]
        (tmp_path / f"{label}-quality.jsonl").write_text("\n".join(lines) + "\n")
        if label != "bm25-top1":  # a run written before metas: a fixed-k label says its k
            meta = {"method": label, "dataset": "quality", "options": {} if k is None else {"k": k}}
            (tmp_path / f"{label}-quality.meta.json").write_text(json.dumps(meta))
    rows = [summarize(p) for p in sorted(tmp_path.glob("*.jsonl"))]
    curves = top_x_curves(rows)
    assert list(curves) == ["bm25"]
    assert [(r["method"], r["top_k"]) for r in curves["bm25"]] == [
        ("bm25-top1", ("bm25", 1)), ("bm25-top3", ("bm25", 3)), ("bm25-topx-jerr", ("bm25", 7))]


def test_a_record_answered_twice_counts_once_in_the_summary_as_in_a_pair(tmp_path):
    """Two runs appended to one file answer a record twice: its mean and its pair both take the last answer."""
    first, last = {**_record("1", []), "metrics": {"f1": 0.0}}, {**_record("1", []), "metrics": {"f1": 1.0}}
    rows = (first, _record("2", []), last)
    (tmp_path / "full-hotpotqa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = report([tmp_path], tmp_path / "out")
    assert "| hotpotqa | full | 2 | 0 | 0 | 100.0 |" in text
