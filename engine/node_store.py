"""Nodes prefilled once and placed at any position: a node's keys and values computed from an empty cache, kept with
the keys un-rotated, and written into a session's cache at its current position with the engine's own RoPE.

Prefix caching reuses KV only where the reused text is the prompt's prefix. A retrieved node arrives at a different
offset for every question; RoPE makes its keys depend on that offset, and only there: a key at position p is R(p) k
for the un-rotated k that the layer computed. So a stored node keeps k (and v, which has no position), and placing it
at p rotates k by the same tables a prefill at p uses. What placing cannot reproduce is context: the stored node's
tokens attended to nothing before it, where a prefill at p would have attended to everything cached there; the
tokens whose keys deviate most can be recomputed with that context (`Session.key_deviation`, `Session.repair`:
CacheBlend's repair).

`Engine.store_node` prefills the node at positions 0..n-1 and reads its keys back from the cache, un-rotated in
float64 (exact up to the fp32 tables' own rounding: cos² + sin² = 1 within ~1e-7); `Engine.place_stored` and
`Session.append_stored` put it anywhere.
"""
from __future__ import annotations

import hashlib
import json
import mmap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..paths import atomic_path


@dataclass(frozen=True, eq=False)
class StoredNode:
    """A node's tokens, its un-rotated keys and its values, from a prefill with no context before it."""

    tokens: tuple[int, ...]
    k: torch.Tensor  # [layers, tokens, kv_heads, head_dim], before RoPE
    v: torch.Tensor  # [layers, tokens, kv_heads, head_dim]
    model: dict | None = None  # the `Engine.model_id` that computed it, which `Engine.place_stored` checks

    def __len__(self) -> int:
        return len(self.tokens)


def same_model(recorded, loaded: dict) -> bool:
    """Whether a model identity recorded with stored KV or an index (`Engine.model_id`: a name, a config hash and a
    weight fingerprint) names the loaded one, `loaded` (all of those, or only some: a check before the model loads):
    it names a model and config, and every key both hold is equal. One recorded before weight fingerprints were (no
    "weights") is checked by name and config."""
    return isinstance(recorded, dict) and {"name", "config"} <= recorded.keys() \
        and all(recorded[k] == loaded[k] for k in recorded.keys() & loaded.keys())


def describe_model(model) -> str:
    """A model identity for an error message: its name, and short hashes of its config and weights."""
    if not isinstance(model, dict):
        return repr(model)
    hashes = [f"{key} {str(model[key])[:12]}" for key in ("config", "weights") if model.get(key)]
    return str(model.get("name")) + (f" ({', '.join(hashes)})" if hashes else "")


def check_fits(node: StoredNode, config) -> None:
    """ValueError unless `node` holds at least one token, every token id is in `config`'s vocabulary and its keys
    and values have that model's attention shape."""
    if len(node) == 0:
        raise ValueError("a stored node must hold at least one token")
    bad = next((t for t in node.tokens if not (isinstance(t, int) and 0 <= t < config.vocab_size)), None)
    if bad is not None:
        raise ValueError(f"stored node token id {bad!r} is not in the vocabulary [0, {config.vocab_size})")
    want = (config.n_layers, len(node), config.n_kv_heads, config.head_dim)
    if tuple(node.k.shape) != want or tuple(node.v.shape) != want:
        raise ValueError(f"stored node of K {list(node.k.shape)} and V {list(node.v.shape)} does not fit this model: "
                         f"it needs [layers, tokens, kv_heads, head_dim] = {list(want)}")


def unrotate(k: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Keys [layers, n, kv_heads, hd] as rope left them at the positions of cos, sin_signed [n, hd], turned back, in
    float64: rope's x cos + roll(x) sin_signed inverted as y cos - roll(y) sin_signed."""
    k, cos, sin_signed = k.double(), cos.double()[:, None, :], sin_signed.double()[:, None, :]
    return k * cos - k.roll(k.shape[-1] // 2, -1) * sin_signed


# ---------------------------------------------------------------- the store file

STORE_FORMAT, STORE_VERSION = "nodekv-node-store", 1
STORE_DTYPES = ("float32", "float16", "int8")  # int8: symmetric, one fp32 scale per (layer, token, head) vector
_MAGIC = b"NODEKVKV"


class NodeStoreError(ValueError):
    """A node store file that is truncated, corrupt, foreign, of another version or of another model."""


def _check_dtype(dtype: str) -> None:
    if dtype not in STORE_DTYPES:
        raise ValueError(f"store dtype must be one of {', '.join(STORE_DTYPES)}, got {dtype!r}")


def _encode(t: torch.Tensor, dtype: str) -> tuple[bytes, bytes]:
    """(values, scales) bytes of fp32 `t` [..., hd] in `dtype`; int8 keeps a scale per vector: d = max|x| / 127, so
    each value moves by at most d / 2."""
    t = t.float().contiguous()
    if dtype == "float32":
        return t.numpy().tobytes(), b""
    if dtype == "float16":
        return t.half().numpy().tobytes(), b""
    d = t.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, t / torch.where(d > 0, d, 1), 0).round().clamp(-127, 127).to(torch.int8)
    return q.numpy().tobytes(), d.numpy().tobytes()


def _decode(values: memoryview, scales: memoryview, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    # numpy reads the (read-only) bytes in place and `astype` writes the fp32 copy: no staging copy of the bytes,
    # whose freed buffer the allocator would keep resident after the read
    t = np.frombuffer(values, dtype=np.dtype(dtype)).astype(np.float32).reshape(shape)
    if dtype == "int8":
        t *= np.frombuffer(scales, dtype=np.float32).reshape(*shape[:-1], 1)
    return torch.from_numpy(t)


def as_stored(node: StoredNode, dtype: str) -> StoredNode:
    """`node` with its K and V as a store of `dtype` gives them back, so that a node used where it was computed and
    one read back from a file are the same numbers."""
    _check_dtype(dtype)
    k, v = (_decode(*map(memoryview, _encode(t, dtype)), dtype, tuple(t.shape)) for t in (node.k, node.v))
    return StoredNode(node.tokens, k, v, node.model)


def write_node_store(path: str | Path, nodes: dict[str, StoredNode], model: dict, dtype: str = "float16") -> str:
    """Write `nodes` (id -> node) to one file, whole or not at all: a magic, a JSON header (format, version, the model
    the nodes were computed with, dtype, and per node its tokens, byte ranges and SHA-256) and the tensors. Ids are
    kept as text: two ids with one text (1 and "1") are refused, not merged. Returns the store's `NodeStore.digest`,
    what a file that refers to the store records to know it again."""
    _check_dtype(dtype)
    texts = [str(i) for i in nodes]
    if len(set(texts)) != len(texts):
        same = next(t for t in texts if texts.count(t) > 1)
        raise ValueError(f"node ids are stored as text, and two of them read {same!r}")
    entries, blobs, offset = {}, [], 0
    for node_id, node in nodes.items():
        parts = [b for t in (node.k, node.v) for b in _encode(t, dtype)]
        blob = b"".join(parts)
        entries[str(node_id)] = {"tokens": list(node.tokens), "shape": list(node.k.shape), "offset": offset,
                                 "sizes": [len(b) for b in parts], "sha256": hashlib.sha256(blob).hexdigest()}
        blobs.append(blob)
        offset += len(blob)
    header = json.dumps({"format": STORE_FORMAT, "version": STORE_VERSION, "model": model, "dtype": dtype,
                         "payload_bytes": offset, "nodes": entries}).encode()
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(_MAGIC + len(header).to_bytes(8, "little") + header)
        for blob in blobs:
            f.write(blob)
    return hashlib.sha256(header).hexdigest()


class NodeStore:
    """A node store file opened for reading: the header checked at once (a truncated, foreign or other-model file is
    refused here, and nothing else is read), each node's bytes read from a memory map and checked when first asked
    for, so a store larger than memory costs only the nodes used."""

    def __init__(self, path: str | Path, model: dict):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise NodeStoreError(f"{self.path} is not a readable node store: {e}") from e
        head = self._map[:16]
        if head[:8] != _MAGIC:
            raise NodeStoreError(f"{self.path} is not a node store file")
        size = int.from_bytes(head[8:16], "little")
        try:
            header = json.loads(self._map[16:16 + size])
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise NodeStoreError(f"{self.path} has a corrupt node store header: {e}") from e
        if not isinstance(header, dict) or header.get("format") != STORE_FORMAT \
                or header.get("version") != STORE_VERSION:
            got = header if not isinstance(header, dict) else f"{header.get('format')} version {header.get('version')}"
            raise NodeStoreError(f"{self.path} is node store format {got}, this nodekv reads {STORE_FORMAT} "
                                 f"{STORE_VERSION}")
        lacking = [k for k in ("model", "dtype", "payload_bytes", "nodes") if k not in header]
        if lacking or header["dtype"] not in STORE_DTYPES:
            raise NodeStoreError(f"{self.path} has a corrupt node store header: " + (
                f"no {', '.join(lacking)}" if lacking else f"dtype {header['dtype']!r}"))
        if not same_model(header["model"], model):
            raise NodeStoreError(f"{self.path} was stored with model {describe_model(header['model'])}, not the loaded "
                                 f"{describe_model(model)}")
        self.digest = hashlib.sha256(self._map[16:16 + size]).hexdigest()  # `write_node_store`'s, to know it by
        self._base = 16 + size
        if len(self._map) != self._base + header["payload_bytes"]:
            raise NodeStoreError(f"{self.path} is truncated or padded: {len(self._map)} bytes, its header says "
                                 f"{self._base + header['payload_bytes']}")
        self.dtype, self._entries, self.model = header["dtype"], header["nodes"], model

    def __contains__(self, node_id) -> bool:
        return str(node_id) in self._entries

    @property
    def ids(self) -> list[str]:
        return list(self._entries)

    def bytes_per_1k_tokens(self) -> float:
        """The file's KV bytes per 1,000 stored tokens (its size on disk against the tokens it can place)."""
        tokens = sum(len(e["tokens"]) for e in self._entries.values())
        return 1000 * sum(sum(e["sizes"]) for e in self._entries.values()) / max(tokens, 1)

    def nbytes(self, node_id) -> int:
        """The node's bytes in the file (what reading it maps in)."""
        return sum(self._entries[str(node_id)]["sizes"])

    def __getitem__(self, node_id) -> StoredNode:
        return self.get(node_id)

    def get(self, node_id) -> StoredNode:
        """The node, decoded to fp32 (values within the dtype's error of those written)."""
        e = self._entries.get(str(node_id))
        if e is None:
            raise KeyError(f"node {node_id!r} is not in the store {self.path}")
        start = self._base + e["offset"]
        blob = memoryview(self._map)[start:start + sum(e["sizes"])]
        if hashlib.sha256(blob).hexdigest() != e["sha256"]:
            raise NodeStoreError(f"{self.path}: the bytes of node {node_id!r} are corrupt (checksum mismatch)")
        bounds = [0]
        for n in e["sizes"]:
            bounds.append(bounds[-1] + n)
        pieces = [blob[a:b] for a, b in zip(bounds, bounds[1:])]
        shape = tuple(e["shape"])  # pieces: K's values and scales, then V's (no scales but int8's)
        try:
            k, v = (_decode(pieces[i], pieces[i + 1], self.dtype, shape) for i in (0, 2))
        except ValueError as err:  # sizes that do not hold the shape: a header that disagrees with its bytes
            raise NodeStoreError(f"{self.path}: node {node_id!r}'s bytes do not hold its shape {shape}: {err}") from None
        self._unmap(start, len(blob))
        return StoredNode(tuple(e["tokens"]), k, v, self.model)

    def _unmap(self, start: int, length: int) -> None:
        """Drop the mapped pages of bytes already decoded from this process's resident set (they stay in the page
        cache, and a later read maps them again), so a node read costs its fp32 copy and not its file bytes too."""
        if hasattr(mmap, "MADV_DONTNEED"):  # Linux and the BSDs; elsewhere the pages stay mapped
            a = start - start % mmap.PAGESIZE
            self._map.madvise(mmap.MADV_DONTNEED, a, start + length - a)
