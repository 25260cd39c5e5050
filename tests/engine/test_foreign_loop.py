"""examples/foreign_loop.py — a foreign attention loop over PagedKVCache — against brute-force causal attention on
the whole sequence: chunked prefill, two forked continuations and the collected node mass."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "foreign_loop.py"


def _load():
    spec = importlib.util.spec_from_file_location("foreign_loop", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _brute_force(ex, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The stack on the whole sequence with dense causal attention; also each layer's [H, T, T] probabilities."""
    t, probs = x.shape[0], []
    for layer in range(ex.CONFIG.n_layers):
        q, k, v = ex.layer_inputs(x, layer)
        group = ex.HEADS // ex.KV_HEADS
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("thd,shd->hts", q, k) / ex.HEAD_DIM ** 0.5
        p = scores.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf")).softmax(-1)
        probs.append(p)
        x = torch.einsum("hts,shd->thd", p, v).reshape(t, -1)
    return x, probs


def test_foreign_loop_matches_dense_attention(capsys):
    ex = _load()
    got = ex.main()
    assert "pages in use" in capsys.readouterr().out
    prompt = torch.randn(40, ex.CONFIG.dim, generator=torch.Generator().manual_seed(7))
    full, probs = _brute_force(ex, prompt)
    torch.testing.assert_close(got["prompt_out"], full[24:], atol=1e-5, rtol=1e-5)
    for key, token in (("a", torch.ones(1, ex.CONFIG.dim)), ("b", -torch.ones(1, ex.CONFIG.dim))):
        torch.testing.assert_close(got[key], _brute_force(ex, torch.cat([prompt, token]))[0][-1:], atol=1e-5,
                                   rtol=1e-5)
    mean = torch.stack(probs).mean(dim=(0, 1))[24:]  # [16 queries, 40 keys], averaged over layers and heads
    torch.testing.assert_close(got["mass"], torch.stack([mean[:, :24].sum(-1), mean[:, 24:].sum(-1)], -1),
                               atol=1e-5, rtol=1e-5)


def test_begin_and_commit_refuse_counts_no_forward_wrote():
    """A foreign loop's slip in counting positions is refused, leaving the cache as it was: committed unchecked,
    positions no forward wrote (past the pages even) would be attended to as cached keys."""
    ex = _load()
    pool = ex.PagePool(ex.CONFIG, torch.float32, n_pages=4, page_size=4)
    cache = ex.PagedKVCache(pool, ex.cpu_ops)
    x = torch.randn(3, ex.CONFIG.dim, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="begin takes a number of new positions >= 0, got -1"):
        cache.begin(-1)
    cache.begin(3)
    with pytest.raises(ValueError, match="commit of 10 positions after a begin of 3"):
        cache.commit(10)
    with pytest.raises(ValueError, match="commit of -1 positions"):
        cache.commit(-1)
    assert cache.length == 0 and pool.n_free == 3
    out = ex.forward(cache, x)  # begins and commits 3 again
    with pytest.raises(ValueError, match="commit of 1 positions after a begin of 0"):
        cache.commit(1)  # a commit counts a begin once
    assert cache.length == 3
    torch.testing.assert_close(out, _brute_force(ex, x)[0], atol=1e-5, rtol=1e-5)


def test_read_and_write_refuse_positions_outside_the_cache():
    """read and write take only positions the cache holds (write: or `begin` reserved), else one ValueError and
    nothing written: unchecked, -1 indexed the block table from its end (the last page's last row, never written)
    and a reserved position read uninitialised memory."""
    ex = _load()
    pool = ex.PagePool(ex.CONFIG, torch.float32, n_pages=4, page_size=4)
    cache = ex.PagedKVCache(pool, ex.cpu_ops)
    x = torch.randn(3, ex.CONFIG.dim, generator=torch.Generator().manual_seed(0))
    ex.forward(cache, x)
    cache.begin(2)  # positions 3 and 4 reserved, not written
    pages = pool.k.clone().view(torch.int32)  # bits: pages never written may hold NaNs
    kv = torch.ones(1, ex.KV_HEADS, ex.HEAD_DIM)
    for bad in (-1, 5, 8):
        with pytest.raises(ValueError, match=r"write: positions must be cached or reserved by begin, in \[0, 5\)"):
            cache.write(0, kv, kv, torch.tensor([1, bad]))
    assert torch.equal(pool.k.view(torch.int32), pages)
    for bad in (-1, 3, 4, 8):
        with pytest.raises(ValueError, match=r"read: positions must be cached, in \[0, 3\)"):
            cache.read(0, torch.tensor([bad]))
    cache.write(0, kv, kv, torch.tensor([4]))  # a reserved position may be written
    _, k, v = ex.layer_inputs(x, 0)
    assert all(torch.equal(got, want) for got, want in zip(cache.read(0, torch.arange(3)), (k, v)))
