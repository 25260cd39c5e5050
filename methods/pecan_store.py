"""PECAN's index (the graph, its nodes' embeddings and its build log), its files (index files, methods/index_file.py)
and exports of the graph to GraphML and to a self-contained HTML page drawing the levels and weighted edges (like
Fig. A1)."""
from __future__ import annotations

import base64
import html
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..engine.engine import Engine
from .index_file import IndexFileError, read_index_file, write_index_file
from .pecan_graph import Graph, Node

FORMAT, VERSION = "nodekv-pecan-index", 1
__all__ = ["IndexFileError", "PecanIndex", "load", "save", "to_graphml", "to_html"]


@dataclass
class PecanIndex:
    """A document's graph, its nodes' embeddings and the log of how it was built."""

    graph: Graph
    vectors: torch.Tensor                                  # [nodes, 384] all-MiniLM-L6-v2
    config: dict
    log: list[str] = field(default_factory=list)


def save(index: PecanIndex, path: str | Path, engine: Engine) -> None:
    vectors = index.vectors.float().contiguous()
    body = {"config": index.config, "log": index.log,
            "nodes": [[n.id, n.level, n.text] for n in index.graph.nodes.values()],
            "edges": {str(p): {str(c): w for c, w in kids.items()} for p, kids in index.graph.edges.items()},
            "vectors": {"shape": list(vectors.shape), "float32": base64.b64encode(vectors.numpy().tobytes()).decode()}}
    write_index_file(path, FORMAT, VERSION, engine, body)


def load(path: str | Path, engine: Engine) -> PecanIndex:
    """Read an index, refusing a corrupt or foreign file and one built with a different model."""
    data = read_index_file(path, FORMAT, VERSION, engine, "PECAN index")
    graph = Graph({i: Node(i, level, text) for i, level, text in data["nodes"]},
                  {int(p): {int(c): w for c, w in kids.items()} for p, kids in data["edges"].items()})
    raw = base64.b64decode(data["vectors"]["float32"])
    vectors = torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(data["vectors"]["shape"])
    return PecanIndex(graph, vectors, data["config"], data["log"])


def to_graphml(graph: Graph) -> str:
    """GraphML with node attributes level and text, and edge attribute weight (edges point from IP to input)."""
    lines = ['<?xml version="1.0" encoding="UTF-8"?>',
             '<graphml xmlns="http://graphml.graphdrawing.org/xmlns">',
             '<key id="level" for="node" attr.name="level" attr.type="int"/>',
             '<key id="text" for="node" attr.name="text" attr.type="string"/>',
             '<key id="weight" for="edge" attr.name="weight" attr.type="double"/>',
             '<graph id="pecan" edgedefault="directed">']
    for n in graph.nodes.values():
        lines.append(f'<node id="n{n.id}"><data key="level">{n.level}</data>'
                     f'<data key="text">{html.escape(n.text)}</data></node>')
    for p, kids in graph.edges.items():
        for c, w in kids.items():
            lines.append(f'<edge source="n{p}" target="n{c}"><data key="weight">{w:.6g}</data></edge>')
    return "\n".join(lines + ["</graph>", "</graphml>"])


def to_html(graph: Graph, min_weight: float = 0.05, label_weight: float = 0.25) -> str:
    """A self-contained page: one column per level under its heading, edges drawn with width and redness by weight
    (edges below `min_weight` left out, as in Fig. A1), the weight written on edges of at least `label_weight`;
    hovering a node shows its whole text, hovering an edge its weight. The SVG is well-formed XML."""
    levels = sorted({n.level for n in graph.nodes.values()})
    cols = {lv: [n for n in graph.nodes.values() if n.level == lv] for lv in levels}
    row_h, col_w, box_w, top = 46, 440, 300, 44
    pos = {n.id: (20 + k * col_w, top + r * row_h) for k, lv in enumerate(levels) for r, n in enumerate(cols[lv])}
    height = top + 20 + row_h * max(len(c) for c in cols.values())
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{40 + col_w * len(levels)}" height="{height}" '
             'font-family="sans-serif" font-size="11">']
    for k, lv in enumerate(levels):
        name = ("chunk" if lv == 1 else "information point") + ("s" if len(cols[lv]) != 1 else "")
        parts.append(f'<text x="{20 + k * col_w}" y="24" font-size="14" font-weight="bold">level {lv}: '
                     f'{len(cols[lv])} {name}</text>')
    for p, kids in graph.edges.items():
        for c, w in kids.items():
            if w < min_weight:
                continue
            (x1, y1), (x2, y2) = pos[c], pos[p]
            parts.append(f'<line x1="{x1 + box_w}" y1="{y1 + 15}" x2="{x2}" y2="{y2 + 15}" '
                         f'stroke="rgb({int(80 + 175 * w)},60,60)" stroke-opacity="{0.3 + 0.7 * w:.2f}" '
                         f'stroke-width="{0.5 + 5 * w:.2f}"><title>e(#{p} → #{c}) = {w:.3f}</title></line>')
            if w >= label_weight:  # near the IP's end, where its edges fan out
                x, y = x2 - 0.35 * (x2 - x1 - box_w), y2 + 12 - 0.35 * (y2 - y1)
                parts.append(f'<text x="{x:.0f}" y="{y:.0f}" font-size="9" fill="#a22">{w:.2f}</text>')
    for n in graph.nodes.values():
        x, y = pos[n.id]
        label = html.escape(n.text[:42] + ("…" if len(n.text) > 42 else ""))
        parts.append(f'<g><title>{html.escape(n.text)}</title><rect x="{x}" y="{y}" width="{box_w}" height="30" '
                     f'rx="4" fill="#eef" stroke="#88a"/><text x="{x + 6}" y="{y + 19}">#{n.id} {label}</text></g>')
    parts.append("</svg>")
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'/><title>PECAN graph</title></head><body>"
            f"<h3>PECAN graph: {len(graph.nodes)} nodes, levels {levels[0]}-{levels[-1]}</h3>"
            "<p>Edges run from an information point to the nodes it was generated from; width and colour grow "
            "with the weight. Hover a node for its text, an edge for its weight.</p>"
            + "".join(parts) + "</body></html>")
