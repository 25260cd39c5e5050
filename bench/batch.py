"""Batched steps across sessions, side by side in one process on one engine:

- decode: B sessions with different prompts generate N tokens each through `Engine.generate_batch` (one forward per
  step for all B); aggregate tokens/s at each B and the ratio to B = 1 (which runs the fused one-token decoder), for
  each precision asked (an engine each: exact fp32 activations, and the int8 fast path; a name ending in -avx2 runs
  that engine with its C++ kernels capped at AVX2, which on a CPU with AVX-512 shows what the 512-bit kernels buy:
  `--precisions exact,exact-avx2`);
- prefill: 8 short prompts as one `Engine.append_batch` against 8 `Session.append` calls.

EOS is masked (a logits processor) so every session generates exactly N tokens. Rounds alternate between the
configurations and the table shows medians, since these machines are noisy.

    nodekv bench batch [--model qwen2.5-0.5b] [--batches 1,2,4,8] [--tokens 32] [--prompt-tokens 48]
                                 [--precisions exact,int8] [--rounds 3] [--threads N] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from nodekv.bench import count, counts, model, output_file
from nodekv.paths import example, write_atomic

TEXT = example("lost_in_translation.txt")


def prompts(ids: list[int], n: int, length: int) -> list[list[int]]:
    """n different prompts of `length` tokens: consecutive windows of the story's `ids` (which must hold them)."""
    return [ids[i * length:(i + 1) * length] for i in range(n)]


AVX2_CAP = "-avx2"  # a precision name's suffix: its engine's kernels capped at AVX2 (`cpu_ops.simd_level`)


def _precisions(text: str) -> list[str]:
    """Precisions an fp32 CPU engine runs here (bf16 needs bf16 matrix units), each optionally with AVX2_CAP, checked
    before any model loads."""
    from nodekv.engine.model import check_precision

    for name in text.split(","):
        try:
            check_precision(name.removesuffix(AVX2_CAP), torch.float32, torch.device("cpu"))
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return text.split(",")


def decode_seconds(engine, batch: list[list[int]], n_tokens: int) -> float:
    eos = list(engine.tokenizer.eos_ids)

    def no_eos(ids, logits):
        logits[eos] = float("-inf")
        return logits

    sessions = [engine.session() for _ in batch]
    try:
        engine.append_batch(sessions, batch)
        start = time.perf_counter()
        gens = engine.generate_batch(sessions, n_tokens, logits_processors=[no_eos])
        seconds = time.perf_counter() - start
    finally:
        for s in sessions:
            s.release()
    assert all(len(g.ids) == n_tokens for g in gens)
    return seconds


def prefill_seconds(engine, batch: list[list[int]], batched: bool) -> float:
    sessions = [engine.session() for _ in batch]
    try:
        start = time.perf_counter()
        if batched:
            engine.append_batch(sessions, batch)
        else:
            for s, ids in zip(sessions, batch):
                s.append(ids)
        return time.perf_counter() - start
    finally:
        for s in sessions:
            s.release()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-0.5b", type=model)
    p.add_argument("--batches", default="1,2,4,8", type=counts, help="session counts for the decode rows")
    p.add_argument("--tokens", type=count, default=32, help="tokens generated per session")
    p.add_argument("--prompt-tokens", type=count, default=48, help="tokens per prompt")
    p.add_argument("--prefill-prompts", type=count, default=8)
    p.add_argument("--precisions", default="exact,int8", type=_precisions,
                   help="engines' precisions for the decode rows")
    p.add_argument("--rounds", type=count, default=3)
    p.add_argument("--threads", type=count, default=None)
    p.add_argument("--json", type=output_file, default=None, help="also write the medians here")
    args = p.parse_args(argv)

    from nodekv.engine.engine import load_engine
    from nodekv.engine.models import resolve_model
    from nodekv.engine.tokenizer import Tokenizer
    from nodekv.kernels.cpu_ops import simd_level

    precisions, sizes = args.precisions, args.batches
    n = max(max(sizes), args.prefill_prompts)
    ids = Tokenizer.from_model(resolve_model(args.model)).encode(TEXT.read_text())
    if n * args.prompt_tokens > len(ids):  # every prompt a different window of the story, none cut short
        p.error(f"{n} prompts of --prompt-tokens {args.prompt_tokens} need {n * args.prompt_tokens:,} tokens; "
                f"{TEXT.name} has {len(ids):,} ({len(ids) // n:,} per prompt at most)")
    texts = prompts(ids, n, args.prompt_tokens)
    loaded = {}  # one engine per precision, shared by its capped name
    for prec in precisions:
        base = prec.removesuffix(AVX2_CAP)
        loaded.setdefault(base, load_engine(args.model, threads=args.threads, precision=base))
    engines = {prec: loaded[prec.removesuffix(AVX2_CAP)] for prec in precisions}
    levels = {prec: "avx2" if prec.endswith(AVX2_CAP) else "avx512" for prec in precisions}
    engine = engines[precisions[0]]
    for e in loaded.values():
        decode_seconds(e, texts[:2], 4)  # warm: the fused decoder, RoPE tables, thread pools
    decode = {(prec, b): [] for prec in precisions for b in sizes}
    prefill = {True: [], False: []}
    for _ in range(args.rounds):
        for prec, b in decode:
            with simd_level(levels[prec]):
                decode[prec, b].append(decode_seconds(engines[prec], texts[:b], args.tokens))
        for batched in (False, True):
            prefill[batched].append(prefill_seconds(engine, texts[:args.prefill_prompts], batched))

    print(f"model {args.model}, {torch.get_num_threads()} threads, {args.tokens} tokens per session after "
          f"{args.prompt_tokens}-token prompts, median of {args.rounds} rounds\n")
    print("| precision | sessions | step ms | aggregate decode tok/s | vs 1 session | vs exact, 1 session |")
    print("|---|---:|---:|---:|---:|---:|")
    rate = {key: key[1] * args.tokens / statistics.median(times) for key, times in decode.items()}
    for prec, b in decode:
        print(f"| {prec} | {b} | {1e3 * statistics.median(decode[prec, b]) / args.tokens:.1f} | {rate[prec, b]:.1f} "
              f"| {rate[prec, b] / rate[prec, sizes[0]]:.2f}x | {rate[prec, b] / rate[precisions[0], sizes[0]]:.2f}x |")
    seq, bat = statistics.median(prefill[False]), statistics.median(prefill[True])
    n = args.prefill_prompts * args.prompt_tokens
    print(f"\n| prefill of {args.prefill_prompts} x {args.prompt_tokens} tokens | ms | tok/s |")
    print("|---|---:|---:|")
    print(f"| {args.prefill_prompts} sequential appends | {1e3 * seq:.0f} | {n / seq:.0f} |")
    print(f"| one append_batch | {1e3 * bat:.0f} | {n / bat:.0f} |")
    print(f"\nbatched prefill: {seq / bat:.2f}x the sequential tokens/s")
    if args.json:
        write_atomic(args.json, json.dumps({
            "model": args.model, "threads": torch.get_num_threads(), "tokens": args.tokens,
            "prompt_tokens": args.prompt_tokens,
            "decode_s": {prec: {b: statistics.median(decode[prec, b]) for b in sizes} for prec in precisions},
            "prefill_prompts": args.prefill_prompts, "prefill_s": {"sequential": seq, "batched": bat}}, indent=1))


if __name__ == "__main__":
    main()
