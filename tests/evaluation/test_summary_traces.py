"""evaluation/summary_traces: a run's row counted by hand from three crafted lines."""
import json

from nodekv.evaluation.summary_traces import run_stats


def test_run_stats_counts_by_hand(tmp_path):
    nodes = [{"node": 1, "kind": "chunk"}, {"node": 7, "kind": "response"}, {"node": 2, "kind": "chunk"}]
    lines = [{"id": "a", "metrics": {"rougeL": 0.2}, "generated_tokens": 100, "trace": [{"nodes": nodes}]},
             {"id": "b", "metrics": {"rougeL": 0.1}, "generated_tokens": 300, "trace": [{"nodes": nodes[:1]}]},
             {"id": "c", "error": "boom"}]
    run = tmp_path / "gor-qmsum.jsonl"
    run.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    (tmp_path / "gor-qmsum.meta.json").write_text(json.dumps({"generation": {"max_new_tokens": 300}}))
    s = run_stats(run, default_limit=512)
    assert (s["records"], s["errors"], s["at_limit"], s["responses"]) == (2, 1, 1, "1/4")
    assert abs(s["rougeL"] - 15.0) < 1e-9 and s["tokens"] == 200
    (tmp_path / "gor-qmsum.meta.json").unlink()  # no meta: the default limit, which neither summary reaches
    assert run_stats(run, default_limit=512)["at_limit"] == 0
