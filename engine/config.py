"""Model configuration for the Llama family, read from HF `config.json` or GGUF metadata, plus named presets."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 frequency-dependent RoPE scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder: RMSNorm, RoPE, GQA, SwiGLU, optional QKV bias."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    max_seq_len: int
    head_dim: int = 0  # 0 = dim // n_heads
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "intermediate_size", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"config: {name} must be positive, got {getattr(self, name)}")
        if self.head_dim == 0:  # after the checks: n_heads may have been 0
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.head_dim <= 0:
            raise ModelLoadError(f"config: head_dim must be positive, got {self.head_dim}")
        if self.n_heads % self.n_kv_heads:
            raise ModelLoadError(f"config: n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ModelLoadError(f"config: head_dim={self.head_dim} must be even for RoPE")

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face `config.json` dict; unsupported architectures are refused by name, a field
        missing or of the wrong type (null, a string, a list) by its name."""
        if not isinstance(cfg, Mapping):
            raise ModelLoadError(f"config.json holds a {type(cfg).__name__}, expected a JSON object")
        archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {arch!r}; nodekv runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if cfg.get("hidden_act", "silu") != "silu" or cfg.get("mlp_bias"):
            raise ModelLoadError(f"unsupported MLP (hidden_act={cfg.get('hidden_act')!r}, mlp_bias="
                                 f"{cfg.get('mlp_bias')}); nodekv implements SwiGLU without bias")
        quant = cfg.get("quantization_config")
        if quant:  # bitsandbytes/fp8 weights sit under the plain names: they would load as numbers, not fail
            method = quant.get("quant_method", "?") if isinstance(quant, Mapping) else quant
            raise ModelLoadError(f"quantised checkpoint (quantization_config: {method}) is not supported; nodekv "
                                 "loads float weights from a HF directory, or a quantised .gguf file")
        rope = cfg.get("rope_parameters") or {}  # transformers >= 5 keeps theta and scaling here
        if not isinstance(rope, Mapping):
            raise ModelLoadError(f"config.json field 'rope_parameters' is {rope!r}, expected an object")

        def num(key: str, kind: type, default: float | None = None) -> Any:
            return config_number(cfg, key, kind, "config.json", default)

        n_heads = num("num_attention_heads", int)
        return cls(
            vocab_size=num("vocab_size", int),
            dim=num("hidden_size", int),
            n_layers=num("num_hidden_layers", int),
            n_heads=n_heads,
            n_kv_heads=num("num_key_value_heads", int, n_heads) or n_heads,
            intermediate_size=num("intermediate_size", int),
            max_seq_len=num("max_position_embeddings", int, 2048),
            head_dim=num("head_dim", int, 0),
            rope_theta=config_number(cfg if "rope_theta" in cfg else rope, "rope_theta", float, "config.json", 10000.0),
            rope_scaling=_rope_scaling_from_hf(cfg.get("rope_scaling") or rope),
            norm_eps=num("rms_norm_eps", float, 1e-5),
            tie_embeddings=config_flag(cfg, "tie_word_embeddings", "config.json", False),
            qkv_bias=config_flag(cfg, "attention_bias", "config.json", arch == "Qwen2ForCausalLM"),
            architecture=arch,
        )

    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face `config.json` dict of this config (`from_hf` reads it back to an equal config): what
        transformers needs to build the same model, e.g. as the reference for random weights of a preset's shapes."""
        scaling = None
        if self.rope_scaling is not None:
            s = self.rope_scaling
            scaling = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                       "high_freq_factor": s.high_freq_factor,
                       "original_max_position_embeddings": s.original_max_position_embeddings}
        return {
            "architectures": [self.architecture], "model_type": _HF_MODEL_TYPES[self.architecture],
            "vocab_size": self.vocab_size, "hidden_size": self.dim, "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads, "num_key_value_heads": self.n_kv_heads,
            "intermediate_size": self.intermediate_size, "max_position_embeddings": self.max_seq_len,
            "head_dim": self.head_dim, "rope_theta": self.rope_theta, "rope_scaling": scaling,
            "rms_norm_eps": self.norm_eps, "tie_word_embeddings": self.tie_embeddings,
            "attention_bias": self.qkv_bias, "hidden_act": "silu",
        }


_HF_MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}


def _rope_scaling_from_hf(scaling: Mapping[str, Any] | None) -> RopeScaling | None:
    if not scaling:
        return None
    if not isinstance(scaling, Mapping):
        raise ModelLoadError(f"config.json field 'rope_scaling' is {scaling!r}, expected an object")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ModelLoadError(f"unsupported rope_scaling type {kind!r}; nodekv implements 'llama3'")
    where = "config.json rope_scaling"
    return RopeScaling(
        factor=config_number(scaling, "factor", float, where),
        low_freq_factor=config_number(scaling, "low_freq_factor", float, where),
        high_freq_factor=config_number(scaling, "high_freq_factor", float, where),
        original_max_position_embeddings=config_number(scaling, "original_max_position_embeddings", int, where),
    )


def config_number(values: Mapping[str, Any], key: str, kind: type, where: str, default: float | None = None) -> Any:
    """`values[key]` as `kind` (int or float), `default` when it is absent or null; a ModelLoadError naming `key` and
    `where` it was read (e.g. "config.json") when it is required and absent, or not a number of that kind (a
    string, a list, a bool, a fraction where an integer belongs: int() would raise TypeError or cut it silently)."""
    value = values.get(key)
    if value is None:
        if default is None:
            raise ModelLoadError(f"{where} lacks required field {key!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (kind is int and not float(value).is_integer()):
        expected = "an integer" if kind is int else "a number"
        raise ModelLoadError(f"{where} field {key!r} is {value!r}, expected {expected}")
    return kind(value)


def config_flag(values: Mapping[str, Any], key: str, where: str, default: bool | None = None) -> bool | None:
    """`values[key]`, which must be a bool, or `default` when it is absent or null; a ModelLoadError naming `key`
    and `where` it was read for anything else (bool() would take the string "false" as true)."""
    value = values.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ModelLoadError(f"{where} field {key!r} is {value!r}, expected true or false")
    return value


_LLAMA3_SCALING = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=8192)

PRESETS: dict[str, ModelConfig] = {
    "llama-3.1-8b": ModelConfig(
        vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, intermediate_size=14336,
        max_seq_len=131072, rope_theta=500000.0, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192), norm_eps=1e-5,
    ),
    "llama-3.2-1b": ModelConfig(
        vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, intermediate_size=8192,
        max_seq_len=131072, rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING, norm_eps=1e-5, tie_embeddings=True,
    ),
    "llama-3.2-3b": ModelConfig(
        vocab_size=128256, dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, intermediate_size=8192,
        max_seq_len=131072, rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING, norm_eps=1e-5, tie_embeddings=True,
    ),
    "qwen2.5-0.5b": ModelConfig(
        vocab_size=151936, dim=896, n_layers=24, n_heads=14, n_kv_heads=2, intermediate_size=4864,
        max_seq_len=32768, rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=True, qkv_bias=True,
        architecture="Qwen2ForCausalLM",
    ),
    "qwen2.5-1.5b": ModelConfig(
        vocab_size=151936, dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, intermediate_size=8960,
        max_seq_len=32768, rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=True, qkv_bias=True,
        architecture="Qwen2ForCausalLM",
    ),
    "smollm2-135m": ModelConfig(
        vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, intermediate_size=1536,
        max_seq_len=8192, rope_theta=100000.0, norm_eps=1e-5, tie_embeddings=True,
    ),
}


def preset(name: str) -> ModelConfig:
    """A named config without weights, for FLOP projection."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
