"""What PECAN's KV-cached search saves: the same search run on one cached session (each node appended once, probes
rolled back) and naively, re-prefilling the whole prompt from scratch before every probe and before the answer.

The naive run replays the cached run's visit order, so both do the same search; it prefills each prompt as one
collected node, as a search without a cache would to read the new node's attention to the query. The predicted
factor is the closed-form ratio of the two FLOP counts (engine.flops.forward_flops) for that visit order; the
measured one comes from the engine's account, and the wall times are measured side by side in one process.

    nodekv bench pecan_search [--model qwen2.5-0.5b] [--index X.pecan] [--question Q] [--budget 12]
                                        [--threads 2]
"""
from __future__ import annotations

import argparse
import time
from itertools import accumulate
from pathlib import Path

from nodekv.bench import count, model
from nodekv.paths import base, example

STORY = example("lost_in_translation.txt")
QUESTION = "Who is Korvin, and where is he held?"


def prompt_pieces(method, index, question: str, visited: list[int]) -> dict[str, list]:
    """The token ids of the search prompt's pieces: the first turn ("prefix": head, query, info), the visited
    nodes, the probe and the second turn."""
    from nodekv.methods.chat_prompt import SLOT, ChatPrompt
    from nodekv.methods.pecan.pecan import FIRST_TURN, SECOND_TURN

    tok = method.search_engine.tokenizer
    first = ChatPrompt(tok, [{"role": "user", "content": FIRST_TURN}])
    turns = ChatPrompt(tok, [{"role": "user", "content": FIRST_TURN}, {"role": "assistant", "content": "Yes"},
                             {"role": "user", "content": SLOT}])
    before, query, after = first.fill_parts(0, question)
    info, probe = first.around(1)
    return {"prefix": [first.head + before, query, after + info],
            "nodes": [tok.encode("* " + index.graph.nodes[i].text.strip() + "\n") for i in visited],
            "probe": probe, "second": turns.around(1)[1] + turns.fill(2, SECOND_TURN)}


def naive_search(method, pieces: dict[str, list], probed: list[bool]) -> tuple[dict, str]:
    """Re-prefill [first turn, query, nodes so far] from an empty cache before each probe, and the whole final
    prompt before the answer. Returns ({step: p_yes}, answer text)."""
    eng = method.search_engine
    prefix = [t for ids in pieces["prefix"] for t in ids]
    flat = [t for ids in pieces["nodes"] for t in ids]
    ends = list(accumulate(len(ids) for ids in pieces["nodes"]))
    p_yes = {}
    for k, probe in enumerate(probed):
        if probe:
            with eng.session() as s:
                s.append(prefix + flat[:ends[k]], collect=True)
                p_yes[k] = s.probe(["Yes", "No"], tokens=pieces["probe"])["Yes"]
    with eng.session() as s:
        s.append(prefix + flat + pieces["second"])
        text = s.generate(method.config.answer_tokens).text
    return p_yes, text.strip()


def predicted_ratio(c, prefix: list[int], nodes: list[int], probed: list[bool], probe: int, second: int,
                    gen: int) -> float:
    from nodekv.engine.flops import forward_flops

    def decode(n: int) -> int:
        return sum(forward_flops(c, 1, n + i) for i in range(gen))

    cached, end, naive = 0, 0, 0
    for n in prefix:  # the cached run appends the first turn as three nodes: head, query, info
        cached += forward_flops(c, n, end)
        end += n
    for k, n in enumerate(nodes):
        cached += forward_flops(c, n, end, 1, True)
        end += n
        if probed[k]:
            cached += forward_flops(c, probe, end)
            naive += forward_flops(c, end, 0, 1, True) + forward_flops(c, probe, end)
    cached += forward_flops(c, second, end) + decode(end + second)
    naive += forward_flops(c, end + second) + decode(end + second)
    return naive / cached


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=model, default=None, help="default: nodekv's default model")
    ap.add_argument("--index", default=None, help="a PECAN index of --model (built from the bundled story with "
                                                  "1.5K-token batches if missing; default build/bench-story.pecan, "
                                                  "build/bench-story-MODEL.pecan for another --model)")
    ap.add_argument("--question", default=QUESTION)
    ap.add_argument("--budget", type=count, default=12, help="nodes beyond the top level")
    ap.add_argument("--t-p", type=float, default=0.5)
    ap.add_argument("--threads", type=count, default=2)
    args = ap.parse_args()

    from nodekv import load_engine
    from nodekv.methods.pecan.pecan import Pecan
    from nodekv.methods.pecan.pecan_store import load, save

    # the default model keeps the index name it always had, so an index built before is still found
    path = Path(args.index or base() / "build" / f"bench-story{'' if args.model is None else '-' + args.model}.pecan")
    eng = load_engine(args.model, threads=args.threads)
    method = Pecan(eng, batch_tokens=1500, node_budget=args.budget, t_p=args.t_p)
    if not path.exists():
        print(f"building {path} from {STORY.name} ...")
        path.parent.mkdir(parents=True, exist_ok=True)
        save(method.index(STORY.read_text()), path, eng)
    index = load(path, eng)

    method.answer(index, args.question)  # warm-up
    t = time.perf_counter()
    answer = method.answer(index, args.question)
    cached_s = time.perf_counter() - t
    steps = [s for s in answer.trace if "node" in s]
    visited, probed = [s["node"] for s in steps], ["p_yes" in s for s in steps]

    before = eng.flops.total
    t = time.perf_counter()
    pieces = prompt_pieces(method, index, args.question, visited)
    p_yes, naive_text = naive_search(method, pieces, probed)
    naive_s, naive_flops = time.perf_counter() - t, eng.flops.total - before

    lengths = {k: [len(ids) for ids in pieces[k]] for k in ("prefix", "nodes")}
    ratio = predicted_ratio(eng.config, lengths["prefix"], lengths["nodes"], probed, len(pieces["probe"]),
                            len(pieces["second"]), answer.generated_tokens)
    drift = max(abs(p_yes[k] - s["p_yes"]) for k, s in enumerate(steps) if "p_yes" in s)

    print(f"{len(visited)} nodes visited ({sum(probed)} probes), final prompt {answer.prompt_tokens} tokens, "
          f"{answer.generated_tokens} answer tokens, stop: {answer.trace[-1]['stop']}")
    print("| search | query TFLOPs | wall s |\n|---|---|---|")
    print(f"| cached session | {answer.flops / 1e12:.4f} | {cached_s:.2f} |")
    print(f"| naive re-prefill per step | {naive_flops / 1e12:.4f} | {naive_s:.2f} |")
    print(f"FLOPs ratio naive/cached: measured {naive_flops / answer.flops:.3f}, predicted {ratio:.3f}; "
          f"wall ratio {naive_s / cached_s:.2f}")
    print(f"same answer: {naive_text == answer.text}; largest p_yes difference {drift:.2e}")


if __name__ == "__main__":
    main()
