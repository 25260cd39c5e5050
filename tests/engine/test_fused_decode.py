"""The fused decode step (cpu_ops.Decoder, csrc/fused_decode.cpp) on tiny GGUF models: the same logits, K/V and node
mass as the op-by-op forward (bit for bit; asserted to 1e-5 relative), HF's logits to 1e-4, for q8_0 / q4_1 / q4_0
weights, mixed types within fused projections (as Qwen2.5's GGUFs have), GQA / MQA / MHA, tied and untied heads and
qkv biases (qwen2); batches of sequences (one token each) against their one-token steps and the op-by-op batch; bad
inputs, alone or in a batch, which leave every cache as it was; when it applies and when the op-by-op path runs
instead; and on the real Qwen2.5-0.5B GGUF against its dense path."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from conftest import new_cache, tiny_engine, tiny_hf_model, write_tiny_gguf
from numerics import hf_attention
from nodekv.engine.cache_batch import CacheBatch
from nodekv.engine.errors import PoolExhaustedError
from nodekv.engine.kv_cache import PagedKVCache
from nodekv.engine.loader import _hf_canonical, load_checkpoint
from nodekv.engine.model import QUANT_MAX_TOKENS, Linear, Llama
from nodekv.engine.page_pool import PagePool
from nodekv.kernels import cpu_ops, reference
from nodekv.kernels.quant import QuantStack, QuantWeight


def _gguf(tmp_path, qtype="q8_0", kind="llama", tied=False, n_kv_heads=2, seed=0):
    hf = tiny_hf_model(kind, tied=tied, n_kv_heads=n_kv_heads, seed=seed)
    path = tmp_path / f"tiny-{kind}-{qtype}-{n_kv_heads}-{int(tied)}.gguf"
    write_tiny_gguf(hf, path, qtype, arch=kind)  # also rounds hf's weights to the quantised values
    return hf, path


def _model(path, backend="auto") -> Llama:
    ckpt = load_checkpoint(path)
    return Llama(ckpt.config, ckpt.tensors, backend=backend)


def _decode(model, ids, n_prompt, fused, page_size=8):
    """Prefill ids[:n_prompt] in one forward, then one token per step; the steps' logits [n, vocab] and the cache."""
    model.fused_decode = fused
    cache = new_cache(model, page_size=page_size)
    model.forward(ids[:n_prompt], cache, logits="last")
    steps = torch.cat([model.forward(ids[i:i + 1], cache, logits="last") for i in range(n_prompt, len(ids))])
    return steps, cache


def _close(got, want, rel):
    assert (got - want).abs().max() <= rel * want.abs().max(), (got - want).abs().max()


def _kv(cache):
    """The cache's K and V in position order: [layers, positions, kv_heads, hd] each."""
    pool = cache.pool
    pages = torch.tensor(cache.pages)
    k = pool.k[:, pages].permute(0, 1, 3, 2, 4).flatten(1, 2)[:, : cache.length]
    v = pool.v[:, pages].permute(0, 1, 3, 2, 4).flatten(1, 2)[:, : cache.length]
    return k, v


CASES = [  # (qtype, kind, tied, n_kv_heads)
    ("q8_0", "llama", False, 2),  # GQA 4:2
    ("q4_1", "llama", True, 2),  # tied quantised lm_head
    ("q4_0", "llama", False, 1),  # MQA
    ("q4_1", "llama", False, 4),  # MHA
    ("q8_0", "qwen2", False, 2),  # qkv bias
    ("q4_0", "qwen2", True, 1),
]


@pytest.mark.parametrize("qtype,kind,tied,n_kv_heads", CASES)
def test_fused_steps_match_op_by_op_and_hf(qtype, kind, tied, n_kv_heads, tmp_path):
    hf, path = _gguf(tmp_path, qtype, kind, tied, n_kv_heads)
    model = _model(path)
    assert model.config.qkv_bias == (kind == "qwen2")
    ids = torch.randint(0, 101, (40,), generator=torch.Generator().manual_seed(1))
    fused, fused_cache = _decode(model, ids, 5, True)
    assert isinstance(model._decoder, cpu_ops.Decoder)  # it did run fused
    assert model._decoder.has_lm_head  # the GGUF lm_head is quantised too
    plain, plain_cache = _decode(model, ids, 5, False)
    _close(fused, plain, 1e-5)
    assert torch.equal(fused, plain)  # the same kernels in the same order: bit for bit
    for a, b in zip(_kv(fused_cache), _kv(plain_cache)):
        assert torch.equal(a, b)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0, 5:]
    _close(fused, ref, 1e-4)


# Types per tensor as Qwen2.5's GGUFs mix them inside fused projections (q|k|v = q5_0|q5_0|q8_0), here gate|up too,
# with the embedding looked up from q5_0 blocks.
MIXED = {"wq": "q5_0", "wk": "q5_0", "wv": "q8_0", "wo": "q4_1", "w1": "q4_0", "w3": "q5_0", "w2": "q8_0",
         "embed": "q5_0", "lm_head": "q8_0"}


def _mixed_model(tmp_path, kind: str, tied: bool):
    """A tiny model with MIXED's type per tensor (gguf's quantisation of the weights) and the HF model holding the
    same numbers."""
    hf, ckpt = _mixed_checkpoint(tmp_path, kind, tied)
    return hf, Llama(ckpt.config, ckpt.tensors)


def _mixed_checkpoint(tmp_path, kind: str, tied: bool):
    """`_mixed_model`'s HF model and checkpoint."""
    import gguf

    hf = tiny_hf_model(kind, tied=tied)
    path = tmp_path / f"tiny-{kind}-{int(tied)}-f32.gguf"
    write_tiny_gguf(hf, path, "f32", arch=kind)
    ckpt = load_checkpoint(path)
    for name, t in list(ckpt.tensors.items()):
        qtype = MIXED.get(name.rsplit(".", 1)[-1])
        if qtype is not None:
            raw = gguf.quants.quantize(t.numpy(), gguf.GGMLQuantizationType[qtype.upper()])
            ckpt.tensors[name] = QuantWeight(torch.from_numpy(raw), qtype, t.shape[1])
    with torch.no_grad():
        for key, p in hf.named_parameters():
            w = ckpt.tensors.get(_hf_canonical(key))
            if isinstance(w, QuantWeight):
                p.copy_(w.dequantize())
    return hf, ckpt


@pytest.mark.parametrize("kind,tied", [("qwen2", False), ("llama", True)])
def test_mixed_type_projections_run_fused(kind, tied, tmp_path):
    hf, model = _mixed_model(tmp_path, kind, tied)
    layer = model.layers[0]
    assert [p.qtype for p in layer.wqkv.quant.parts] == ["q5_0", "q5_0", "q8_0"]
    assert [p.qtype for p in layer.w13.quant.parts] == ["q4_0", "q5_0"]
    assert isinstance(model.embed, QuantWeight) and model.lm_head.dense is None
    ids = torch.randint(0, 101, (30,), generator=torch.Generator().manual_seed(6))
    fused, fused_cache = _decode(model, ids, 5, True)
    assert isinstance(model._decoder, cpu_ops.Decoder) and model._decoder.has_lm_head
    plain, plain_cache = _decode(model, ids, 5, False)
    assert torch.equal(fused, plain)
    for a, b in zip(_kv(fused_cache), _kv(plain_cache)):
        assert torch.equal(a, b)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0, 5:]
    _close(fused, ref, 1e-4)


@pytest.fixture(scope="module")
def qwen_gguf() -> Path:
    """The Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF: q5_0, q8_0, q4_k and q6_k tensors, q|k|v = q5_0|q5_0|q8_0."""
    from nodekv.engine.errors import ModelLoadError
    from nodekv.engine.models import resolve_model

    try:
        return resolve_model("qwen2.5-0.5b")
    except ModelLoadError as err:
        pytest.skip(str(err))


@pytest.mark.model
def test_real_qwen_decodes_fused_as_the_dense_path(qwen_gguf):
    model = _model(qwen_gguf)
    quants = [lin.quant for l in model.layers for lin in (l.wqkv, l.wo, l.w13, l.w2)]
    types = {p.qtype for q in quants for p in (q.parts if isinstance(q, QuantStack) else [q])}
    assert types == {"q5_0", "q8_0", "q4_k", "q6_k"}
    ids = torch.randint(0, model.config.vocab_size, (24,), generator=torch.Generator().manual_seed(7))
    fused, _ = _decode(model, ids, 16, True)
    assert isinstance(model._decoder, cpu_ops.Decoder) and model._decoder.has_lm_head
    dense = model.forward(ids, new_cache(model), logits="all")[16:]  # 24 tokens: the layers' dense fp32 GEMMs
    _close(fused, dense, 1e-4)


@pytest.mark.parametrize("qtype", ["q8_0", "q4_1", "q4_0", "mixed"])
def test_prompts_on_the_blocks_equal_the_dense_copy_bit_for_bit(qtype, tmp_path):
    """Many-token steps decode each quantised projection into the shared scratch (no dense copy kept): the logits
    and K/V of a prompt longer than QUANT_MAX_TOKENS equal the dense-copy path's exactly, one scratch serves every
    layer, and the model holds no dense projection."""
    from nodekv.engine.model import DequantScratch

    ckpt = _mixed_checkpoint(tmp_path, "qwen2", False)[1] if qtype == "mixed" else \
        load_checkpoint(_gguf(tmp_path, qtype)[1])
    tensors = ckpt.tensors
    ids = torch.randint(0, 100, (QUANT_MAX_TOKENS + 9,), generator=torch.Generator().manual_seed(1))
    out = {}
    for dense in (True, False):
        model = Llama(ckpt.config, tensors, dense_copy=dense)
        cache = new_cache(model)
        out[dense] = (model.forward(ids, cache, logits="all"), *_kv(cache))
    assert all(torch.equal(a, b) for a, b in zip(out[True], out[False]))
    layers = model.layers
    assert all(lin.dense is None for layer in layers for lin in (layer.wqkv, layer.wo, layer.w13, layer.w2))
    scratches = {id(lin.scratch) for layer in layers for lin in (layer.wqkv, layer.wo, layer.w13, layer.w2)}
    assert len(scratches) == 1 and isinstance(layers[0].w13.scratch, DequantScratch)
    if qtype == "mixed":
        assert isinstance(layers[0].wqkv.quant, QuantStack)


@pytest.mark.parametrize("path", ["scratch", "dense", "int8"])
def test_the_gate_up_product_in_tiles_equals_it_whole(tmp_path, monkeypatch, path):
    """A many-token step computes silu(gate) * up in tiles of GATED_ROWS rows (and, decoding into the scratch,
    GATED_COLS columns: gate and up rows decoded a block at a time; Linear.gated): the logits equal those of the
    product taken whole, to fp32 rounding (the GEMM may block a tile differently), and bit for bit on the int8
    blocks (a row's product does not depend on the others)."""
    from nodekv.engine import model as model_module

    ckpt = load_checkpoint(_gguf(tmp_path, "q8_0", kind="qwen2")[1])
    if path == "int8":  # prompts on the int8 blocks (the K-quants' rule, given to q8_0 here)
        monkeypatch.setattr(model_module, "INT8_PROMPT_QTYPES", frozenset({"q8_0"}))
        monkeypatch.setattr(model_module, "int8_prompts_outrun_fp32", lambda: True)
    precision = "int8" if path == "int8" else "exact"
    model = Llama(ckpt.config, ckpt.tensors, dense_copy=path == "dense", precision=precision)
    ids = torch.randint(0, 101, (QUANT_MAX_TOKENS + 9,), generator=torch.Generator().manual_seed(3))
    whole = model.forward(ids, new_cache(model), logits="all")
    monkeypatch.setattr(model_module, "GATED_ROWS", 8)
    monkeypatch.setattr(model_module, "GATED_COLS", 40)
    tiles = []
    act = model.ops.silu_mul
    monkeypatch.setattr(model.ops, "silu_mul", lambda gate_up: tiles.append(tuple(gate_up.shape)) or act(gate_up))
    parts = model.forward(ids, new_cache(model), logits="all")
    rows = [8, 8, 8, 8, 8, 1]  # 41 rows in tiles of 8
    cols = [80, 80, 32] if path == "scratch" else [192]  # 96 outputs decoded in blocks of 40; else in one block
    assert tiles == [(r, c) for c in cols for r in rows] * model.config.n_layers
    if path == "int8":
        assert torch.equal(parts, whole)
    else:
        _close(parts, whole, 1e-5)


def test_dense_lm_head_runs_in_python(tmp_path):
    """An lm_head that is not quantised (here: replaced by its dense weights) is applied to the fused step's
    hidden state by the op-by-op Linear."""
    hf, path = _gguf(tmp_path, "q8_0", tied=False)
    model = _model(path)
    model.lm_head = Linear(model.lm_head.quant.dequantize())
    ids = torch.randint(0, 101, (20,), generator=torch.Generator().manual_seed(2))
    fused, _ = _decode(model, ids, 3, True)
    assert isinstance(model._decoder, cpu_ops.Decoder) and not model._decoder.has_lm_head
    plain, _ = _decode(model, ids, 3, False)
    _close(fused, plain, 1e-5)
    with torch.no_grad():
        _close(fused, hf(ids[None]).logits[0, 3:], 1e-4)


@pytest.mark.parametrize("collect", [False, True])
def test_steps_without_logits_store_kv(collect, tmp_path):
    """logits=None: the last layer only stores its K/V (attending when collecting mass); later steps see it."""
    _, path = _gguf(tmp_path, "q4_1")
    model = _model(path)
    ids = torch.randint(0, 101, (30,), generator=torch.Generator().manual_seed(3))
    out = {}
    for fused in (True, False):
        model.fused_decode = fused
        cache = new_cache(model)
        model.forward(ids[:4], cache, logits=None)
        masses, logits = [], []
        for i in range(4, len(ids)):
            if collect:
                masses.append(torch.zeros(1, 2))
                cache.collect(torch.tensor([0, 4, i + 1], dtype=torch.int32), masses[-1])
            got = model.forward(ids[i:i + 1], cache, logits="last" if i % 3 == 0 else None)
            assert (got is None) == (i % 3 != 0)
            if got is not None:
                logits.append(got)
            cache.collect(None, None)
        out[fused] = (torch.cat(logits), _kv(cache), torch.cat(masses) if collect else None)
    (a, kv_a, m_a), (b, kv_b, m_b) = out[True], out[False]
    assert torch.equal(a, b)
    assert all(torch.equal(x, y) for x, y in zip(kv_a, kv_b))
    if collect:
        assert torch.equal(m_a, m_b)
        # every layer and head attends from the new token, also the last layer: rows sum to layers * heads
        c = model.config
        torch.testing.assert_close(m_a.sum(1), torch.full((m_a.shape[0],), float(c.n_layers * c.n_heads)))


@pytest.mark.parametrize("qtype,kind,n_kv_heads", [("q4_1", "llama", 2), ("q8_0", "qwen2", 1)])
def test_decode_time_node_mass_matches_op_by_op_and_hf(qtype, kind, n_kv_heads, tmp_path):
    hf, path = _gguf(tmp_path, qtype, kind, n_kv_heads=n_kv_heads)
    results = {}
    for fused in (True, False):
        eng = tiny_engine(path, page_size=8)
        eng.model.fused_decode = fused
        s = eng.session()
        s.append(list(range(40, 52)), node_id="a")
        s.append(list(range(60, 69)), node_id="b", collect=True)
        text = s.generate(12, node_id="gen", collect=True).text
        assert (eng.model._decoder not in (None, False)) == fused
        results[fused] = (text, list(s.tokens), s.token_mass("gen"), s.token_mass("b"), s._last_logits())
    (text, toks, mass, mass_b, logits), plain = results[True], results[False]
    assert text == plain[0] and toks == plain[1]
    _close(mass, plain[2], 1e-5)
    assert torch.equal(mass, plain[2]) and torch.equal(mass_b, plain[3]) and torch.equal(logits, plain[4])
    n = len(toks) - 21
    assert n > 0
    # against HF's eager attention, averaged over layers and heads
    att = hf_attention(hf, toks)[21:]
    bounds = [0, 12, 21, 21 + n]
    want = torch.stack([att[:, a:b].sum(1) for a, b in zip(bounds, bounds[1:])], 1)
    torch.testing.assert_close(mass.double(), want, atol=1e-5, rtol=0)


def test_scalar_kernels_and_one_thread_give_the_same_steps(tmp_path):
    """The fused step takes whatever path the kernels take (forced scalar here) and does not depend on threads."""
    _, path = _gguf(tmp_path, "q4_1", n_kv_heads=1)
    model = _model(path)
    ids = torch.randint(0, 101, (150,), generator=torch.Generator().manual_seed(4))  # > 128 keys: several chunks
    base, _ = _decode(model, ids, 100, True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = _decode(model, ids, 100, True)
        torch.set_num_threads(threads)
        with cpu_ops.simd_level("scalar"):
            scalar, _ = _decode(model, ids, 100, True)
            scalar_plain, _ = _decode(model, ids, 100, False)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, base)
    assert torch.equal(scalar, scalar_plain)
    _close(scalar, base, 1e-5)


def test_op_by_op_path_where_fusion_does_not_apply(tmp_path):
    ids = torch.randint(0, 101, (12,), generator=torch.Generator().manual_seed(5))
    # unquantised weights
    _, f32 = _gguf(tmp_path, "f32")
    model = _model(f32)
    _decode(model, ids, 4, True)
    assert model._decoder is False
    # the torch backend
    _, q8 = _gguf(tmp_path, "q8_0")
    model = _model(q8, backend="torch")
    got, _ = _decode(model, ids, 4, True)
    assert model._decoder is False
    cpu = _model(q8)
    want, _ = _decode(cpu, ids, 4, True)
    assert isinstance(cpu._decoder, cpu_ops.Decoder)
    _close(got, want, 1e-4)
    # a cache attending through another backend than the model's
    cache = new_cache(cpu)
    cache.ops = reference
    cpu.forward(ids[:4], cache)
    got = torch.cat([cpu.forward(ids[i:i + 1], cache) for i in range(4, len(ids))])
    _close(got, want, 1e-4)
    # more than one token
    cache = new_cache(cpu)
    cpu.forward(ids[:4], cache)
    got = cpu.forward(ids[4:6], cache, logits="all")
    _close(got, want[:2], 1e-4)


def test_bad_inputs_raise_as_op_by_op(tmp_path):
    _, path = _gguf(tmp_path, "q8_0")
    model = _model(path)
    cache = new_cache(model, tokens=64)
    model.forward(torch.tensor([1, 2, 3]), cache)
    with pytest.raises(IndexError):  # outside the vocabulary: the op-by-op path's embedding lookup raises
        model.forward(torch.tensor([101]), cache)
    cache.truncate(3)
    # a corrupt block table: nothing is written, the error names the entry (as paged_attention's)
    cache.begin(1)
    table = cache._table.clone()
    cache._table[0] = 10_000
    with pytest.raises(ValueError, match=r"block_table\[0\] = 10000 is not a page"):
        model.forward(torch.tensor([4]), cache)
    cache._table.copy_(table)
    cache.truncate(3)
    # bad node bounds
    cache.collect(torch.tensor([0, 2, 2, 4], dtype=torch.int32), torch.zeros(1, 3))
    with pytest.raises(ValueError, match="node_bounds must rise strictly"):
        model.forward(torch.tensor([4]), cache)
    cache.collect(None, None)
    cache.truncate(3)
    dec = model._decoder
    cache.begin(1)
    with pytest.raises(ValueError, match="Decoder.step: invalid arguments"):
        dec.step([4], torch.zeros(1, 3), torch.zeros(1, 3), cache.pool.k, cache.pool.v, [cache._table], [4])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        cos, sin = model.rope(slice(3, 4))
        dec.step([101], cos, sin, cache.pool.k, cache.pool.v, [cache._table], [4])
    cache.truncate(3)
    # still usable: the next step matches a fresh run
    got = model.forward(torch.tensor([4]), cache)
    model.fused_decode = False
    fresh = new_cache(model)
    model.forward(torch.tensor([1, 2, 3]), fresh)
    want = model.forward(torch.tensor([4]), fresh)
    assert torch.equal(got, want)


def test_profile_counters(tmp_path):
    _, path = _gguf(tmp_path, "q4_1")
    model = _model(path)
    _decode(model, torch.arange(10), 2, True)
    times = model._decoder.times()
    assert set(times) == {"wqkv", "rope", "attention", "wo", "w13", "w2", "norms+silu", "lm_head"}
    assert all(t >= 0 for t in times.values()) and sum(times.values()) > 0
    model._decoder.reset_times()
    assert sum(model._decoder.times().values()) == 0


def _batch_caches(model, n: int, seed: int, page_size: int = 4) -> list[PagedKVCache]:
    """n caches of different lengths in one pool of their own, prefilled op by op: every third one forked from a
    shared base of 13 tokens (its last page partly filled, so the first write copies it) and continued, the others
    fresh."""
    rng = random.Random(seed)
    pool = PagePool(model.config, model.dtype, 200, page_size)
    base = PagedKVCache(pool, model.ops)
    model.forward(torch.randint(0, 100, (13,), generator=torch.Generator().manual_seed(seed)), base, logits=None)
    caches = []
    for i in range(n):
        cache = base.fork() if i % 3 == 1 else PagedKVCache(pool, model.ops)
        model.forward(torch.tensor([rng.randrange(100) for _ in range(rng.randint(1, 20))]), cache, logits=None)
        caches.append(cache)
    return caches


def _batched_decode(model, n: int, how: str, steps: int = 6):
    """`steps` decode steps of one token in each of n caches (`_batch_caches`), "fused" / "op-by-op" as one
    forward_batch per step, "alone" as n one-token forwards (fused); rows 0, 3, 6 collect node mass from step 1 on,
    and steps 1 and 4 take no logits. Returns the logits of each step [n, vocab] (None when not taken), each row's
    mass per step and each cache's K/V."""
    model.fused_decode = how != "op-by-op"
    caches = _batch_caches(model, n, seed=n)
    rng = random.Random(100 + n)
    logits, masses = [], []
    for step in range(steps):
        tokens = torch.tensor([rng.randrange(100) for _ in range(n)])
        want = None if step % 3 == 1 else "last"
        step_mass = {}
        for b, cache in enumerate(caches):
            if b % 3 == 0 and step >= 1:
                end = cache.length + 1
                step_mass[b] = torch.zeros(1, 2)
                cache.collect(torch.tensor([0, end // 2, end], dtype=torch.int32), step_mass[b])
        if how == "alone":
            outs = [model.forward(tokens[b:b + 1], cache, want) for b, cache in enumerate(caches)]
            logits.append(None if want is None else torch.cat(outs))
        else:
            logits.append(model.forward_batch(tokens, CacheBatch(caches, [1] * n), want))
        for cache in caches:
            cache.collect(None, None)
        masses.append(step_mass)
    return logits, masses, [_kv(c) for c in caches]


@pytest.mark.parametrize("n,qtype,kind,n_kv_heads", [(2, "q4_1", "llama", 2), (3, "q8_0", "qwen2", 1),
                                                      (8, "q4_0", "llama", 2)])
def test_fused_batch_equals_one_token_steps_and_op_by_op(n, qtype, kind, n_kv_heads, tmp_path, monkeypatch):
    _, path = _gguf(tmp_path, qtype, kind, n_kv_heads=n_kv_heads)
    model = _model(path)
    rows = []  # B of every fused step
    step = cpu_ops.Decoder.step
    monkeypatch.setattr(cpu_ops.Decoder, "step", lambda self, ids, *a: rows.append(len(ids)) or step(self, ids, *a))
    fused = _batched_decode(model, n, "fused")
    assert rows.count(n) == 6  # every batched step ran as one call
    for other in (_batched_decode(model, n, "alone"), _batched_decode(model, n, "op-by-op")):
        for got, want in zip(fused[0], other[0]):
            assert (got is None and want is None) or torch.equal(got, want)
        for got, want in zip(fused[1], other[1]):
            assert got.keys() == want.keys() and all(torch.equal(got[b], want[b]) for b in got)
        for (k, v), (k2, v2) in zip(fused[2], other[2]):
            assert torch.equal(k, k2) and torch.equal(v, v2)
    assert any(fused[1]) and all(m.sum() > 0 for step in fused[1] for m in step.values())


def test_fused_batch_falls_back_to_op_by_op(tmp_path):
    """Caches of two pools, or more sequences than the quantised matmuls take (the op-by-op path's go dense there),
    run op by op."""
    _, path = _gguf(tmp_path, "q8_0")
    model = _model(path)
    model.forward(torch.tensor([1]), new_cache(model))  # builds the decoder
    dec = model._decoder
    for caches in ([new_cache(model), new_cache(model)],
                   [PagedKVCache(new_cache(model).pool, model.ops) for _ in range(QUANT_MAX_TOKENS + 1)]):
        for c in caches:
            model.forward(torch.tensor([5, 6]), c, logits=None)
        dec.reset_times()
        model.forward_batch(torch.arange(len(caches)), CacheBatch(caches, [1] * len(caches)))
        assert sum(dec.times().values()) == 0


def _pool_bits(pool) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool's K and V bit patterns (its unused rows are uninitialised memory, maybe NaNs)."""
    return pool.k.view(torch.int32).clone(), pool.v.view(torch.int32).clone()


def _unwritten(pool, bits) -> bool:
    return all(torch.equal(a, b) for a, b in zip(_pool_bits(pool), bits))


def _same_kv(caches, kvs) -> bool:
    """The caches hold `kvs` (their `_kv` from before), no more and no less."""
    return all(torch.equal(a, b) for c, kv in zip(caches, kvs) for a, b in zip(_kv(c), kv))


@pytest.mark.parametrize("fused", [True, False])
def test_bad_inputs_in_a_batch_raise_as_op_by_op(fused, tmp_path):
    """A bad token, block table or node bounds in one row raises the op-by-op path's error, naming the problem; the
    fused step writes nothing at all (the op-by-op one has stored the K/V of the rows before the bad one)."""
    _, path = _gguf(tmp_path, "q4_1")
    model = _model(path)
    caches = _batch_caches(model, 3, seed=7)
    pool = caches[0].pool
    model.fused_decode = fused
    lengths, kvs = [c.length for c in caches], [_kv(c) for c in caches]

    def run(tokens, error, match=None, corrupt=lambda: None):
        for c in caches:  # the step's reservation (which copies a shared last page) first, kept by the step
            c.begin(1)
        corrupt()
        bits = _pool_bits(pool)
        with pytest.raises(error, match=match):
            model.forward_batch(torch.tensor(tokens), CacheBatch(caches, [1] * 3))
        if fused:  # not one K/V row written
            assert _unwritten(pool, bits)
        for c, n in zip(caches, lengths):  # as Engine.run_batch does on errors
            c.truncate(n)

    run([1, 101, 2], IndexError)  # outside the vocabulary: the embedding lookup raises (the fused step defers)
    run([1, 2, 3], ValueError, r"block_table\[0\] = 10000 is not a page",  # in the last row
        corrupt=lambda: caches[2].block_table.__setitem__(0, 10_000))
    # bad node bounds in the middle row
    caches[1].collect(torch.tensor([0, 2, 2, caches[1].length + 1], dtype=torch.int32), torch.zeros(1, 3))
    run([1, 2, 3], ValueError, "node_bounds must rise strictly")
    caches[1].collect(None, None)
    assert [c.length for c in caches] == lengths and _same_kv(caches, kvs)
    # still usable: the next step matches fresh caches'
    got = model.forward_batch(torch.tensor([4, 5, 6]), CacheBatch(caches, [1] * 3))
    fresh = _batch_caches(model, 3, seed=7)
    assert torch.equal(got, model.forward_batch(torch.tensor([4, 5, 6]), CacheBatch(fresh, [1] * 3)))


def test_decoder_names_the_bad_row(tmp_path):
    _, path = _gguf(tmp_path, "q8_0")
    model = _model(path)
    caches = _batch_caches(model, 3, seed=2)
    model.forward_batch(torch.tensor([1, 2, 3]), CacheBatch(caches, [1] * 3))  # builds the decoder
    dec, pool = model._decoder, caches[0].pool
    ends = [c.begin(1) + 1 for c in caches]
    cos, sin = model.rope(torch.tensor(ends) - 1)
    tables = [c.block_table for c in caches]
    bits = _pool_bits(pool)
    with pytest.raises(ValueError, match="token 101 is outside the vocabulary"):
        dec.step([1, 2, 101], cos, sin, pool.k, pool.v, tables, ends)
    with pytest.raises(ValueError, match="Decoder.step: invalid arguments"):  # RoPE rows for 2 of 3 rows
        dec.step([1, 2, 3], cos[:2], sin[:2], pool.k, pool.v, tables, ends)
    with pytest.raises(ValueError, match=r"Decoder.step: tokens\[1\] must be an integer, got float 2.0"):
        dec.step([1, 2.0, 3], cos, sin, pool.k, pool.v, tables, ends)  # was pybind's TypeError with its signature
    with pytest.raises(ValueError, match=r"Decoder.step: ends\[0\] must be an integer, got float"):
        dec.step([1, 2, 3], cos, sin, pool.k, pool.v, tables, [float(ends[0])] + ends[1:])
    bad = tables[1].clone()
    bad[-1] = -1
    with pytest.raises(ValueError, match=rf"block_table\[{len(bad) - 1}\] = -1 is not a page"):
        dec.step([1, 2, 3], cos, sin, pool.k, pool.v, [tables[0], bad, tables[2]], ends)
    with pytest.raises(ValueError, match="node_bounds must rise strictly"):
        dec.step([1, 2, 3], cos, sin, pool.k, pool.v, tables, ends,
                 [(None, None), (None, None), (torch.tensor([0, ends[2]], dtype=torch.int32) - 1, torch.zeros(1, 1))])
    assert _unwritten(pool, bits)


def test_engine_batch_failures_leave_every_session(tmp_path):
    """Engine.run_batch over the fused step: an error in one row (bad node bounds; an exhausted pool) leaves every
    session's cache as it was, and the batch runs afterwards."""
    _, path = _gguf(tmp_path, "q8_0")
    eng = tiny_engine(path, pages=14, page_size=4)
    sessions = [eng.session() for _ in range(3)]
    for s, n in zip(sessions, (8, 6, 4)):
        s.append(list(range(1, n + 1)))  # 2 + 2 + 1 pages; the first and last need a new one for their next token
    caches = [s.cache for s in sessions]
    states, kvs = [c.state() for c in caches], [_kv(c) for c in caches]

    def fails(error, match=None):
        refcount = eng.pool.refcount[:]
        with pytest.raises(error, match=match):
            eng.run_batch([[1], [2], [3]], caches, decode=True)
        assert [c.state() for c in caches] == states and eng.pool.refcount == refcount and _same_kv(caches, kvs)

    caches[2].collect(torch.tensor([0, 2, 2, 5], dtype=torch.int32), torch.zeros(1, 3))
    fails(ValueError, "node_bounds must rise strictly")
    caches[2].collect(None, None)
    hog = eng.session()
    hog.append(list(range(1, 33)))  # takes 8 of the 9 free pages: the first session gets the last, the third none
    fails(PoolExhaustedError)
    hog.release()
    assert eng.model._decoder is not None
    outs, _ = eng.run_batch([[1], [2], [3]], caches, decode=True)
    assert [c.length for c in caches] == [9, 7, 5] and all(o.shape == (1, 101) for o in outs)
