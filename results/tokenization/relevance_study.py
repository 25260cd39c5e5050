"""The relevance probe's ranking of HotpotQA chunks, its prompt tokenised piece by piece (as before ChatPrompt) and
whole (ChatPrompt): per record the AUC of supporting against other chunks, and top-3 support recall.
Usage: relevance_study.py MODEL OUT.jsonl [N]; resumes by record id."""
import json, math, os, sys, time
from nodekv.engine.engine import load_engine
from nodekv.evaluation.datasets import load_dataset
from nodekv.evaluation.metrics import support_read
from nodekv.methods.chat_prompt import ChatPrompt
from nodekv.methods.relevance import QUESTION
from nodekv.methods.dice.dice import word_chunks

model, out, n = sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 40
eng = load_engine(model, threads=1)
tok = eng.tokenizer
mark = "\x00\x01\x00"
pieces = tok.render_chat([{"role": "user", "content": QUESTION.replace("{}", mark)}]).split(mark)
old_head, old_between, old_tail = (tok.encode(p, parse_special=True) for p in pieces)
cp = ChatPrompt(tok, [{"role": "user", "content": QUESTION}])

def scores(head, question_ids, passage_ids):
    with eng.prefixes.fork(head) as s:
        s.append(question_ids)
        forks = [s.fork() for _ in passage_ids]
        try:
            eng.append_batch(forks, passage_ids)
            return [math.log(max(f.probe(["Yes", "No"])["Yes"], 1e-30)) for f in forks]
        finally:
            for f in forks:
                f.release()

def auc(pos, neg):
    if not pos or not neg:
        return None
    return sum((p > q) + 0.5 * (p == q) for p in pos for q in neg) / (len(pos) * len(neg))

done = set()
if os.path.exists(out):
    done = {json.loads(l)["id"] for l in open(out)}
for r in load_dataset("hotpotqa").records[:n]:
    if r.id in done:
        continue
    t0 = time.time()
    chunks = word_chunks(r.document, 80)
    label = [any(support_read(r.supports, c)) for c in chunks]  # the chunk holds a supporting sentence
    row = {"id": r.id, "chunks": len(chunks), "support": label}
    for name, (head, q, ps) in {
        "pieces": (old_head, tok.encode(r.question) + old_between, [tok.encode(c) + old_tail for c in chunks]),
        "whole": (cp.head, cp.fill(0, r.question), [cp.fill(1, c) for c in chunks]),
    }.items():
        sc = scores(head, q, ps)
        top3 = sorted(range(len(chunks)), key=lambda i: -sc[i])[:3]
        row[name] = {"scores": sc, "auc": auc([s for s, l in zip(sc, label) if l], [s for s, l in zip(sc, label) if not l]),
                     "top3_support": sum(label[i] for i in top3)}
    row["s"] = round(time.time() - t0, 1)
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(r.id, row["pieces"]["auc"], row["whole"]["auc"], row["pieces"]["top3_support"], row["whole"]["top3_support"], sum(label), row["s"], flush=True)
