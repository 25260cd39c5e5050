"""A session: one token sequence in the paged KV cache, made of named node spans, that can be extended, probed,
decoded, truncated to a node, forked (sharing pages) and released; optionally it records attention mass per node."""
from __future__ import annotations

import bisect
import operator
from dataclasses import dataclass
from functools import partial
from typing import Collection, Hashable, Sequence

import torch

from .generation import Generation, GenerationState, LogitsProcessor, check_one_engine, generate
from .node_store import StoredNode
from .runner import ModelRunner
from .sampling import SamplingParams


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
    """An ordered list of node spans over a paged KV cache; every forward goes through the engine (FLOPs are
    charged)."""

    def __init__(self, engine: ModelRunner):
        self.engine = engine
        self.cache = engine.new_cache()
        self.tokens: list[int] = []
        self.nodes: list[NodeSpan] = []
        self._index: dict[Hashable, int] = {}  # node id -> position in self.nodes
        self._logits: dict[Hashable, torch.Tensor] = {}  # node id -> float32 [vocab] after the node's last token
        self._mass: dict[Hashable, torch.Tensor] = {}  # collected node -> float32 [tokens, nodes up to itself]
        self._generation: GenerationState | None = None  # the generation in progress, if any

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
        return append_batch([self], [ids], [node_id], collect)[0]

    def append_stored(self, node: StoredNode, node_id: Hashable | None = None) -> NodeSpan:
        """Place a stored node (`Engine.store_node`) after everything cached, its keys rotated to where it lands,
        without a forward over its tokens: their prefill was paid once, when the node was stored, with no context
        before it (`engine/node_store.py`). No logits follow it, so append at least one token (the question) before
        generating, probing or scoring. On error the session is unchanged."""
        self._check_idle()
        node_id = self._new_node_id(node_id)
        self.engine.place_stored(node, self.cache)
        return self._add_node(node_id, list(node.tokens), None, None)

    def repair(self, positions: Sequence[int], collect: bool = False) -> None:
        """Recompute the keys and values at `positions` (increasing; typically tokens of stored nodes, which saw no
        context) with everything cached before each (`Llama.recompute`, CacheBlend's repair). Repair before appending
        what follows the stored nodes: logits already taken are not redone. collect: record the recomputed tokens'
        attention mass; `token_mass` of a node then has one row per token of it repaired here, in order (replacing
        what it had). On error the session is unchanged."""
        self._check_idle()
        positions = self._cached_positions(positions, "repair")
        if not positions:
            return
        mass = self._start_collecting(0, len(positions)) if collect else None
        try:
            self.engine.recompute([self.tokens[p] for p in positions], positions, self.cache)
        finally:
            self.cache.collect(None, None)
        if mass is not None:
            mass = mass.cpu()  # collected on the engine's device
            c, owner = self.engine.config, torch.tensor([self._node_at(p) for p in positions])
            for j in owner.unique().tolist():
                self._mass[self.nodes[j].node_id] = mass[owner == j, : j + 1] / (c.n_heads * c.n_layers)

    def key_deviation(self, positions: Sequence[int], layer: int = 1) -> torch.Tensor:
        """float32 [len(positions)]: how far each cached key at `positions` is from the key the token would have with
        everything cached before it, in layer `layer` (0-based; layer 0's keys see no context, so CacheBlend reads the
        first layer after it): ||k_context - k_cached|| / ||k_cached||. Costs the first layer + 1 layers' forward of
        those tokens; the cache is left as it was. The tokens to `repair` are those that deviate most."""
        self._check_idle()
        n_layers = self.engine.config.n_layers
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n_layers:
            raise ValueError(f"layer must be an int in 0..{n_layers - 1}, got {layer!r}")
        positions = self._cached_positions(positions, "measure")
        if not positions:
            return torch.zeros(0)
        return self.engine.recompute([self.tokens[p] for p in positions], positions, self.cache, layers=layer + 1)

    def generate(self, params: SamplingParams | int = SamplingParams(), /, *,
                 logits_processors: Sequence[LogitsProcessor] = (), allowed_tokens: Collection[int] | None = None,
                 choices: Sequence[str] | None = None, node_id: Hashable | None = None, collect: bool = False,
                 **sampling) -> Generation:
        """Decode after the cached tokens; the generated tokens become one node.

        params: a `SamplingParams`, or max_new_tokens with its other fields as keywords (`s.generate(32, stop="\\n",
        temperature=0.7, seed=0)`). Ends at an EOS token (not kept), when a stop string appears (the text is cut
        before it; its tokens stay cached), at max_new_tokens, or when the context window is full
        (`Generation.finish_reason` says which). Steering: each `logits_processors` fn(ids generated so far, logits)
        -> logits runs after the repetition penalty and before sampling; `allowed_tokens` restricts every token to
        those ids; `choices` restricts the output to one of these strings (their tokenizations; EOS is allowed where
        one is complete and another continues it). collect: record each generated token's attention mass to every
        node (the generated one included). On error the session is unchanged."""
        return generate(self.engine, [self], SamplingParams.of(params, **sampling),
                        logits_processors=logits_processors, allowed_tokens=allowed_tokens, choices=choices,
                        node_id=node_id, collect=collect)[0]

    def start_generation(self, params: SamplingParams | int = SamplingParams(), /, *,
                         logits_processors: Sequence[LogitsProcessor] = (),
                         allowed_tokens: Collection[int] | None = None, choices: Sequence[str] | None = None,
                         node_id: Hashable | None = None, collect: bool = False, **sampling) -> GenerationState:
        """A generation to advance with `Engine.step` alongside other sessions' (arguments as for `generate`)."""
        self._check_idle()
        params = SamplingParams.of(params, **sampling)
        before = self.cache.hold()  # a cancel goes back to these very pages
        try:
            state = GenerationState(self, params, self._last_logits(), self._new_node_id(node_id),
                                    partial(self._settle_generation, nodes_before=len(self.nodes), before=before),
                                    logits_processors, allowed_tokens, choices, collect)
        except BaseException:
            self.cache.let_go()
            raise
        self._generation = state
        return state

    def score(self, ids: Sequence[int] | str) -> torch.Tensor:
        """float32 [n]: log p(ids[i] | the session, ids[:i]) of a continuation (text is encoded without special
        tokens), computed on temporary tokens that are rolled back afterwards, as `probe` does."""
        if isinstance(ids, str):
            ids = self.engine.tokenizer.encode(ids)
        if not len(ids):
            raise ValueError("score needs at least one token")
        ids = self.engine._check_ids(ids).tolist()  # every id, the last too (it is scored, not run)
        first = self._last_logits()[None]
        rest = self._logits_after(ids[:-1], "all") if len(ids) > 1 else first[:0]
        logprobs = torch.log_softmax(torch.cat([first, rest]), dim=-1)
        return logprobs.gather(1, torch.tensor(ids)[:, None])[:, 0]

    def probe(self, choices: Sequence[str] = ("Yes", "No"),
              tokens: Sequence[int] | str | None = None) -> dict[str, float]:
        """Probabilities of single-token answers, normalised over `choices`, at the end of the session or after
        temporary `tokens` (e.g. a question; text is encoded as `score` encodes it) that are rolled back
        afterwards: the cache returns to the same length and the same pages."""
        if isinstance(choices, str) or not choices:  # a string would be probed character by character
            raise ValueError(f"choices must be a non-empty list of strings, got {choices!r}")
        if isinstance(tokens, str):
            tokens = self.engine.tokenizer.encode(tokens)
        tokens = None if tokens is None or not len(tokens) else tokens  # a tensor's truth is ambiguous
        ids = [self.engine.tokenizer.token_id(c) for c in choices]
        if len(set(ids)) != len(ids):
            raise ValueError(f"choices {list(choices)} map to repeated token ids {ids}")
        logits = self._logits_after(tokens, "last")[-1] if tokens is not None else self._last_logits()
        probs = torch.softmax(logits[ids].double(), dim=0)
        return {c: float(p) for c, p in zip(choices, probs)}

    def truncate(self, node_id: Hashable) -> None:
        """Keep the nodes up to and including `node_id`; drop the later ones and their KV pages."""
        self._check_idle()
        self._keep_nodes(self._node_index(node_id, "cannot truncate to") + 1)

    def fork(self) -> "Session":
        """A session with the same nodes on the same KV pages (copied on write): a prefix computed once for many."""
        self._check_idle()
        other = Session.__new__(Session)
        other.engine, other.cache, other._generation = self.engine, self.cache.fork(), None
        other.tokens, other.nodes = list(self.tokens), list(self.nodes)
        other._index, other._logits, other._mass = dict(self._index), dict(self._logits), dict(self._mass)
        return other

    def release(self) -> None:
        """Give the session's KV pages back to the pool; the session cannot be used afterwards. (A session that is
        garbage-collected, or left through `with`, releases itself.)"""
        self.cache.release()

    def token_mass(self, node_id: Hashable) -> torch.Tensor:
        """float32 [tokens of the node, nodes up to and including it]: each token's attention mass per key node,
        averaged over heads and layers (rows sum to 1). Only for nodes appended or generated with collect=True, or
        repaired with `repair(positions, collect=True)`, which gives one row per repaired token of the node. A copy:
        the session's own is shared with its forks."""
        self._node_index(node_id, "no attention mass for")
        if node_id not in self._mass:
            raise ValueError(f"no attention mass for node {node_id!r}: it was not collected")
        return self._mass[node_id].clone()

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
        self._check_idle()
        if not self.nodes:
            raise ValueError("the session is empty: append tokens to it first")
        logits = self._logits[self.nodes[-1].node_id]
        if logits is None:
            raise ValueError(f"the session ends with stored node {self.nodes[-1].node_id!r}, which has no logits: "
                             "append a token (e.g. the question) after it first")
        return logits

    def _logits_after(self, tokens: Sequence[int], logits: str) -> torch.Tensor:
        """Logits ("last" or "all") of `tokens` run after the session, then rolled back to the same pages."""
        self._check_idle()
        state = self.cache.state()
        try:
            return self.engine.run(tokens, self.cache, logits)
        finally:
            self.cache.restore(state)

    def _check_idle(self) -> None:
        self.cache.check_live()
        if self._generation is not None:
            raise RuntimeError("this session has a generation in progress: step it to its end or cancel it first")

    def _settle_generation(self, state: GenerationState, ids: list[int] | None, logits: torch.Tensor | None,
                           mass: torch.Tensor | None, nodes_before: int, before: tuple[int, list[int]]) -> None:
        """The end of `state` (its `settle`): finished, its tokens become a node; cancelled (ids None), the session
        goes back to its `nodes_before` nodes, on the cache's pages `before` while the generation still runs (a
        shared last page it copied on write goes back: `PagedKVCache.hold`)."""
        running = self._generation is state  # it holds the cache's pages `before` until here
        if ids is None and not self.cache.released:
            if not running and self._generation is not None:
                raise ValueError(f"cannot cancel the finished generation of node {state.node_id!r} while another "
                                 "generation runs in this session")
            own = nodes_before + (state.result is not None and state.result.node_id is not None)
            if len(self.nodes) > own:
                raise ValueError(f"cannot cancel the generation of node {state.node_id!r}: nodes "
                                 f"{[s.node_id for s in self.nodes[own:]]} were appended after it (truncate instead)")
        if running:
            self._generation = None
        if ids is None:
            if not self.cache.released:
                self.cache.collect(None, None)
                if running:
                    self.cache.restore(before)
                self._keep_nodes(nodes_before)
        elif ids:
            self._add_node(state.node_id, ids, logits, mass)
        if running:
            self.cache.let_go()

    def _keep_nodes(self, keep: int) -> None:
        """Drop every node after the first `keep` and the KV positions past them."""
        for span in self.nodes[keep:]:
            del self._index[span.node_id]
            self._logits.pop(span.node_id)
            self._mass.pop(span.node_id, None)
        del self.nodes[keep:]
        end = self.nodes[-1].end if self.nodes else 0
        self.cache.truncate(end)
        del self.tokens[end:]

    def _start_collecting(self, n_tokens: int, n_queries: int | None = None) -> torch.Tensor:
        """Collect the mass of the next forward's queries (`n_queries`, default the `n_tokens` it appends) on every
        node cached and the appended one."""
        bounds = [s.start for s in self.nodes] + [len(self.tokens)] + ([len(self.tokens) + n_tokens] if n_tokens
                                                                       else [])
        # on the engine's device, where the attention kernels add to it; `_add_node` brings it back
        device = self.engine.device
        mass = torch.zeros(n_tokens if n_queries is None else n_queries, len(bounds) - 1, device=device)
        self.cache.collect(torch.tensor(bounds, dtype=torch.int32, device=device), mass)
        return mass

    def _cached_positions(self, positions: Sequence[int], action: str) -> list[int]:
        """`positions` as ints, or a ValueError naming the first that is not an integer or not a cached position."""
        out = []
        for p in positions:
            try:  # ints of any kind (numpy's, a one-element integer tensor), not a float, not a bool
                if isinstance(p, bool):
                    raise TypeError
                out.append(operator.index(p))
            except TypeError:
                raise ValueError(f"cannot {action} position {p!r}: positions must be integers") from None
            if not 0 <= out[-1] < len(self.tokens):
                raise ValueError(f"cannot {action} position {out[-1]}: the session holds positions "
                                 f"0..{len(self.tokens) - 1}")
        return out

    def _node_index(self, node_id: Hashable, refusal: str) -> int:
        """Where node `node_id` is in `nodes`, or a ValueError starting with `refusal`: it is not in this session."""
        try:
            return self._index[node_id]
        except (KeyError, TypeError):  # TypeError: an unhashable id, which no node has
            raise ValueError(f"{refusal} node {node_id!r}: it is not in this session "
                             f"(nodes: {[s.node_id for s in self.nodes]})") from None

    def _node_at(self, position: int) -> int:
        """The index of the node holding cached `position`."""
        return bisect.bisect_right([s.start for s in self.nodes], position) - 1

    def _new_node_id(self, node_id: Hashable | None) -> Hashable:
        if node_id is None:
            k = len(self.nodes)
            while f"n{k}" in self._index:
                k += 1
            return f"n{k}"
        if node_id in self._index:
            raise ValueError(f"node id {node_id!r} is already in this session")
        return node_id

    def _add_node(self, node_id: Hashable, ids: list[int], logits: torch.Tensor | None,
                  mass: torch.Tensor | None) -> NodeSpan:
        span = NodeSpan(node_id, len(self.tokens), len(self.tokens) + len(ids))
        self.tokens += ids
        self._index[node_id] = len(self.nodes)
        self.nodes.append(span)
        self._logits[node_id] = logits
        if mass is not None:
            c = self.engine.config
            self._mass[node_id] = mass.cpu() / (c.n_heads * c.n_layers)
        return span


def append_batch(sessions: Sequence[Session], ids: Sequence[Sequence[int]],
                 node_ids: Sequence[Hashable | None] | None = None, collect: bool = False) -> list[NodeSpan]:
    """Prefill ids[i] as a new node of sessions[i], all in one forward (`Engine.run_batch`); on error every session
    is unchanged. collect: as in `Session.append`, for every session."""
    if not sessions or len(ids) != len(sessions) or (node_ids is not None and len(node_ids) != len(sessions)):
        raise ValueError(f"append_batch needs one id sequence (and node id) per session, got {len(sessions)} "
                         f"sessions and {len(ids)} id sequences")
    check_one_engine(sessions[0].engine, sessions)
    for s in sessions:
        s._check_idle()
    node_ids = [s._new_node_id(n) for s, n in zip(sessions, node_ids or [None] * len(sessions))]
    tokens = [sessions[0].engine._check_ids(x) for x in ids]  # checked and converted once, here
    ids = [t.tolist() for t in tokens]  # Python ints in `Session.tokens`, whatever came in
    masses = [s._start_collecting(len(x)) if collect else None for s, x in zip(sessions, ids)]
    try:
        logits, _ = sessions[0].engine.run_batch(tokens, [s.cache for s in sessions])
    finally:
        for s in sessions:
            s.cache.collect(None, None)
    return [s._add_node(n, x, out[-1], m) for s, n, x, out, m in zip(sessions, node_ids, ids, logits, masses)]
