"""The engine's bf16 prompt path (load_engine(precision="bf16")) on tiny GGUF models: the quantised projections'
many-token steps are bf16 products (inputs, decoded weights and outputs rounded to bf16, accumulated in fp32), checked
against a float64 product of the same rounded operands, and their attention runs in bf16 over the fp32 cache (unless
node mass is collected), checked against float64 attention; steps of up to QUANT_MAX_TOKENS tokens and the lm_head
stay on the exact path bit for bit; a prompt's logits stay close to the exact path's; and no dense copy is kept.

Where the CPU has no bf16 matrix units, precision "bf16" is refused (tests/test_bad_input.py); these tests lift that
check, since torch's bf16 GEMM gives the same numbers there, only slowly, and the shapes here are tiny."""
from __future__ import annotations

import pytest
import torch

from conftest import new_cache, tiny_hf_model, write_tiny_gguf
from nodekv.engine import model as model_module
from nodekv.engine.loader import load_checkpoint
from nodekv.engine.model import QUANT_MAX_TOKENS, DequantScratch, Llama

BF16_ULP = 2.0 ** -7  # bf16 keeps 8 significant bits: its values lie this far apart, relative to their binade


@pytest.fixture(autouse=True)
def bf16_units(monkeypatch):
    monkeypatch.setattr(model_module, "native_bf16_matmul", lambda: True)


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    hf = tiny_hf_model("qwen2", n_kv_heads=2, seed=5)  # qwen2: a q|k|v bias
    path = tmp_path_factory.mktemp("bf16") / "tiny-qwen2-q8_0.gguf"
    write_tiny_gguf(hf, path, "q8_0", arch="qwen2")
    return path


def _model(path, precision="exact", **kwargs) -> Llama:
    ckpt = load_checkpoint(path)
    return Llama(ckpt.config, ckpt.tensors, precision=precision, **kwargs)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).double()


@pytest.mark.parametrize("name", ["wqkv", "wo", "w13", "w2"])
def test_prompt_projections_are_bf16_products(gguf_path, name):
    """A many-token step's output is the float64 product of the bf16-rounded input and weight (+ the bias, rounded
    too), rounded once to bf16: every output is a bf16 value within one bf16 rounding of that product, plus the fp32
    accumulation's error."""
    lin = getattr(_model(gguf_path, "bf16").layers[1], name)
    x = torch.randn(QUANT_MAX_TOKENS + 7, lin.quant.in_features, generator=torch.Generator().manual_seed(1))
    y = lin(x)
    assert y.dtype == torch.float32 and torch.equal(y, y.to(torch.bfloat16).float())  # a bf16 GEMM's output
    exact = _bf16(x) @ _bf16(lin.quant.dequantize()).T + (0 if lin.bias is None else _bf16(lin.bias))
    scale = _bf16(x).abs() @ _bf16(lin.quant.dequantize()).abs().T
    err = (y.double() - exact).abs()
    assert (err <= BF16_ULP / 2 * exact.abs() + 1e-6 * scale).all(), (err / exact.abs()).max()


def test_short_steps_and_decode_are_exact(gguf_path):
    """Steps of up to QUANT_MAX_TOKENS tokens (decode, probes, short appends) run on the blocks as on the exact path:
    the same logits, bit for bit, fused decode steps included."""
    ids = torch.randint(0, 101, (QUANT_MAX_TOKENS + 6,), generator=torch.Generator().manual_seed(2))
    out = {}
    for precision in ("exact", "bf16"):
        model = _model(gguf_path, precision)
        cache = new_cache(model, page_size=8)
        steps = [model.forward(ids[:QUANT_MAX_TOKENS], cache, logits="all")]
        steps += [model.forward(ids[i:i + 1], cache) for i in range(QUANT_MAX_TOKENS, len(ids))]
        assert model._decoder  # the one-token steps ran fused
        out[precision] = torch.cat(steps)
    assert torch.equal(out["exact"], out["bf16"])


def test_prompt_logits_are_close_to_exact_and_not_equal(gguf_path):
    ids = torch.randint(0, 101, (2 * QUANT_MAX_TOKENS + 9,), generator=torch.Generator().manual_seed(3))
    logits = {}
    for precision in ("exact", "bf16"):
        model = _model(gguf_path, precision)
        logits[precision] = model.forward(ids, new_cache(model, page_size=8), logits="all")
    p, q = logits["exact"].double().log_softmax(-1), logits["bf16"].double().log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1)
    assert 0 < kl.max() < 1e-3, kl.max()  # it took the bf16 GEMMs, and they stay close
    assert (p.argmax(-1) == q.argmax(-1)).float().mean() >= 0.95


def test_no_dense_copy_and_a_dense_copy_in_bf16(gguf_path):
    """The projections keep only their blocks and decode into one shared bf16 scratch; dense_copy=True keeps bf16
    copies instead, with the scratch's values (so the same logits, to the GEMM's blocking); the lm_head stays on its
    blocks either way."""
    ids = torch.randint(0, 101, (QUANT_MAX_TOKENS + 9,), generator=torch.Generator().manual_seed(4))
    scratch, dense = _model(gguf_path, "bf16"), _model(gguf_path, "bf16", dense_copy=True)
    linears = [(layer.wqkv, layer.wo, layer.w13, layer.w2) for layer in scratch.layers]
    assert all(lin.dense is None for group in linears for lin in group)
    shared = {id(lin.scratch) for group in linears for lin in group}
    assert len(shared) == 1 and isinstance(scratch.layers[0].wo.scratch, DequantScratch)
    assert scratch.layers[0].wo.scratch.buffer.dtype == torch.bfloat16
    copies = [lin for layer in dense.layers for lin in (layer.wqkv, layer.wo, layer.w13, layer.w2)]
    assert all(lin.dense.dtype == torch.bfloat16 for lin in copies)
    assert all(lin.bias is None or lin.bias.dtype == torch.float32 for lin in copies)  # the blocks' steps add it
    assert scratch.lm_head.dense is None and dense.lm_head.dense is None
    a = scratch.forward(ids, new_cache(scratch, page_size=8), logits="all")
    b = dense.forward(ids, new_cache(dense, page_size=8), logits="all")
    torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)


def _attention64(q, k, v, start):
    """float64 causal GQA attention of q [n, H, hd] at positions start.. over k, v [end, kv_heads, hd]."""
    n, H, hd = q.shape
    keys, values = (t.double().repeat_interleave(H // t.shape[1], 1) for t in (k, v))
    scores = torch.einsum("nhd,khd->hnk", q.double(), keys) / hd ** 0.5
    visible = torch.arange(k.shape[0])[None, :] <= torch.arange(start, start + n)[:, None]
    p = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hnk,khd->nhd", p, values).reshape(n, H * hd)


def test_bf16_queries_attend_in_bf16_over_fp32_pages(gguf_path):
    """A cache of fp32 pages asked to attend bf16 queries (a prompt under precision "bf16") stores the new keys and
    values in fp32 as given and returns the attention of the bf16-rounded queries, keys and values, in bf16: within
    bf16's rounding of the float64 result, after a prefix it attends too."""
    model = _model(gguf_path, "bf16")
    c = model.config
    cache = new_cache(model, page_size=8)
    gen = torch.Generator().manual_seed(6)
    k, v = (torch.randn(45, c.n_kv_heads, c.head_dim, generator=gen) for _ in range(2))
    q = torch.randn(45, c.n_heads, c.head_dim, generator=gen)
    outs = []
    for a, b in ((0, 12), (12, 45)):  # a prefix, then a prompt after it
        cache.begin(b - a)
        outs.append(cache.attend(0, q[a:b].to(torch.bfloat16), k[a:b], v[a:b]))
        cache.commit(b - a)
    assert all(o.dtype == torch.bfloat16 for o in outs)
    kept_k, kept_v = cache.read(0, torch.arange(45))
    assert torch.equal(kept_k, k) and torch.equal(kept_v, v)
    for out, (a, b) in zip(outs, ((0, 12), (12, 45))):
        exact = _attention64(_bf16(q[a:b]), _bf16(k[:b]), _bf16(v[:b]), a)
        assert (out.double() - exact).abs().max() <= BF16_ULP * exact.abs().max()  # ~3x the error seen


def test_prompts_attend_in_bf16_unless_node_mass_is_collected(gguf_path, monkeypatch):
    """Under precision "bf16" a many-token step's queries attend in bf16 in every layer; a step that collects node mass
    keeps the fp32 kernels, which accumulate the mass in their one pass; a decode step stays exact."""
    from nodekv.engine import kv_cache

    seen = []
    attention = kv_cache.reference.paged_attention
    monkeypatch.setattr(kv_cache.reference, "paged_attention",
                        lambda q, *a, **k: seen.append(q.dtype) or attention(q, *a, **k))
    model = _model(gguf_path, "bf16")
    ids = torch.randint(0, 101, (QUANT_MAX_TOKENS + 9,), generator=torch.Generator().manual_seed(5))
    cache = new_cache(model, page_size=8)
    model.forward(ids, cache)
    assert seen == [torch.bfloat16] * model.config.n_layers
    model.forward(ids[:1], cache)
    assert len(seen) == model.config.n_layers
    cache = new_cache(model, page_size=8)
    mass = torch.zeros(len(ids), 2)
    cache.collect(torch.tensor([0, 20, len(ids)], dtype=torch.int32), mass)
    model.forward(ids, cache)
    assert len(seen) == model.config.n_layers and mass.sum() > 0


@pytest.mark.parametrize("kwargs, message", [
    ({"dtype": torch.bfloat16}, "precision 'bf16' runs float32 models on the CPU only"),
    ({"device": "cuda"}, "precision 'bf16' runs float32 models on the CPU only"),
])
def test_bf16_precision_off_its_path_is_refused(gguf_path, kwargs, message):
    ckpt = load_checkpoint(gguf_path)
    with pytest.raises(ValueError, match=message):
        Llama(ckpt.config, ckpt.tensors, precision="bf16", **kwargs)
