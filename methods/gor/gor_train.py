"""GoR's learning parts (gor.txt §2.3, App. A.3–A.4), in plain PyTorch: the graph attention network over the graph of
records, BERTScore node ranking, and the two training losses.

- `GATLayer` (Veličković et al. 2017): per head, z = W h; e_ij = LeakyReLU_0.2(a_dstᵀ z_i + a_srcᵀ z_j) over the
  edges j → i (self-loops added, so isolated nodes keep their own features, as App. A.4 keeps them); α_i· =
  softmax over i's in-edges; h'_i = Σ_j α_ij z_j. `GAT`: two layers, heads concatenated then ELU after the first,
  averaged after the last, so node embeddings live in the query encoder's space (E_q(q)ᵀ h ranks them).
- `bertscore_f1`: BERTScore F1 (Zhang et al. 2019) with idf weights: greedy matching of L2-normalised token
  embeddings, R = Σ_ref idf·max cos / Σ idf, P likewise over the candidate, F1 = 2PR / (P + R);
  `bertscore_ranking` orders the nodes by it against a query's source chunk (Eq. 4's M_i).
- `info_nce` (Eq. 6) and `pairwise_rank_loss` (Eq. 7) with s(q, h) = exp(qᵀh / τ); `train_gat` minimises
  L = L_CL + α·L_RANK (Eq. 8) over graphs in mini-batches, as App. A.4 does. τ is not in the paper; 1.0 is its
  public code's value.

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

    def __init__(self, in_dim: int, out_dim: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.heads, self.out_dim = heads, out_dim
        self.linear = nn.Linear(in_dim, heads * out_dim, bias=False)
        self.att_src = nn.Parameter(torch.empty(heads, out_dim))
        self.att_dst = nn.Parameter(torch.empty(heads, out_dim))
        self.dropout = nn.Dropout(dropout)
        for p in (self.linear.weight, self.att_src, self.att_dst):
            nn.init.xavier_uniform_(p)

    def forward(self, h: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
        n = h.shape[0]
        loops = torch.arange(n, device=h.device).expand(2, n)
        src, dst = torch.cat([edges, loops], dim=1)
        z = self.linear(self.dropout(h)).view(n, self.heads, self.out_dim)
        logits = F.leaky_relu((z * self.att_dst).sum(-1)[dst] + (z * self.att_src).sum(-1)[src], 0.2)  # [E, H]
        index = dst[:, None].expand(-1, self.heads)
        top = torch.full((n, self.heads), float("-inf"), device=h.device).scatter_reduce_(0, index, logits, "amax")
        weight = (logits - top[dst]).exp()
        total = torch.zeros(n, self.heads, device=h.device).index_add_(0, dst, weight)
        alpha = self.dropout(weight / total[dst])
        return torch.zeros_like(z).index_add_(0, dst, alpha[..., None] * z[src])


class GAT(nn.Module):
    """GoR's two-layer GAT: `dim` → heads × `hidden` (concatenated, ELU) → `dim` (heads averaged)."""

    def __init__(self, dim: int, hidden: int, heads: int = 4, dropout: float = 0.0):
        super().__init__()
        self.first = GATLayer(dim, hidden, heads, dropout)
        self.second = GATLayer(heads * hidden, dim, heads, dropout)

    def forward(self, h: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
        x = F.elu(self.first(h, edges).flatten(1))
        return self.second(x, edges).mean(1)


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


def pairwise_rank_loss(q: torch.Tensor, nodes: torch.Tensor, ranking: torch.Tensor, tau: float) -> torch.Tensor:
    """Eq. 7 averaged over queries: q [B, d], nodes [N, d], ranking [B, N] node indices best first; every pair
    (i above j) adds log(1 + s(q, h_j) / s(q, h_i)) = softplus((qᵀh_j − qᵀh_i) / τ)."""
    scores = torch.gather(q @ nodes.T, 1, ranking) / tau  # [B, N] in ranked order
    above = torch.triu(torch.ones(ranking.shape[1], ranking.shape[1], dtype=torch.bool, device=q.device), 1)
    pairs = F.softplus(scores[:, None, :] - scores[:, :, None])  # [B, i, j]: j's score minus i's
    return (pairs * above).sum((1, 2)).mean()


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
    (both directions), training queries [Q, d] (the query encoder's) and each query's node ranking [Q, N], best
    first (Eq. 4's M_i)."""

    features: torch.Tensor
    edges: torch.Tensor
    queries: torch.Tensor
    ranking: torch.Tensor


@dataclass(frozen=True)
class TrainConfig:
    """The training run (App. A.4, Table 6): Adam, the learning rate decayed from `lr` to 0 on a half cosine over all
    steps, `batch` graphs per step. L = cl·L_CL + α·L_RANK; `in_batch`: the other graphs' nodes of the step join
    every query's InfoNCE denominator."""

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


def train_gat(graphs: list[GraphData], config: TrainConfig) -> GAT:
    """A GAT trained on `graphs` (Eq. 8), deterministic under `config.seed`; returned in eval mode. Graphs without
    queries have nothing to learn from and are left out."""
    # encoders run in inference mode, whose tensors autograd refuses: train on plain copies
    graphs = [GraphData(g.features.clone(), g.edges, g.queries.clone(), g.ranking) for g in graphs if len(g.queries)]
    if not graphs:
        raise ValueError("GoR training needs at least one graph with simulated queries")
    torch.manual_seed(config.seed)
    order = torch.Generator().manual_seed(config.seed)
    gat = GAT(graphs[0].features.shape[1], config.hidden, config.heads, config.dropout)
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


def _batch_loss(gat: GAT, batch: list[GraphData], config: TrainConfig) -> torch.Tensor:
    """Eq. 8 averaged over the batch's graphs; one GAT forward per graph."""
    nodes = [gat(g.features, g.edges) for g in batch]
    losses = []
    for i, g in enumerate(batch):
        others = [h for j, h in enumerate(nodes) if j != i]
        negatives = torch.cat(others) if config.in_batch and others else None
        loss = config.alpha * pairwise_rank_loss(g.queries, nodes[i], g.ranking, config.tau)
        if config.cl:
            loss = loss + info_nce(g.queries, nodes[i], g.ranking[:, 0], config.tau, negatives)
        losses.append(loss)
    return torch.stack(losses).mean()
