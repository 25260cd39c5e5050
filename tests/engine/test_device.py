"""The engine's device: choosing and refusing devices, building a model from transformers' weights held in memory (the
GPU benchmark's random-weight models), and, where CUDA is present, the whole forward on the GPU against HF."""
from __future__ import annotations

import pytest
import torch

from conftest import needs_triton_interpreter, tiny_hf_model
from nodekv.engine.cache_batch import CacheBatch
from nodekv.engine.config import PRESETS, ModelConfig
from nodekv.engine.decode_graphs import DecodeGraphs
from nodekv.engine.engine import load_engine, resolve_device
from nodekv.engine.kv_cache import PagedKVCache
from nodekv.engine.loader import hf_state_tensors
from nodekv.engine.model import Llama
from nodekv.engine.page_pool import PagePool
from nodekv.kernels import backend_ops, cpu_ops, reference, triton_ops

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_devices_are_resolved_or_refused_by_name():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for bad in ("gpu", "cuda:x", "cpu:0", "cuda:", ""):
        with pytest.raises(ValueError, match="device must be one of"):
            resolve_device(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a GPU torch cannot see")
def test_cuda_without_a_gpu_is_refused_before_loading():
    with pytest.raises(ValueError, match="sees no CUDA GPU"):
        load_engine("/nonexistent/model.gguf", device="cuda")  # the device is refused, not the path


def test_backends_follow_the_device():
    assert backend_ops("auto", torch.float32, "cpu") is cpu_ops
    assert backend_ops("auto", torch.bfloat16, "cpu") is reference
    assert backend_ops("auto", torch.bfloat16, "cuda") is triton_ops
    assert backend_ops("torch", torch.float32, "cuda") is reference
    with pytest.raises(ValueError, match="float32 CPU tensors only"):
        backend_ops("cpu", torch.float32, "cuda")
    with pytest.raises(ValueError, match="CPU only"):
        load_engine("/nonexistent/model.gguf", device="cpu", dtype="bfloat16", precision="int8")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip_through_hf_configs(name):
    assert ModelConfig.from_hf(PRESETS[name].to_hf()) == PRESETS[name]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_model_from_a_state_dict_in_memory_matches_hf(kind):
    """`hf_state_tensors` + `ModelConfig.to_hf`: transformers builds the model from our config, we run its weights."""
    hf = tiny_hf_model(kind, rope_scaling=kind == "llama")
    config = ModelConfig.from_hf({**hf.config.to_dict(), "architectures": [type(hf).__name__]})
    rebuilt = type(hf)(type(hf.config)(**config.to_hf())).eval()
    rebuilt.load_state_dict(hf.state_dict())
    ours = Llama(config, hf_state_tensors(hf.state_dict()))
    ids = torch.randint(0, 101, (60,), generator=torch.Generator().manual_seed(0))
    pool = PagePool(config, torch.float32, 2, 64)
    got = ours.forward(ids, PagedKVCache(pool, ours.ops), logits="all")
    with torch.no_grad():
        ref, again = hf(ids[None]).logits[0], rebuilt(ids[None]).logits[0]
    assert torch.equal(ref, again)
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_the_forward_keeps_to_the_models_device():
    """The whole forward on the meta device (shapes without data): a tensor the forward makes on the CPU, where the
    model's device is another (the bug CPU-only runs cannot see), fails loudly when it meets the model's tensors.
    Covers a prompt longer than the gate|up tile (Linear.gated), a batched step and a probe rolled back; node mass and
    recompute read data (`.item()`), so they are left to the CUDA tests."""
    from nodekv.bench import gpu_engine
    from nodekv.engine.cache_batch import CacheBatch
    from nodekv.engine.model import GATED_ROWS

    tensors = hf_state_tensors(gpu_engine.hf_model(gpu_engine.TINY, torch.float32, torch.device("cpu"),
                                                   "eager").state_dict())
    model = Llama(gpu_engine.TINY, tensors, backend="torch", device="meta")
    pool = PagePool(gpu_engine.TINY, torch.float32, 64, 16, "meta")
    a, b = PagedKVCache(pool, model.ops), PagedKVCache(pool, model.ops)
    ids = torch.arange(GATED_ROWS + 88) % gpu_engine.TINY.vocab_size
    assert model.forward(ids, a).device.type == "meta"
    model.forward(ids[:5], b, logits=None)
    assert model.forward_batch(ids[:3], CacheBatch([a, b], [2, 1])).shape == (2, gpu_engine.TINY.vocab_size)
    state = a.state()
    model.forward(ids[:4], a, logits="all")
    a.restore(state)
    model.forward(ids[:1], a)
    assert a.length == GATED_ROWS + 91 and a.block_table.device.type == "meta"


def test_gpu_benchmark_runs_its_checks_on_the_cpu(capsys):
    """bench gpu_engine's own code path on the CPU (tiny shapes, fp32): its checks hold and every table row prints."""
    from nodekv.bench import gpu_engine

    gpu_engine.main(["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--prompts", "96", "--decode", "3",
                     "--batch", "2", "--nodes", "5", "--repeats", "1"])
    out = capsys.readouterr().out
    check = next(line for line in out.splitlines() if line.startswith("| nodekv float32"))
    cells = [c.strip() for c in check.strip("|").split("|")]
    assert float(cells[1]) < 1e-5 and float(cells[3].split()[0]) < 1e-5 and cells[4] == "True"
    assert "prefill 96 tokens, tok/s" in out and "decode at batch 2" in out


@needs_cuda
@pytest.mark.parametrize("fresh_mass", ["kernel", "sdpa"])  # how a bf16 prefill sums node mass (fp32: the kernel)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_forward_matches_the_cpu_and_hf(dtype, fresh_mass, monkeypatch):
    """The tiny model on CUDA (Triton kernels, cuBLAS matmuls) against HF in fp32: within 2x HF's own error in the same
    dtype; node mass within 1e-5 (fp32) / 1e-3 (bf16) of the CPU engine's; a probe rolled back leaves the cached
    keys and values bit-identical."""
    from nodekv.bench import gpu_engine
    from nodekv.kernels import triton_ops

    monkeypatch.setattr(triton_ops, "FRESH_PREFILL_MASS", fresh_mass)

    hf = gpu_engine.hf_model(gpu_engine.TINY, torch.float32, torch.device("cuda"), "eager")
    ids = torch.randint(0, gpu_engine.TINY.vocab_size, (200,), generator=torch.Generator().manual_seed(0))
    tensors = hf_state_tensors(hf.state_dict())
    with torch.no_grad():
        exact = hf(ids[None].cuda()).logits[0].double().cpu()
        hf_err = (hf.to(dtype)(ids[None].cuda()).logits[0].double().cpu() - exact).abs().max().item()
    gpu = Llama(gpu_engine.TINY, tensors, dtype, device="cuda")
    cpu = Llama(gpu_engine.TINY, tensors, torch.float32)
    got = gpu.forward(ids, gpu_engine.new_cache(gpu, 200), logits="all").double().cpu()
    assert (got - exact).abs().max().item() <= 2 * max(hf_err, 1e-6)
    bounds = gpu_engine.node_bounds(200, 7, torch.device("cpu"))
    mass_err = (gpu_engine.our_mass(gpu, ids, bounds.cuda()) - gpu_engine.our_mass(cpu, ids, bounds)).abs().max()
    assert mass_err <= (1e-5 if dtype == torch.float32 else 1e-3)
    assert gpu_engine.probe_is_undone(gpu, ids[:150], ids[150:])


@needs_cuda
def test_cuda_engine_keeps_its_tensors_on_the_gpu_and_answers_on_the_cpu():
    from nodekv.bench import gpu_engine

    model = Llama(gpu_engine.TINY, hf_state_tensors(gpu_engine.hf_model(
        gpu_engine.TINY, torch.float32, torch.device("cpu"), "eager").state_dict()), torch.bfloat16, device="cuda")
    assert model.ops is triton_ops and model.inv_freq.is_cuda and model.embed.is_cuda
    assert all(lin.dense.is_cuda and lin.quant is None for layer in model.layers
               for lin in (layer.wqkv, layer.wo, layer.w13, layer.w2))
    cache = gpu_engine.new_cache(model, 64)
    assert cache.pool.k.is_cuda
    model.forward(torch.arange(10), cache)
    assert cache.block_table.is_cuda


def _graph_model(device: str, dtype: torch.dtype = torch.float32) -> Llama:
    from nodekv.bench import gpu_engine

    hf = gpu_engine.hf_model(gpu_engine.TINY, torch.float32, torch.device("cpu"), "eager")
    return Llama(gpu_engine.TINY, hf_state_tensors(hf.state_dict()), dtype, backend="triton", device=device)


def _graphs(model: Llama, pool: PagePool, capture: bool = True) -> DecodeGraphs:
    return DecodeGraphs(model.config, model.ops, model.rope, model._forward_rows, pool, capture)


def _decode_rounds(model: Llama, pool: PagePool, graphs: DecodeGraphs | None):
    """Decode steps of batches that grow and shrink (padding rows come and go, tables cross page boundaries) over
    sessions of different lengths, by `graphs` or, with None, op by op; every step's logits, and the final caches'
    keys."""
    caches = [PagedKVCache(pool, model.ops) for _ in range(5)]
    for i, c in enumerate(caches):
        model.forward((torch.arange(3 + 7 * i) + 11 * i + 1) % 97, c, logits=None)  # no token 0: padding's
    g = torch.Generator().manual_seed(1)
    out = []
    for members in ([0, 1, 2, 3], [3], [0, 1, 2, 3, 4], [4, 1, 0], [4, 1], [2]):
        batch = CacheBatch([caches[m] for m in members], [1] * len(members))
        tokens = torch.randint(0, 512, (len(members),), generator=g)
        if graphs is None:
            model.fused_decode = False
            out.append(model.forward_batch(tokens, batch).cpu())
        else:
            assert graphs.serves(batch)
            out.append(graphs.step(tokens, batch, True).cpu())
    keys = [c.read(1, torch.arange(c.length))[0].cpu() for c in caches]
    return out, keys


@needs_triton_interpreter
def test_a_decode_graphs_static_step_is_the_op_by_op_step():
    """What a CUDA graph records, run eagerly on the CPU (capture=False): batches of 4, 1, 5, 3, 2 and 1 sessions in
    buckets of 4, 1, 8, 4, 2 and 1 rows give the op-by-op step's logits and cached keys (fp32, up to the key splits'
    summation order): the row a session left is padding again, the padding rows write only the graphs' own page,
    and that page stays reserved."""
    model = _graph_model("cpu")
    pools = [PagePool(model.config, torch.float32, 40, 4) for _ in range(2)]
    graphs = _graphs(model, pools[1], capture=False)
    assert pools[1].n_free == 39 and graphs.max_len == min(model.config.max_seq_len, 160)
    sink = pools[1].k[:, graphs.sink].clone()
    want, want_keys = _decode_rounds(model, pools[0], None)
    got, got_keys = _decode_rounds(model, pools[1], graphs)
    for a, b in zip(want + want_keys, got + got_keys):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert not torch.equal(pools[1].k[:, graphs.sink], sink)  # the padding rows wrote there
    assert sorted(b.size for b in graphs._buckets.values()) == [1, 2, 4, 8]


@needs_cuda
def test_cuda_graph_decode_steps_replay_the_static_step():
    """On CUDA, decode steps replayed from the recorded graphs (bf16) give the logits and keys of the same static
    step run eagerly (the same kernels on the same inputs; bf16's tolerance, should cuBLAS pick other kernels inside
    a capture), and a model's own decode steps take them."""
    model = _graph_model("cuda", torch.bfloat16)
    pools = [PagePool(model.config, torch.bfloat16, 40, 4, "cuda") for _ in range(2)]
    eager = _graphs(model, pools[0], capture=False)
    recorded = _graphs(model, pools[1])
    want, want_keys = _decode_rounds(model, pools[0], eager)
    got, got_keys = _decode_rounds(model, pools[1], recorded)
    for a, b in zip(want + want_keys, got + got_keys):
        torch.testing.assert_close(b, a, rtol=1.6e-2, atol=1e-2)
    assert all(b.graph is not None for b in recorded._buckets.values())
    model.fused_decode = True
    cache = PagedKVCache(pools[1], model.ops)
    model.forward(torch.arange(9), cache, logits=None)
    model.forward(torch.tensor([5]), cache)
    assert isinstance(model._decoder, DecodeGraphs) and model._decoder.pool is pools[1]
