"""GoR's learning parts against independent computations: the GAT layer against dense masked attention written
from the paper's formula, BERTScore against a double loop, Eq. 6 and Eq. 7 by hand, and a toy graph on which
training with Eq. 6 brings a chosen node to rank 1."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from nodekv.methods.gor.gor_train import (GAT, GATLayer, PublicGAT, bertscore_f1, bertscore_ranking, idf_weights,
                                      info_nce, pairwise_rank_loss)


def dense_gat(layer: GATLayer, h: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """Veličković et al. Eq. 1–4 with a dense [N, N] neighbour mask (self-loops included)."""
    n = h.shape[0]
    mask = torch.eye(n, dtype=torch.bool)
    mask[edges[1], edges[0]] = True  # row i: the nodes j with an edge j -> i
    z = layer.linear(h).view(n, layer.heads, layer.out_dim)
    out = torch.empty_like(z)
    for k in range(layer.heads):
        e = F.leaky_relu((z[:, k] @ layer.att_dst[k])[:, None] + (z[:, k] @ layer.att_src[k])[None, :], 0.2)
        alpha = torch.softmax(e.masked_fill(~mask, float("-inf")), dim=1)
        out[:, k] = alpha @ z[:, k]
    return out if layer.bias is None else out + layer.bias


@pytest.mark.parametrize("n, heads, seed", [(1, 1, 0), (7, 4, 1), (40, 2, 2)])
def test_gat_layer_matches_dense_masked_attention(n, heads, seed):
    torch.manual_seed(seed)
    layer = GATLayer(12, 5, heads)
    h = torch.randn(n, 12)
    pairs = sorted({(int(a), int(b)) for a, b in torch.randint(0, n, (3 * n, 2)) if a != b})
    edges = torch.tensor(pairs, dtype=torch.long).reshape(-1, 2).T
    torch.testing.assert_close(layer(h, edges), dense_gat(layer, h, edges), rtol=1e-5, atol=1e-6)


def test_an_isolated_node_keeps_its_own_projection_and_gat_maps_back_to_the_input_dimension():
    torch.manual_seed(0)
    layer, h = GATLayer(6, 3, 2), torch.randn(3, 6)
    out = layer(h, torch.tensor([[0], [1]]))
    torch.testing.assert_close(out[2], layer.linear(h[2]).view(2, 3))
    assert GAT(6, 4, heads=4)(h, torch.tensor([[0], [1]])).shape == (3, 6)


def test_public_gat_matches_its_layers_written_out_in_float64():
    """Each layer: dense masked attention plus bias, batch norm by its running statistics (eval), PReLU with a
    weight per channel; a layer's vector is its heads' mean and the output the max over the two layers."""
    torch.manual_seed(0)
    n, dim, heads = 9, 6, 3
    gat = PublicGAT(dim, dim, heads).double().eval()
    for layer, norm, act in zip(gat.layers, gat.norms, gat.acts):
        for t in (layer.bias, norm.weight, norm.bias, norm.running_mean, act.weight):
            t.data = torch.randn_like(t)
        norm.running_var = torch.rand_like(norm.running_var) + 0.5
    h = torch.randn(n, dim, dtype=torch.float64)
    edges = torch.tensor([[0, 1, 2, 5, 7], [4, 4, 4, 8, 8]])
    x, layers = h, []
    for layer, norm, act in zip(gat.layers, gat.norms, gat.acts):
        y = dense_gat(layer, x, edges).reshape(n, -1)
        y = (y - norm.running_mean) / torch.sqrt(norm.running_var + norm.eps) * norm.weight + norm.bias
        x = torch.where(y >= 0, y, act.weight * y)
        layers.append(x.view(n, heads, dim).mean(1))
    torch.testing.assert_close(gat(h, edges), torch.maximum(*layers), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="must equal the input's 6"):
        PublicGAT(dim, 4)


def test_public_gat_is_initialised_as_dgls_gatconv():
    """Xavier-normal with ReLU's gain: std = √2·√(2 / (fan_in + fan_out)); a (1, heads, out) attention vector has
    fans heads·out and out. (The paper's GAT's Xavier-uniform, gain 1, is 1/√2 of these for the weights.)"""
    torch.manual_seed(0)
    dim, heads = 128, 4
    first = PublicGAT(dim, dim, heads).layers[0].requires_grad_(False)
    std = lambda fan_in, fan_out: math.sqrt(2) * math.sqrt(2 / (fan_in + fan_out))  # noqa: E731
    assert float(first.linear.weight.std()) == pytest.approx(std(dim, heads * dim), rel=0.03)
    attention = torch.cat([first.att_src.flatten(), first.att_dst.flatten()])
    assert float(attention.std()) == pytest.approx(std(heads * dim, dim), rel=0.06)
    assert torch.equal(first.bias, torch.zeros(heads, dim)) and first.attn_dropout.p == 0.1


def test_bertscore_matches_a_double_loop():
    torch.manual_seed(0)
    cand, ref = torch.randn(5, 8), torch.randn(7, 8)
    ci, ri = torch.rand(5), torch.rand(7)
    cos = lambda a, b: float(a @ b / (a.norm() * b.norm()))  # noqa: E731
    r = sum(ri[i] * max(cos(ref[i], cand[j]) for j in range(5)) for i in range(7)) / ri.sum()
    p = sum(ci[j] * max(cos(ref[i], cand[j]) for i in range(7)) for j in range(5)) / ci.sum()
    assert bertscore_f1(cand, ci, ref, ri) == pytest.approx(float(2 * p * r / (p + r)), rel=1e-5)
    assert bertscore_f1(ref, ri, ref, ri) == pytest.approx(1.0, rel=1e-6)


def test_bertscore_ranking_orders_nodes_by_f1_against_each_source():
    torch.manual_seed(1)
    nodes = [([1, 2, 3], torch.randn(3, 4)), ([2, 4], torch.randn(2, 4)), ([5], torch.randn(1, 4))]
    sources = [nodes[1], ([1, 5], torch.randn(2, 4))]
    idf = {1: 0.5, 2: 1.0, 3: 2.0, 4: 0.7, 5: 1.3}
    ranking = bertscore_ranking(nodes, sources, idf)
    for s, (ref_ids, ref) in enumerate(sources):
        w = lambda ids: torch.tensor([idf[t] for t in ids])  # noqa: E731
        f1 = [bertscore_f1(emb, w(ids), ref, w(ref_ids)) for ids, emb in nodes]
        assert ranking[s].tolist() == sorted(range(3), key=lambda j: -f1[j])
    assert ranking[0, 0] == 1  # a node scores best against itself


def test_idf_is_log_of_smoothed_inverse_document_frequency():
    idf = idf_weights([[101, 5, 6], [101, 5], [101, 7]], special={101})
    assert idf == {101: 0.0, 5: pytest.approx(math.log(4 / 3)), 6: pytest.approx(math.log(2)),
                   7: pytest.approx(math.log(2))}


def test_info_nce_by_hand_with_and_without_in_batch_negatives():
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    nodes = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    neg = torch.tensor([[3.0, 3.0]])
    tau = 0.5
    s = lambda a, b: math.exp(float(a @ b) / tau)  # noqa: E731
    own = [-math.log(s(q[0], nodes[0]) / sum(s(q[0], h) for h in nodes)),
           -math.log(s(q[1], nodes[2]) / sum(s(q[1], h) for h in nodes))]
    both = [-math.log(s(q[0], nodes[0]) / (sum(s(q[0], h) for h in nodes) + s(q[0], neg[0]))),
            -math.log(s(q[1], nodes[2]) / (sum(s(q[1], h) for h in nodes) + s(q[1], neg[0])))]
    pos = torch.tensor([0, 2])
    assert float(info_nce(q, nodes, pos, tau)) == pytest.approx(sum(own) / 2, rel=1e-6)
    assert float(info_nce(q, nodes, pos, tau, negatives=neg)) == pytest.approx(sum(both) / 2, rel=1e-6)


def test_pairwise_rank_loss_by_hand():
    torch.manual_seed(0)
    q, nodes, tau = torch.randn(2, 3), torch.randn(4, 3), 0.7
    ranking = torch.tensor([[2, 0, 3, 1], [1, 2, 0, 3]])
    s = lambda a, b: math.exp(float(a @ b) / tau)  # noqa: E731
    total = 0.0
    for k in range(2):
        order = ranking[k].tolist()
        for a in range(4):
            for b in range(a + 1, 4):  # order[b] ranks below order[a]
                total += math.log(1 + s(q[k], nodes[order[b]]) / s(q[k], nodes[order[a]]))
    assert float(pairwise_rank_loss(q, nodes, ranking, tau)) == pytest.approx(total / 2, rel=1e-5)
    assert float(pairwise_rank_loss(q, nodes, ranking, tau, pair_mean=True)) == pytest.approx(total / 2 / 6, rel=1e-5)


def test_training_on_a_toy_graph_brings_the_labelled_node_to_rank_one():
    torch.manual_seed(0)
    n, dim = 12, 8
    h = F.normalize(torch.randn(n, dim), dim=1)
    edges = torch.tensor([[i for i in range(n - 1)], [i + 1 for i in range(n - 1)]])
    q = F.normalize(torch.randn(3, dim), dim=1)
    target = torch.tensor([5, 5, 9])
    gat = GAT(dim, 8, heads=2)
    before = (q @ gat(h, edges).T).argmax(1)
    opt = torch.optim.Adam(gat.parameters(), lr=1e-2)
    for _ in range(200):
        opt.zero_grad()
        loss = info_nce(q, gat(h, edges), target, tau=0.1)
        loss.backward()
        opt.step()
    assert not torch.equal(before, target)
    assert torch.equal((q @ gat(h, edges).T).argmax(1), target)
