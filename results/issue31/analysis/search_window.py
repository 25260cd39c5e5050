"""Whether §4's s = 8K would have cut PECAN's QuALITY searches, which ran to the model's window (32K) before the
`search_tokens` option: each search session's length (the first turn with the question and its options, then every node
the search appended, as the search encodes them) against the room an 8K window leaves them (`Pecan.search_prompt`).
Tokens are counted with today's prompts, whole (the run's were encoded in parts, a few tokens apart).

    python analysis/search_window.py     # from results/issue31, with qwen2.5-1.5b installed; the 5 longest, then a count
"""
import json
from pathlib import Path

import nodekv
from nodekv.evaluation.datasets import load_dataset
from nodekv.methods.pecan.pecan import Pecan
from nodekv.methods.pecan.pecan_store import load
from nodekv.methods.prompts import prompt_for

S = 8192
RUNS = Path(__file__).resolve().parent.parent / "runs"

engine = nodekv.load_engine("qwen2.5-1.5b", threads=1)
pecan = Pecan(engine, prompt=prompt_for("quality"), search_tokens=S)
records = {r.id: r for r in load_dataset("quality").records}
graphs, rows = {}, []
for line in map(json.loads, (RUNS / "pecan-quality.jsonl").read_text().splitlines()):
    record, doc = records[line["id"]], line["document"]
    if doc not in graphs:
        graphs[doc] = load(next(RUNS.glob(f"indexes/pecan-*-{doc}.idx")), engine).graph
    first, _, room = pecan.search_prompt(record.question, record.options)
    nodes = [step["node"] for step in line["trace"] if "node" in step]
    session = sum(map(len, first)) + sum(len(pecan._node_ids(graphs[doc], n)) for n in nodes)
    stop = next(step["stop"] for step in line["trace"] if "stop" in step)
    rows.append((session, room, line["id"], len(nodes), stop))
print("| record | search session, tokens | room in an 8K window | nodes | stop |\n|---|---:|---:|---:|---|")
for session, room, rid, n, stop in sorted(rows, reverse=True)[:5]:
    print(f"| {rid} | {session:,} | {room:,} | {n} | {stop} |")
print(f"\n{sum(s > room for s, room, *_ in rows)} of {len(rows)} searches would have been cut by s = {S}")
