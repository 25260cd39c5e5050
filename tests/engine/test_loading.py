"""GGUF loading (Q/K un-permutation, quantised kernels) against HF on the same numbers; bad checkpoints are
refused with an error naming the problem."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import new_cache, tiny_hf_model, write_tiny_gguf
from nodekv.engine.errors import ModelLoadError
from nodekv.engine.loader import load_checkpoint
from nodekv.engine.model import Llama


@pytest.mark.parametrize("qtype", ["f32", "q8_0", "q4_1", "q4_0"])
@pytest.mark.parametrize("tied", [False, True])
def test_gguf_matches_hf(qtype, tied, tmp_path):
    hf = tiny_hf_model(tied=tied)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(hf, path, qtype)
    ids = torch.randint(0, 101, (24,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    ckpt = load_checkpoint(path)
    config, tensors = ckpt.config, ckpt.tensors
    assert config.tie_embeddings == tied
    model = Llama(config, tensors)
    prefill = model.forward(ids, new_cache(model), logits="all")
    assert (prefill - ref).abs().max() <= 1e-4 * ref.abs().max()
    # one token at a time: the quantised kernels (for q* types) on the decode path
    cache = new_cache(model)
    steps = torch.cat([model.forward(ids[i:i + 1], cache, logits="last") for i in range(len(ids))])
    assert (steps - ref).abs().max() <= 1e-4 * ref.abs().max()


def _hf_dir(save_hf):
    return save_hf(tiny_hf_model())


def test_unsupported_architecture(save_hf, tmp_path):
    path = _hf_dir(save_hf)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_checkpoint(path)
    write_tiny_gguf(tiny_hf_model(), tmp_path / "x.gguf", "f32", arch="gpt2")
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        load_checkpoint(tmp_path / "x.gguf")


def _edit_weights(path, edit):
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def test_missing_tensor(save_hf):
    path = _hf_dir(save_hf)
    _edit_weights(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    ckpt = load_checkpoint(path)
    config, tensors = ckpt.config, ckpt.tensors
    with pytest.raises(ModelLoadError, match=r"lacks tensor 'layers\.1\.w3'"):
        Llama(config, tensors)


def test_misshaped_tensor(save_hf):
    path = _hf_dir(save_hf)
    _edit_weights(path, lambda t: t.__setitem__("model.layers.0.self_attn.k_proj.weight", torch.zeros(16, 64)))
    ckpt = load_checkpoint(path)
    config, tensors = ckpt.config, ckpt.tensors
    with pytest.raises(ModelLoadError, match=r"'layers\.0\.wk' has shape \[16, 64\], expected \[32, 64\]"):
        Llama(config, tensors)


@pytest.mark.parametrize("file, text, message", [
    ("model.safetensors.index.json", "{}", "expected a weight_map object"),  # was a KeyError
    ("model.safetensors.index.json", "[]", "index.json: expected a JSON object"),  # was a TypeError
    ("model.safetensors.index.json", "{oops", r"index.json: cannot read JSON \(Expecting"),  # a JSONDecodeError
    ("config.json", "\udcff", "config.json: cannot read JSON .*can't decode byte 0xff"),  # a UnicodeDecodeError
])
def test_corrupt_json_files_are_named(save_hf, file, text, message):
    path = save_hf(tiny_hf_model(), shard="20KB")
    (path / file).write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(ModelLoadError, match=message):
        load_checkpoint(path)


def test_quantised_hf_checkpoint_is_refused(save_hf):
    path = _hf_dir(save_hf)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "bitsandbytes"}}))
    with pytest.raises(ModelLoadError, match=r"quantised checkpoint \(quantization_config: bitsandbytes\)"):
        load_checkpoint(path)
    (path / "config.json").write_text(json.dumps(cfg))  # int8 weights without the config that says so
    _edit_weights(path, lambda t: t.__setitem__("model.layers.0.mlp.up_proj.weight", torch.ones(96, 64,
                                                                                               dtype=torch.int8)))
    with pytest.raises(ModelLoadError, match="tensor model.layers.0.mlp.up_proj.weight is torch.int8"):
        load_checkpoint(path)


def test_hf_dir_without_tokenizer_is_refused_before_its_weights_load(save_hf, monkeypatch):
    import nodekv.engine.engine as engine

    path = _hf_dir(save_hf)  # config and weights, no tokenizer.json

    def no_load(path):
        raise AssertionError("the weights were loaded before the tokenizer was checked")

    monkeypatch.setattr(engine, "load_checkpoint", no_load)
    with pytest.raises(ModelLoadError, match="missing tokenizer.json"):
        engine.load_engine(path, device="cpu")


def test_gguf_without_tokenizer_is_refused_before_its_weights_load(tmp_path, monkeypatch):
    import nodekv.engine.engine as engine

    path = tmp_path / "t.gguf"
    write_tiny_gguf(tiny_hf_model(), path, "q8_0")  # config and weights, no tokenizer.ggml.* metadata
    monkeypatch.setattr(engine, "load_checkpoint", lambda *a: pytest.fail("the weights were loaded first"))
    with pytest.raises(ModelLoadError, match="GGUF has no tokenizer metadata"):
        engine.load_engine(path, device="cpu")


def test_truncated_safetensors(save_hf):
    path = _hf_dir(save_hf)
    file = path / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        load_checkpoint(path)


@pytest.mark.parametrize("keep", [0.5, 0.01])
def test_truncated_gguf(tmp_path, keep):
    path = tmp_path / "t.gguf"
    write_tiny_gguf(tiny_hf_model(), path, "q8_0")
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        load_checkpoint(path)


def test_not_a_model(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_checkpoint(junk)
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_checkpoint(tmp_path / "empty_dir")


def test_read_gguf_tensors_match_gguf_reader(tmp_path):
    import gguf
    import numpy as np

    from nodekv.engine.gguf_file import read_gguf

    path = tmp_path / "t.gguf"
    write_tiny_gguf(tiny_hf_model(kind="qwen2"), path, "q4_1")
    mine, theirs = read_gguf(path), gguf.GGUFReader(str(path))
    assert list(mine.tensors) == [t.name for t in theirs.tensors]
    for t in theirs.tensors:
        m = mine.tensors[t.name]
        assert (m.qtype, m.shape) == (t.tensor_type, tuple(int(d) for d in t.shape))
        assert np.array_equal(m.data, t.data), t.name


def _raw_gguf(version: int = 3, n_dims: int = 1, alignment: int | None = None,
              names: tuple[str, ...] = ("a",)) -> bytes:
    """A GGUF v`version` file holding an 8-float tensor of `n_dims` header dimensions (8, 1, 1, ...) under each of
    `names`, written byte by byte (the gguf package's writer refuses the corrupt values these tests need)."""
    import struct

    def text(s: str) -> bytes:
        return struct.pack("<Q", len(s)) + s.encode()

    kv = [] if alignment is None else [text("general.alignment") + struct.pack("<II", 4, alignment)]
    header = b"GGUF" + struct.pack("<IQQ", version, len(names), len(kv)) + b"".join(kv)
    for k, name in enumerate(names):
        header += text(name) + struct.pack("<I", n_dims) + struct.pack("<Q", 8)
        header += struct.pack("<Q", 1) * min(n_dims - 1, 3) + struct.pack("<IQ", 0, 32 * k)  # F32, 32 bytes each
    return header + bytes(-len(header) % 32) + bytes(32 * len(names))


@pytest.mark.parametrize("bad, message", [
    (dict(n_dims=0xFFFF_FFF0), "tensor a has 4294967280 dimensions"),  # was a MemoryError (a 4-billion-item unpack)
    (dict(n_dims=0), "tensor a has 0 dimensions"),
    (dict(alignment=0), "general.alignment 0 is not a power of two"),  # was a ZeroDivisionError
    (dict(alignment=24), "general.alignment 24 is not a power of two"),
    (dict(version=4), "GGUF version 4 is not supported"),
    (dict(names=("a", "b", "a")), "tensor a is listed twice"),  # was read as the second "a"
])
def test_corrupt_gguf_header(tmp_path, bad, message):
    from nodekv.engine.gguf_file import read_gguf

    path = tmp_path / "t.gguf"
    path.write_bytes(_raw_gguf())
    assert read_gguf(path).tensors["a"].shape == (8,)  # the well-formed file reads
    path.write_bytes(_raw_gguf(**bad))
    with pytest.raises(ModelLoadError, match=message):
        read_gguf(path)


@pytest.mark.parametrize("edit, message", [
    ({"num_attention_heads": None}, "config.json lacks required field 'num_attention_heads'"),  # was a TypeError
    ({"intermediate_size": "96"}, "field 'intermediate_size' is '96', expected an integer"),
    ({"hidden_size": 64.5}, "field 'hidden_size' is 64.5, expected an integer"),  # was cut to 64
    ({"rms_norm_eps": [1e-5]}, r"field 'rms_norm_eps' is \[1e-05\], expected a number"),
    ({"rope_scaling": "llama3"}, "field 'rope_scaling' is 'llama3', expected an object"),  # was an AttributeError
    ({"num_attention_heads": 0, "head_dim": None}, "n_heads must be positive, got 0"),  # was a ZeroDivisionError
    # bool("false") is True: an untied lm_head was ignored for the embedding, or q/k/v biases were asked for
    ({"tie_word_embeddings": "false"}, "field 'tie_word_embeddings' is 'false', expected true or false"),
    ({"attention_bias": 0}, "field 'attention_bias' is 0, expected true or false"),
])
def test_hf_config_field_of_wrong_type(save_hf, edit, message):
    from nodekv.engine.loader import model_config

    path = _hf_dir(save_hf)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(ModelLoadError, match=message):
        model_config(path)
    (path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="config.json: expected a JSON object"):
        model_config(path)


@pytest.mark.parametrize("head_count, message", [
    ([4, 4], r"'llama.attention.head_count' is \[4, 4\], expected an integer"),  # was a TypeError
    ("4", "'llama.attention.head_count' is '4', expected an integer"),
    (0, "n_heads must be positive, got 0"),  # was a ZeroDivisionError
])
def test_gguf_metadata_of_wrong_type(tmp_path, head_count, message):
    import gguf

    from nodekv.engine.loader import model_config

    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in {"block_count": 2, "context_length": 256, "embedding_length": 64, "feed_forward_length": 96,
                       "vocab_size": 101}.items():
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    key = "llama.attention.head_count"
    {list: w.add_array, str: w.add_string, int: w.add_uint32}[type(head_count)](key, head_count)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=message):
        model_config(path)
