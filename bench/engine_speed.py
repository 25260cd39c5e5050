"""Prefill and decode speed of nodekv, HF transformers and llama.cpp on the same GGUF, same prompt tokens, same
threads: prefill tokens/s at 512 and 2K tokens, decode tokens/s after 512 and 4K, resident memory. One child
process per engine (so each gets a clean allocator, its own thread pools and an honest peak RSS), run one after
another; the parent prints a Markdown table as each finishes, then the ratios, nodekv's prefill GFLOP/s against a
torch.mm peak measured in the same run, and the targets. About 5 minutes on a quiet 2-core machine (--quick: 3).

    nodekv bench engine_speed [--model qwen2.5-0.5b] [--engines nodekv,hf,llama-cpp] [--threads 2]
                                        [--rounds 512:512,2048:4096] [--quick] [--json FILE]

Engines: nodekv, nodekv-avx2 (nodekv with its C++ kernels capped at AVX2: the same bits, and on a CPU with AVX-512
what it buys), nodekv-int8 (precision="int8": int8 activations in the quantised projections), nodekv-bf16-prompts
(precision="bf16": prompts multiplied on the CPU's bf16 matrix units, decode exact; refused on CPUs without them),
nodekv-bf16 (dtype="bfloat16": a bf16 model, multiplied in bf16 on CPUs with bf16 matrix units), nodekv-kv16
(kv_dtype="float16": a KV cache of halves, as llama.cpp's default), nodekv-bf16-prompts-kv16 (both), hf (HF
transformers, sdpa attention), hf-eager (HF's eager attention), llama-cpp. `--rounds`
P:C,... prefills P tokens from an empty cache and decodes after C; peak RSS is also read after each round (rounds
run in the order given, so in increasing length it is the peak up to that length).

llama.cpp (llama-cpp-python) is optional: without it its row says "not installed". Build it for AVX2 (what every
machine here has) with CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
-DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF".
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from nodekv.bench import count, model, output_file
from nodekv.paths import example, write_atomic

TEXT = example("lost_in_translation.txt")
DEFAULT_MODEL = "qwen2.5-0.5b"
ENGINES = {"nodekv": "nodekv", "nodekv-avx2": "nodekv avx2",
           "nodekv-int8": "nodekv int8", "nodekv-bf16-prompts": "nodekv bf16 prompts",
           "nodekv-bf16": "nodekv bf16", "nodekv-kv16": "nodekv kv16",
           "nodekv-bf16-prompts-kv16": "nodekv bf16 prompts kv16", "hf": "HF transformers sdpa", "hf-eager": "HF transformers eager",
           "llama-cpp": "llama.cpp"}
DEFAULT_ENGINES = ("nodekv", "nodekv-int8", "hf", "llama-cpp")
# (tokens prefilled from an empty cache and timed, prompt length when the timed decode starts)
ROUNDS = ((512, 512), (2048, 4096))
# nodekv's prefill tokens/s on qwen2.5-0.5b at 2 threads, measured before this bench existed: not to go below
PREFILL_BASELINE = {512: 221.0, 2048: 210.0}
FP32_PEAK_BASELINE = 135.0  # torch.mm fp32 2048² GFLOP/s at 2 threads on the machine that measured PREFILL_BASELINE
DECODE_TARGET = 1.0  # nodekv's decode tokens/s at least llama.cpp's (same GGUF, same threads), in the same run
INT8_PREFILL_TARGET = 1.3  # the int8 path's prefill tokens/s over the exact path's, in the same run


def prompt_ids(path: Path, n: int) -> list[int]:
    """The first n tokens of the bundled story (repeated if it is shorter), by nodekv's tokenizer (= HF's)."""
    from nodekv.engine.tokenizer import Tokenizer

    ids = Tokenizer.from_gguf(path).encode(TEXT.read_text())
    return (ids * -(-n // len(ids)))[:n]


def matmul_gflops(dtype_name: str, size: int, repeats: int) -> float:
    """Best-of-`repeats` GFLOP/s of torch.mm on two size x size matrices (after one untimed call)."""
    import torch

    a = torch.randn(size, size).to(getattr(torch, dtype_name))
    b = torch.randn(size, size).to(a.dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * size**3 / best / 1e9


def cpu_summary() -> str:
    """The CPU's name and the vector/matrix extensions that decide which dtype is fast (Linux: /proc/cpuinfo)."""
    info = {key.strip(): value.strip() for key, value in
            (line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().splitlines() if ":" in line)}
    flags = set(info.get("flags", "").split())
    name = info.get("model name") or platform.machine()
    return name + ", " + ", ".join(f"{label} {'yes' if flag in flags else 'no'}" for label, flag in
                                   (("AVX2", "avx2"), ("AVX-512", "avx512f"), ("AVX-512 BF16", "avx512_bf16"),
                                    ("AMX", "amx_tile")))


def run_child(engine: str, path: Path, ids: list[int], args) -> dict | str:
    """Measure one engine in its own process; its JSON result, or a short reason it has none."""
    if engine == "llama-cpp" and importlib.util.find_spec("llama_cpp") is None:
        return "not installed"
    rounds = [(p, c) for p, c in args.rounds if engine != "hf-eager" or c <= args.eager_max]
    if not rounds:
        return f"not run (eager attention only up to {args.eager_max} tokens)"
    cmd = [sys.executable, "-m", "nodekv.bench.engine_speed", "--child", engine, "--model", str(path),
           "--threads", str(args.threads), "--decode", str(args.decode), "--repeats", str(args.repeats),
           "--rounds", ",".join(f"{p}:{c}" for p, c in rounds)]
    # OpenMP/MKL pools sized before torch starts, so no library runs on more threads than the others
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
               TRANSFORMERS_VERBOSITY="error", HF_HUB_DISABLE_PROGRESS_BARS="1", TQDM_DISABLE="1")
    proc = subprocess.run(cmd, input=json.dumps(ids), capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        return f"failed (exit {proc.returncode})"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("prefill_s", "decode_s", "prefill_flops", "continuation", "peak_rss_gib_at"):
        result[key] = {int(k): v for k, v in result[key].items()}  # JSON made the token counts strings
    return result


def child(args) -> None:
    import torch

    from nodekv.bench.engine_runners import measure

    torch.set_num_threads(args.threads)
    ids = json.loads(sys.stdin.read())
    result = measure(args.child, Path(args.model), ids, args.rounds, args.decode, args.repeats, args.threads)
    if args.child.startswith("hf"):
        import transformers
        result["version"] = f"transformers {transformers.__version__}, fp32"
    elif args.child == "llama-cpp":
        import llama_cpp
        result["version"] = f"llama-cpp-python {llama_cpp.__version__}"
    print(json.dumps(result))


def sizes(rounds) -> tuple[list[int], list[int]]:
    """The rounds' distinct prefill sizes and decode contexts, in order: the table's columns, each once (rounds
    that share a prefill time it alike)."""
    return list(dict.fromkeys(p for p, _ in rounds)), list(dict.fromkeys(c for _, c in rounds))


def speeds(result: dict, decode_tokens: int, rounds) -> list[float | None]:
    """The table's numeric columns: prefill and decode tokens/s (None: a round not run), then RSS after load and
    peak, GiB."""
    prefills, contexts = sizes(rounds)
    prefill = [p / result["prefill_s"][p] if p in result["prefill_s"] else None for p in prefills]
    decode = [decode_tokens / result["decode_s"][c] if c in result["decode_s"] else None for c in contexts]
    return prefill + decode + [result["rss_after_load_gib"], result["peak_rss_gib"]]


def _k(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else f"{n:,}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, type=model, help="a registered name or a .gguf path")
    p.add_argument("--engines", default=",".join(DEFAULT_ENGINES), type=lambda s: s.split(","),
                   help=f"comma-separated, run in this order, of {', '.join(ENGINES)} (default: "
                        f"{','.join(DEFAULT_ENGINES)})")
    p.add_argument("--rounds", default=ROUNDS, type=_rounds, help="P:C,...: prefill P tokens, decode after C")
    p.add_argument("--json", type=output_file, default=None, help="also write the results here")
    p.add_argument("--eager-max", type=count, default=2048, help="longest context HF eager attention runs at (its "
                                                               "T×T scores take minutes at 8K)")
    p.add_argument("--threads", default=2, type=count, help="for every engine, prefill and decode alike")
    p.add_argument("--decode", type=count, help="tokens decoded (and timed) after each prompt (default: 64)")
    p.add_argument("--repeats", type=count, help="rounds per engine; the fastest counts (default: 2)")
    p.add_argument("--quick", action="store_true",
                   help="one round, 16 decoded tokens (unless --repeats or --decode say otherwise): checks it runs")
    p.add_argument("--child", choices=list(ENGINES), help=argparse.SUPPRESS)  # internal: measure one engine
    args = p.parse_args(argv)
    # --quick changes the defaults only: a value given on purpose wins
    args.decode = args.decode or (16 if args.quick else 64)
    args.repeats = args.repeats or (1 if args.quick else 2)
    if unknown := set(args.engines) - set(ENGINES):
        p.error(f"unknown engine(s) {', '.join(sorted(unknown))}; choose from {', '.join(ENGINES)}")
    if args.child:
        return child(args)

    import torch

    from nodekv.engine.cpu import native_bf16_matmul
    from nodekv.engine.models import resolve_model

    torch.set_num_threads(args.threads)
    if (bf16 := [e for e in args.engines if e.startswith("nodekv-bf16-prompts")]) and not native_bf16_matmul():
        p.error(f"{bf16[0]} needs a CPU with bf16 matrix units (AMX or AVX512-BF16); this one has none")
    path = resolve_model(args.model)
    if path.suffix != ".gguf":
        p.error(f"{path} is not a .gguf file: the engines must read the same GGUF")
    from nodekv.engine.loader import gguf_config

    room = gguf_config(path).max_seq_len - args.decode  # every context and its decoded tokens fit the window
    if any(c > room for _, c in args.rounds):
        args.rounds = tuple((min(p, room), min(c, room)) for p, c in args.rounds)
        print(f"(rounds cut to the model's window less the {args.decode} decoded tokens: {room:,} tokens)\n")
    ids = prompt_ids(path, max(c for _, c in args.rounds))
    fp32_peak = matmul_gflops("float32", 2048, 5)
    bf16_peak = matmul_gflops("bfloat16", 512, 1)  # 512²: at the sub-GFLOP/s rates of CPUs without bf16 units
    title = args.model if Path(args.model) == path else f"{args.model} ({path.name})"
    print(f"## {title}, {args.threads} threads\n\nCPU: {cpu_summary()}; torch {torch.__version__}. "
          f"Prompt: {TEXT.name} tokenised once, the same ids for every engine; greedy decode of {args.decode} tokens, "
          f"never stopping at EOS; fastest of {args.repeats} round(s); one process per engine.\n", flush=True)

    prefills, contexts = sizes(args.rounds)
    columns = [f"prefill {_k(p)} tok/s" for p in prefills] + [f"decode after {_k(c)} tok/s" for c in contexts]
    columns += ["RSS after load GiB", "peak RSS GiB"]
    print("| engine | " + " | ".join(columns) + " |\n|---|" + "---:|" * len(columns), flush=True)
    results, failed = {}, []
    for engine in args.engines:
        result = run_child(engine, path, ids, args)
        if isinstance(result, str):
            print(f"| {ENGINES[engine]} | {result} |" + " |" * (len(columns) - 1), flush=True)
            if result.startswith("failed"):
                failed.append(engine)
            continue
        results[engine] = result
        name = ENGINES[engine] + (f" ({result['version']})" if "version" in result else "")
        cells = ["not run" if v is None else f"{v:,.1f}" if i < len(prefills) + len(contexts) else f"{v:.2f}"
                 for i, v in enumerate(speeds(result, args.decode, args.rounds))]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    ours = results.get("nodekv")
    variants = [e for e in ENGINES if e.startswith("nodekv-")]  # each against the exact path, all against peers
    pairs = [(v, "nodekv") for v in variants]
    pairs += [(m, p) for m in ("nodekv", *variants) for p in ("hf", "hf-eager", "llama-cpp")]
    for a, b in pairs:
        if a in results and b in results:
            ratios = [x / y if x and y else None for x, y in zip(speeds(results[a], args.decode, args.rounds),
                                                                 speeds(results[b], args.decode, args.rounds))]
            print(f"| {ENGINES[a]} / {ENGINES[b]} | " + " | ".join("" if r is None else f"{r:.2f}x" for r in ratios)
                  + " |")
    print(f"\ntorch.mm at {args.threads} threads: fp32 2048² {fp32_peak:.1f} GFLOP/s, bf16 512² {bf16_peak:.2f} "
          f"GFLOP/s ({bf16_peak / fp32_peak:.1%} of fp32: " + ("bf16 GEMM is native here, so bf16 models multiply in "
          "bf16)." if native_bf16_matmul() else "without bf16 matrix units, bf16 models' prefill weights stay fp32)."))
    if ours:
        report_nodekv(results, fp32_peak, args)
    if failed:  # a table with a hole is no result: nothing written, and the caller (engine_suite) sees it
        sys.exit(f"error: {', '.join(failed)} failed (the error is above)"
                 + (f"; {args.json} not written" if args.json else ""))
    if args.json:
        write_atomic(args.json, json.dumps({"model": args.model, "file": path.name, "threads": args.threads,
                                            "decode_tokens": args.decode, "rounds": args.rounds, "cpu": cpu_summary(),
                                            "torch": torch.__version__, "fp32_peak_gflops": fp32_peak,
                                            "bf16_peak_gflops": bf16_peak, "results": results}, indent=1))


def report_nodekv(results: dict[str, dict], fp32_peak: float, args) -> None:
    """nodekv's prefill GFLOP/s against the fp32 peak, the targets, and how far the engines' greedy tokens agree."""
    from nodekv.engine.cpu import int8_prompts_outrun_fp32

    ours, llama = results["nodekv"], results.get("llama-cpp")
    prefills, contexts = sizes(args.rounds)
    rates = {p: ours["prefill_flops"][p] / ours["prefill_s"][p] / 1e9 for p in prefills}
    print("nodekv prefill, exact FLOP account: " + ", ".join(
        f"{_k(p)} tokens {r:.1f} GFLOP/s ({r / fp32_peak:.0%} of the fp32 peak)" for p, r in rates.items()) + ".")
    print("\nTargets:")
    for mine in ("nodekv", "nodekv-int8"):
        for c in contexts if mine in results else ():
            ratio = llama["decode_s"][c] / results[mine]["decode_s"][c] if llama else None
            verdict = "not checked (llama.cpp not run)" if ratio is None else \
                f"{ratio:.2f}x, " + ("met" if ratio >= DECODE_TARGET else "**not met**")
            print(f"- {ENGINES[mine]} decode after {_k(c)} >= {DECODE_TARGET}x llama.cpp: {verdict}")
    fast = results.get("nodekv-int8")
    exact_prompts = "" if int8_prompts_outrun_fp32() else " (its prompts exact on this CPU: int8_prompts_outrun_fp32)"
    for p in prefills if fast else ():
        ratio = ours["prefill_s"][p] / fast["prefill_s"][p]
        print(f"- nodekv int8 prefill {_k(p)} >= {INT8_PREFILL_TARGET}x nodekv{exact_prompts}: {ratio:.2f}x, "
              + ("met" if ratio >= INT8_PREFILL_TARGET else "**not met**"))
    if args.model == DEFAULT_MODEL and args.threads == 2:
        if fp32_peak < 0.9 * FP32_PEAK_BASELINE:
            print(f"- (the fp32 peak is below the {FP32_PEAK_BASELINE:.0f} GFLOP/s of the machine that set the prefill "
                  "baseline: this machine is busy or slower, so the prefill lines below compare unlike machines)")
        for p, baseline in PREFILL_BASELINE.items():
            if p not in ours["prefill_s"]:
                continue
            rate = p / ours["prefill_s"][p]
            print(f"- prefill {_k(p)} >= {baseline:.0f} tok/s (measured before this bench): {rate:.0f}, "
                  + ("met" if rate >= baseline else "**not met**"))
    c = args.rounds[0][1]
    agree = [f"{ENGINES[e]} {_common_prefix(ours['continuation'][c], r['continuation'][c])}"
             for e, r in results.items() if e != "nodekv"]
    if agree:
        print(f"\nGreedy tokens after {_k(c)}, equal to nodekv's up to the first difference (of {args.decode}): "
              + ", ".join(agree) + ".")


def _rounds(text: str) -> tuple[tuple[int, int], ...]:
    """"512:512,2048:4096" -> ((512, 512), (2048, 4096)); a context shorter than its prefill is refused."""
    try:
        rounds = tuple(tuple(int(x) for x in r.split(":")) for r in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"rounds are P:C pairs separated by commas, not {text!r}") from None
    if any(len(r) != 2 or r[0] < 1 or r[1] < r[0] for r in rounds):
        raise argparse.ArgumentTypeError(f"each round is P:C with 1 <= P <= C: {text!r}")
    return rounds


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


if __name__ == "__main__":
    main()
