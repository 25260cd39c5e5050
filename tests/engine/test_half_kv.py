"""A KV cache of IEEE halves under a float32 model (`load_engine(kv_dtype="float16")`): logits against HF with its keys
and values rounded to float16 in every attention (the same arithmetic, done independently), decode and prefill,
cpu and torch backends; the fused decode step bit for bit as the op-by-op one; probes that leave the cache
bit-identical; half the pool's bytes; the index store keyed apart; refusals before any loading."""
from __future__ import annotations

import pytest
import torch

from conftest import cached_kv, tiny_engine, tiny_hf_model, write_tiny_gguf
from nodekv.engine.engine import load_engine
from nodekv.engine.page_pool import PagePool
from nodekv.kernels import cpu_ops

PROMPT = [5, 17, 3, 99, 42, 8, 8, 61, 12, 0, 33, 71, 2, 2, 90, 14, 27]


def _half_kv_engine(path, backend="auto"):
    """tiny_engine with a pool of halves (what load_engine(kv_dtype="float16") builds)."""
    return tiny_engine(path, backend, kv_dtype=torch.float16)


def _hf_logits(hf, ids: list[int], round_kv: bool) -> torch.Tensor:
    """HF's logits for ids in one forward, its attention's keys and values rounded to float16 first with round_kv
    (a causal forward sees what a cache of halves holds: every position's K/V as stored, its own included)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def rounded(module, query, key, value, *args, **kwargs):
        return sdpa_attention_forward(module, query, key.half().float(), value.half().float(), *args, **kwargs)

    AttentionInterface.register("half_kv_test", rounded)
    before = hf.config._attn_implementation
    hf.set_attn_implementation("half_kv_test" if round_kv else "sdpa")
    try:
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0]
    finally:
        hf.set_attn_implementation(before)


@pytest.fixture(params=["q8_0-cpu", "f32-torch"])
def half_pair(request, tmp_path):
    """(HF model, engine on its weights with a cache of halves): the C++ kernels on a quantised GGUF (its fused
    decode step included), or the torch backend on dense weights."""
    qtype, backend = request.param.split("-")
    hf = tiny_hf_model("qwen2", max_positions=128)
    path = tmp_path / f"tiny-{qtype}.gguf"
    write_tiny_gguf(hf, path, qtype, arch="qwen2")  # rounds hf's weights to the quantised values
    return hf, _half_kv_engine(path, backend)


def test_logits_match_hf_with_rounded_kv(half_pair):
    """Prefill, then decode one token at a time: every step's logits within 1e-5 (relative to their scale) of HF's
    rounded-K/V forward, and measurably off the unrounded one (the halves are really used)."""
    hf, eng = half_pair
    ids = PROMPT + [7, 44, 1, 95, 3, 3, 60, 18]
    s = eng.session()
    s.append(PROMPT)
    steps = [s._last_logits()]
    for t in ids[len(PROMPT):]:
        s.append([t])
        steps.append(s._last_logits())
    ours = torch.stack(steps)
    want = _hf_logits(hf, ids, round_kv=True)[len(PROMPT) - 1:]
    unrounded = _hf_logits(hf, ids, round_kv=False)[len(PROMPT) - 1:]
    scale = want.abs().max()
    err, half_effect = (ours - want).abs().max() / scale, (unrounded - want).abs().max() / scale
    assert err <= 1e-5, err
    assert half_effect > 20 * err, (half_effect, err)


def test_fused_decode_on_half_pages_is_the_op_by_op_step(tmp_path):
    hf = tiny_hf_model("qwen2", max_positions=128)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(hf, path, "q4_0", arch="qwen2")
    runs = []
    for fused in (True, False):
        eng = _half_kv_engine(path)
        eng.model.fused_decode = fused
        s = eng.session()
        s.append(PROMPT)
        gen = s.generate(12, temperature=0.0)
        pages = torch.tensor(s.cache.pages)
        runs.append((gen.ids, s._last_logits(), eng.pool.k[:, pages].clone(), eng.pool.v[:, pages].clone()))
        assert isinstance(eng.model._decoder, cpu_ops.Decoder) == fused
    (ids_f, logits_f, k_f, v_f), (ids_p, logits_p, k_p, v_p) = runs
    assert ids_f == ids_p and torch.equal(logits_f, logits_p)
    length = len(PROMPT) + len(ids_f) - 1  # the last token is sampled, not cached
    for a, b in ((k_f, k_p), (v_f, v_p)):  # compare cached rows only: the rest of the pages is never written
        a, b = (t.permute(0, 1, 3, 2, 4).flatten(1, 2)[:, :length] for t in (a, b))
        assert torch.equal(a, b)


def test_probe_and_fork_leave_half_pages_bit_identical(tmp_path):
    hf = tiny_hf_model(max_positions=128)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(hf, path, "q8_0")
    eng = _half_kv_engine(path)
    s = eng.session()
    s.append(PROMPT)
    before = cached_kv(s)
    p = s.probe(["<4>", "<9>"], tokens=[7, 7, 1])
    with s.fork() as f:
        f.append([3, 4])  # into a copy of the shared last page
    assert before.dtype == torch.float16 and torch.equal(cached_kv(s), before)
    assert s.probe(["<4>", "<9>"], tokens=[7, 7, 1]) == p


def test_a_page_of_halves_takes_half_the_bytes():
    from nodekv.engine.config import PRESETS

    config = PRESETS["qwen2.5-1.5b"]
    full, half = PagePool(config, torch.float32, 8), PagePool(config, torch.float16, 8)
    assert 2 * half.bytes_per_page == full.bytes_per_page == 2 * 28 * 2 * 64 * 128 * 4


def test_index_store_keys_a_half_cache_apart(tmp_path):
    from nodekv.evaluation.index_store import IndexStore
    from nodekv.methods import get

    hf = tiny_hf_model()
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(hf, path, "q8_0")
    engines = [tiny_engine(path), tiny_engine(path), _half_kv_engine(path)]
    keys = [IndexStore.for_method(tmp_path, e, get("pecan")(e)).key for e in engines]
    assert keys[0] == keys[1] != keys[2]


@pytest.mark.model
def test_smollm2_with_half_kv_stays_close_to_the_exact_cache():
    """Real weights, 600 tokens of text: mean KL divergence of the next-token distributions from the exact cache's
    below 1e-4 nats and top-1 agreement above 99%, and load_engine's pool really holds halves."""
    import nodekv

    exact, half = nodekv.load_engine("smollm2-135m"), nodekv.load_engine("smollm2-135m", kv_dtype="float16")
    assert half.pool.dtype == torch.float16 and exact.pool.dtype == torch.float32
    text = " ".join(["The river ran past the mill and under the old stone bridge, where children fished."] * 30)
    ids = exact.tokenizer.encode(text)[:600]
    logp = [e.forward_logits(ids).log_softmax(-1) for e in (exact, half)]
    kl = (logp[0].exp() * (logp[0] - logp[1])).sum(-1)
    top1 = (logp[0].argmax(-1) == logp[1].argmax(-1)).float().mean()
    assert kl.mean() < 1e-4 and top1 > 0.99, (kl.mean(), top1)


@pytest.mark.parametrize("kwargs,words", [
    ({"kv_dtype": "int8"}, "kv_dtype must be one of"),
    ({"kv_dtype": "float16", "dtype": "bfloat16"}, "kv_dtype 'float16' with a torch.bfloat16 model"),
    ({"kv_dtype": "bfloat16"}, "kv_dtype 'bfloat16' with a torch.float32 model"),
])
def test_bad_kv_dtype_is_refused_before_loading(kwargs, words, tmp_path):
    """Refused in one line naming kv_dtype, before the (here missing) model file is even looked for."""
    with pytest.raises(ValueError, match=words) as e:
        load_engine(tmp_path / "missing.gguf", device="cpu", **kwargs)
    assert "\n" not in str(e.value)
