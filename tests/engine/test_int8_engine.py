"""The engine's int8 fast path (load_engine(precision="int8")) on tiny GGUF models: few-token steps take the int8
kernels (their logits move off the exact path's by about the activations' quantisation error, and no further), the
fused decode step gives the op-by-op int8 step's numbers bit for bit, a batch of sequences gives each sequence's
one-token steps, long prompts take the int8 kernels where their types are listed and the CPU favours them and stay
exact elsewhere, and bad precisions (or a model without quantised projections) are refused before anything loads."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import new_cache, tiny_hf_model, write_tiny_gguf
from nodekv.engine.loader import load_checkpoint
from nodekv.engine.model import QUANT_MAX_TOKENS, Llama


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    hf = tiny_hf_model("qwen2", n_kv_heads=2, seed=3)
    path = tmp_path_factory.mktemp("int8") / "tiny-qwen2-q4_0.gguf"
    write_tiny_gguf(hf, path, "q4_0", arch="qwen2")
    return path


def _model(path, precision="exact") -> Llama:
    ckpt = load_checkpoint(path)
    return Llama(ckpt.config, ckpt.tensors, precision=precision)


def _steps(model, ids, fused):
    """Logits [len(ids) - 1, vocab] of one token per step after the first, and the cache."""
    model.fused_decode = fused
    cache = new_cache(model, page_size=8)
    model.forward(ids[:1], cache, logits=None)
    return torch.cat([model.forward(ids[i:i + 1], cache) for i in range(1, len(ids))]), cache


IDS = torch.randint(0, 101, (24,), generator=torch.Generator().manual_seed(7))


def test_int8_steps_are_close_to_exact_and_not_equal(gguf_path):
    exact, _ = _steps(_model(gguf_path), IDS, fused=False)
    int8, _ = _steps(_model(gguf_path, "int8"), IDS, fused=False)
    p, q = exact.double().log_softmax(-1), int8.double().log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1)
    assert 0 < kl.max() < 1e-3, kl.max()  # it took the int8 kernels, and they stay close
    assert (exact.argmax(-1) == int8.argmax(-1)).float().mean() >= 0.9


def test_fused_int8_step_matches_op_by_op_int8(gguf_path):
    model = _model(gguf_path, "int8")
    fused, fused_cache = _steps(model, IDS, fused=True)
    assert model._decoder is not None and model._decoder is not False  # it ran fused
    op, op_cache = _steps(_model(gguf_path, "int8"), IDS, fused=False)
    assert torch.equal(fused, op)
    n = fused_cache.length
    pages = torch.tensor(fused_cache.pages)
    assert torch.equal(fused_cache.pool.k[:, pages].flatten(1, 3)[:, :n],
                       op_cache.pool.k[:, torch.tensor(op_cache.pages)].flatten(1, 3)[:, :n])


def test_int8_batch_matches_single_sequences(gguf_path):
    from nodekv.engine.cache_batch import CacheBatch

    model = _model(gguf_path, "int8")
    seqs = [IDS[:5], IDS[5:13], IDS[13:16]]
    alone = []
    for s in seqs:
        cache = new_cache(model, page_size=8)
        model.forward(s, cache, logits=None)
        alone.append(model.forward(IDS[-1:], cache))
    caches = []
    for s in seqs:
        cache = new_cache(model, page_size=8)
        model.forward(s, cache, logits=None)
        caches.append(cache)
    batch = model.forward_batch(IDS[-1:].repeat(3), CacheBatch(caches, [1, 1, 1]))
    assert torch.equal(batch, torch.cat(alone))


@pytest.mark.parametrize("listed,int8_cpu", [(False, True), (True, True), (True, False)])
def test_long_prompts_take_the_int8_kernels_of_listed_types(gguf_path, monkeypatch, listed, int8_cpu):
    """A step longer than QUANT_MAX_TOKENS takes the int8 kernels where the weight's type is in INT8_PROMPT_QTYPES
    (the K-quants, faster than the fp32 GEMM there; the tiny model's q4_0 is listed here for the test, as a K-quant
    model cannot be this small) and the CPU is one where they outrun the fp32 GEMM (int8_cpu; set whatever this CPU
    is): its logits are those of the same tokens appended in steps of QUANT_MAX_TOKENS (a projection's output row
    depends on its own token alone; only attention's summation order differs), off the exact path's by about the
    activations' quantisation error. Unlisted, or on another CPU, it stays on the fp32 GEMM: the exact logits."""
    from nodekv.engine import model as model_module

    monkeypatch.setattr(model_module, "int8_prompts_outrun_fp32", lambda: int8_cpu)
    if listed:
        monkeypatch.setattr(model_module, "INT8_PROMPT_QTYPES", frozenset({"q4_0"}))
    ids = torch.randint(0, 101, (2 * QUANT_MAX_TOKENS + 9,), generator=torch.Generator().manual_seed(8))
    exact, int8 = _model(gguf_path), _model(gguf_path, "int8")
    exact.lm_head.int8 = int8.lm_head.int8 = False  # the lm_head runs on its blocks at any length, int8 included
    whole = int8.forward(ids, new_cache(int8, page_size=8), logits="all")
    reference = exact.forward(ids, new_cache(exact, page_size=8), logits="all")
    if not (listed and int8_cpu):
        assert torch.equal(whole, reference)
        return
    cache = new_cache(int8, page_size=8)
    steps = torch.cat([int8.forward(ids[i:i + QUANT_MAX_TOKENS], cache, logits="all")
                       for i in range(0, len(ids), QUANT_MAX_TOKENS)])
    torch.testing.assert_close(whole, steps, rtol=0, atol=1e-5)
    p, q = reference.double().log_softmax(-1), whole.double().log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1)
    assert 0 < kl.max() < 1e-3, kl.max()


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="needs Linux's /proc/cpuinfo for the CPU's vendor")
def test_int8_prompts_stay_exact_on_intel_cores_with_avx512():
    """int8_prompts_outrun_fp32 against /proc/cpuinfo: False on Intel with AVX-512 (the fp32 GEMM's 512-bit FMA units
    outran the int8 kernels on a Cascade Lake Xeon), True elsewhere (AMD's Zen 4, AVX2 cores)."""
    from nodekv.engine.cpu import int8_prompts_outrun_fp32

    first_cpu = open("/proc/cpuinfo").read().split("\n\n")[0].splitlines()
    first = {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in first_cpu)}
    intel_avx512 = first.get("vendor_id") == "GenuineIntel" and "avx512f" in first.get("flags", "").split()
    assert int8_prompts_outrun_fp32() == (not intel_avx512)


@pytest.mark.parametrize("kwargs,message", [
    ({"precision": "fp8"}, "precision must be one of exact, int8, bf16"),
    ({"precision": "int8", "dtype": torch.bfloat16}, "runs float32 models on the CPU only"),
])
def test_bad_precision_is_refused(gguf_path, kwargs, message):
    ckpt = load_checkpoint(gguf_path)
    with pytest.raises(ValueError, match=message):
        Llama(ckpt.config, ckpt.tensors, **kwargs)


@pytest.mark.parametrize("precision", ["int8", "bf16"])
def test_a_fast_precision_without_quantised_projections_is_refused(hf_tiny, monkeypatch, precision):
    """Both fast paths run quantised projections: a HF directory (dense weights) is refused before it is read, and a
    model built from dense tensors when it is built, rather than running the exact path under another name."""
    from nodekv.engine import engine, model as model_module

    monkeypatch.setattr(model_module, "native_bf16_matmul", lambda: True)
    monkeypatch.setattr(engine, "load_checkpoint", lambda *a: pytest.fail("the model was read"))
    _, path = hf_tiny
    with pytest.raises(ValueError, match=f"precision '{precision}' runs a GGUF model's quantised projections: "):
        engine.load_engine(path, precision=precision)
    monkeypatch.undo()
    monkeypatch.setattr(model_module, "native_bf16_matmul", lambda: True)
    ckpt = load_checkpoint(path)
    with pytest.raises(ValueError, match=f"precision '{precision}' runs quantised projections, and this model has"):
        Llama(ckpt.config, ckpt.tensors, precision=precision)
