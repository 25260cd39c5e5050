"""PECAN's t_p calibration: threshold outcomes and choices on hand-made sweeps, and on SmolLM2 each sweep point
equals what a real search with that threshold does (nodes, query FLOPs, answer)."""
from __future__ import annotations

import json

import pytest

from nodekv.evaluation.pecan_calibration import Point, choose, outcome, probe_auc, table, thresholds
from conftest import bare_engine

A = [Point(2, 0.30, 100, 0.0), Point(3, 0.60, 200, 0.5), Point(4, 0.70, 300, 1.0)]
B = [Point(1, 0.55, 50, 1.0), Point(2, 0.20, 90, 0.0)]


def test_outcome_is_the_t_n_th_pass_or_the_last_step():
    assert outcome(A, 0.5) == A[1]
    assert outcome(A, 0.5, t_n=2) == A[2]
    assert outcome(A, 0.65) == A[2]
    assert outcome(A, 0.9) == A[2]  # never passes: the budget
    assert outcome(A, 0.0) == A[0]


def test_table_and_choices_by_hand():
    assert thresholds([A, B]) == [0.0, 0.25, 0.425, 0.575, 0.65, 1.0]
    rows = {r["t_p"]: r for r in table([A, B])}
    # t_p 0.425: A stops at 0.60 (3 nodes, 200 FLOPs, F1 0.5), B at 0.55 (1 node, 50, 1.0)
    assert rows[0.425] == {"t_p": 0.425, "nodes": 2.0, "f1": 75.0, "query_tflops": 125 / 1e12}
    # t_p 0.575: A at 0.60, B never passes -> its last step (2 nodes, 90, 0.0)
    assert rows[0.575] == {"t_p": 0.575, "nodes": 2.5, "f1": 25.0, "query_tflops": 145 / 1e12}
    assert rows[0.0] == rows[0.25] | {"t_p": 0.0} == {"t_p": 0.0, "nodes": 1.5, "f1": 50.0, "query_tflops": 75e-12}
    assert choose(list(rows.values()), "f1")["t_p"] == 0.425
    assert choose(list(rows.values()), "nodes", 3.0)["t_p"] == 0.65  # 0.65 and 1 both give 3 nodes: the lower
    assert choose(list(rows.values()), "f1-per-tflop")["t_p"] == 0.0  # 50 / 75: 0 and 0.25 tie, the lower
    with pytest.raises(ValueError, match="target"):
        choose(list(rows.values()), "nodes")
    with pytest.raises(ValueError, match="unknown calibration objective"):
        choose(list(rows.values()), "speed")


def test_a_stopped_calibration_resumes_from_its_logged_sweeps_and_refuses_another_model(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import nodekv.evaluation.pecan_calibration as cal
    from nodekv.evaluation.records import LoadResult, Record

    records = [Record(f"r{i}", "hotpotqa", f"document {i}", "q?", ("a",)) for i in range(3)]
    monkeypatch.setattr(cal, "load_dataset", lambda *args: LoadResult(records))
    store = SimpleNamespace(build_or_load=lambda method, document: SimpleNamespace(index=document))
    monkeypatch.setattr(cal.IndexStore, "for_method", classmethod(lambda cls, *args: store))
    swept, kill_at = [], ["r2"]

    def scripted_sweep(method, index, record):
        if record.id in kill_at:
            raise KeyboardInterrupt  # the session ends mid-calibration
        swept.append(record.id)
        return {"r0": A, "r1": B, "r2": A}[record.id]

    monkeypatch.setattr(cal, "sweep", scripted_sweep)
    engine = bare_engine(path="/models/model-a.gguf", config=SimpleNamespace(max_seq_len=4096))
    run = dict(dataset="hotpotqa", dev=(0, 3), objective="f1", progress=False)
    with pytest.raises(KeyboardInterrupt):
        cal.calibrate(engine, out=tmp_path / "stopped", **run)
    log = tmp_path / "stopped" / "pecan-calibration-hotpotqa-paper.sweeps.jsonl"
    with log.open("a") as f:
        f.write('{"id": "r2", "poi')  # killed mid-line
    kill_at.clear()
    resumed = cal.calibrate(engine, out=tmp_path / "stopped", **run)
    assert swept == ["r0", "r1", "r2"]  # r0 and r1 were read back, not swept again
    assert all(line["seconds"] >= 0 for line in cal.read_json_lines(log)[1:])  # what each sweep cost, for the record
    fresh = cal.calibrate(engine, out=tmp_path / "fresh", **run)
    assert {**resumed, "path": ""} == {**fresh, "path": ""}
    swept.clear()
    other = bare_engine(path="/models/model-b.gguf", config=SimpleNamespace(max_seq_len=4096))
    with pytest.raises(ValueError, match="another model"):
        cal.calibrate(other, out=tmp_path / "stopped", **run)
    with pytest.raises(ValueError, match="another config"):
        cal.calibrate(engine, out=tmp_path / "stopped", options={"t_n": 2}, **run)
    with pytest.raises(ValueError, match="t_p is what a calibration chooses"):
        cal.calibrate(engine, out=tmp_path / "stopped", options={"t_p": 0.3}, **run)
    assert swept == []


@pytest.mark.model
def test_sweep_points_are_what_a_search_with_that_threshold_does():
    import nodekv
    from nodekv.evaluation.datasets import Record
    from nodekv.evaluation.metrics import score
    from nodekv.methods.pecan.pecan import Pecan
    from nodekv.evaluation.pecan_calibration import sweep

    eng = nodekv.load_engine("smollm2-135m")
    method = Pecan(eng, chunk_tokens=40, batch_tokens=120, summary_tokens=80, answer_tokens=16, node_budget=3)
    doc = ("The lighthouse keeper of Varn Island was Ida Brecht. Every evening she climbed the 112 steps to light "
           "the lamp.\n\nIn the winter of 1893 a storm broke the lamp's great lens. The new lens arrived from "
           "Hamburg after nine nights.\n\nThe harbour master, Olek Sand, wrote to the ministry to praise her.")
    index = method.index(doc)
    record = Record("r", "test", doc, "Where did the new lens come from?", ("Hamburg",))
    points = sweep(method, index, record)
    assert len(points) >= 2
    for t in thresholds([points]):
        method.config.t_p = t
        answer = method.answer(index, record.question)
        expected = outcome(points, t)
        assert (len(answer.nodes), answer.flops) == (expected.nodes, expected.flops)
        assert score(record, answer.text)["f1"] == expected.quality


def test_eval_takes_t_p_from_a_calibration_that_holds_for_the_run(tmp_path):
    from nodekv.evaluation.pecan_calibration import calibration_path, with_calibration
    from nodekv.methods.pecan import Pecan

    def defaults(dataset, options, model, ids=()):
        return with_calibration(Pecan, Pecan.dataset_defaults(dataset), dataset, tmp_path, options, model, ids)

    def write(style, options, model="m.gguf", t_p=0.31):
        calibration_path(tmp_path, "hotpotqa", style).write_text(json.dumps(
            {"t_p": t_p, "options": {**options, "t_p": t_p}, "model": model, "dev_ids": ["a", "b"]}))

    t_p, source = defaults("hotpotqa", {}, "m.gguf")["t_p"]
    assert t_p == 0.5 and "App. E" in source  # no calibration yet: the paper's value
    write("restate", {"prompt_style": "restate"})
    assert defaults("hotpotqa", {}, "m.gguf")["t_p"][0] == 0.5  # made for another style
    t_p, source = defaults("hotpotqa", {"prompt_style": "restate", "attention": "false"}, "m.gguf")["t_p"]
    assert t_p == 0.31 and "calibrated on 2 dev records" in source  # ablations of the search share it
    assert "warning" not in source
    (tmp_path / "m.gguf").write_bytes(b"")
    (tmp_path / "current.gguf").symlink_to(tmp_path / "m.gguf")
    for same in (tmp_path / "m.gguf", tmp_path / "current.gguf"):  # the model file by name, a link by its target's
        assert defaults("hotpotqa", {"prompt_style": "restate"}, str(same))["t_p"][0] == 0.31
    t_p, source = defaults("hotpotqa", {"prompt_style": "restate"}, "m.gguf", ["z", "b"])["t_p"]
    assert t_p == 0.31 and source.endswith("; warning: 1 of this run's records were among them (b), so their scores "
                                           "are not held out")  # an eval over a dev record
    for run, model, why in [({"prompt_style": "restate", "batch_tokens": 1024}, "m.gguf", "batch_tokens"),
                            ({"prompt_style": "restate", "t_n": 2}, "m.gguf", "t_n"),
                            ({"prompt_style": "restate", "search_tokens": 0}, "m.gguf", "search_tokens"),
                            ({"prompt_style": "restate"}, "other.gguf", "model")]:
        t_p, source = defaults("hotpotqa", run, model)["t_p"]
        assert t_p == 0.5 and f"made for another {why}" in source
    assert defaults("qmsum", {}, "m.gguf") == {}  # no paper value, no calibration


def test_probe_auc_by_hand():
    # right steps' p(Yes): 0.60, 0.70, 0.55; wrong ones: 0.30, 0.20 -> every pair ordered: 1.0
    assert probe_auc([A, B]) == 1.0
    flipped = [[Point(1, 0.9, 1, 0.0), Point(2, 0.1, 2, 1.0)], [Point(1, 0.5, 1, 1.0), Point(2, 0.5, 2, 0.0)]]
    assert probe_auc(flipped) == (0 + 0 + 0 + 0.5) / 4  # right {0.1, 0.5} vs wrong {0.9, 0.5}
    assert probe_auc([[Point(1, 0.3, 1, 1.0)]]) is None
