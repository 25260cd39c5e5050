"""The report's summarisation columns, counted by hand from three crafted lines."""
import json

from nodekv.evaluation.report import summarize


def _line(rid, rouge_l, tokens, nodes):
    return {"id": rid, "document": "d", "metrics": {"rougeL": rouge_l, "rouge1": 0.0, "rouge2": 0.0},
            "generated_tokens": tokens, "trace": [{"nodes": nodes}], "nodes": [], "wall_s": 1.0, "query_flops": 0,
            "query_flops_8b": 0, "index_flops": 0, "index_flops_8b": 0}


def test_summary_lengths_budget_hits_and_response_share_by_hand(tmp_path):
    nodes = [{"node": 1, "kind": "chunk"}, {"node": 7, "kind": "response"}, {"node": 2, "kind": "chunk"}]
    lines = [_line("a", 0.2, 100, nodes), _line("b", 0.1, 300, nodes[:1]), {"id": "c", "error": "boom"}]
    run = tmp_path / "gor-qmsum.jsonl"
    run.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    (tmp_path / "gor-qmsum.meta.json").write_text(json.dumps({"method": "gor", "dataset": "qmsum",
                                                               "generation": {"max_new_tokens": 300}}))
    s = summarize(run)
    assert (s["n"], s["errors"], s["at_limit"], s["responses"], s["summary_tokens"]) == (2, 1, 1, "1/4", 200)
    assert abs(s["rougeL"] - 15.0) < 1e-9
    (tmp_path / "gor-qmsum.meta.json").unlink()  # no meta: the budget is unknown, not guessed
    assert "at_limit" not in summarize(run)
