"""PECAN's index (the graph, its nodes' embeddings and its build log), its files (index files, methods/index_file.py)
and exports of the graph to GraphML and to a self-contained HTML page drawing the levels and weighted edges (like
Fig. A1)."""
from __future__ import annotations

import base64
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch

from ...engine.engine import Engine
from ...engine.node_store import NodeStore, StoredNode
from .. import graph_view
from ..graph_view import GraphView
from ..index_file import IndexFileError, read_index_file, read_kv_beside, write_index_files
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
    stored: Mapping[int, StoredNode] | NodeStore | None = None  # with kv_reuse: each node's KV, as it is appended


def save(index: PecanIndex, path: str | Path, engine: Engine, kv_dtype: str = "float16") -> None:
    """Write an index file, and its nodes' KV beside it (FILE.kv, `kv_dtype`) where the index holds them."""
    vectors = index.vectors.float().contiguous()
    body = {"config": index.config, "log": index.log,
            "nodes": [[n.id, n.level, n.text] for n in index.graph.nodes.values()],
            "edges": {str(p): {str(c): w for c, w in kids.items()} for p, kids in index.graph.edges.items()},
            "vectors": {"shape": list(vectors.shape), "float32": base64.b64encode(vectors.numpy().tobytes()).decode()}}
    write_index_files(path, FORMAT, VERSION, engine, body, None if index.stored is None else dict(index.stored),
                      kv_dtype)


def load(path: str | Path, engine: Engine, kv: bool = False) -> PecanIndex:
    """Read an index, refusing a corrupt or foreign file and one built with a different model; kv: open its node
    store too (`read_kv_beside`), refusing one that is missing or bad."""
    data = read_index_file(path, FORMAT, VERSION, engine, "PECAN index")
    graph = Graph({i: Node(i, level, text) for i, level, text in data["nodes"]},
                  {int(p): {int(c): w for c, w in kids.items()} for p, kids in data["edges"].items()})
    raw = base64.b64decode(data["vectors"]["float32"])
    vectors = torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(data["vectors"]["shape"])
    stored = read_kv_beside(path, engine, data.get("stored_kv", False)) if kv else None
    return PecanIndex(graph, vectors, data["config"], data["log"], stored)


def view(graph: Graph) -> GraphView:
    """The graph as `graph_view` draws it: a column per level, edges from an information point to its inputs."""
    count = {}
    for n in graph.nodes.values():
        count[n.level] = count.get(n.level, 0) + 1
    headings = {lv: f"level {lv}: {k} " + ("chunk" if lv == 1 else "information point") + ("s" if k != 1 else "")
                for lv, k in count.items()}
    return GraphView("PECAN", "level", [(n.id, n.level, n.text) for n in graph.nodes.values()],
                     [(p, c, w, None) for p, kids in graph.edges.items() for c, w in kids.items()], headings,
                     "Edges run from an information point to the nodes it was generated from; width and colour grow "
                     "with the weight. Hover a node for its text, an edge for its weight.")


def to_graphml(graph: Graph) -> str:
    """GraphML with node attributes level and text, and edge attribute weight (edges point from IP to input)."""
    return graph_view.to_graphml(view(graph))


def to_html(graph: Graph, min_weight: float = 0.05, label_weight: float = 0.25) -> str:
    """A self-contained page drawing one column per level (Fig. A1's layout; `graph_view.to_html`)."""
    return graph_view.to_html(view(graph), min_weight, label_weight)
