"""GoR's learning parts (gor.txt §2.3, App. A.3–A.4), in plain PyTorch: the graph attention network over the graph of
records, BERTScore node ranking, and the two training losses.

- `GATLayer` (Veličković et al. 2017): per head, z = W h; e_ij = LeakyReLU_0.2(a_dstᵀ z_i + a_srcᵀ z_j) over the
  edges j → i (self-loops added, so isolated nodes keep their own features, as App. A.4 keeps them); α_i· =
  softmax over i's in-edges; h'_i = Σ_j α_ij z_j (+ b). `GAT`: two layers, heads concatenated then ELU after the
  first, averaged after the last, so node embeddings live in the query encoder's space (E_q(q)ᵀ h ranks them).
  `PublicGAT`: the authors' public code's encoder (DGL's GATConv, initialised as DGL does): per layer the heads
  concatenated, batch norm, PReLU; each layer's heads averaged and the max over the two layers (jumping knowledge).
- `bertscore_f1`: BERTScore F1 (Zhang et al. 2019) with idf weights: greedy matching of L2-normalised token
  embeddings, R = Σ_ref idf·max cos / Σ idf, P likewise over the candidate, F1 = 2PR / (P + R);
  `bertscore_ranking` orders the nodes by it against a query's source chunk (Eq. 4's M_i).
- `info_nce` (Eq. 6) and `pairwise_rank_loss` (Eq. 7) with s(q, h) = exp(qᵀh / τ); `train_gat` minimises
  L = L_CL + α·L_RANK (Eq. 8) over graphs in mini-batches, as App. A.4 does. τ is not in the paper; 1.0 is its
  public code's value. `TrainConfig.recipe` picks the paper's Eq. 7 (a sum over ranked pairs) and `GAT`, or the
  public code's mean over pairs and `PublicGAT` (the scale Table 6's α was tuned at).

Edge lists are [2, E] (source row 0, destination row 1); the graphs here have tens to hundreds of nodes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class GATLayer(nn.Module):
    """One graph attention layer with `heads` heads of `out_dim` each; output [N, heads, out_dim]."""

    def __init__(self, in_dim: int, out_dim: int, heads: int, dropout: float = 0.0, attn_dropout: float | None = None,
                 bias: bool = False):
        """`dropout` drops input features and, unless `attn_dropout` is given, attention weights; `bias` adds b."""
        super().__init__()
        self.heads, self.out_dim = heads, out_dim
        self.linear = nn.Linear(in_dim, heads * out_dim, bias=False)
        self.att_src = nn.Parameter(torch.empty(heads, out_dim))
        self.att_dst = nn.Parameter(torch.empty(heads, out_dim))
        self.bias = nn.Parameter(torch.zeros(heads, out_dim)) if bias else None
        self.dropout = nn.Dropout(dropout)
        self.attn_dropout = self.dropout if attn_dropout is None else nn.Dropout(attn_dropout)
        for p in (self.linear.weight, self.att_src, self.att_dst):
            nn.init.xavier_uniform_(p)

    def forward(self, h: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
        n = h.shape[0]
        loops = torch.arange(n, device=h.device).expand(2, n)
        src, dst = torch.cat([edges, loops], dim=1)
        z = self.linear(self.dropout(h)).view(n, self.heads, self.out_dim)
        logits = F.leaky_relu((z * self.att_dst).sum(-1)[dst] + (z * self.att_src).sum(-1)[src], 0.2)  # [E, H]
        index = dst[:, None].expand(-1, self.heads)
        top = logits.new_full((n, self.heads), float("-inf")).scatter_reduce_(0, index, logits, "amax")
        weight = (logits - top[dst]).exp()
        total = weight.new_zeros(n, self.heads).index_add_(0, dst, weight)
        alpha = self.attn_dropout(weight / total[dst])
        out = torch.zeros_like(z).index_add_(0, dst, alpha[..., None] * z[src])
        return out if self.bias is None else out + self.bias


class GAT(nn.Module):
    """GoR's two-layer GAT: `dim` → heads × `hidden` (concatenated, ELU) → `dim` (heads averaged)."""

    def __init__(self, dim: int, hidden: int, heads: int = 4, dropout: float = 0.0):
        super().__init__()
        self.first = GATLayer(dim, hidden, heads, dropout)
        self.second = GATLayer(heads * hidden, dim, heads, dropout)

    def forward(self, h: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
        x = F.elu(self.first(h, edges).flatten(1))
        return self.second(x, edges).mean(1)


class PublicGAT(nn.Module):
    """The GAT of GoR's public code: two layers `dim` → heads × `hidden`, each followed by batch norm and PReLU over
    the concatenated heads; a layer's node vector is its heads' mean, and the output the elementwise max over the
    layers (DGL's JumpingKnowledge "max"), so `hidden` must equal `dim` for the query encoder's space. Layers are
    DGL's GATConv: a bias, attention dropout 0.1 beside the feature dropout, Xavier-normal weights with ReLU's gain
    √2, and (1, heads, hidden)-shaped attention vectors (so their fans are heads·hidden and hidden)."""

    def __init__(self, dim: int, hidden: int, heads: int = 4, dropout: float = 0.0):
        super().__init__()
        if hidden != dim:
            raise ValueError(f"PublicGAT's output is `hidden` wide ({hidden}); it must equal the input's {dim}")
        self.layers = nn.ModuleList([GATLayer(dim, hidden, heads, dropout, attn_dropout=0.1, bias=True),
                                     GATLayer(heads * hidden, hidden, heads, dropout, attn_dropout=0.1, bias=True)])
        self.norms = nn.ModuleList([nn.BatchNorm1d(heads * hidden) for _ in self.layers])
        self.acts = nn.ModuleList([nn.PReLU(heads * hidden) for _ in self.layers])
        gain = nn.init.calculate_gain("relu")
        for layer in self.layers:
            nn.init.xavier_normal_(layer.linear.weight, gain=gain)
            for a in (layer.att_src, layer.att_dst):
                a.data = nn.init.xavier_normal_(torch.empty(1, heads, hidden), gain=gain)[0]

    def forward(self, h: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
        n, per_layer = h.shape[0], []
        for layer, norm, act in zip(self.layers, self.norms, self.acts):
            h = act(norm(layer(h, edges).flatten(1)))
            per_layer.append(h.view(n, layer.heads, -1).mean(1))
        return torch.stack(per_layer).amax(0)


def idf_weights(token_ids: list[list[int]], special: set[int] = frozenset()) -> dict[int, float]:
    """BERTScore's idf over a corpus of tokenised texts: log((M + 1) / (df + 1)); special tokens weigh 0."""
    m, df = len(token_ids), {}
    for ids in token_ids:
        for t in set(ids):
            df[t] = df.get(t, 0) + 1
    return {t: 0.0 if t in special else math.log((m + 1) / (d + 1)) for t, d in df.items()}


def bertscore_f1(cand: torch.Tensor, cand_idf: torch.Tensor, ref: torch.Tensor, ref_idf: torch.Tensor) -> float:
    """BERTScore F1 of a candidate against a reference: token embeddings [n, d] / [m, d] and idf weights [n] / [m]."""
    sim = F.normalize(ref, dim=-1) @ F.normalize(cand, dim=-1).T  # [m, n]
    recall = (sim.max(1).values * ref_idf).sum() / ref_idf.sum().clamp_min(1e-12)
    precision = (sim.max(0).values * cand_idf).sum() / cand_idf.sum().clamp_min(1e-12)
    return float(2 * precision * recall / (precision + recall).clamp_min(1e-12))


def info_nce(q: torch.Tensor, nodes: torch.Tensor, positive: torch.Tensor, tau: float,
             negatives: torch.Tensor | None = None) -> torch.Tensor:
    """Eq. 6 averaged over queries: q [B, d], nodes [N, d] (the query's own graph), positive [B] node index;
    `negatives` [K, d]: in-batch negatives from other graphs, added to every query's denominator."""
    pool = nodes if negatives is None else torch.cat([nodes, negatives])
    return F.cross_entropy(q @ pool.T / tau, positive)


def pairwise_rank_loss(q: torch.Tensor, nodes: torch.Tensor, ranking: torch.Tensor, tau: float,
                       pair_mean: bool = False) -> torch.Tensor:
    """Eq. 7 averaged over queries: q [B, d], nodes [N, d], ranking [B, N] node indices best first; every pair
    (i above j) adds log(1 + s(q, h_j) / s(q, h_i)) = softplus((qᵀh_j − qᵀh_i) / τ). `pair_mean`: each query's
    loss is the mean over its N(N-1)/2 pairs rather than their sum (the public code's reduction)."""
    scores = torch.gather(q @ nodes.T, 1, ranking) / tau  # [B, N] in ranked order
    above = torch.triu(torch.ones(ranking.shape[1], ranking.shape[1], dtype=torch.bool, device=q.device), 1)
    pairs = F.softplus(scores[:, None, :] - scores[:, :, None])  # [B, i, j]: j's score minus i's
    per_query = (pairs * above).sum((1, 2))
    return (per_query / max(int(above.sum()), 1) if pair_mean else per_query).mean()


def bertscore_ranking(nodes: list[tuple[list[int], torch.Tensor]], sources: list[tuple[list[int], torch.Tensor]],
                      idf: dict[int, float]) -> torch.Tensor:
    """[len(sources), len(nodes)] node indices, best first, by BERTScore F1 of each node (candidate) against each
    source chunk (reference): M_i of Eq. 4. Token lists are (ids, embeddings) as `Embedder.token_embeddings` gives
    them; `idf` weighs tokens (unknown ones weigh 0); ties keep node order."""
    weights = [torch.tensor([idf.get(t, 0.0) for t in ids]) for ids, _ in nodes]
    f1 = torch.tensor([[bertscore_f1(emb, w, ref, torch.tensor([idf.get(t, 0.0) for t in ref_ids]))
                        for (_, emb), w in zip(nodes, weights)] for ref_ids, ref in sources])
    return torch.argsort(-f1, dim=1, stable=True)


@dataclass
class GraphData:
    """What training needs of one document's graph: node features [N, d] (the context encoder's), edges [2, E]
    (as the recipe directs them), training queries [Q, d] (the query encoder's) and each query's node ranking
    [Q, N], best first (Eq. 4's M_i)."""

    features: torch.Tensor
    edges: torch.Tensor
    queries: torch.Tensor
    ranking: torch.Tensor


@dataclass(frozen=True)
class TrainConfig:
    """The training run (App. A.4, Table 6): Adam, the learning rate decayed from `lr` to 0 on a half cosine over all
    steps, `batch` graphs per step. L = cl·L_CL + α·L_RANK; `in_batch`: the other graphs' nodes of the step join
    every query's InfoNCE denominator. `recipe`: "paper" (`GAT`, L_RANK summed over pairs) or "public" (`PublicGAT`
    over the step's graphs as one disjoint graph, as its batch norm sees them, and L_RANK averaged over pairs)."""

    hidden: int
    heads: int = 4
    dropout: float = 0.0
    epochs: int = 150
    lr: float = 1e-3
    batch: int = 32
    tau: float = 1.0
    alpha: float = 0.9
    cl: bool = True
    in_batch: bool = True
    seed: int = 0
    recipe: str = "paper"


def train_gat(graphs: list[GraphData], config: TrainConfig) -> GAT | PublicGAT:
    """A GAT trained on `graphs` (Eq. 8), deterministic under `config.seed`; returned in eval mode. Graphs without
    queries have nothing to learn from and are left out."""
    # encoders run in inference mode, whose tensors autograd refuses: train on plain copies
    graphs = [GraphData(g.features.clone(), g.edges, g.queries.clone(), g.ranking) for g in graphs if len(g.queries)]
    if not graphs:
        raise ValueError("GoR training needs at least one graph with simulated queries")
    torch.manual_seed(config.seed)
    order = torch.Generator().manual_seed(config.seed)
    model = PublicGAT if config.recipe == "public" else GAT
    gat = model(graphs[0].features.shape[1], config.hidden, config.heads, config.dropout)
    steps = config.epochs * math.ceil(len(graphs) / config.batch)
    opt = torch.optim.Adam(gat.parameters(), lr=config.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 * (1 + math.cos(math.pi * step / steps)))
    gat.train()
    for _ in range(config.epochs):
        shuffled = torch.randperm(len(graphs), generator=order).tolist()
        for start in range(0, len(graphs), config.batch):
            batch = [graphs[i] for i in shuffled[start:start + config.batch]]
            loss = _batch_loss(gat, batch, config)
            opt.zero_grad()
            loss.backward()
            opt.step()
            schedule.step()
    return gat.eval()


def _batch_loss(gat: GAT | PublicGAT, batch: list[GraphData], config: TrainConfig) -> torch.Tensor:
    """Eq. 8 averaged over the batch's graphs; one GAT forward per graph, or one over their disjoint union for the
    public recipe (whose batch norm then takes its statistics over every node of the step, as DGL's batched graph
    gives them)."""
    if config.recipe == "public":
        sizes = [len(g.features) for g in batch]
        offsets = torch.tensor([0, *sizes[:-1]]).cumsum(0)
        edges = torch.cat([g.edges + o for g, o in zip(batch, offsets)], dim=1)
        nodes = list(gat(torch.cat([g.features for g in batch]), edges).split(sizes))
    else:
        nodes = [gat(g.features, g.edges) for g in batch]
    losses = []
    for i, g in enumerate(batch):
        others = [h for j, h in enumerate(nodes) if j != i]
        negatives = torch.cat(others) if config.in_batch and others else None
        loss = config.alpha * pairwise_rank_loss(g.queries, nodes[i], g.ranking, config.tau,
                                                 pair_mean=config.recipe == "public")
        if config.cl:
            loss = loss + info_nce(g.queries, nodes[i], g.ranking[:, 0], config.tau, negatives)
        losses.append(loss)
    return torch.stack(losses).mean()
