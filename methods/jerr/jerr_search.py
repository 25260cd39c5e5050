"""JERR's relational reasoning over the entity DAG (jerr.txt §3.4, App. B): Monte Carlo tree search for the nodes
that answer, and the PageRank ranking of the paper's ablation (Table 4).

MCTS keeps a search tree whose nodes stand for graph nodes (a graph node may appear on several tree paths); the
root stands for the start set (the nodes that match the question's keywords). One iteration:
- selection: from the root, while the tree node has children, go to the child of highest
  UCB = W/N + c·sqrt(ln N_parent / N) (an unvisited child first; ties: the first child);
- expansion: the reached node gets one child per DAG successor (the root: per start node);
- simulation: every new child is evaluated at once (one batched reward call, so an engine can score the siblings in
  one forward): a random walk from it along DAG edges of at most `depth` nodes, seeded, scored by `reward(paths)`;
- backpropagation: each child's reward is added to W, and 1 to N, of it and every ancestor up to the root.
A reached node without successors is a leaf: its own path is simulated again and backpropagated. After the
iterations, graph nodes rank by their best tree node's mean reward W/N (ties: more visits, then first reached).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

import numpy as np

Node = Hashable
# reward(paths) -> one score per path; a path is the graph nodes of one simulated walk, its start first
Reward = Callable[[list[list[Node]]], list[float]]
Successors = Callable[[Node], Sequence[Node]]


@dataclass(eq=False)
class TreeNode:
    """A search-tree node: the graph node it stands for (None at the root), its visits N and total reward W."""

    node: Node | None
    parent: "TreeNode | None" = None
    children: list["TreeNode"] = field(default_factory=list)
    expanded: bool = False
    visits: int = 0
    value: float = 0.0

    def ucb(self, c: float) -> float:
        if self.visits == 0:
            return math.inf
        return self.value / self.visits + c * math.sqrt(math.log(self.parent.visits) / self.visits)


class MCTS:
    """Monte Carlo tree search from `starts` over `successors`, scoring walks by `reward` (see the module)."""

    def __init__(self, starts: Sequence[Node], successors: Successors, reward: Reward, c: float = 1.0,
                 depth: int = 3, seed: int = 0):
        if depth < 1:
            raise ValueError(f"the simulation depth must be at least 1, got {depth}")
        self.successors, self.reward, self.c, self.depth = successors, reward, c, depth
        self.starts = list(dict.fromkeys(starts))
        self.root = TreeNode(None)
        self.rng = random.Random(seed)
        self.order: dict[Node, int] = {}  # graph nodes in the order the tree first reached them

    def iterate(self) -> None:
        leaf = self.root
        while leaf.children:
            leaf = max(leaf.children, key=lambda t: t.ucb(self.c))  # max keeps the first of equals
        if not leaf.expanded:
            leaf.expanded = True
            nexts = self.starts if leaf is self.root else self.successors(leaf.node)
            leaf.children = [TreeNode(n, leaf) for n in nexts]
            for t in leaf.children:
                self.order.setdefault(t.node, len(self.order))
        fresh = leaf.children or ([leaf] if leaf is not self.root else [])
        rewards = self.reward([self._walk(t.node) for t in fresh]) if fresh else []
        for t, r in zip(fresh, rewards):
            while t is not None:
                t.visits, t.value = t.visits + 1, t.value + float(r)
                t = t.parent

    def run(self, iterations: int) -> "MCTS":
        for _ in range(iterations):
            self.iterate()
        return self

    def top(self, k: int) -> list[Node]:
        """The `k` best graph nodes the search visited (see the module)."""
        best: dict[Node, tuple[float, int]] = {}
        stack = list(self.root.children)
        while stack:
            t = stack.pop()
            stack.extend(t.children)
            if t.visits:
                best[t.node] = max(best.get(t.node, (-math.inf, 0)), (t.value / t.visits, t.visits))
        return sorted(best, key=lambda n: (-best[n][0], -best[n][1], self.order[n]))[:k]

    def _walk(self, start: Node) -> list[Node]:
        path = [start]
        while len(path) < self.depth:
            nexts = self.successors(path[-1])
            if not nexts:
                break
            path.append(nexts[self.rng.randrange(len(nexts))])
        return path


def pagerank(nodes: Sequence[Node], edges: Sequence[tuple[Node, Node]], personal: dict[Node, float] | None = None,
             damping: float = 0.85, tol: float = 1e-10, max_iter: int = 1000) -> dict[Node, float]:
    """PageRank by power iteration: r ← d·(Σ over in-edges of r_u / outdeg_u + dangling rank · p) + (1 − d)·p,
    with p the personalisation (normalised; uniform when None or all zero). Repeated edges count once."""
    if not nodes:  # a graph whose chunks gave no entity
        return {}
    index = {v: i for i, v in enumerate(nodes)}
    pairs = np.array(list(dict.fromkeys((index[u], index[w]) for u, w in edges)), dtype=np.int64).reshape(-1, 2)
    n = len(nodes)
    p = np.array([max((personal or {}).get(v, 0.0), 0.0) for v in nodes])
    p = p / p.sum() if p.sum() > 0 else np.full(n, 1 / n)
    out = np.bincount(pairs[:, 0], minlength=n).astype(float)
    r = np.full(n, 1 / n)
    for _ in range(max_iter):
        nxt = np.zeros(n)
        np.add.at(nxt, pairs[:, 1], damping * r[pairs[:, 0]] / out[pairs[:, 0]])
        nxt += (damping * r[out == 0].sum() + 1 - damping) * p
        done = np.abs(nxt - r).sum() < n * tol
        r = nxt
        if done:
            break
    return dict(zip(nodes, r.tolist()))


def pagerank_top(nodes: Sequence[Node], edges: Sequence[tuple[Node, Node]], relevance: dict[Node, float], k: int,
                 damping: float = 0.85) -> list[Node]:
    """The `k` nodes of highest PageRank personalised by `relevance` (the paper's ablation); ties keep `nodes`'
    order."""
    rank = pagerank(nodes, edges, relevance, damping)
    position = {n: i for i, n in enumerate(nodes)}
    return sorted(nodes, key=lambda n: (-rank[n], position[n]))[:k]
