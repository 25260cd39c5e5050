"""The HTML view of a PECAN graph, read back headless: its SVG parses as XML and shows each level's heading,
every node's whole text, and the weight of every edge it draws."""
import re
import xml.etree.ElementTree as ET

from nodekv.methods.pecan.pecan_graph import Graph
from nodekv.methods.pecan.pecan_store import to_html

SVG = "{http://www.w3.org/2000/svg}"


def test_html_view_shows_levels_texts_and_edge_weights():
    g = Graph()
    for level, text in [(1, "Ida & Tom <met> at the lighthouse."), (1, "The storm came."), (1, "Nobody slept."),
                        (2, "Ida met Tom."), (2, "A storm kept everyone awake.")]:
        g.add(level, text)
    g.edges = {3: {0: 0.9, 1: 0.1}, 4: {1: 0.48, 2: 0.49, 0: 0.03}}
    page = to_html(g)
    assert page.startswith("<!DOCTYPE html>") and page.count("<svg") == 1
    svg = ET.fromstring(re.search(r"<svg.*</svg>", page, re.S).group(0))
    texts = ["".join(t.itertext()) for t in svg.iter(SVG + "text")]
    assert "level 1: 3 chunks" in texts and "level 2: 2 information points" in texts
    node_titles = [g_.find(SVG + "title").text for g_ in svg.iter(SVG + "g")]
    assert node_titles == [n.text for n in g.nodes.values()]
    edge_titles = sorted(line.find(SVG + "title").text for line in svg.iter(SVG + "line"))
    assert edge_titles == ["e(#3 → #0) = 0.900", "e(#3 → #1) = 0.100", "e(#4 → #1) = 0.480", "e(#4 → #2) = 0.490"]
    assert {"0.90", "0.48", "0.49"} <= set(texts) and "0.10" not in texts  # weights written on strong edges
