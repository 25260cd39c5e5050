"""Shared fixtures: tiny random HF checkpoints (the reference model is HF transformers on the same weights)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))

SHARED_DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"


def tiny_hf_model(kind: str = "llama", *, tied: bool = False, rope_scaling: bool = False, n_kv_heads: int = 2,
                  seed: int = 0, max_positions: int = 256):
    """A random-weight HF model: 2 layers, d=64, 4 query heads (GQA 4:2 by default)."""
    import transformers

    torch.manual_seed(seed)
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if rope_scaling:
        rope = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    common = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
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


@pytest.fixture
def save_hf(tmp_path):
    """Save an HF model to a fresh directory (optionally sharded) and return the path."""

    def save(model, shard: str | None = None) -> Path:
        out = tmp_path / "ckpt"
        model.save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
        return out

    return save
