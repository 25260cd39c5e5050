"""GoR's index (the graph of records, its MiniLM node and query vectors and the BERTScore rankings) and its files: an
index file (JSON, methods/index_file.py) for the graph and the configs, and a safetensors file beside it for every
tensor; the JSON holds the SHA-256 of the safetensors file, so a pair that does not belong together is refused. No
pickle anywhere. A GAT trained on the graph alone is kept in memory only (files written before 2026-11-26 also hold
one; it is not read)."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import load_file
from safetensors.torch import save as to_bytes

from ...engine.engine import Engine
from ...engine.node_store import NodeStore, StoredNode
from .gor_graph import RecordGraph
from .gor_train import GAT, TrainConfig
from ..index_file import IndexFileError, read_index_file, read_kv_beside, write_index_files

FORMAT, VERSION = "nodekv-gor-index", 1
__all__ = ["GorIndex", "IndexFileError", "load", "save", "tensors_path"]


@dataclass
class GorIndex:
    """A document's graph of records with what retrieval and training need of it.

    features [N, d]: MiniLM embeddings of graph.texts (chunks, then responses); queries [Q, d]: of the simulated
    queries; ranking [Q, N]: each query's nodes by BERTScore F1 against its source chunk, best first (Eq. 4);
    gat / trained_with: a GAT trained on this graph alone and its TrainConfig, kept in memory only (None until an
    answer without a fit needs it; retrained in well under a minute, so a saved index holds the graph and not ~11 MB
    of weights);
    stored: with kv_reuse, node j's KV as the reader places it (None without)."""

    graph: RecordGraph
    features: torch.Tensor
    queries: torch.Tensor
    ranking: torch.Tensor
    gat: GAT | None = None
    trained_with: TrainConfig | None = None
    config: dict = field(default_factory=dict)
    stored: Sequence[StoredNode] | NodeStore | None = None


def tensors_path(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".safetensors")


def save(index: GorIndex, path: str | Path, engine: Engine, kv_dtype: str = "float16") -> None:
    """Write the index file and its tensor file, and its nodes' KV beside them (FILE.kv, `kv_dtype`) where the index
    holds them."""
    tensors = {"features": index.features, "queries": index.queries, "ranking": index.ranking}
    # bytes, written as any file here is (safetensors' own writer makes the file owner-only)
    data = to_bytes({k: v.contiguous() for k, v in tensors.items()})
    g = index.graph
    body = {"config": index.config, "tensors_sha256": hashlib.sha256(data).hexdigest(),
            "graph": {"chunks": g.chunks, "queries": g.queries, "sources": g.sources, "responses": g.responses,
                      "edges": g.edges, "draws": g.draws}}
    write_index_files(path, FORMAT, VERSION, engine, body,
                      None if index.stored is None else dict(enumerate(index.stored)), kv_dtype,
                      sidecars={tensors_path(path): data})


def load(path: str | Path, engine: Engine, kv: bool = False) -> GorIndex:
    """Read an index, refusing a corrupt or foreign file, one built with another model, and a safetensors file
    that is missing or is not the one written with it; kv: open its node store too (`read_kv_beside`), refusing one
    that is missing or bad."""
    data = read_index_file(path, FORMAT, VERSION, engine, "GoR index")
    sidecar = tensors_path(path)
    if not sidecar.exists():
        raise IndexFileError(f"{path} has no tensor file {sidecar.name} beside it")
    if hashlib.sha256(sidecar.read_bytes()).hexdigest() != data["tensors_sha256"]:
        raise IndexFileError(f"{sidecar} is not the tensor file written with {path} (its SHA-256 differs)")
    tensors = load_file(str(sidecar))
    g = data["graph"]
    graph = RecordGraph(g["chunks"], g["queries"], g["sources"], g["responses"], [tuple(e) for e in g["edges"]],
                        g["draws"])
    stored = read_kv_beside(path, engine, data.get("stored_kv", False)) if kv else None
    return GorIndex(graph, tensors["features"], tensors["queries"], tensors["ranking"], config=data["config"],
                    stored=stored)
