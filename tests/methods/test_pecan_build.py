"""PECAN's level stopping (§3.1) on a hand-built case, with the summariser replaced by a stub that gives more but
much shorter points than its inputs: the hierarchy must still end in one top-level batch, measured in tokens."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def engine():
    import nodekv

    return nodekv.load_engine("smollm2-135m")


def test_more_but_shorter_points_still_end_in_one_top_batch(engine, monkeypatch):
    from nodekv.methods.pecan.pecan import Pecan
    from nodekv.methods.pecan.pecan_build import GraphBuilder

    calls = []

    def more_points_than_inputs(self, graph, batch, depth, log):
        """One IP more than the batch has inputs (the old node-count rule stopped there), each a few tokens long."""
        calls.append((depth, list(batch)))
        return [graph.add(depth, f"point {k} of node {i}").id for i in batch for k in range(2)][:len(batch) + 1]

    monkeypatch.setattr(GraphBuilder, "_summarise", more_points_than_inputs)
    sentence = "The keeper climbed the stairs of the lighthouse every evening to light the lamp. "
    config = Pecan.configure(chunk_tokens=60, batch_tokens=200, summary_tokens=16, max_levels=6)
    graph, log = GraphBuilder(engine, config).build(sentence * 40)
    levels = sorted({n.level for n in graph.nodes.values()})
    batches_per_level = {d: sum(1 for depth, _ in calls if depth == d) for d in levels[1:]}
    assert batches_per_level[2] > 1 and len(graph.nodes) > 0
    top = max(levels)
    assert batches_per_level[top] == 1, (batches_per_level, log)  # the top level is one batch's summary
    level2 = [i for i, n in graph.nodes.items() if n.level == 2]
    assert len(level2) > len([i for i, n in graph.nodes.items() if n.level == 1])  # more nodes, yet it went on
    assert "max_levels" not in " ".join(log)
