"""The hand-written forward against HF transformers' modeling code on the same weights (tiny random configs)."""
from __future__ import annotations

import pytest
import torch

from conftest import MODEL_BACKENDS, new_cache, tiny_hf_model
from nodekv.engine.loader import load_checkpoint
from nodekv.engine.model import Llama

VARIANTS = {
    "llama-gqa": dict(kind="llama"),
    "llama-mha-tied": dict(kind="llama", tied=True, n_kv_heads=4),
    "llama3-rope-scaling": dict(kind="llama", rope_scaling=True),
    "qwen2-qkv-bias": dict(kind="qwen2"),
    "qwen2-tied-mqa": dict(kind="qwen2", tied=True, n_kv_heads=1),
}


def _load(path, dtype=torch.float32) -> Llama:
    ckpt = load_checkpoint(path)
    config, tensors = ckpt.config, ckpt.tensors
    return Llama(config, tensors, dtype)


def _hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids[None]).logits[0].float()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_hf(variant, save_hf):
    hf = tiny_hf_model(**VARIANTS[variant])
    ours = _load(save_hf(hf))
    ids = torch.randint(0, 101, (150,), generator=torch.Generator().manual_seed(1))  # past the rope-scaling window
    ref = _hf_logits(hf, ids)
    got = ours.forward(ids, new_cache(ours), logits="all")
    assert got.shape == ref.shape
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_sharded_checkpoint_and_config(save_hf):
    hf = tiny_hf_model(rope_scaling=True)
    path = save_hf(hf, shard="20KB")
    assert (path / "model.safetensors.index.json").exists()
    config = load_checkpoint(path).config
    assert (config.n_kv_heads, config.rope_scaling.factor, config.tie_embeddings) == (2, 8.0, False)
    ours = _load(path)
    ids = torch.arange(40) % 101
    got = ours.forward(ids, new_cache(ours), logits="all")
    ref = _hf_logits(hf, ids)
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()


@pytest.mark.parametrize("splits", [[1] * 12, [5, 1, 6], [7, 5]])
def test_incremental_forward_matches_single_prefill(splits, save_hf):
    """Chunked prefill and one-token decode steps give the last logits of a single prefill."""
    hf = tiny_hf_model()
    ours = _load(save_hf(hf))
    ids = torch.randint(0, 101, (12,), generator=torch.Generator().manual_seed(2))
    ref = _hf_logits(hf, ids)
    cache = new_cache(ours, page_size=2)  # many page boundaries
    pos = 0
    for n in splits:
        last = ours.forward(ids[pos:pos + n], cache, logits="last")
        pos += n
        assert (last[0] - ref[pos - 1]).abs().max() <= 1e-4 * ref.abs().max()


def test_bf16_close_to_fp32(save_hf):
    hf = tiny_hf_model()
    path = save_hf(hf)
    ids = torch.randint(0, 101, (64,), generator=torch.Generator().manual_seed(3))
    f32, bf16 = _load(path), _load(path, torch.bfloat16)
    a = f32.forward(ids, new_cache(f32), logits="all")
    b = bf16.forward(ids, new_cache(bf16), logits="all")
    assert b.dtype == torch.float32
    # bf16 keeps ~3 significant digits: relative error of a few 1e-2 is expected, an error of 1 is a bug
    assert (a - b).abs().max() <= 0.05 * a.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


def test_prefill_without_logits_keeps_the_cache_exact(save_hf):
    """logits=None skips the last layer's attention/MLP entirely; the cached K/V must still be complete."""
    hf = tiny_hf_model()
    ours = _load(save_hf(hf))
    ids = torch.randint(0, 101, (20,), generator=torch.Generator().manual_seed(4))
    ref = _hf_logits(hf, ids)
    cache = new_cache(ours)
    assert ours.forward(ids[:13], cache, logits=None) is None
    got = ours.forward(ids[13:], cache, logits="all")
    assert (got - ref[13:]).abs().max() <= 1e-4 * ref.abs().max()


@pytest.mark.parametrize("backend", MODEL_BACKENDS)
def test_every_backend_matches_hf(backend, save_hf):
    """The torch reference (bf16's path), the C++ kernels and the Triton kernels (in Triton's interpreter here)
    compute the same forward, through prefill, chunked prefill and single-token steps."""
    hf = tiny_hf_model(rope_scaling=True)
    ckpt = load_checkpoint(save_hf(hf))
    ours = Llama(ckpt.config, ckpt.tensors, backend=backend)
    ids = torch.randint(0, 101, (60,), generator=torch.Generator().manual_seed(5))
    ref = _hf_logits(hf, ids)
    cache = new_cache(ours)
    got = torch.cat([ours.forward(ids[:37], cache, logits="all"), ours.forward(ids[37:57], cache, logits="all"),
                     *[ours.forward(ids[i:i + 1], cache, logits="all") for i in range(57, 60)]])
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()
