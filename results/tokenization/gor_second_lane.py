"""A second indexing lane for the GoR Multi-News rerun: builds the run's missing indexes from the last document back
into the same index store as `nodekv eval --method gor --dataset multi_news --limit 30 --out DIR` does, and stops where
it meets the other lane (the store's claims keep two builders off one document). Its indexes are the ones `nodekv eval`
would build: the method is made from the run's options as the runner makes it, and the store's key is checked.

    python gor_second_lane.py DIR      # beside a running `nodekv eval ... --out DIR`, one thread each
"""
import sys
import time
from pathlib import Path

import nodekv
from nodekv.evaluation.datasets import load_dataset
from nodekv.evaluation.index_store import IndexStore, document_hash
from nodekv.evaluation.runner import RunConfig, _run_meta
from nodekv.methods import get

KEY = "gor-6f5ad7d5bf0b"  # the store key of runs/indexes/gor-*

cfg = RunConfig("gor", "multi_news", limit=30, out=sys.argv[1])
engine = nodekv.load_engine("qwen2.5-1.5b", threads=1)
loaded = load_dataset(cfg.dataset, cfg.data_dir, cfg.limit)
options = _run_meta(cfg, str(engine.path), engine.model.precision, "float32", "float32", loaded)["options"]
method = get("gor")(engine, prompt=cfg.prompt, **options)
store = IndexStore.for_method(Path(cfg.out) / "indexes", engine, method)
if store.key != KEY:
    sys.exit(f"the store key is {store.key}, not {KEY}: this code builds other indexes than the run's")
documents = {document_hash(r.document): r.document for r in loaded.records}
for doc in reversed(documents):
    if store.cost(doc) is not None:
        continue
    if store.builder(doc) is not None:
        print(f"{doc} is being built by {store.builder(doc)}: the lanes have met", file=sys.stderr)
        break
    t = time.time()
    store.build_or_load(method, documents[doc])
    print(f"built {doc} in {time.time() - t:.0f} s", file=sys.stderr, flush=True)
