"""`nodekv eval rescore`: a run's answers scored again by the current metrics against its dataset, no model."""
import fcntl
import json

from nodekv.cli import main


def _setup(tmp_path, lines):
    data = tmp_path / "data" / "multihop"
    data.mkdir(parents=True)
    records = [{"_id": "q1", "question": "Who built it?", "answer": "Ann Lee",
                "context": [["Mill", ["Ann built it."]]]},
               {"_id": "q2", "question": "When?", "answer": "1821", "context": [["Mill", ["In 1821."]]]}]
    (data / "hotpotqa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run = tmp_path / "full-hotpotqa.jsonl"
    run.write_text("".join(json.dumps(line) + "\n" for line in lines))
    (tmp_path / "full-hotpotqa.meta.json").write_text(json.dumps({"method": "full", "dataset": "hotpotqa"}))
    return run


def test_stale_metrics_are_rescored_and_every_other_field_kept(tmp_path, capsys):
    stale = {"id": "q1", "question": "Who built it?", "references": ["Ann Lee"], "prediction": "ann",
             "metrics": {"f1": 0.0, "em": 0.0, "rouge_l": 0.0}, "query_flops": 7, "trace": [{"node": 0}]}
    failed = {"id": "q2", "question": "When?", "references": ["1821"], "error": "RuntimeError: x"}
    run = _setup(tmp_path, [stale, failed])
    assert main(["eval", "rescore", str(run), "--data-dir", str(tmp_path / "data")]) == 0
    assert "1 line(s) rescored" in capsys.readouterr().out
    lines = [json.loads(line) for line in run.read_text().splitlines()]
    # "ann" against "ann lee": precision 1, recall 1/2, F1 2/3; ROUGE-L the same (LCS 1 of 1 and 2); no exact match
    assert lines[0]["metrics"] == {"f1": 2 / 3, "em": 0.0, "rouge_l": 2 / 3}
    assert {k: v for k, v in lines[0].items() if k != "metrics"} == {k: v for k, v in stale.items() if k != "metrics"}
    assert lines[1] == failed
    before = run.read_bytes()
    assert main(["eval", "rescore", str(run), "--data-dir", str(tmp_path / "data")]) == 0
    assert "unchanged" in capsys.readouterr().out and run.read_bytes() == before


def test_a_run_of_other_data_is_refused_before_anything_is_written(tmp_path, capsys):
    good = {"id": "q1", "question": "Who built it?", "references": ["Ann Lee"], "prediction": "x",
            "metrics": {"f1": 1.0}}
    other = {**good, "id": "q2", "question": "Who owns it?"}
    run = _setup(tmp_path, [good, other])
    first = tmp_path / "a-hotpotqa.jsonl"  # a good run named first: not rewritten either
    first.write_text(json.dumps(good) + "\n")
    (tmp_path / "a-hotpotqa.meta.json").write_text(json.dumps({"method": "a", "dataset": "hotpotqa"}))
    before = run.read_bytes(), first.read_bytes()
    assert main(["eval", "rescore", str(first), str(run), "--data-dir", str(tmp_path / "data")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {run}: record 'q2' is another question in hotpotqa")
    assert (run.read_bytes(), first.read_bytes()) == before


def test_a_run_being_written_is_refused(tmp_path, capsys):
    run = _setup(tmp_path, [{"id": "q1", "question": "Who built it?", "references": ["Ann Lee"], "prediction": "x",
                             "metrics": {"f1": 1.0}}])
    before = run.read_bytes()
    with run.open("a") as writer:  # what a running `nodekv eval` holds
        fcntl.flock(writer, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert main(["eval", "rescore", str(run), "--data-dir", str(tmp_path / "data")]) == 2
    assert "is being written by a nodekv eval" in capsys.readouterr().err and run.read_bytes() == before
