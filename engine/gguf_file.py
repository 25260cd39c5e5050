"""A GGUF file's metadata and tensor table, parsed directly and memory-mapped.

`gguf.GGUFReader` turns every metadata array element (49k vocabulary strings) into a field object and takes
seconds; this parser reads the header with `struct`/numpy in ~0.1 s. Tensor payloads are numpy views of a
read-only memory map: uint8 [rows, row_bytes] for block-quantised types, float arrays [rows, cols] otherwise.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .errors import ModelLoadError

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NP_TYPES = {0: "u1", 1: "i1", 2: "u2", 3: "i2", 4: "u4", 5: "i4", 6: "f4", 7: "?", 10: "u8", 11: "i8", 12: "f8"}
_STRING, _ARRAY = 8, 9
_FLOAT_TYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}
_MAX_DIMS = 4  # GGML_MAX_DIMS: a corrupt count would otherwise have struct build a tuple of billions of dims


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: `shape` in GGUF order (fastest-varying first), its payload as a 2-D (or 1-D) numpy view of the
    map, and where that payload starts in the file (`offset`, bytes)."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray
    offset: int


@dataclass(frozen=True)
class GGUFFile:
    """Metadata key/values (strings as str, arrays as lists) and tensors by name, in file order."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse a GGUF v2/v3 file (either byte order). Raises ModelLoadError when it is not GGUF or is cut short."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:  # ValueError: an empty file cannot be mapped
        raise ModelLoadError(f"cannot read GGUF file {path}: corrupt or truncated ({e})") from None
    try:
        return _parse(path, mm)
    except (struct.error, ValueError, IndexError, UnicodeDecodeError) as e:
        if isinstance(e, ModelLoadError):
            raise
        raise ModelLoadError(f"cannot read GGUF file {path}: corrupt or truncated ({e})") from None


def _parse(path: Path, mm: mmap.mmap) -> GGUFFile:
    if mm[:4] != b"GGUF":
        raise ModelLoadError(f"cannot read GGUF file {path}: not a GGUF file (magic {bytes(mm[:4])!r})")
    end = "<"
    (version,) = struct.unpack_from("<I", mm, 4)
    if version & 0xFFFF == 0:  # written big-endian
        end = ">"
        (version,) = struct.unpack_from(">I", mm, 4)
    if version not in (2, 3):
        raise ModelLoadError(f"{path}: GGUF version {version} is not supported (need 2 or 3)")
    n_tensors, n_kv = struct.unpack_from(end + "QQ", mm, 8)
    pos = 24

    def read_str() -> str:
        nonlocal pos
        (n,) = struct.unpack_from(end + "Q", mm, pos)
        raw = mm[pos + 8:pos + 8 + n]
        if len(raw) != n:
            raise ModelLoadError(f"cannot read GGUF file {path}: corrupt or truncated (metadata cut short)")
        pos += 8 + n
        return raw.decode("utf-8", errors="replace")

    def read_value(vtype: int) -> Any:
        nonlocal pos
        if vtype == _STRING:
            return read_str()
        if vtype in _SCALARS:
            fmt = end + _SCALARS[vtype]
            (v,) = struct.unpack_from(fmt, mm, pos)
            pos += struct.calcsize(fmt)
            return v
        if vtype == _ARRAY:
            etype, count = struct.unpack_from(end + "IQ", mm, pos)
            pos += 12
            if etype in _NP_TYPES:
                dt = np.dtype(end + _NP_TYPES[etype])
                arr = np.frombuffer(mm, dtype=dt, count=count, offset=pos)
                pos += dt.itemsize * count
                return arr.tolist()
            return [read_value(etype) for _ in range(count)]
        raise ModelLoadError(f"{path}: unknown GGUF metadata value type {vtype}")

    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = read_str()
        (vtype,) = struct.unpack_from(end + "I", mm, pos)
        pos += 4
        metadata[key] = read_value(vtype)

    infos: dict[str, tuple[tuple[int, ...], GGMLQuantizationType, int]] = {}
    for _ in range(n_tensors):
        name = read_str()
        if name in infos:  # as llama.cpp and GGUFReader: a dict would silently keep the last of the two
            raise ModelLoadError(f"cannot read GGUF file {path}: corrupt (tensor {name} is listed twice)")
        (n_dims,) = struct.unpack_from(end + "I", mm, pos)
        if not 1 <= n_dims <= _MAX_DIMS:
            raise ModelLoadError(f"cannot read GGUF file {path}: corrupt (tensor {name} has {n_dims} dimensions)")
        dims = struct.unpack_from(end + "Q" * n_dims, mm, pos + 4)
        qtype, offset = struct.unpack_from(end + "IQ", mm, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        infos[name] = (tuple(int(d) for d in dims), GGMLQuantizationType(qtype), offset)

    alignment = int(metadata.get("general.alignment", 32))
    if alignment <= 0 or alignment & (alignment - 1):  # as llama.cpp: data_start below divides by it
        raise ModelLoadError(f"cannot read GGUF file {path}: corrupt (general.alignment {alignment} is not a power "
                             "of two)")
    data_start = -(-pos // alignment) * alignment
    tensors = {}
    for name, (dims, qtype, offset) in infos.items():
        block, type_size = GGML_QUANT_SIZES[qtype]
        cols, rows = dims[0], int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
        if cols % block:
            raise ModelLoadError(f"{path}: tensor {name} has {cols} columns, not a multiple of {qtype.name}'s "
                                 f"block of {block}")
        row_bytes = cols // block * type_size
        start = data_start + offset
        if start + rows * row_bytes > len(mm):
            raise ModelLoadError(f"cannot read GGUF file {path}: corrupt or truncated (tensor {name} needs bytes "
                                 f"up to {start + rows * row_bytes:,}, the file has {len(mm):,})")
        if qtype in _FLOAT_TYPES:
            data = np.frombuffer(mm, dtype=np.dtype(end + np.dtype(_FLOAT_TYPES[qtype]).str[1:]),
                                 count=rows * cols, offset=start).reshape(rows, cols)
        else:
            data = np.frombuffer(mm, dtype=np.uint8, count=rows * row_bytes, offset=start).reshape(rows, row_bytes)
        tensors[name] = GGUFTensor(name, qtype, dims, data if len(dims) > 1 else data[0], start)
    return GGUFFile(path, metadata, tensors)
