"""PECAN on SmolLM2 over a tiny document: the index survives save/load with the same answer and trace, bad index
files are refused with a clear error, empty documents are refused, and the graph exports."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.model

DOC = ("The lighthouse keeper of Varn Island was Ida Brecht. Every evening she climbed the 112 steps to light the "
       "lamp. Ships from the mainland brought her coal once a month.\n\n"
       "In the winter of 1893 a storm broke the lamp's great lens. Ida Brecht kept a row of oil lamps burning in the "
       "window for nine nights until the new lens arrived from Hamburg.\n\n"
       "The harbour master, Olek Sand, wrote to the ministry to praise her. She received a silver medal in spring.")


@pytest.fixture(scope="module")
def built():
    import nodekv
    from nodekv.methods.pecan import Pecan

    eng = nodekv.load_engine()
    method = Pecan(eng, chunk_tokens=40, batch_tokens=120, summary_tokens=80, answer_tokens=24, node_budget=3)
    return eng, method, method.index(DOC)


def test_graph_has_levels_and_normalised_edges(built):
    _, _, index = built
    levels = {n.level for n in index.graph.nodes.values()}
    assert 1 in levels and max(levels) >= 2
    for parent, kids in index.graph.edges.items():
        assert index.graph.nodes[parent].level > 1
        assert sum(kids.values()) == pytest.approx(1.0, abs=1e-5)
        assert all(index.graph.nodes[c].level == index.graph.nodes[parent].level - 1 for c in kids)


def test_save_load_search_is_identical_and_bad_files_are_refused(built, tmp_path):
    from nodekv.methods.pecan_store import IndexFileError, load, save, to_graphml, to_html

    eng, method, index = built
    path = tmp_path / "doc.pecan"
    save(index, path, eng)
    again = load(path, eng)
    a, b = method.answer(index, "Who kept the lamps burning?"), method.answer(again, "Who kept the lamps burning?")
    assert (a.text, a.nodes, a.trace, a.flops) == (b.text, b.nodes, b.trace, b.flops)
    assert a.trace[-1]["stop"] in ("yes", "budget", "graph exhausted")

    data = json.loads(path.read_text())
    corrupt = tmp_path / "corrupt.pecan"
    corrupt.write_text(path.read_text().replace("Ida", "Eva", 1))
    with pytest.raises(IndexFileError, match="checksum"):
        load(corrupt, eng)
    foreign = tmp_path / "foreign.pecan"
    foreign.write_text(json.dumps({"hello": 1}))
    with pytest.raises(IndexFileError, match="not a PECAN index"):
        load(foreign, eng)
    (tmp_path / "garbage.pecan").write_bytes(b"\x00\xff")
    with pytest.raises(IndexFileError, match="not a readable"):
        load(tmp_path / "garbage.pecan", eng)
    import hashlib

    data.pop("checksum")
    data["model"]["name"] = "other.gguf"
    data["checksum"] = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
    other = tmp_path / "other.pecan"
    other.write_text(json.dumps(data))
    with pytest.raises(IndexFileError, match="built with model other.gguf"):
        load(other, eng)
    assert to_graphml(index.graph).count("<node ") == len(index.graph.nodes)
    assert "<svg" in to_html(index.graph)


def test_empty_document_is_refused(built):
    _, method, _ = built
    for doc in ("", "  \n\t "):
        with pytest.raises(ValueError, match="empty"):
            method.index(doc)
