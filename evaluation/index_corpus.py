"""`nodekv index-corpus DIR`: every text file under a directory indexed by one method into an index store (the one
`nodekv eval` reads, so a corpus indexed on a cluster is not built again), locally or as Ray tasks; resumable, since
documents the store has are skipped; and a manifest from each file to its index and what building it cost."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

from ..engine.engine import DTYPES, Engine
from .index_store import IndexStore, document_hash
from .ray_tasks import RayPlan, WorkerSpec, index_on_ray
from ..methods.base import check_document
from ..methods.registry import get
from ..paths import NotUTF8Error, read_text, write_atomic


def check_request(method: str, directory: Path) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """The corpus under `directory` (`read_corpus`), or a ValueError naming the problem if `method` cannot store
    indexes, `directory` is not a directory or holds no usable text file (checked before a model loads)."""
    if not get(method).can_save:
        raise ValueError(f"{method} cannot save an index, so it has nothing to store for a corpus")
    if directory.is_file():
        raise ValueError(f"{directory} is a file, not a corpus directory")
    if not directory.is_dir():
        raise ValueError(f"corpus directory {directory} does not exist")
    return read_corpus(directory)


def read_corpus(directory: Path) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """({relative path: text} of every *.txt under `directory`, sorted; [(relative path, why skipped)]) — files that
    cannot be read, are not UTF-8 text, are empty or hold NUL characters are skipped, not fatal, so one bad file
    does not stop a corpus."""
    texts, skipped = {}, []
    for path in sorted(p for p in directory.rglob("*.txt") if p.is_file()):
        name = str(path.relative_to(directory))
        try:
            text = read_text(path)
        except NotUTF8Error as e:
            skipped.append((name, f"not UTF-8 (byte 0x{e.byte:02x} at offset {e.offset})"))
        except OSError as e:
            skipped.append((name, f"unreadable ({e.strerror})"))
        else:
            try:
                texts[name] = check_document(text, "it")
            except ValueError as e:  # the rule every method's index applies
                skipped.append((name, str(e)))
    if not texts:
        listed = "; ".join(f"{name}: {why}" for name, why in skipped[:3]) + ("; ..." if len(skipped) > 3 else "")
        raise ValueError(f"no usable *.txt files under {directory}" + (f" ({listed})" if skipped else ""))
    return texts, skipped


def index_corpus(engine: Engine, method: str, options: dict, directory: Path, store_root: Path,
                 ray: RayPlan | None = None, log: Callable[[str], None] = print) -> tuple[Path, int]:
    """Index every *.txt under `directory` with `method` (and its `options`) into the store at `store_root` (on Ray
    with `ray`), then write the manifest (one JSON line per file: file, document hash, index path, TFLOPs, seconds,
    tokens; or the error that stopped its index); returns its path and how many documents failed. Files with the
    same text share one index; a document that fails does not stop the others; one that another process is
    building (another `index-corpus` on the same store) is left to it and waited for last."""
    texts, skipped = check_request(method, directory)
    for name, why in skipped:
        print(f"skipped {name}: {why}", file=sys.stderr)
    store_method = get(method)(engine, **options)
    store = IndexStore.for_method(store_root, engine, store_method)
    documents = {document_hash(text): text for text in texts.values()}
    todo = {doc: text for doc, text in documents.items() if store.cost(doc) is None}
    names = {document_hash(text): name for name, text in reversed(texts.items())}  # the first file of each text
    log(f"{len(texts)} files, {len(documents)} distinct documents, {len(documents) - len(todo)} already in "
        f"{store_root}")
    count, errors = iter(range(1, len(todo) + 1)), {}

    def built(doc: str, cost: tuple | str) -> None:
        if isinstance(cost, str):
            errors[doc] = cost
            log(f"[{next(count)}/{len(todo)}] FAILED {names[doc]}: {cost}")
        else:
            log(f"[{next(count)}/{len(todo)}] indexed {names[doc]}: {cost[0] / 1e12:.3f} TFLOPs, {cost[2]:.1f}s")

    if ray is not None:
        dtype = next(name for name, d in DTYPES.items() if d == engine.model.dtype)
        index_on_ray(ray, WorkerSpec(str(engine.path), dtype, method, options, str(store_root)), todo, built)
    else:
        pending = list(todo)
        while pending:  # a document another process is building waits till last: this one builds others meanwhile
            doc = next((d for d in pending if store.builder(d) is None), pending[0])
            pending.remove(doc)
            built(doc, store.build_cost(store_method, todo[doc]))
    store_root.mkdir(parents=True, exist_ok=True)
    # named by the folder and a hash of its path: two corpora whose folders share a name keep two manifests
    folder = directory.resolve()
    manifest = store_root / f"{store.key}-{folder.name}-{document_hash(str(folder))[:8]}.corpus.jsonl"
    rows = []
    for name, text in texts.items():
        doc = document_hash(text)
        row = {"file": name, "document": doc}
        if doc in errors:
            row["error"] = errors[doc]
        else:
            flops, _, seconds, tokens = store.cost(doc)
            row.update(index=str(store.index_path(doc)), tflops=flops / 1e12, seconds=seconds, tokens=tokens)
        rows.append(json.dumps(row) + "\n")
    write_atomic(manifest, "".join(rows))
    return manifest, len(errors)
