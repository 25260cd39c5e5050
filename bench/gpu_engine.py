"""The engine on a GPU against HF transformers on the same weights: a preset's shapes (qwen2.5-1.5b by default, or
llama-3.1-8b) with seeded random weights that transformers initialises, run by both, side by side, on one device.

Random weights because real ones cannot reach a lent GPU machine; every cost is a real model's, and numerics are
compared against HF on the very same tensors. Prints the device, torch, Triton and transformers versions, then:

- correctness (--check, on by default): nodekv's logits in the model dtype and HF's own forward in that dtype, each
  against HF in fp32 (max |error|; target: nodekv <= 2x HF's); node mass (heads and layers averaged) against HF's
  eager attention probabilities summed the same way (targets 1e-5 in fp32, 1e-3 in bf16); a probe rolled back leaves
  the cache's pages bit-identical and a repeated probe gives bit-identical logits;
- speed (CUDA events, medians): prefill of each --prompts length against HF sdpa (target >= 1.0x), the same prefill
  with node mass over --nodes nodes against without (target <= 1.25x), decode tokens/s at batch 1 (target >= 2x HF)
  and at --batch, each with the fused steps (CUDA graphs on a GPU) and op by op. The GPU is kept busy for 2 s
  before the timings, so that its clocks are up.

--fresh-mass kernel,sdpa,kernel/64x32x4x2 checks and times a bf16 prefill's node mass each way side by side (the
Triton kernel's one pass, SDPA then the Triton mass pass, or the kernel at chosen tiles: `triton_ops.FRESH_PREFILL_MASS`
and `MASS_TILES`); by default the engine's own choice.

    nodekv bench gpu_engine [--preset qwen2.5-1.5b] [--prompts 2048,8192] [--decode 64] [--batch 32] [--nodes 32]
        [--fresh-mass kernel,sdpa,kernel/64x32x4x2]
    nodekv bench gpu_engine --preset tiny --device cpu --dtype float32 --prompts 512,1024   # a smoke run on the CPU
"""
from __future__ import annotations

import argparse
import contextlib
import time
from typing import Callable, TypeVar

import torch

from nodekv.bench import count, device as device_arg
from nodekv.bench.engine_runners import hf_cache_name
from nodekv.engine.cache_batch import CacheBatch
from nodekv.engine.config import ModelConfig, preset
from nodekv.engine.kv_cache import PagedKVCache
from nodekv.engine.loader import hf_state_tensors
from nodekv.engine.model import Llama
from nodekv.engine.page_pool import PagePool
from nodekv.kernels import triton_ops
from nodekv.kernels.triton_attention import check_tiles

# a few-second stand-in for the smoke run and the tests (Qwen2's layout: QKV bias, tied embeddings)
TINY = ModelConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=128,
                   max_seq_len=1024, rope_theta=10000.0, norm_eps=1e-6, tie_embeddings=True, qkv_bias=True,
                   architecture="Qwen2ForCausalLM")
TARGETS = {"logits": 2.0, "mass_fp32": 1e-5, "mass_bf16": 1e-3, "prefill": 1.0, "mass_cost": 1.25, "decode": 2.0}
CHECK_TOKENS = 512  # the correctness prompt (HF eager keeps every layer's [H, T, T] probabilities)
DECODE_PROMPT = 512  # the prompt the decode steps follow
R = TypeVar("R")


def config_of(name: str) -> ModelConfig:
    return TINY if name == "tiny" else preset(name)


def hf_model(config: ModelConfig, dtype: torch.dtype, device: torch.device, attention: str, seed: int = 0):
    """transformers' model of `config` with its own seeded random initialisation (norms and biases perturbed too, so
    that they are tested), in `dtype` on `device`."""
    import transformers

    fields = config.to_hf()
    hf_config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32,
                                                              attn_implementation=attention)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn_like(p))
    return model.to(dtype).eval()


def new_cache(model: Llama, tokens: int) -> PagedKVCache:
    pool = PagePool(model.config, model.dtype, -(-tokens // 64) + 1, 64, model.device)
    return PagedKVCache(pool, model.ops)


def node_bounds(tokens: int, nodes: int, device: torch.device) -> torch.Tensor:
    return torch.linspace(0, tokens, nodes + 1, device=device).round().int()


@torch.inference_mode()
def our_mass(model: Llama, ids: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """Each prompt token's attention mass per node, heads and layers averaged: float64 [T, N]."""
    cache = new_cache(model, ids.shape[0])
    mass = torch.zeros(ids.shape[0], bounds.shape[0] - 1, device=model.device)
    cache.collect(bounds, mass)
    model.forward(ids, cache, logits=None)
    c = model.config
    return mass.double().cpu() / (c.n_heads * c.n_layers)


@torch.inference_mode()
def hf_mass(hf, ids: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """The same from HF eager's attention probabilities: Σ over layers, heads and each node's keys, averaged."""
    probs = hf(ids[None], output_attentions=True).attentions  # per layer [1, H, T, T]
    total = sum(p[0].double().sum(0) for p in probs)  # [T, T]
    b = bounds.tolist()
    mass = torch.stack([total[:, a:z].sum(1) for a, z in zip(b, b[1:])], 1)
    return mass.cpu() / (len(probs) * probs[0].shape[1])


@torch.inference_mode()
def probe_is_undone(model: Llama, ids: torch.Tensor, probe: torch.Tensor) -> bool:
    """A probe after `ids`, rolled back: the same length and pages, every cached position's keys and values
    bit-identical, and a repeat of the probe gives bit-identical logits."""
    cache = new_cache(model, ids.shape[0] + probe.shape[0])
    model.forward(ids, cache, logits=None)
    positions = torch.arange(ids.shape[0])
    cached = lambda: [t for layer in range(model.config.n_layers) for t in cache.read(layer, positions)]  # noqa: E731
    state, before = cache.state(), cached()
    first = model.forward(probe, cache, logits="all")
    cache.restore(state)
    same = cache.state() == state and all(torch.equal(a, b) for a, b in zip(cached(), before))
    return same and torch.equal(model.forward(probe, cache, logits="all"), first)


def spin_up(device: torch.device, seconds: float = 2.0) -> None:
    """Busy the GPU for `seconds` of matrix products: an idle H200 clocks its SMs at 345 MHz, and the first timings
    of a run were taken while the clocks rose (a 2K prefill timed at 2.1x its later time)."""
    if device.type != "cuda":
        return
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(50):
            a @ a
        torch.cuda.synchronize()


def timer(device: torch.device, warmup: int = 2) -> Callable[[Callable[[], object], int], float]:
    """time(fn, repeats): fn's median seconds after `warmup` runs (CUDA events on a GPU)."""
    def cuda_time(fn, repeats):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        return sorted(times)[len(times) // 2]

    def cpu_time(fn, repeats):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    return cuda_time if device.type == "cuda" else cpu_time


@torch.inference_mode()
def our_prefill(model: Llama, ids: torch.Tensor, bounds: torch.Tensor | None = None) -> None:
    cache = new_cache(model, ids.shape[0])
    if bounds is not None:
        cache.collect(bounds, torch.zeros(ids.shape[0], bounds.shape[0] - 1, device=model.device))
    model.forward(ids, cache)
    cache.release()


@torch.inference_mode()
def our_decode(model: Llama, pool: PagePool, prompt: torch.Tensor, batch: int, steps: int,
               graphs: bool = True) -> Callable[[], None]:
    """A function that runs `steps` greedy decode steps of `batch` sequences after `prompt` (each prefilled once,
    here, into `pool`, as an engine's sessions share one), rolled back after each run. graphs: the model's fused
    decode steps (CUDA graphs on a GPU), else op by op."""
    caches = [PagedKVCache(pool, model.ops) for _ in range(batch)]
    for c in caches:
        model.forward(prompt, c, logits=None)
    start = [c.state() for c in caches]

    @torch.inference_mode()
    def run() -> None:
        model.fused_decode = graphs
        tokens = torch.zeros(batch, dtype=torch.long)
        for _ in range(steps):
            logits = model.forward_batch(tokens, CacheBatch(caches, [1] * batch))
            tokens = logits.argmax(-1).cpu()
        for c, s in zip(caches, start):
            c.restore(s)

    return run


@torch.inference_mode()
def hf_decode(hf, prompt: torch.Tensor, batch: int, steps: int) -> Callable[[], None]:
    """The same for HF: `batch` copies of `prompt` prefilled once, here, into its cache, which each run crops back."""
    out = hf(prompt[None].expand(batch, -1).to(hf.device), use_cache=True, logits_to_keep=1)
    name = hf_cache_name(hf)
    cache, first = out[name], out.logits[:, -1].argmax(-1, keepdim=True)

    @torch.inference_mode()
    def run() -> None:
        token = first
        for _ in range(steps):
            token = hf(token, use_cache=True, **{name: cache}).logits[:, -1].argmax(-1, keepdim=True)
        cache.crop(-steps)

    return run


def or_failure(run: Callable[[], R]) -> R | str:
    """run()'s result, or "failed: <error>" where it raises one of Python's errors: a way of summing node mass that
    fails (a torch without the op it calls, say) leaves the other rows of a one-call GPU session. A CUDA fault is
    not caught: it leaves the device unusable for the rows after it anyway."""
    try:
        return run()
    except (RuntimeError, ValueError, NotImplementedError, AttributeError) as e:
        if "CUDA error" in str(e):
            raise
        return f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}"


def versions(device: torch.device) -> str:
    import transformers
    import triton

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    return f"{name}; torch {torch.__version__}, Triton {triton.__version__}, transformers {transformers.__version__}"


def mass_way(way: str) -> tuple[str, tuple[int, int, int, int] | None]:
    """A --fresh-mass way as (`triton_ops.FRESH_PREFILL_MASS`, `triton_ops.MASS_TILES`): "kernel", "sdpa", or
    "kernel/BMxBNxWARPSxSTAGES", the kernel at those tiles; a ValueError naming a malformed one."""
    how, _, text = way.partition("/")
    if how not in ("kernel", "sdpa") or (text and how != "kernel"):
        raise ValueError(f"{way!r} is not kernel, sdpa or kernel/BMxBNxWARPSxSTAGES (e.g. kernel/64x32x4x2)")
    if not text:
        return how, None
    try:
        tiles = tuple(int(t) for t in text.split("x"))
    except ValueError:
        raise ValueError(f"{way!r}: tiles are four integers joined by x, e.g. kernel/64x32x4x2") from None
    check_tiles(tiles, repr(way))
    return how, tiles


@contextlib.contextmanager
def _mass_settings_kept():
    """`triton_ops`' node-mass settings restored after the block: main sets them for each way it times, and a run in a
    test's process must not leave them to the tests after it."""
    saved = triton_ops.FRESH_PREFILL_MASS, triton_ops.MASS_TILES
    try:
        yield
    finally:
        triton_ops.FRESH_PREFILL_MASS, triton_ops.MASS_TILES = saved


@_mass_settings_kept()
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen2.5-1.5b", help="a config preset (nodekv.engine.config) or 'tiny'")
    p.add_argument("--device", default="cuda", type=device_arg)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--prompts", default="2048,8192", help="prefill lengths, comma-separated")
    p.add_argument("--decode", type=count, default=64, help="decode steps timed")
    p.add_argument("--batch", type=count, default=32, help="the batched decode's sessions")
    p.add_argument("--nodes", type=count, default=32, help="node segments of the mass measurements")
    p.add_argument("--repeats", type=count, default=5)
    p.add_argument("--no-check", dest="check", action="store_false", help="speed only (e.g. an 8B on one GPU)")
    p.add_argument("--fresh-mass", default=None,
                   help="how a bf16 prefill sums node mass: kernel, sdpa or kernel/BMxBNxWARPSxSTAGES (the kernel at "
                        "those tiles), several comma-separated to check and time them side by side (default: the "
                        "engine's own, triton_ops.FRESH_PREFILL_MASS and MASS_TILES)")
    a = p.parse_args(argv)
    tiles = triton_ops.MASS_TILES
    fresh_mass = a.fresh_mass.split(",") if a.fresh_mass else \
        [triton_ops.FRESH_PREFILL_MASS + ("/" + "x".join(map(str, tiles)) if tiles else "")]
    try:
        for way in fresh_mass:
            mass_way(way)
    except ValueError as e:
        p.error(f"--fresh-mass: {e}")

    def summed_by(way: str) -> str:
        """Set how the engine's fresh prefills sum node mass; the label of a row where several are compared."""
        triton_ops.FRESH_PREFILL_MASS, triton_ops.MASS_TILES = mass_way(way)
        return "" if len(fresh_mass) == 1 else f" ({way})"

    device, dtype = a.device, getattr(torch, a.dtype)
    config = config_of(a.preset)
    prompts = [int(x) for x in a.prompts.split(",")]
    if not all(1 <= T <= config.max_seq_len for T in prompts) or DECODE_PROMPT + a.decode > config.max_seq_len:
        p.error(f"--prompts {a.prompts} and {DECODE_PROMPT} + --decode {a.decode} must fit {a.preset}'s "
                f"{config.max_seq_len}-token window")
    time_it = timer(device)
    g = torch.Generator().manual_seed(0)
    print(f"{a.preset} shapes, random weights, {a.dtype}, a fresh prefill's node mass by {' and '.join(fresh_mass)}; "
          f"{versions(device)}")

    hf32 = hf_model(config, torch.float32, device, "eager")
    tensors = hf_state_tensors(hf32.state_dict())
    hf = hf_model(config, dtype, device, "sdpa")  # the speed reference, on the same weights
    hf.load_state_dict(hf32.state_dict())
    if a.check:
        ids = torch.randint(0, config.vocab_size, (min(CHECK_TOKENS, config.max_seq_len),), generator=g)
        with torch.inference_mode():
            exact = hf32(ids[None].to(device)).logits[0].double().cpu()
        hf_low = hf_model(config, dtype, device, "eager")
        hf_low.load_state_dict(hf32.state_dict())
        bounds = node_bounds(ids.shape[0], a.nodes, device)
        with torch.inference_mode():
            hf_err = (hf_low(ids[None].to(device)).logits[0].double().cpu() - exact).abs().max().item()
        ref_mass = hf_mass(hf32, ids.to(device), bounds)
        del hf_low
        rows = []
        for check_dtype in dict.fromkeys([torch.float32, dtype]):
            model = Llama(config, tensors, check_dtype, device=device)
            with torch.inference_mode():
                got = model.forward(ids, new_cache(model, ids.shape[0]), logits="all").double().cpu()
            err = (got - exact).abs().max().item()
            mass_target = TARGETS["mass_fp32" if check_dtype == torch.float32 else "mass_bf16"]
            mass_errs = []  # fp32 prefills keep the kernel: one row, at the first way's tiles
            for how in fresh_mass if check_dtype != torch.float32 else fresh_mass[:1]:
                label = summed_by(how)
                if check_dtype == torch.float32:
                    label = ""
                got = or_failure(lambda: our_mass(model, ids, bounds))
                err_text = got if isinstance(got, str) else f"{(got - ref_mass).abs().max().item():.3g}"
                mass_errs.append(err_text + label)
            mass_err = "; ".join(mass_errs) + f" (target <= {mass_target:g})"
            undone = probe_is_undone(model, ids[:-16], ids[-16:])
            rows.append((check_dtype, err, mass_err, undone))
            del model
        print(f"\n| check ({ids.shape[0]} tokens, {a.nodes} nodes) | logits max err vs HF fp32 | HF's own err "
              f"| node mass max err vs HF eager | probe undone bit-exactly |")
        print("|---|---|---|---|---|")
        for check_dtype, err, mass_err, undone in rows:
            name = str(check_dtype).removeprefix("torch.")
            own = hf_err if check_dtype == dtype else 0.0
            logit_note = "" if check_dtype == torch.float32 else \
                f" ({err / max(own, 1e-30):.2f}x HF's, target <= {TARGETS['logits']})"
            print(f"| nodekv {name} | {err:.3g}{logit_note} | {own:.3g} | {mass_err} | {undone} |")
    del hf32
    if device.type == "cuda":
        torch.cuda.empty_cache()

    model = Llama(config, tensors, dtype, device=device)
    del tensors
    spin_up(device)
    print(f"\n| {a.dtype} | nodekv | HF sdpa | nodekv / HF | target |")
    print("|---|---|---|---|---|")
    for T in prompts:
        ids = torch.randint(0, config.vocab_size, (T,), generator=g)
        ours = time_it(lambda: our_prefill(model, ids), a.repeats)
        with torch.inference_mode():
            theirs = time_it(lambda: hf(ids[None].to(device), logits_to_keep=1), a.repeats)
        print(f"| prefill {T} tokens, tok/s | {T / ours:,.0f} | {T / theirs:,.0f} | {theirs / ours:.2f}x "
              f"| >= {TARGETS['prefill']}x |")
        bounds = node_bounds(T, a.nodes, device)
        for how in fresh_mass:
            label = summed_by(how)
            with_mass = or_failure(lambda: time_it(lambda: our_prefill(model, ids, bounds), a.repeats))
            if isinstance(with_mass, str):
                print(f"| prefill {T} tokens with node mass ({a.nodes} nodes){label}, s | {with_mass} | | | |")
                continue
            print(f"| prefill {T} tokens with node mass ({a.nodes} nodes){label}, s | {with_mass:.4f} "
                  f"(without: {ours:.4f}) | | {with_mass / ours:.2f}x of without | <= {TARGETS['mass_cost']}x |")
    prompt = torch.randint(0, config.vocab_size, (DECODE_PROMPT,), generator=g)
    pages = -(-(prompt.shape[0] + a.decode + 1) // 64)
    pool = PagePool(config, dtype, (1 + a.batch) * pages + 1, 64, device)  # + the decode graphs' padding page
    for batch in dict.fromkeys([1, a.batch]):
        theirs = time_it(hf_decode(hf, prompt, batch, a.decode), a.repeats)
        for graphs in (True, False):
            ours = time_it(our_decode(model, pool, prompt, batch, a.decode, graphs), a.repeats)
            how = ("CUDA graphs" if device.type == "cuda" else "fused") if graphs else "op by op"
            target = f">= {TARGETS['decode']}x" if batch == 1 and graphs else "reported"
            print(f"| decode at batch {batch} after {DECODE_PROMPT} ({how}), tok/s | {batch * a.decode / ours:,.1f} | "
                  f"{batch * a.decode / theirs:,.1f} | {theirs / ours:.2f}x | {target} |")


if __name__ == "__main__":
    main()
