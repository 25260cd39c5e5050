"""Shared fixtures: tiny random HF checkpoints (the reference model is HF transformers on the same weights)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from nodekv.paths import keep_checkout_off_sys_path

keep_checkout_off_sys_path()  # `python -m pytest` and xdist's workers put the repository root first on sys.path

# `make test` runs pytest-xdist workers side by side: the cores are shared among them, not oversubscribed
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
if not torch.cuda.is_available():  # Triton kernels run (slowly, single-threaded) in its interpreter on CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")
# the Triton tests on CPU tensors need the interpreter; on a GPU, tests/kernels/test_triton_cuda.py runs the kernels
needs_triton_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                              reason="Triton on CPU tensors needs TRITON_INTERPRET=1")
MODEL_BACKENDS = ["torch", "cpu", pytest.param("triton", marks=needs_triton_interpreter)]  # engines on CPU tensors

SHARED_DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"

# The longest test files, longest first (seconds under `make test` on 2 cores, 2026-11-29: 233, 140, 112, 93, 89, 87,
# 85, 61). `make test` deals whole files to its two workers in collection order (`--dist loadfile
# --no-loadscope-reorder`), so these start first and the short files even out the end; dealt by test count instead,
# a long file with few tests came last and ran alone for minutes while the other worker idled.
LONGEST_FIRST = ("engine/test_qwen.py", "methods/test_gor.py", "methods/test_pecan.py", "bench/test_bench_report.py",
                 "engine/test_smollm2.py", "evaluation/test_ray_tasks.py", "engine/test_batch.py",
                 "methods/test_dice.py")


def pytest_collection_modifyitems(items: list) -> None:
    """LONGEST_FIRST's files before the rest, each in its collection order."""
    rank = {f"tests/{name}": i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


@pytest.fixture(autouse=True)
def _threads_kept():
    """torch's thread count as the worker's share again after each test: a command run in-process (a benchmark's
    main, the CLI's --threads, `load_engine(threads=...)`) sets it for the whole process, and a worker left on 2
    threads beside another worker ran its decode-heavy tests 5x slower (OpenMP threads waiting on a preempted one)."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def new_cache(model, tokens: int = 512, page_size: int = 8):
    """An empty paged KV cache for `model` (a nodekv Llama) in a pool of its own; small pages cross boundaries."""
    from nodekv.engine.kv_cache import PagedKVCache
    from nodekv.engine.page_pool import PagePool

    return PagedKVCache(PagePool(model.config, model.dtype, -(-tokens // page_size), page_size), model.ops)


def cached_kv(session):
    """A session's cached keys and values, every layer, as [2, layers, kv_heads, length, hd]."""
    from nodekv.kernels.reference import gather_kv

    pool, table = session.cache.pool, torch.tensor(session.cache.pages, dtype=torch.int32)
    return torch.stack([torch.stack([gather_kv(pages, i, table, session.cache.length)
                                     for i in range(pool.k.shape[0])]) for pages in (pool.k, pool.v)])


class DigitTokenizer:
    """A stand-in tokenizer for the 101-token tiny models: token i is the text f"<{i}>"."""

    eos_ids = (100,)

    def encode(self, text):
        import re

        pieces = re.findall(r"<(\d+)>", text)
        if "".join(f"<{p}>" for p in pieces) != text:
            raise ValueError(f"{text!r} is not a sequence of <i> tokens")
        return [int(p) for p in pieces]

    def decode(self, ids, skip_special=False):
        return "".join(f"<{i}>" for i in ids)

    def decode_stream(self, skip_special=False, context=()):
        from nodekv.engine.tokenizer import DecodeStream

        return DecodeStream(self, skip_special, context)

    def token_id(self, piece):
        if not (piece.startswith("<") and piece.endswith(">")):
            raise ValueError(f"{piece!r} is not a single token")
        return int(piece[1:-1])

    def chat(self, messages, add_generation_prompt=True):
        """A token per word of the messages' contents: a prompt's length, for the checks that measure one."""
        return [ord(word[0]) % 100 for m in messages for word in m["content"].split()]


def tiny_engine(path, backend: str = "auto", dtype=torch.float32, pages: int = 64, page_size: int = 8,
                kv_dtype=None):
    """A nodekv Engine on a saved tiny checkpoint with the digit tokenizer and a small page pool of its own, holding
    kv_dtype (default: the model's dtype)."""
    from nodekv.engine.engine import Engine
    from nodekv.engine.loader import load_checkpoint
    from nodekv.engine.model import Llama
    from nodekv.engine.page_pool import PagePool

    ckpt = load_checkpoint(path)
    model = Llama(ckpt.config, ckpt.tensors, dtype, backend)
    return Engine(model, DigitTokenizer(), PagePool(ckpt.config, kv_dtype or model.dtype, pages, page_size),
                  ckpt.path, ckpt.fingerprint)


def bare_engine(**attributes):
    """An Engine with no model that holds `attributes` alone (a tokenizer, a config, flops): a method takes it for
    an engine (it refuses what is not one), and a test's scripted steps never reach a model."""
    from nodekv.engine.engine import Engine

    engine = Engine.__new__(Engine)
    vars(engine).update(attributes)
    return engine


def tiny_hf_model(kind: str = "llama", *, tied: bool = False, rope_scaling: bool = False, n_kv_heads: int = 2,
                  seed: int = 0, max_positions: int = 256, layers: int = 2):
    """A random-weight HF model: 2 layers by default, d=64, 4 query heads (GQA 4:2 by default)."""
    import transformers

    torch.manual_seed(seed)
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if rope_scaling:
        rope = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    common = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=n_kv_heads, max_position_embeddings=max_positions, rms_norm_eps=1e-5,
                  tie_word_embeddings=tied, rope_parameters=rope)
    if kind == "qwen2":
        cfg, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    else:
        cfg, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    model = cls(cfg).eval()
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0: randomise them so they are tested
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.5 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory):
    """A tiny random HF llama (128 positions) and the directory it is saved in, shared by a test module."""
    hf = tiny_hf_model(max_positions=128)
    path = tmp_path_factory.mktemp("tiny")
    hf.save_pretrained(path)
    return hf, path


def refs_held(sessions) -> list[int]:
    """Per page of the sessions' pool, how many live sessions hold it: what the pool's refcounts must equal."""
    held = [0] * sessions[0].cache.pool.n_pages
    for s in sessions:
        if not s.cache.released:
            for p in s.cache.pages:
                held[p] += 1
    return held


@pytest.fixture
def save_hf(tmp_path):
    """Save an HF model to a fresh directory (optionally sharded) and return the path."""

    def save(model, shard: str | None = None) -> Path:
        out = tmp_path / "ckpt"
        model.save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
        return out

    return save


def write_tiny_gguf(hf_model, path: Path, qtype: str = "q8_0", arch: str = "llama") -> None:
    """Write an HF model as a GGUF file the way llama.cpp's converter does (Q/K rows permuted for interleaved
    RoPE in llama/mistral files, not in qwen2 ones; linear weights quantised to `qtype`), and set the HF model's
    weights to the quantise-dequantise round trip so both sides hold the same numbers."""
    import gguf
    import numpy as np

    cfg = hf_model.config
    qt = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_1": gguf.GGMLQuantizationType.Q4_1,
          "q4_0": gguf.GGMLQuantizationType.Q4_0, "f32": gguf.GGMLQuantizationType.F32}[qtype]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)

    def permute(x: np.ndarray, heads: int) -> np.ndarray:
        return x.reshape(heads, 2, x.shape[0] // heads // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer_names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                   "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                   "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down"}
    permuted = arch in ("llama", "mistral")  # the converter's Qwen2Model keeps HF's row order (NeoX RoPE)
    state = hf_model.state_dict()
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for key, tensor in state.items():
        if key in names:
            name = names[key]
        else:
            _, _, i, rest = key.split(".", 3)
            module, _, kind = rest.rpartition(".")
            name = f"blk.{i}.{layer_names[module]}.{kind}"
        x = tensor.detach().float().numpy()
        if x.ndim == 2 and qt != gguf.GGMLQuantizationType.F32:
            packed = gguf.quants.quantize(x, qt)
            with torch.no_grad():
                tensor.copy_(torch.from_numpy(gguf.quants.dequantize(packed, qt)))
            x = packed
        if permuted and ".attn_q." in name:
            x = permute(x, cfg.num_attention_heads)
        elif permuted and ".attn_k." in name:
            x = permute(x, cfg.num_key_value_heads)
        w.add_tensor(name, x, raw_dtype=qt if x.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# The method interface's fixtures: a saving test method and a tiny engine that the CLI loads.
@pytest.fixture
def registry():
    """The registry as it was before the test (tests declare methods of their own)."""
    from nodekv.methods import names
    from nodekv.methods.base import REGISTERED

    names()  # the built-in methods register on first use: before the copy, or restoring it would drop them
    saved = dict(REGISTERED)
    yield REGISTERED
    REGISTERED.clear()
    REGISTERED.update(saved)


@pytest.fixture
def saver(registry):
    """A method that can save: its index counts the document's words (a document containing FAIL fails); `width`
    is part of the index key, `search` is not; `built` counts the indexes built."""
    from nodekv.methods.base import Answer, Method
    from nodekv.methods.options import Option

    class WordCount(Method, name="test-saver"):
        """Counts the document's words (a test method)."""

        options = (Option("width", int, 1, "part of the index key", low=1),
                   Option("search", int, 0, "not part of the index key"))
        can_save = True
        built = 0

        def index_key(self) -> dict:
            return {"width": self.config.width}

        def index(self, document: str) -> dict:
            if "FAIL" in document:
                raise ValueError("this document asks to fail")
            WordCount.built += 1
            return {"words": len(document.split())}

        def answer(self, index: dict, question: str, options: tuple[str, ...] = ()) -> Answer:
            return Answer(str(index["words"]), ["document"], [{"words": index["words"]}])

        def save_index(self, index: dict, path) -> None:
            Path(path).write_text(json.dumps(index))

        def load_index(self, path) -> dict:
            return json.loads(Path(path).read_text())

        def describe(self, index: dict) -> list[str]:
            return [f"{index['words']} words"]

    return WordCount


@pytest.fixture
def engine(save_hf, monkeypatch):
    """A tiny random-weight engine, also what the CLI's load_engine returns."""
    import nodekv

    path = save_hf(tiny_hf_model())
    eng = tiny_engine(path)
    eng.path = path
    monkeypatch.setattr(nodekv, "load_engine", lambda *args, **kwargs: eng)
    return eng
