"""How far placed chunks stay from a full prefill of the same BM25 Top-5 prompt when each chunk's KV is stored alone
(from an empty cache) or in its document's context (one prefill of the document's chunks in order, each keeping its
span: what `kv_context=document` stores), with and without a boundary repair: the KL divergence of the answer's
first-token distribution from the full prefill's.

    python kv_context_kl.py MODEL RECORDS [DATASET]     # e.g. qwen2.5-0.5b 10 musique
"""
import sys
import time

import torch

from nodekv.engine.engine import load_engine
from nodekv.evaluation.datasets import load_dataset
from nodekv.methods.baselines import BM25TopK
from nodekv.methods.prompts import prompt_for
from nodekv.methods.reader import Repair

model, n_rec = sys.argv[1], int(sys.argv[2])
dataset = sys.argv[3] if len(sys.argv) > 3 else "hotpotqa"
eng = load_engine(model, threads=1)
m = BM25TopK(eng, prompt_for(dataset), k=5)


def dist_full(ids):
    with eng.session() as s:
        s.append(ids)
        return torch.log_softmax(s._last_logits().double(), -1)


def dist_placed(head, nodes, tail, repair=Repair()):
    with eng.session() as s:
        s.append(head)
        spans = [s.append_stored(n) for n in nodes]
        worst = repair.positions(s, spans)
        if worst:
            s.repair(worst)
        s.append(tail)
        return torch.log_softmax(s._last_logits().double(), -1)


def kl(p, q):
    return float((p.exp() * (p - q)).sum())


rows = {}
for rec in load_dataset(dataset, limit=n_rec).records:
    t0 = time.time()
    index = m.index(rec.document)
    _, hits = m.context(index, rec.question)
    chosen = sorted(i for i, _ in hits)
    head, tail = m.reader.pieces(rec.question)
    pids = [m.reader.passage_ids(c) for c in index.chunks]
    ref = dist_full(head + [t for i in chosen for t in pids[i]] + tail)
    alone = [eng.store_node(pids[i]) for i in chosen]
    in_doc = eng.store_nodes(pids)
    in_doc = [in_doc[i] for i in chosen]
    variants = {"alone, reuse": (alone, Repair()), "alone, boundary 15%": (alone, Repair(0.15, "boundary")),
                "in document, reuse": (in_doc, Repair()), "in document, boundary 5%": (in_doc, Repair(0.05, "boundary")),
                "in document, boundary 15%": (in_doc, Repair(0.15, "boundary"))}
    for name, (nodes, rep) in variants.items():
        d = dist_placed(head, nodes, tail, rep)
        rows.setdefault(name, []).append((kl(ref, d), int(d.argmax() == ref.argmax())))
    print(rec.id, len(chosen), len(pids), {k: round(v[-1][0], 3) for k, v in rows.items()}, f"{time.time() - t0:.0f}s",
          flush=True)

print(f"\n{model}, {n_rec} {dataset} records, BM25 Top-5 prompts")
print("| stored | mean KL (nats) | median | top-1 as the full prefill's |\n|---|---:|---:|---:|")
for name, v in rows.items():
    ks = sorted(k for k, _ in v)
    print(f"| {name} | {sum(ks) / len(ks):.3f} | {ks[len(ks) // 2]:.3f} | {sum(t for _, t in v)} / {len(v)} |")
