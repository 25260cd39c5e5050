"""Which nodes GoR reads for each Multi-News record's query under the paper and the public recipe (`--option
recipe=public`), cross-fitted in 3 folds over the indexes in runs/indexes (a preview while they are built: if both
recipes read the same nodes, their answers cannot differ).

    python gor_recipe_reads.py
"""
from pathlib import Path

import torch

import nodekv
from nodekv.methods import get
from nodekv.evaluation.datasets import load_dataset
from nodekv.evaluation.index_store import document_hash
eng = nodekv.load_engine("qwen2.5-1.5b", threads=1)
recs = load_dataset("multi_news", None, 30).records
idx_dir = Path(__file__).parent / "runs" / "indexes"
have = [r for r in recs if (idx_dir / f"gor-6f5ad7d5bf0b-{document_hash(r.document)}.idx").exists()]
folds = [have[i::3] for i in range(3)]
out = {}
for recipe in ("paper", "public"):
    m = get("gor")(eng, alpha=0.7, dropout=0.1, recipe=recipe)
    load = lambda r: m.load_index(idx_dir / f"gor-6f5ad7d5bf0b-{document_hash(r.document)}.idx")
    for f, fold in enumerate(folds):
        m.fit([(load(r), r) for g, other in enumerate(folds) if g != f for r in other])
        for r in fold:
            ix = load(r)
            vec, _ = m.node_vectors(ix)
            s = vec @ m.embedder.encode([r.question])[0]
            top = torch.argsort(-s, stable=True)[:6].tolist()
            out.setdefault(r.id, {})[recipe] = (top, len(ix.graph.chunks))
        print(recipe, f, flush=True)
same = sum(set(v["paper"][0]) == set(v["public"][0]) for v in out.values())
overlap = sum(len(set(v["paper"][0]) & set(v["public"][0])) for v in out.values())
chunks = {k: sum(sum(j < v[k][1] for j in v[k][0]) for v in out.values()) for k in ("paper", "public")}
print(f"{len(out)} records: same 6 nodes on {same}; {overlap} of {6*len(out)} nodes shared; chunks read: {chunks}")
