"""Exports of a method's graph: GraphML, and a self-contained HTML page that draws it in columns (PECAN's levels,
JERR's DAG depths), edges from the left node's right side to the right node's left side. A weight in [0, 1] sets an
edge's width and redness (edges below `min_weight` left out, the weight written on those of at least
`label_weight`); a label (JERR's relation attribute) is written on its edge. Hovering shows a node's whole text and an
edge's weight or label. The SVG is well-formed XML."""
from __future__ import annotations

import html
from dataclasses import dataclass


@dataclass
class GraphView:
    """What to draw: nodes as (id, column, text), edges as (source, target, weight or None, label or None), a
    heading per column, the page's title and a sentence on how to read it; `column_attr` names the column in GraphML."""

    title: str
    column_attr: str
    nodes: list[tuple[int, int, str]]
    edges: list[tuple[int, int, float | None, str | None]]
    headings: dict[int, str]
    note: str


def to_graphml(view: GraphView) -> str:
    """GraphML with node attributes `column_attr` and text, and edge attributes weight and label where they are set."""
    weighted = any(w is not None for _, _, w, _ in view.edges)
    labelled = any(lab is not None for _, _, _, lab in view.edges)
    lines = ['<?xml version="1.0" encoding="UTF-8"?>',
             '<graphml xmlns="http://graphml.graphdrawing.org/xmlns">',
             f'<key id="{view.column_attr}" for="node" attr.name="{view.column_attr}" attr.type="int"/>',
             '<key id="text" for="node" attr.name="text" attr.type="string"/>']
    lines += ['<key id="weight" for="edge" attr.name="weight" attr.type="double"/>'] * weighted
    lines += ['<key id="label" for="edge" attr.name="label" attr.type="string"/>'] * labelled
    lines.append(f'<graph id="{html.escape(view.title.lower())}" edgedefault="directed">')
    for i, column, text in view.nodes:
        lines.append(f'<node id="n{i}"><data key="{view.column_attr}">{column}</data>'
                     f'<data key="text">{html.escape(text)}</data></node>')
    for s, t, w, lab in view.edges:
        data = (f'<data key="weight">{w:.6g}</data>' if w is not None else "") + \
               (f'<data key="label">{html.escape(lab)}</data>' if lab is not None else "")
        lines.append(f'<edge source="n{s}" target="n{t}">{data}</edge>')
    return "\n".join(lines + ["</graph>", "</graphml>"])


def to_html(view: GraphView, min_weight: float = 0.05, label_weight: float = 0.25) -> str:
    """The page (see the module)."""
    columns = sorted({c for _, c, _ in view.nodes})
    members = {c: [(i, text) for i, col, text in view.nodes if col == c] for c in columns}
    row_h, col_w, box_w, top = 46, 440, 300, 44
    pos = {i: (20 + k * col_w, top + r * row_h) for k, c in enumerate(columns) for r, (i, _) in enumerate(members[c])}
    column_of = {i: c for i, c, _ in view.nodes}
    height = top + 20 + row_h * max((len(m) for m in members.values()), default=0)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{40 + col_w * len(columns)}" height="{height}" '
             'font-family="sans-serif" font-size="11">']
    for k, c in enumerate(columns):
        parts.append(f'<text x="{20 + k * col_w}" y="24" font-size="14" font-weight="bold">'
                     f'{html.escape(view.headings.get(c, str(c)))}</text>')
    for s, t, w, lab in view.edges:
        if w is not None and w < min_weight:
            continue
        left, right = (s, t) if column_of[s] < column_of[t] else (t, s)
        (x1, y1), (x2, y2) = pos[left], pos[right]
        if w is None:
            style, title = 'stroke="#668" stroke-opacity="0.6" stroke-width="1.2"', f"#{s} → #{t}: {lab}"
        else:
            style = (f'stroke="rgb({int(80 + 175 * w)},60,60)" stroke-opacity="{0.3 + 0.7 * w:.2f}" '
                     f'stroke-width="{0.5 + 5 * w:.2f}"')
            title = f"e(#{s} → #{t}) = {w:.3f}"
        parts.append(f'<line x1="{x1 + box_w}" y1="{y1 + 15}" x2="{x2}" y2="{y2 + 15}" {style}>'
                     f'<title>{html.escape(title)}</title></line>')
        written = lab if lab is not None else (f"{w:.2f}" if w is not None and w >= label_weight else None)
        if written is not None:  # near the right node, where its edges fan out
            x, y = x2 - 0.35 * (x2 - x1 - box_w), y2 + 12 - 0.35 * (y2 - y1)
            parts.append(f'<text x="{x:.0f}" y="{y:.0f}" font-size="9" fill="#a22">{html.escape(written)}</text>')
    for i, _, text in view.nodes:
        x, y = pos[i]
        label = html.escape(text[:42] + ("…" if len(text) > 42 else ""))
        parts.append(f'<g><title>{html.escape(text)}</title><rect x="{x}" y="{y}" width="{box_w}" height="30" '
                     f'rx="4" fill="#eef" stroke="#88a"/><text x="{x + 6}" y="{y + 19}">#{i} {label}</text></g>')
    parts.append("</svg>")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'/><title>{html.escape(view.title)} graph</title>"
            f"</head><body><h3>{html.escape(view.title)} graph: {len(view.nodes)} nodes, {view.column_attr}s "
            f"{columns[0] if columns else '-'}-{columns[-1] if columns else '-'}</h3>"
            f"<p>{html.escape(view.note)}</p>" + "".join(parts) + "</body></html>")
