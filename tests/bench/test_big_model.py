"""bench/big_model on a small config: the random-block GGUF it writes decodes as gguf's reference decodes it, loads,
and runs a prompt with node mass (rows sum to 1) and a decode."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from nodekv.bench.big_model import run, write_model
from nodekv.engine.config import ModelConfig
from nodekv.engine.loader import load_checkpoint


def test_the_random_model_loads_decodes_as_gguf_does_and_runs(tmp_path):
    c = ModelConfig(vocab_size=512, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=512,
                    max_seq_len=1024, rope_theta=10000.0, norm_eps=1e-5)
    path = tmp_path / "small.gguf"
    write_model(c, path)
    ckpt = load_checkpoint(path)
    assert ckpt.config.n_layers == 2 and not ckpt.config.tie_embeddings
    down = ckpt.tensors["layers.1.w2"]
    assert (down.qtype, down.shape) == ("q6_k", (256, 512))
    ref = quants.dequantize(down.data.numpy(), GGMLQuantizationType.Q6_K)
    assert np.isfinite(ref).all() and torch.equal(down.dequantize(), torch.from_numpy(ref))
    r = run(path, tokens=300, decode=4, node=128)
    assert r["finite"] and abs(r["mass_rows_sum"] - 1) < 1e-4 and r["decode_tok_s"] > 0
    assert r["peak_rss_gib"] > r["rss_after_load_gib"] > 0


def test_a_failed_write_leaves_no_file_and_a_file_of_other_shapes_is_refused(tmp_path, monkeypatch, capsys):
    from nodekv.bench.big_model import main

    c = ModelConfig(vocab_size=512, dim=320, n_layers=1, n_heads=4, n_kv_heads=2, intermediate_size=512,
                    max_seq_len=1024, rope_theta=10000.0, norm_eps=1e-5)  # 320: not whole 256-value blocks
    with pytest.raises(ValueError):
        write_model(c, tmp_path / "x.gguf")
    assert list(tmp_path.iterdir()) == []
    small = tmp_path / "small.gguf"
    write_model(ModelConfig(vocab_size=512, dim=256, n_layers=1, n_heads=4, n_kv_heads=2, intermediate_size=512,
                            max_seq_len=1024, rope_theta=10000.0, norm_eps=1e-5), small)
    monkeypatch.setattr("nodekv.bench.big_model.run", lambda *a, **k: pytest.fail("it ran"))
    with pytest.raises(SystemExit):
        main(["--preset", "llama-3.2-1b", "--path", str(small)])
    assert "is not a llama-3.2-1b model" in capsys.readouterr().err
