"""What batching buys GoR's query simulation: `simulate_queries` on the bundled story's 256-token chunks with the
engine's sampler drawing 1 and then `--batch` chunks per round (one prefill of all the round's chunks, one forward per
decode step for all of them), side by side in one process; rounds alternate and the table shows medians. Both
settings draw the same number of times from the same seeded chunks.

    nodekv bench gor_sampling [--model qwen2.5-0.5b] [--draws 8] [--batch 4] [--rounds 2] [--threads N]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from nodekv.bench import count, model
from nodekv.paths import example

TEXT = example("lost_in_translation.txt")


def simulate_seconds(engine, chunks: list[str], draws: int, batch: int) -> tuple[float, int]:
    """Seconds to spend `draws` simulation draws `batch` at a time, and the distinct queries they gave."""
    from nodekv.methods.gor.gor_graph import RecordGraph, engine_sampler, simulate_queries

    graph = RecordGraph(list(chunks))
    t = time.perf_counter()
    simulate_queries(graph, engine_sampler(engine), n=draws, seed=0, max_attempts=draws, batch=batch)
    return time.perf_counter() - t, len(graph.queries)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-0.5b", type=model)
    p.add_argument("--draws", type=count, default=8)
    p.add_argument("--batch", type=count, default=4)
    p.add_argument("--rounds", type=count, default=2)
    p.add_argument("--threads", type=count, default=None)
    a = p.parse_args(argv)
    import nodekv
    from nodekv.methods.retrieval import chunk_tokens

    if a.threads:
        torch.set_num_threads(a.threads)
    engine = nodekv.load_engine(a.model)
    tok = engine.tokenizer
    ids = tok.encode(TEXT.read_text())
    chunks = [tok.decode(ids[s:e]) for s, e in chunk_tokens(ids, 256, 32)]
    times: dict[int, list[float]] = {1: [], a.batch: []}
    for _ in range(a.rounds):
        for b in times:
            seconds, _ = simulate_seconds(engine, chunks, a.draws, b)
            times[b].append(seconds)
    base = statistics.median(times[1])
    print(f"| draws per forward | s for {a.draws} draws | vs 1 |\n|---:|---:|---:|")
    for b, ts in times.items():
        print(f"| {b} | {statistics.median(ts):.1f} | {base / statistics.median(ts):.2f}x |")


if __name__ == "__main__":
    main()
