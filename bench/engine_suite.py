"""One run of the engine benchmarks, gathered into one JSON file (`nodekv bench results_page` plots it) and printed as
Markdown. Every piece runs in its own process at the same thread count:

- prefill and decode tokens/s and peak memory for nodekv, HF transformers sdpa and llama.cpp (when installed) at
  512 / 2K / 8K tokens on qwen2.5-0.5b and at 512 / 2K on qwen2.5-1.5b (the model the methods are judged on) and
  SmolLM2, and HF eager attention on SmolLM2 (its T×T scores take minutes beyond 2K; `engine_speed`), with torch.mm's
  fp32 peak measured in the same run and nodekv's achieved GFLOP/s;
- batched decode throughput at 1/2/4/8 sessions (`batch`);
- node-mass collection against HF's output_attentions (`node_mass`, SmolLM2);
- one node appended to a cached prompt, probed and rolled back, against prefilling the whole prompt again (here).

Only the first model prefills 8K tokens (every model's 8K prefills would double the run): the whole run took 13
minutes on a 2-core Xeon (2026-11-28). `--quick` runs every piece small (a smoke test): its numbers are
not measurements, so its files go to build/engine_suite-quick unless --out says otherwise (never over the committed
results by default) and say "quick": true. Every piece's file and engine.json are written together, and only once
every piece has succeeded: a failed run leaves the previous results as they were.

    nodekv bench engine_suite [--out results/engine] [--threads 2] [--quick]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nodekv.bench import count, models, output_folder
from nodekv.bench.engine_speed import ENGINES as SPEED_ENGINES
from nodekv.paths import base, results_dir, write_atomic

MODELS = ("qwen2.5-0.5b", "qwen2.5-1.5b", "smollm2-135m")
ENGINES = "nodekv,hf,llama-cpp"
EAGER_MODEL = "smollm2-135m"  # HF eager runs on this model only (a second HF load of the 0.5B costs a minute)
# rounds: for the first model; other_rounds: for the others
FULL = {"rounds": "512:512,2048:2048,8192:8192", "other_rounds": "512:512,2048:2048", "decode": "16", "repeats": "1",
        "batches": "1,2,4,8", "batch_rounds": "1", "mass_tokens": "2048", "append": (512, 2048)}
QUICK = {"rounds": "64:64,128:128", "other_rounds": "64:64,128:128", "decode": "4", "repeats": "1",
         "batches": "1,2", "batch_rounds": "1", "mass_tokens": "256", "append": (64, 128)}
QUICK_OUT = "engine_suite-quick"  # --quick's default folder under build/ (git-ignored)
NODE = 300  # tokens per appended node, as PECAN's information points run


def append_vs_prefill(model: str, lengths: tuple[int, ...], threads: int, repeats: int = 1) -> list[dict]:
    """Seconds to append one NODE-token node after T cached tokens, probe Yes/No and roll back, against prefilling
    the T + NODE tokens from an empty cache; best of `repeats`, the two alternated."""
    import torch

    from nodekv.bench.engine_speed import TEXT
    from nodekv.engine.engine import load_engine

    torch.set_num_threads(threads)
    engine = load_engine(model, threads=threads)
    ids = engine.tokenizer.encode(TEXT.read_text())
    ids = (ids * -(-(max(lengths) + NODE) // len(ids)))[:max(lengths) + NODE]
    rows = []
    for t in lengths:
        append, prefill = [], []
        with engine.session() as s:
            s.append(ids[:t], node_id="cached")
            for _ in range(repeats):
                start = time.perf_counter()
                s.append(ids[t:t + NODE], node_id="new")
                s.probe()
                s.truncate("cached")
                append.append(time.perf_counter() - start)
                start = time.perf_counter()
                with engine.session() as fresh:
                    fresh.append(ids[:t + NODE])
                    fresh.probe()
                prefill.append(time.perf_counter() - start)
        rows.append({"cached": t, "node": NODE, "append_s": min(append), "prefill_s": min(prefill)})
    return rows


class PieceFailed(Exception):
    """A piece's child process failed: the run stops, and nothing is written."""


def _run(module: str, args: list[str], json_path: Path, threads: int) -> dict:
    """Run `nodekv.bench.<module>` with --json (its Markdown and its errors go straight to our output as they are
    printed); its JSON, or PieceFailed."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    proc = subprocess.run([sys.executable, "-m", f"nodekv.bench.{module}", *args, "--json", str(json_path)], env=env)
    print(flush=True)
    if proc.returncode != 0:
        raise PieceFailed(f"{module} failed (exit {proc.returncode}; its error is above)")
    return json.loads(json_path.read_text())


def _names(known):
    """An argparse type for a comma-separated list of names from `known`."""
    def names(text: str) -> str:
        if unknown := sorted(set(text.split(",")) - set(known)):
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}; choose from {', '.join(known)}")
        return text
    return names


def _lap(started: float, laps: dict[str, float]) -> float:
    """Minutes since the last lap (since `started` for the first)."""
    return (time.perf_counter() - started) / 60 - sum(laps.values())


def main() -> None:
    p = argparse.ArgumentParser(prog="nodekv bench engine_suite", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=output_folder, default=None,
                   help=f"folder for engine.json (default: results/engine; with --quick, build/{QUICK_OUT})")
    p.add_argument("--threads", type=count, default=2)
    p.add_argument("--quick", action="store_true", help="every piece small: checks that the run works")
    p.add_argument("--models", default=",".join(MODELS), type=models,
                   help="comma-separated: the speed table's models; the first also runs the batch and append rows")
    p.add_argument("--engines", default=None, type=_names(SPEED_ENGINES),
                   help=f"for the speed table (default: {ENGINES})")
    p.add_argument("--append-child", help=argparse.SUPPRESS)  # internal: the append measurement's process
    args = p.parse_args()
    cfg = QUICK if args.quick else FULL
    if args.append_child:
        print(json.dumps(append_vs_prefill(args.append_child, cfg["append"], args.threads)))
        return
    out = args.out or (base() / "build" / QUICK_OUT if args.quick else results_dir("engine"))
    with tempfile.TemporaryDirectory(prefix="engine_suite-") as pieces:
        try:
            result = run_suite(args, cfg, Path(pieces))
        except PieceFailed as e:
            print(f"error: {e}; nothing written to {out}", file=sys.stderr)
            sys.exit(1)
        out.mkdir(parents=True, exist_ok=True)
        for piece in sorted(Path(pieces).glob("*.json")):  # the pieces' own files, beside engine.json as before
            write_atomic(out / piece.name, piece.read_bytes())
    write_atomic(out / "engine.json", json.dumps(result, indent=1))
    laps = ", ".join(f"{k} {v:.1f}" for k, v in result["minutes"].items())
    print(f"\nwhole run {result['seconds'] / 60:.1f} min ({laps}); results in {out / 'engine.json'}")


def run_suite(args: argparse.Namespace, cfg: dict, pieces: Path) -> dict:
    """Every piece in turn, each child writing its JSON into `pieces`; engine.json's contents, or PieceFailed."""
    started = time.perf_counter()
    result = {"date": datetime.date.today().isoformat(), "threads": args.threads, "quick": args.quick, "speed": {},
              "minutes": {}}
    for model in args.models:
        print(f"# {model}\n", flush=True)
        engines = args.engines or ENGINES + (",hf-eager" if model == EAGER_MODEL else "")
        result["speed"][model] = _run("engine_speed", [
            "--model", model, "--threads", str(args.threads), "--engines", engines,
            "--rounds", cfg["rounds" if model == args.models[0] else "other_rounds"], "--decode", cfg["decode"],
            "--repeats", cfg["repeats"]],
            pieces / f"speed-{model}.json", args.threads)
        result["minutes"][model] = _lap(started, result["minutes"])
    print("# batched decode\n", flush=True)
    result["batch"] = _run("batch", ["--model", args.models[0], "--threads", str(args.threads), "--batches",
                                     cfg["batches"], "--rounds", cfg["batch_rounds"]], pieces / "batch.json",
                           args.threads)
    result["minutes"]["batch"] = _lap(started, result["minutes"])
    print("# node mass\n", flush=True)
    result["node_mass"] = _run("node_mass", ["--tokens", cfg["mass_tokens"], "--threads", str(args.threads)],
                               pieces / "node_mass.json", args.threads)
    result["minutes"]["node mass"] = _lap(started, result["minutes"])
    proc = subprocess.run([sys.executable, "-m", "nodekv.bench.engine_suite", "--append-child", args.models[0],
                           "--threads", str(args.threads), *(["--quick"] if args.quick else [])],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no error output"])[-1]
        raise PieceFailed(f"the append measurement failed (exit {proc.returncode}): {last}")
    result["append"] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"# one {NODE}-token node appended, probed and rolled back vs the whole prompt prefilled again "
          f"({args.models[0]})\n\n| cached tokens | append + probe + roll back s | prefill again s | speed-up |\n"
          "|---:|---:|---:|---:|")
    for row in result["append"]:
        print(f"| {row['cached']:,} | {row['append_s']:.3f} | {row['prefill_s']:.3f} | "
              f"{row['prefill_s'] / row['append_s']:.1f}x |")
    result["minutes"]["append"] = _lap(started, result["minutes"])
    result["seconds"] = time.perf_counter() - started
    return result


if __name__ == "__main__":
    main()
