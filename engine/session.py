"""A session: one token sequence in the paged KV cache, made of named node spans, that can be extended, probed,
decoded, truncated to a node, forked (sharing pages) and released; optionally it records attention mass per node."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Hashable, Sequence

import torch

from .sampling import check_sampling, sample

if TYPE_CHECKING:
    from .engine import Engine


@dataclass(frozen=True)
class NodeSpan:
    """A node's tokens in the session: positions [start, end)."""

    node_id: Hashable
    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class NodeMass:
    """Attention mass from query nodes (those appended or generated with collect=True) to key nodes (every node of
    the session), averaged over heads and layers. sum[i, j]: mean over the tokens t of query node i of Σ_{k in node
    j} p(t → k); mean[i, j]: the same with the sum over k replaced by the mean (sum / len(node j))."""

    query_nodes: list
    key_nodes: list
    sum: torch.Tensor   # float32 [Q, K]
    mean: torch.Tensor  # float32 [Q, K]


class Session:
    """An ordered list of node spans over a paged KV cache; every forward goes through the engine (FLOPs are charged)."""

    def __init__(self, engine: "Engine"):
        self.engine = engine
        self.cache = engine.new_cache()
        self.tokens: list[int] = []
        self.nodes: list[NodeSpan] = []
        self.finish_reason: str | None = None  # of the last generate: "eos", "stop", "length" or "context"
        self._index: dict[Hashable, int] = {}  # node id -> position in self.nodes
        self._logits: dict[Hashable, torch.Tensor] = {}  # node id -> float32 [vocab] after the node's last token
        self._mass: dict[Hashable, torch.Tensor] = {}  # collected node -> float32 [tokens, nodes up to itself]

    def __len__(self) -> int:
        return len(self.tokens)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        if not self.cache.released:
            self.release()

    def append(self, ids: Sequence[int], node_id: Hashable | None = None, collect: bool = False) -> NodeSpan:
        """Prefill `ids` as a new node after everything cached; on error the session is unchanged.
        collect: record each new token's attention mass to every node so far, this one included."""
        self.cache.check_live()
        node_id = self._new_node_id(node_id)
        ids = list(ids)
        mass = self._start_collecting(len(ids)) if collect else None
        try:
            logits = self.engine.run(ids, self.cache)[-1]
        finally:
            self.cache.collect(None, None)
        return self._add_node(node_id, ids, logits, mass)

    def generate(self, max_new_tokens: int, stop: Sequence[str] | str | None = None, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, node_id: Hashable | None = None,
                 collect: bool = False) -> str:
        """Decode up to `max_new_tokens` after the cached tokens; the generated tokens become one node.

        Ends at an EOS token (not kept), when a stop string appears (the text is cut before it; its tokens stay
        cached), at `max_new_tokens`, or when the context window is full (`finish_reason` says which).
        collect: record each generated token's attention mass to every node (the generated one included)."""
        logits = self._last_logits()
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        check_sampling(temperature, top_p)
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        node_id = self._new_node_id(node_id)
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        tok = self.engine.tokenizer
        out: list[int] = []
        rows: list[torch.Tensor] = []
        bounds = [s.start for s in self.nodes] + [len(self.tokens)]
        self.finish_reason = "length"
        try:
            for _ in range(max_new_tokens):
                next_id = sample(logits, temperature, top_p, generator)
                if next_id in tok.eos_ids:
                    self.finish_reason = "eos"
                    break
                if self.cache.length + 1 > self.engine.config.max_seq_len:
                    self.finish_reason = "context"
                    break
                if collect:
                    rows.append(torch.zeros(1, len(bounds)))
                    self.cache.collect(torch.tensor(bounds + [self.cache.length + 1], dtype=torch.int32), rows[-1])
                logits = self.engine.run([next_id], self.cache, decode=True)[-1]
                out.append(next_id)
                if stops:
                    text = tok.decode(out)
                    hit = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
                    if hit >= 0:
                        text, self.finish_reason = text[:hit], "stop"
                        break
        except BaseException:
            self.cache.truncate(len(self.tokens))  # the session stays as it was before the call
            raise
        finally:
            self.cache.collect(None, None)
        if self.finish_reason != "stop":
            text = tok.decode(out)
        if out:
            self._add_node(node_id, out, logits, torch.cat(rows) if collect else None)
        return text

    def probe(self, choices: Sequence[str] = ("Yes", "No"), tokens: Sequence[int] | None = None) -> dict[str, float]:
        """Probabilities of single-token answers, normalised over `choices`, at the end of the session or after
        temporary `tokens` (e.g. a question) that are rolled back afterwards: the cache returns to the same
        length and the same pages."""
        ids = [self.engine.tokenizer.token_id(c) for c in choices]
        if len(set(ids)) != len(ids):
            raise ValueError(f"choices {list(choices)} map to repeated token ids {ids}")
        if tokens:
            self.cache.check_live()
            state = self.cache.state()
            try:
                logits = self.engine.run(tokens, self.cache)[-1]
            finally:
                self.cache.restore(state)
        else:
            logits = self._last_logits()
        probs = torch.softmax(logits[ids].double(), dim=0)
        return {c: float(p) for c, p in zip(choices, probs)}

    def truncate(self, node_id: Hashable) -> None:
        """Keep the nodes up to and including `node_id`; drop the later ones and their KV pages."""
        self.cache.check_live()
        if node_id not in self._index:
            raise KeyError(f"cannot truncate to node {node_id!r}: it is not in this session "
                           f"(nodes: {[s.node_id for s in self.nodes]})")
        keep = self._index[node_id] + 1
        for span in self.nodes[keep:]:
            del self._index[span.node_id]
            self._logits.pop(span.node_id)
            self._mass.pop(span.node_id, None)
        del self.nodes[keep:]
        end = self.nodes[-1].end
        self.cache.truncate(end)
        del self.tokens[end:]

    def fork(self) -> "Session":
        """A session with the same nodes on the same KV pages (copied on write): a prefix computed once for many."""
        other = Session.__new__(Session)
        other.engine, other.cache = self.engine, self.cache.fork()
        other.tokens, other.nodes, other.finish_reason = list(self.tokens), list(self.nodes), None
        other._index, other._logits, other._mass = dict(self._index), dict(self._logits), dict(self._mass)
        return other

    def release(self) -> None:
        """Give the session's KV pages back to the pool; the session cannot be used afterwards. (A session that is
        garbage-collected, or left through `with`, releases itself.)"""
        self.cache.release()

    def token_mass(self, node_id: Hashable) -> torch.Tensor:
        """float32 [tokens of the node, nodes up to and including it]: each token's attention mass per key node,
        averaged over heads and layers (rows sum to 1). Only for nodes appended or generated with collect=True."""
        if node_id not in self._mass:
            known = "it is not in this session" if node_id not in self._index else "it was not collected"
            raise KeyError(f"no attention mass for node {node_id!r}: {known}")
        return self._mass[node_id]

    def node_mass(self, exclude_self: bool = False) -> NodeMass:
        """Mass from every collected node to every node (zero for later nodes, which it cannot see).
        exclude_self: zero each query node's mass on itself (PECAN keeps only attention between nodes)."""
        queries = [s.node_id for s in self.nodes if s.node_id in self._mass]
        keys = [s.node_id for s in self.nodes]
        total = torch.zeros(len(queries), len(keys))
        for i, q in enumerate(queries):
            row = self._mass[q].mean(0)
            total[i, : row.shape[0]] = row
            if exclude_self:
                total[i, self._index[q]] = 0.0
        lengths = torch.tensor([len(s) for s in self.nodes], dtype=torch.float32)
        return NodeMass(queries, keys, total, total / lengths)

    def _last_logits(self) -> torch.Tensor:
        self.cache.check_live()
        if not self.nodes:
            raise ValueError("the session is empty: append tokens to it first")
        return self._logits[self.nodes[-1].node_id]

    def _start_collecting(self, n_tokens: int) -> torch.Tensor:
        bounds = [s.start for s in self.nodes] + [len(self.tokens), len(self.tokens) + n_tokens]
        mass = torch.zeros(n_tokens, len(bounds) - 1)
        self.cache.collect(torch.tensor(bounds, dtype=torch.int32), mass)
        return mass

    def _new_node_id(self, node_id: Hashable | None) -> Hashable:
        if node_id is None:
            k = len(self.nodes)
            while f"n{k}" in self._index:
                k += 1
            return f"n{k}"
        if node_id in self._index:
            raise ValueError(f"node id {node_id!r} is already in this session")
        return node_id

    def _add_node(self, node_id: Hashable, ids: list[int], logits: torch.Tensor,
                  mass: torch.Tensor | None) -> NodeSpan:
        span = NodeSpan(node_id, len(self.tokens), len(self.tokens) + len(ids))
        self.tokens += ids
        self._index[node_id] = len(self.nodes)
        self.nodes.append(span)
        self._logits[node_id] = logits
        if mass is not None:
            c = self.engine.config
            self._mass[node_id] = mass / (c.n_heads * c.n_layers)
        return span
