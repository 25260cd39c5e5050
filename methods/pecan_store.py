"""PECAN index files (JSON with a format version, the model it was built with, and a SHA-256 checksum), and exports
of the graph to GraphML and to a self-contained HTML page drawing the levels and weighted edges (like Fig. A1)."""
from __future__ import annotations

import base64
import hashlib
import html
import json
from dataclasses import asdict
from pathlib import Path

import torch

from ..engine.engine import Engine
from .pecan import PecanIndex
from .pecan_graph import Graph, Node

FORMAT, VERSION = "nodekv-pecan-index", 1


class IndexFileError(ValueError):
    """A PECAN index file that is corrupt, foreign, of another version, or built with another model."""


def model_id(engine: Engine) -> dict:
    """What an index is tied to: the model file's name and a hash of its config."""
    config = json.dumps(asdict(engine.config), sort_keys=True, default=str)
    return {"name": engine.path.name if engine.path else None, "config": hashlib.sha256(config.encode()).hexdigest()}


def _checksum(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def save(index: PecanIndex, path: str | Path, engine: Engine) -> None:
    vectors = index.vectors.float().contiguous()
    body = {"format": FORMAT, "version": VERSION, "model": model_id(engine), "config": index.config,
            "log": index.log, "nodes": [[n.id, n.level, n.text] for n in index.graph.nodes.values()],
            "edges": {str(p): {str(c): w for c, w in kids.items()} for p, kids in index.graph.edges.items()},
            "vectors": {"shape": list(vectors.shape), "float32": base64.b64encode(vectors.numpy().tobytes()).decode()}}
    Path(path).write_text(json.dumps({**body, "checksum": _checksum(body)}))


def load(path: str | Path, engine: Engine) -> PecanIndex:
    """Read an index, refusing a corrupt or foreign file and one built with a different model."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise IndexFileError(f"{path} is not a readable PECAN index: {e}") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise IndexFileError(f"{path} is not a PECAN index file (no '{FORMAT}' header)")
    if data.get("version") != VERSION:
        raise IndexFileError(f"{path} has index format version {data.get('version')}, this nodekv reads {VERSION}")
    checksum = data.pop("checksum", None)
    if checksum != _checksum(data):
        raise IndexFileError(f"{path} is corrupt: its checksum does not match its contents")
    if data["model"] != model_id(engine):
        raise IndexFileError(f"{path} was built with model {data['model']['name']} (config "
                             f"{data['model']['config'][:12]}), not the loaded {model_id(engine)['name']}")
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


def to_html(graph: Graph, min_weight: float = 0.05) -> str:
    """A self-contained page: one column per level, edges drawn with width and redness by weight (edges below
    `min_weight` left out, as in Fig. A1); hovering a node shows its text."""
    levels = sorted({n.level for n in graph.nodes.values()})
    cols = {lv: [n for n in graph.nodes.values() if n.level == lv] for lv in levels}
    row_h, col_w, box_w = 46, 360, 300
    pos = {n.id: (20 + k * col_w, 20 + r * row_h) for k, lv in enumerate(levels) for r, n in enumerate(cols[lv])}
    height = 40 + row_h * max(len(c) for c in cols.values())
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{40 + col_w * len(levels)}" height="{height}" '
             'font-family="sans-serif" font-size="11">']
    for p, kids in graph.edges.items():
        for c, w in kids.items():
            if w < min_weight:
                continue
            (x1, y1), (x2, y2) = pos[c], pos[p]
            parts.append(f'<line x1="{x1 + box_w}" y1="{y1 + 15}" x2="{x2}" y2="{y2 + 15}" '
                         f'stroke="rgb({int(80 + 175 * w)},60,60)" stroke-opacity="{0.3 + 0.7 * w:.2f}" '
                         f'stroke-width="{0.5 + 5 * w:.2f}"/>')
    for n in graph.nodes.values():
        x, y = pos[n.id]
        label = html.escape(n.text[:48] + ("…" if len(n.text) > 48 else ""))
        parts.append(f'<g><title>{html.escape(n.text)}</title><rect x="{x}" y="{y}" width="{box_w}" height="30" '
                     f'rx="4" fill="#eef" stroke="#88a"/><text x="{x + 6}" y="{y + 19}">#{n.id} {label}</text></g>')
    parts.append("</svg>")
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>PECAN graph</title></head><body>"
            f"<h3>PECAN graph: {len(graph.nodes)} nodes, levels {levels[0]}-{levels[-1]} (left: chunks)</h3>"
            + "".join(parts) + "</body></html>")
