"""attn_implementation="nodekv" in unmodified HF models: logits against HF's sdpa, node mass against HF eager's
output_attentions aggregated per node and against nodekv's own session node mass, a decode step and a continued
prompt through HF's cache, and the inputs it refuses."""
from __future__ import annotations

import pytest
import torch

import nodekv.hf as nodekv_hf
from nodekv.bench.engine_runners import hf_cache_name
from conftest import tiny_engine, tiny_hf_model

BOUNDS = [0, 7, 20, 33, 40]


@pytest.fixture(scope="module", autouse=True)
def _registered():
    nodekv_hf.register()


def _per_node(attn: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """[B, T, S] attention -> [B, T, N] summed over each node's keys (the last node runs to S)."""
    edges = bounds + [attn.shape[-1]] if bounds[-1] < attn.shape[-1] else bounds
    return torch.stack([attn[..., a:b].sum(-1) for a, b in zip(edges, edges[1:])], -1)


def _run(model, impl: str, ids, **kwargs):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(ids, **kwargs)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_logits_equal_sdpa_and_mass_equals_eager_attentions(kind):
    model = tiny_hf_model(kind)
    ids = torch.randint(0, 101, (2, 40), generator=torch.Generator().manual_seed(1))
    mass = nodekv_hf.NodeMassCollector(BOUNDS)
    ours = _run(model, "nodekv", ids, node_mass=mass).logits
    torch.testing.assert_close(ours, _run(model, "sdpa", ids).logits, atol=1e-5, rtol=0)
    eager = _run(model, "eager", ids, output_attentions=True).attentions  # L x [B, H, T, S]
    want = _per_node(torch.stack(eager).mean(dim=(0, 2)), BOUNDS)
    torch.testing.assert_close(mass.mean(), want, atol=1e-5, rtol=0)


def test_mass_equals_nodekv_session_node_mass(tmp_path):
    model = tiny_hf_model()
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, 101, (1, 40), generator=torch.Generator().manual_seed(2))
    mass = nodekv_hf.NodeMassCollector(BOUNDS)
    _run(model, "nodekv", ids, node_mass=mass)
    engine = tiny_engine(tmp_path)
    with engine.session() as s:
        for j, (a, b) in enumerate(zip(BOUNDS, BOUNDS[1:])):
            s.append(ids[0, a:b].tolist(), node_id=j, collect=True)
        rows = [torch.nn.functional.pad(s.token_mass(j), (0, len(BOUNDS) - 2 - j)) for j in range(len(BOUNDS) - 1)]
    torch.testing.assert_close(mass.mean()[0], torch.cat(rows), atol=1e-5, rtol=0)


@pytest.mark.parametrize("batch, cached, total", [(1, 40, 41), (2, 25, 40)])
def test_forwards_over_hfs_cache_attend_from_its_end(batch, cached, total):
    """A decode step, or a prompt continued (queries 25..39 over a cache of 0..24, where HF builds an explicit mask:
    SDPA's is_causal aligns queries to the keys' start), over HF's cache: logits and node mass as eager's over the
    whole sequence; keys past the last bound (token 40) count as one more node."""
    model = tiny_hf_model()
    ids = torch.randint(0, 101, (batch, total), generator=torch.Generator().manual_seed(3))
    model.set_attn_implementation("nodekv")
    with torch.no_grad():
        name = hf_cache_name(model)
        past = model(ids[:, :cached], use_cache=True)[name]
        mass = nodekv_hf.NodeMassCollector(BOUNDS)
        rest = model(ids[:, cached:], use_cache=True, node_mass=mass, **{name: past}).logits
    full = _run(model, "eager", ids, output_attentions=True)
    torch.testing.assert_close(rest, full.logits[:, cached:], atol=1e-5, rtol=0)
    want = _per_node(torch.stack(full.attentions).mean(dim=(0, 2))[:, cached:], BOUNDS)
    assert mass.mean().shape == (batch, total - cached, len(BOUNDS) - (total == BOUNDS[-1]))
    torch.testing.assert_close(mass.mean(), want, atol=1e-5, rtol=0)


def test_refusals():
    with pytest.raises(ValueError, match="increase strictly"):
        nodekv_hf.NodeMassCollector([0, 5, 5])
    with pytest.raises(ValueError, match="start at 0"):
        nodekv_hf.NodeMassCollector([1, 5])
    model = tiny_hf_model()
    ids = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(4))
    padded = torch.ones(2, 12, dtype=torch.long)
    padded[1, :3] = 0
    with pytest.raises(ValueError, match="without padding"):
        _run(model, "nodekv", ids, attention_mask=padded)
    from transformers import StaticCache

    static = {hf_cache_name(model): StaticCache(config=model.config, max_cache_len=32)}
    with pytest.raises(ValueError, match="last query is at position 11 of 32 keys"):  # no mask, keys past the queries
        _run(model, "nodekv", ids, use_cache=True, **static)
    mass = nodekv_hf.NodeMassCollector([0, 6, 12])
    _run(model, "nodekv", ids, node_mass=mass)
    with pytest.raises(ValueError, match="reset"):
        _run(model, "nodekv", ids, node_mass=mass)
    with pytest.raises(ValueError, match="no attention has been collected"):
        nodekv_hf.NodeMassCollector([0, 6]).mean()


@pytest.mark.parametrize("bounds, match", [([0, 2.7, 10], "must be ints, got 2.7"), ("0123", "got the string"),
                                           ([False, True], "must be ints, got False"), (5, "got int"),
                                           ([0, float("nan")], "must be ints, got nan")])
def test_bounds_that_are_not_ints_are_refused(bounds, match):
    with pytest.raises(ValueError, match=match):
        nodekv_hf.NodeMassCollector(bounds)


def test_refused_forwards_leave_no_mass_that_reads_as_whole():
    """Bounds past the keys, a node_mass that is no collector, a forward with gradients, a layer refused after
    others collected: each refused with a line, and a collector that saw a failed forward says so."""
    model = tiny_hf_model()
    ids = torch.randint(0, 101, (1, 12), generator=torch.Generator().manual_seed(5))
    with pytest.raises(ValueError, match="node bounds run to 20, past this forward's 12 keys"):
        _run(model, "nodekv", ids, node_mass=nodekv_hf.NodeMassCollector([0, 6, 20]))
    with pytest.raises(ValueError, match="node_mass must be a nodekv.hf.NodeMassCollector, got list"):
        _run(model, "nodekv", ids, node_mass=[0, 6, 12])
    with pytest.raises(ValueError, match="returns no attention maps"):
        _run(model, "nodekv", ids, output_attentions=True)
    mass = nodekv_hf.NodeMassCollector([0, 6, 12])
    model.set_attn_implementation("nodekv")
    with pytest.raises(ValueError, match="inference only"):
        model(ids, node_mass=mass)  # grad enabled: the kernel would drop the projections' gradients
    with pytest.raises(ValueError, match="the forward this collector was passed to failed"):
        mass.mean()
    mass.reset()
    model.model.layers[1].self_attn.sliding_window = 4  # the second layer is refused after the first collected
    with pytest.raises(ValueError, match="sliding-window"):
        _run(model, "nodekv", ids, node_mass=mass)
    with pytest.raises(ValueError, match="failed \\(ValueError: nodekv attention does not support sliding"):
        mass.mean()


def test_a_forward_begins_where_its_first_attention_layer_comes_again():
    """A hybrid model's first attention layer need not be layer 0: the collector knows a forward by its first layer
    seen again, not by an index."""
    q = torch.randn(1, 2, 4, 16)
    kv = torch.randn(1, 2, 4, 16)
    first, second = torch.nn.Module(), torch.nn.Module()
    first.layer_idx, second.layer_idx = 1, 3
    mass = nodekv_hf.NodeMassCollector([0, 2, 4])
    with torch.no_grad():
        for layer in (first, second):
            nodekv_hf.nodekv_attention(layer, q, kv, kv, None, node_mass=mass)
        assert mass.layers == 2
        with pytest.raises(ValueError, match="reset"):
            nodekv_hf.nodekv_attention(first, q, kv, kv, None, node_mass=mass)
    torch.testing.assert_close(mass.mean().sum(-1), torch.ones(1, 4))


def test_an_encoder_is_refused():
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=64)).eval()
    model.set_attn_implementation("nodekv")
    with torch.no_grad(), pytest.raises(ValueError, match="this layer is not causal"):
        model(torch.randint(0, 50, (1, 8)))
