"""A model users outgrow to: a GGUF with a preset's shapes (Llama-3.1-8B by default) and seeded random weights in
Q4_K_M's block types (Q4_K projections and embedding, Q6_K down projections and output head), written here at bench
time and never committed; then loaded and run as the engine runs a real one: a prompt of --tokens prefilled as
nodes of 256 with node mass collected, --decode tokens decoded greedily. Prints resident memory (after load, and
the peak) against the file's size, and tokens/s.

Random blocks carry small fp16 scales so that activations stay finite; the values are noise, the cost is a real
model's. Llama 3.1's RoPE frequency scaling is left out of the file (it changes no cost). No tokenizer: the prompt
is seeded random ids.

    nodekv bench big_model [--preset llama-3.1-8b] [--tokens 512] [--decode 16] [--threads 2] [--path FILE]
"""
from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter

from nodekv.bench import count, output_file
from nodekv.engine.config import PRESETS, ModelConfig
from nodekv.engine.engine import Engine
from nodekv.engine.loader import gguf_config, load_checkpoint
from nodekv.engine.model import Llama
from nodekv.engine.page_pool import PagePool
from nodekv.paths import atomic_path, base

Q4_K, Q6_K, F32 = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K, GGMLQuantizationType.F32
# (block bytes, byte offsets of its fp16 scales): Q4_K = d, dmin, scales[12], qs[128]; Q6_K = ql, qh, scales[16], d
BLOCKS = {Q4_K: (144, (0, 2)), Q6_K: (210, (208,))}
SCALE = np.float16(2e-3).tobytes()  # small enough that 32 random layers stay finite


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, cols / 256 * block bytes]: random quants and sub-block scales, the fp16 scales set to SCALE."""
    size, scales = BLOCKS[qtype]
    blocks = rng.integers(0, 256, (rows * cols // 256, size), dtype=np.uint8)
    for at in scales:
        blocks[:, at:at + 2] = np.frombuffer(SCALE, dtype=np.uint8)
    return blocks.reshape(rows, -1)


def tensors(c: ModelConfig) -> list[tuple[str, GGMLQuantizationType, int, int]]:
    """(GGUF name, type, rows, cols) of every tensor, in file order (norms are fp32 vectors: rows 1)."""
    out = [("token_embd.weight", Q4_K, c.vocab_size, c.dim)]
    for i in range(c.n_layers):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", F32, 1, c.dim), (p + "attn_q.weight", Q4_K, c.q_dim, c.dim),
                (p + "attn_k.weight", Q4_K, c.kv_dim, c.dim), (p + "attn_v.weight", Q4_K, c.kv_dim, c.dim),
                (p + "attn_output.weight", Q4_K, c.dim, c.q_dim), (p + "ffn_norm.weight", F32, 1, c.dim),
                (p + "ffn_gate.weight", Q4_K, c.intermediate_size, c.dim),
                (p + "ffn_up.weight", Q4_K, c.intermediate_size, c.dim),
                (p + "ffn_down.weight", Q6_K, c.dim, c.intermediate_size)]
    return out + [("output_norm.weight", F32, 1, c.dim), ("output.weight", Q6_K, c.vocab_size, c.dim)]


def fits_blocks(c: ModelConfig) -> bool:
    """Whether every quantised tensor's row width (dim, q_dim, intermediate_size) is whole 256-value blocks."""
    return all(cols % 256 == 0 for cols in (c.dim, c.q_dim, c.intermediate_size))


SUPPORTED = [name for name, c in PRESETS.items() if fits_blocks(c)]  # e.g. not smollm2-135m: its width is 576
SHAPE = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "intermediate_size")


def _shapes(c: ModelConfig) -> tuple[int, ...]:
    return tuple(getattr(c, key) for key in SHAPE)


def write_model(c: ModelConfig, path: Path, seed: int = 0) -> None:
    """The GGUF file of config `c` with random blocks, streamed tensor by tensor (memory: one tensor), written
    atomically: a failure or a kill leaves no partial file (`atomic_path`)."""
    with atomic_path(path) as tmp:
        _write(c, tmp, seed)


def _write(c: ModelConfig, path: Path, seed: int) -> None:
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(c.n_layers)
    w.add_context_length(c.max_seq_len)
    w.add_embedding_length(c.dim)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.n_heads)
    w.add_head_count_kv(c.n_kv_heads)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_vocab_size(c.vocab_size)
    layout = tensors(c)
    for name, qtype, rows, cols in layout:
        if qtype == F32:
            w.add_tensor_info(name, (cols,), np.dtype(np.float32), cols * 4)
        else:
            w.add_tensor_info(name, (rows, cols // 256 * BLOCKS[qtype][0]), np.dtype(np.uint8),
                              rows * cols // 256 * BLOCKS[qtype][0], raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, qtype, rows, cols in layout:
        w.write_tensor_data(np.ones(cols, dtype=np.float32) if qtype == F32 else random_blocks(qtype, rows, cols, rng))
    w.close()


class IdTokenizer:
    """What generation needs of a tokenizer when the ids are all there is: decoding as the ids' numbers."""

    eos_ids = ()

    def decode(self, ids, skip_special: bool = False) -> str:
        return "".join(f"<{i}>" for i in ids)

    def decode_stream(self, skip_special: bool = False, context=()):
        from nodekv.engine.tokenizer import DecodeStream

        return DecodeStream(self, skip_special, context)


def gib(kib: int) -> float:
    return kib / 2 ** 20


def rss_kib() -> int:
    return int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmRSS")))


def run(path: Path, tokens: int, decode: int, node: int = 256) -> dict:
    """Load `path`, prefill `tokens` random ids as nodes of `node` with node mass, decode `decode`; the numbers."""
    t = time.perf_counter()
    ckpt = load_checkpoint(path)
    model = Llama(ckpt.config, ckpt.tensors)
    del ckpt
    load_s = time.perf_counter() - t
    after_load = rss_kib()
    engine = Engine(model, IdTokenizer(), PagePool(model.config, model.dtype, -(-(tokens + decode) // 64) + 1, 64))
    ids = torch.randint(0, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    s = engine.session()
    t = time.perf_counter()
    for i in range(0, tokens, node):
        s.append(ids[i:i + node], collect=True)
    prefill_s = time.perf_counter() - t
    mass = s.node_mass()
    t = time.perf_counter()
    gen = s.generate(decode)
    decode_s = time.perf_counter() - t
    return {"file_gib": path.stat().st_size / 2 ** 30, "load_s": load_s, "rss_after_load_gib": gib(after_load),
            "peak_rss_gib": gib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss),
            "prefill_tok_s": tokens / prefill_s, "decode_tok_s": len(gen.ids) / decode_s,
            "mass_rows_sum": float(mass.sum.sum(1).mean()), "finite": bool(torch.isfinite(mass.sum).all())}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="nodekv bench big_model", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-3.1-8b", choices=SUPPORTED,
                   help="whose shapes: a preset whose widths are whole Q4_K blocks of 256")
    p.add_argument("--tokens", type=count, default=512)
    p.add_argument("--decode", type=count, default=16)
    p.add_argument("--threads", type=count, default=2)
    p.add_argument("--path", type=output_file, default=None,
                   help="the GGUF to write, or to reuse if it has the preset's shapes (default "
                        "build/<preset>-random.gguf)")
    args = p.parse_args(argv)
    config = PRESETS[args.preset]
    if args.tokens + args.decode > config.max_seq_len:
        p.error(f"--tokens {args.tokens} + --decode {args.decode} exceed {args.preset}'s {config.max_seq_len:,} tokens")
    torch.set_num_threads(args.threads)
    path = args.path or base() / "build" / f"{args.preset}-random.gguf"
    if path.exists():  # reused, not rewritten: the table would otherwise label another model's file as the preset
        try:
            found = _shapes(gguf_config(path))
        except ValueError as e:
            p.error(f"--path {path} exists and is not a GGUF model ({e}); choose another --path")
        if found != _shapes(config):
            p.error(f"--path {path} exists and is not a {args.preset} model (its {', '.join(SHAPE)} are {found}); "
                    "choose another --path")
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        write_model(config, path)
        print(f"wrote {path} ({path.stat().st_size / 2 ** 30:.2f} GiB) in {time.perf_counter() - t:.0f} s")
    r = run(path, args.tokens, args.decode)
    print(f"| {args.preset} (random Q4_K/Q6_K) | file GiB | RSS after load GiB | peak RSS GiB | load s | "
          f"prefill {args.tokens} tok/s (node mass on) | decode tok/s |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {args.threads} threads | {r['file_gib']:.2f} | {r['rss_after_load_gib']:.2f} | {r['peak_rss_gib']:.2f} | "
          f"{r['load_s']:.0f} | {r['prefill_tok_s']:.1f} | {r['decode_tok_s']:.2f} |")
    if not r["finite"]:
        print("(the random weights overflowed: node mass is not finite; the timings stand)")


if __name__ == "__main__":
    main()
