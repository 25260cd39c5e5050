"""Prefill and decode speed of nodekv against HF transformers on the same GGUF, same dtype, same threads,
measured side by side in one process; with --llama-cpp also llama.cpp (llama-cpp-python, computing on the Q4_1
blocks); optionally HF's and nodekv's bf16-vs-fp32 top-1 agreement.

    python -m nodekv.bench.engine_speed [--dtypes float32,bfloat16] [--prefill 512,2048,8192] [--decode 128]
                                        [--llama-cpp]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Iterator

import torch

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "examples" / "lost_in_translation.txt"
QUALITY = ROOT / ".." / "shared" / "data" / "leval" / "quality.jsonl"


def _timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def load_hf(path: Path, dtype: torch.dtype):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    return model.eval()


@torch.inference_mode()
def hf_prefill(model, ids: list[int]) -> None:
    model(torch.tensor([ids]), logits_to_keep=1)


@torch.inference_mode()
def hf_decode(model, prompt: list[int], n: int) -> int:
    """Greedy decoding with HF's KV cache, one token per forward (what generate() does, without its extras)."""
    out = model(torch.tensor([prompt]), logits_to_keep=1)
    past, token = out.past_key_values, out.logits[0, -1].argmax()
    for _ in range(n):
        out = model(token.view(1, 1), past_key_values=past, logits_to_keep=1)
        past, token = out.past_key_values, out.logits[0, -1].argmax()
    return n


class LlamaCpp:
    """llama.cpp on the same GGUF through llama-cpp-python (an optional peer: see DESIGN.md §7 for its build flags)."""

    def __init__(self, path: Path, n_ctx: int, threads: int):
        import llama_cpp

        self._lib = llama_cpp
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                   n_batch=512, logits_all=False, verbose=False)

    def prefill(self, ids: list[int]) -> None:
        self.llm.reset()
        self.llm.eval(ids)

    def decode(self, prompt: list[int], n: int) -> float:
        """Seconds for n greedy tokens after `prompt`."""
        import numpy as np

        self.prefill(prompt)
        t = time.perf_counter()
        for _ in range(n):
            logits = np.ctypeslib.as_array(self._lib.llama_get_logits_ith(self.llm._ctx.ctx, -1),
                                           shape=(self.llm.n_vocab(),))
            self.llm.eval([int(logits.argmax())])
        return time.perf_counter() - t


def nodekv_decode(engine, prompt: list[int], n: int) -> tuple[int, float]:
    """(tokens generated, seconds) for greedy decoding after `prompt`."""
    s = engine.session()
    s.append(prompt)
    t = time.perf_counter()
    s.generate(n)
    return len(s) - len(prompt), time.perf_counter() - t


def speed_table(args) -> Iterator[tuple]:
    import nodekv
    from nodekv.engine.engine import DTYPES

    from nodekv.engine.loader import default_model_path

    llama = LlamaCpp(default_model_path(), max(args.prefill + [640]) + 8, args.threads) if args.llama_cpp else None
    for dtype_name in args.dtypes:
        engine = nodekv.load_engine(dtype=dtype_name, threads=args.threads)
        tok = engine.tokenizer
        ids = tok.encode(TEXT.read_text())
        while len(ids) < max(args.prefill + [512]):
            ids = ids + ids
        hf = None if args.skip_hf else load_hf(engine.path, DTYPES[dtype_name])
        nan = float("nan")
        for n in args.prefill:
            repeats = 3 if n <= 2048 else 1
            ours = _timed(lambda: engine.session().append(ids[:n]), repeats)
            theirs = _timed(lambda: hf_prefill(hf, ids[:n]), repeats) if hf else nan
            cpp = _timed(lambda: llama.prefill(ids[:n]), repeats) if llama else nan
            yield dtype_name, f"prefill {n}", n / ours, n / theirs, n / cpp
        if args.decode:
            prompt = ids[:512]
            count, ours = nodekv_decode(engine, prompt, args.decode)
            theirs = cpp = nan
            if hf:
                t_prefill = _timed(lambda: hf_prefill(hf, prompt), 1)
                t_all = _timed(lambda: hf_decode(hf, prompt, args.decode), 1)
                theirs = (t_all - t_prefill) / args.decode
            if llama:
                cpp = llama.decode(prompt, args.decode) / args.decode
            yield dtype_name, f"decode {count} after 512", count / ours, 1 / theirs, 1 / cpp
        del hf, engine


def agreement(args) -> list[tuple]:
    """Top-1 agreement of bf16 with fp32 logits on the first 2,000 tokens of the first QuALITY story."""
    import nodekv

    story = json.loads(QUALITY.open().readline())["input"]
    e32 = nodekv.load_engine(threads=args.threads)
    ids = e32.tokenizer.encode(story)[:2000]
    ours32 = e32.forward_logits(ids).argmax(-1)
    ours16 = nodekv.load_engine(dtype="bfloat16", threads=args.threads).forward_logits(ids).argmax(-1)
    rows = [("nodekv", (ours32 == ours16).float().mean().item())]
    if not args.skip_hf:
        with torch.inference_mode():
            hf32 = load_hf(e32.path, torch.float32)(torch.tensor([ids])).logits[0].argmax(-1)
            hf16 = load_hf(e32.path, torch.bfloat16)(torch.tensor([ids])).logits[0].argmax(-1)
        rows.append(("HF transformers", (hf32 == hf16).float().mean().item()))
        rows.append(("nodekv fp32 vs HF fp32", (ours32 == hf32).float().mean().item()))
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="float32,bfloat16", type=lambda s: s.split(","))
    p.add_argument("--prefill", default="512,2048,8192", type=lambda s: [int(x) for x in s.split(",") if x])
    p.add_argument("--decode", default=128, type=int, help="tokens to decode after a 512-token prompt (0: skip)")
    p.add_argument("--threads", default=2, type=int)
    p.add_argument("--skip-hf", action="store_true", help="time nodekv alone")
    p.add_argument("--llama-cpp", action="store_true", help="also time llama.cpp (needs llama-cpp-python)")
    p.add_argument("--agreement", action="store_true", help="also measure bf16-vs-fp32 top-1 agreement")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    print(f"SmolLM2-135M-Instruct (GGUF Q4_1), {args.threads} threads, torch {torch.__version__}")
    print(f"{'dtype':<10} {'work':<22} {'nodekv tok/s':>13} {'HF tok/s':>10} {'ratio':>7}"
          f" {'llama.cpp (Q4_1)':>17} {'ratio':>7}")
    for dtype, work, ours, theirs, cpp in speed_table(args):
        print(f"{dtype:<10} {work:<22} {ours:>13,.1f} {theirs:>10,.1f} {ours / theirs:>7.2f} {cpp:>17,.1f}"
              f" {ours / cpp:>7.2f}", flush=True)
    if args.agreement:
        print("\nbf16 vs fp32 top-1 agreement, first 2,000 tokens of the first QuALITY story")
        for who, value in agreement(args):
            print(f"  {who:<24} {value:.2%}")


if __name__ == "__main__":
    main()
