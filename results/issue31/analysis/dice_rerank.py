"""Which rule for choosing among DICE's recalled candidates would have put the supporting passages before the reader:
each step's `recalled` list (bi-encoder score, LLM re-rank score) replayed under other rules, offline, scored by the
evaluation's own `support_read` on the chunks the rule keeps (exact for the first step; later steps would have drafted
from other chunks). Needs a DICE run whose trace has `recalled` and a dataset with supporting passages.

    python dice_rerank.py RUN.jsonl [DATASET]     # DATASET defaults to hotpotqa
"""
import json
import sys

from nodekv.evaluation.datasets import load_dataset
from nodekv.evaluation.metrics import support_read
from nodekv.methods.dice.dice import word_chunks

run = sys.argv[1]
recs = {r.id: r for r in load_dataset(sys.argv[2] if len(sys.argv) > 2 else "hotpotqa").records}
lines = [json.loads(l) for l in open(run)]

def rrf(cands, k=60):
    d = sorted(range(len(cands)), key=lambda j: -cands[j]["dense"])
    r = sorted(range(len(cands)), key=lambda j: -cands[j]["rerank"])
    s = {j: 0.0 for j in range(len(cands))}
    for rank, j in enumerate(d): s[j] += 1 / (k + rank)
    for rank, j in enumerate(r): s[j] += 1 / (k + rank)
    return sorted(s, key=lambda j: -s[j])

def zsum(cands):
    import statistics as st
    out = {}
    for key in ("dense", "rerank"):
        xs = [c[key] for c in cands]; m = st.mean(xs); sd = st.pstdev(xs) or 1
        for j, c in enumerate(cands): out[j] = out.get(j, 0) + (c[key] - m) / sd
    return sorted(out, key=lambda j: -out[j])

rules = {
    "rerank top3 (DICE)": lambda c: sorted(range(len(c)), key=lambda j: -c[j]["rerank"])[:3],
    "dense top3 (no rerank)": lambda c: list(range(len(c)))[:3],
    "RRF top3": lambda c: rrf(c)[:3],
    "z-sum top3": lambda c: zsum(c)[:3],
    "rerank top5": lambda c: sorted(range(len(c)), key=lambda j: -c[j]["rerank"])[:5],
    "dense top5": lambda c: list(range(len(c)))[:5],
    "RRF top5": lambda c: rrf(c)[:5],
    "all 10": lambda c: list(range(len(c))),
}
tot = {k: [0, 0, 0, 0] for k in rules}  # support read (all steps), first step, chunks read, records with all support
n_support = 0
for line in lines:
    rec = recs[line["id"]]
    chunks = word_chunks(rec.document, 80)  # the runs' chunk_words
    n_support += len(rec.supports)
    steps = [s for s in line["trace"] if "recalled" in s]
    for name, rule in rules.items():
        read, first = set(), set()
        for i, s in enumerate(steps):
            c = sorted(s["recalled"], key=lambda x: -x["dense"])
            picked = {c[j]["chunk"] for j in rule(c)}
            read |= picked
            if i == 0: first |= picked
        ctx = "\n\n".join(chunks[i] for i in sorted(read))
        ok = support_read(rec.supports, ctx)
        ok1 = support_read(rec.supports, "\n\n".join(chunks[i] for i in sorted(first)))
        tot[name][0] += sum(ok); tot[name][1] += sum(ok1); tot[name][2] += len(read); tot[name][3] += all(ok)
print(f"{len(lines)} records, {n_support} supporting passages; {run}")
print("| rule | support read (all steps) | after step 1 | chunks read / record | records with all support |")
print("|---|---:|---:|---:|---:|")
for k, (a, b, c, d) in tot.items():
    print(f"| {k} | {a} ({a / n_support:.0%}) | {b} | {c / len(lines):.1f} | {d} |")
