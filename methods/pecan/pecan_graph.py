"""PECAN's hierarchical weighted DAG (§3.1) and its search scores (§3.2.2, App. C): the parts that are plain data.

Level 1 nodes are chunks of the document; a node at level l + 1 is an information point (IP) generated from a
batch of level-l nodes, with an edge e_ij to every node j of that batch. Edge weights come from the attention the
IP's tokens paid to each input node while they were generated (token-to-node *mean*, averaged over the IP's
tokens, intra-node attention left out), normalised so that Σ_j e_ij = 1 (zero where there was no attention).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch


@dataclass
class Node:
    """A chunk (level 1) or an information point (level >= 2)."""

    id: int
    level: int
    text: str


@dataclass
class Graph:
    """Nodes by id and weighted edges from each higher node to the lower nodes it was generated from."""

    nodes: dict[int, Node] = field(default_factory=dict)
    edges: dict[int, dict[int, float]] = field(default_factory=dict)  # parent id -> {child id: e_parent,child}

    def add(self, level: int, text: str) -> Node:
        node = Node(len(self.nodes), level, text)
        self.nodes[node.id] = node
        return node

    @property
    def top_level(self) -> list[int]:
        top = max(n.level for n in self.nodes.values())
        return [i for i, n in self.nodes.items() if n.level == top]

    def parents(self, child: int) -> dict[int, float]:
        """{parent id: e_parent,child} of the nodes with an edge to `child`."""
        return {p: kids[child] for p, kids in self.edges.items() if child in kids}


def edge_weights(mean_mass: torch.Tensor) -> torch.Tensor:
    """PECAN §3.1 normalisation of token-to-node mean attention [IPs, inputs]: each row divided by its sum (rows
    without attention stay zero)."""
    total = mean_mass.sum(1, keepdim=True)
    return torch.where(total > 0, mean_mass / total.clamp_min(torch.finfo(mean_mass.dtype).tiny), 0.0)


def scores(graph: Graph, visited: list[int], relevance: dict[int, float]) -> dict[int, float]:
    """Eq. (1): z_i = Σ_{j in P_i ∩ S} r_j e_{j,i} for every unvisited child i of a visited node."""
    seen, z = set(visited), {}
    for j in visited:
        for i, e in graph.edges.get(j, {}).items():
            if i not in seen:
                z[i] = z.get(i, 0.0) + relevance.get(j, 0.0) * e
    return z


def positional_relevance(query_mass: list[float]) -> list[float]:
    """App. C: r_i = (attention between visited node i and the query) × i's position in the prompt, the query
    being position 1, so the k-th visited node (k = 0, 1, ...) is multiplied by k + 2."""
    return [m * (k + 2) for k, m in enumerate(query_mass)]


# a bullet or number, then possibly a number inside it ("* 1. ..." when the summary is primed with "* ")
_BULLET = re.compile(r"^\s*(?:[-*•·‣▪–—]|\d{1,3}[.)]|\(\d{1,3}\)|[a-zA-Z][.)])\s+(?:\d{1,3}[.)]\s+)?(.*\S)\s*$")
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'])")


# the prompt's own format lines, which small models copy into their summaries
PLACEHOLDERS = {"summary point", "summary point.", "information point"}


def looping(text: str, n: int = 3, min_words: int = 12) -> bool:
    """Whether `text` is a phrase repeated over and over (a greedy decoding loop): fewer than half of its word
    n-grams are distinct. Texts shorter than `min_words` words are never judged looping."""
    words = text.lower().split()
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    return len(words) >= min_words and len(set(grams)) < len(grams) / 2


def parse_ips(text: str, min_chars: int = 8) -> tuple[list[str], str, int]:
    """Information points from a summary: its bullet or numbered lines; failing that, its non-empty lines if more
    than one; failing that, its sentences. Repeats (case- and space-insensitive), looping points (`looping`) and
    fragments shorter than `min_chars` are dropped. Returns (IPs, how they were found: "bullets", "lines",
    "sentences" or "empty", how many candidates were dropped)."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    found = [m.group(1) for m in map(_BULLET.match, lines) if m]
    how = "bullets"
    if not found:
        found, how = ([ln.strip() for ln in lines], "lines") if len(lines) > 1 else (_SENTENCE.split(text.strip()),
                                                                                     "sentences")
    ips, keys = [], set()
    for ip in found:
        key = " ".join(ip.lower().split())
        if len(ip.strip()) >= min_chars and key not in keys and not looping(ip) and key not in PLACEHOLDERS:
            keys.add(key)
            ips.append(ip.strip())
    return ips, how if ips else "empty", len(found) - len(ips)


Z_SCALES = ("paper", "max")  # how z enters the pick: Eq. (1) as it is, or divided by the candidates' largest z


@dataclass(frozen=True)
class Pick:
    """The search's next node and why: its z (Eq. 1; 0 for a node no visited node points to), its similarity to
    the query, and the node similarity alone would have picked among the same candidates."""

    node: int
    z: float
    similarity: float
    by_similarity: int


def next_node(graph: Graph, visited: list[int], relevance: dict[int, float], similarity: dict[int, float],
              attention: bool = True, embedding: bool = True, successors_only: bool = False,
              z_scale: str = "paper") -> Pick | None:
    """The unvisited node with the highest z_i (Eq. 1, when `attention`) + embedding similarity to the query (when
    `embedding`). Candidates are every unvisited node, as §3.2.2 scores all of V (a node no visited node points to
    has z = 0 and can still be reached by similarity); `successors_only`: the children of visited nodes, or every
    unvisited node when no child is left. `z_scale="max"` divides z by its largest value among the candidates
    (Eq. 1's z is a product of mean attentions, orders of magnitude below a cosine similarity); the Pick keeps the
    unscaled z. Ties go to the lower id. None when every node is visited."""
    if z_scale not in Z_SCALES:
        raise ValueError(f"z_scale must be one of {', '.join(Z_SCALES)}, not {z_scale!r}")
    seen = set(visited)
    z = scores(graph, visited, relevance)
    unvisited = [i for i in graph.nodes if i not in seen]
    candidates = (successors_only and [i for i in unvisited if i in z]) or unvisited
    if not candidates:
        return None
    top = max((z.get(i, 0.0) for i in candidates), default=0.0) if z_scale == "max" else 1.0
    scale = 1.0 / top if top > 0 else 1.0
    total = {i: (scale * z.get(i, 0.0) if attention else 0.0) + (similarity.get(i, 0.0) if embedding else 0.0)
             for i in candidates}
    best = min(candidates, key=lambda i: (-total[i], i))
    by_similarity = min(candidates, key=lambda i: (-similarity.get(i, 0.0), i))
    return Pick(best, z.get(best, 0.0), similarity.get(best, 0.0), by_similarity)
