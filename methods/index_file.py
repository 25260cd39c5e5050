"""Index files any method can use: JSON with a format name and version, the model the index was built with, and
a SHA-256 checksum over it all, so that a corrupt, foreign, outdated or other-model file is refused by name."""
from __future__ import annotations

import hashlib
import json
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Mapping

from ..engine.engine import Engine
from ..engine.models import model_file_name
from ..engine.node_store import NodeStore, NodeStoreError, StoredNode, describe_model, same_model, write_node_store
from ..paths import atomic_path, write_atomic


class IndexFileError(ValueError):
    """An index file that is corrupt, foreign, of another version, or built with another model."""


def _checksum(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def write_index_file(path: str | Path, fmt: str, version: int, engine: Engine, body: dict) -> None:
    """Write `body` (JSON-able, without the keys format, version, model and checksum) under that header, whole or
    not at all (a kill mid-write leaves the previous file)."""
    data = {"format": fmt, "version": version, "model": engine.model_id, **body}
    write_atomic(path, json.dumps({**data, "checksum": _checksum(data)}))


def read_index_file(path: str | Path, fmt: str, version: int, engine: Engine, what: str) -> dict:
    """The body of an index file written by `write_index_file` with `engine`'s model; `what` names the kind of
    file in errors (e.g. "PECAN index")."""
    data = _read_checked(Path(path), fmt, version, what)
    _check_model(Path(path), data, engine.model_id)
    return {k: v for k, v in data.items() if k not in ("format", "version", "model")}


def check_index_file(path: str | Path, fmt: str, model: str | Path, what: str, kv: bool = False) -> None:
    """Before a model loads: an IndexFileError for an index file that `read_index_file` will refuse for being
    unreadable, of another format than `fmt`, corrupt, or built with a model file of another name than the one
    `model` is or links to (a model of the same name whose config or weights differ, or another format version, is
    refused at the read); kv: a NodeStoreError for a node store beside it that `read_kv_beside` will refuse."""
    data = _read_checked(Path(path), fmt, None, what)
    _check_model(Path(path), data, {"name": model_file_name(model)})
    if kv:  # the store must hold the index's model: the index's own model is checked against the engine at the read
        _open_kv_beside(path, data["model"], data.get("stored_kv"))


def _read_checked(path: Path, fmt: str | None, version: int | None, what: str) -> dict:
    """An index file's data, its checksum checked (the key dropped), its format `fmt` and its version `version`
    (None: any)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise IndexFileError(f"{path} is not a readable {what}: {e}") from e
    if not isinstance(data, dict) or data.get("format") != fmt:
        raise IndexFileError(f"{path} is not a {what} file (no '{fmt}' header)")
    if version is not None and data.get("version") != version:
        raise IndexFileError(f"{path} has {what} format version {data.get('version')}, this nodekv reads {version}")
    checksum = data.pop("checksum", None)
    if checksum != _checksum(data):
        raise IndexFileError(f"{path} is corrupt: its checksum does not match its contents")
    return data


def _check_model(path: Path, data: dict, model: dict) -> None:
    """Refuse an index built with another model than `model` (an `Engine.model_id`, or only its name before a model
    loads): `same_model`."""
    if not same_model(data.get("model"), model):
        raise IndexFileError(f"{path} was built with model {describe_model(data.get('model'))}, not "
                             f"{describe_model(model)}: load that model (--model) or build the index again")


def saved_format(path: str | Path) -> str | None:
    """The format an index file at `path` names in its header (e.g. "nodekv-pecan-index"), or None for any other
    file: what lets a command refuse to read an index as a document, or to overwrite a file that is not one."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError:
        return None
    found = re.match(rb'\{"format": "(nodekv-[a-z0-9-]+)"', head)  # json.dumps writes the header key first
    return found.group(1).decode() if found else None


def kv_path(index_path: str | Path) -> Path:
    """Where the node store of an index file's nodes is kept: beside it, FILE.kv."""
    return Path(f"{index_path}.kv")


def write_index_files(path: str | Path, fmt: str, version: int, engine: Engine, body: dict,
                      nodes: Mapping[object, StoredNode] | None = None, kv_dtype: str = "float16",
                      sidecars: Mapping[Path, bytes] | None = None) -> None:
    """An index file (`write_index_file`) with the files beside it as one set: its nodes' KV (FILE.kv, when `nodes`
    are given; the body's "stored_kv" records the store's digest, which `read_kv_beside` checks) and `sidecars`
    (path -> bytes). All are written to temporary files first and renamed at the end, the index first, so a kill
    while writing leaves the previous set whole. A store left from an index now saved without one is removed."""
    with ExitStack() as renamed_on_exit:
        digest = None
        if nodes is not None:
            digest = write_node_store(renamed_on_exit.enter_context(atomic_path(kv_path(path))), dict(nodes),
                                      engine.model_id, kv_dtype)
        for sidecar, data in (sidecars or {}).items():
            renamed_on_exit.enter_context(atomic_path(sidecar)).write_bytes(data)
        write_index_file(path, fmt, version, engine, {**body, "stored_kv": digest})
    if nodes is None:
        kv_path(path).unlink(missing_ok=True)


def read_kv_beside(index_path: str | Path, engine: Engine, stored_kv: str | bool | None) -> NodeStore:
    """The node store beside an index file (header checked; nodes read when used), given the index's "stored_kv";
    NodeStoreError, naming the file, when the index was built without one, or the store is missing, truncated,
    foreign, of another model, or not the one written with this index (another index's, or one an interrupted
    rebuild left: its nodes would be read for passages they do not hold)."""
    return _open_kv_beside(index_path, engine.model_id, stored_kv)


def _open_kv_beside(index_path: str | Path, model: dict, stored_kv: str | bool | None) -> NodeStore:
    if not stored_kv:
        raise NodeStoreError(f"{index_path} was indexed with kv_reuse=off: it has no stored KV to reuse")
    store = NodeStore(kv_path(index_path), model)
    if store.digest != stored_kv:
        raise NodeStoreError(f"{store.path} is not the node store written with {index_path}: build the index again")
    return store
