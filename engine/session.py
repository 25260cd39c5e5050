"""A session: one token sequence in a KV cache, made of named node spans, that can be extended, probed and decoded."""
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


class Session:
    """An ordered list of node spans over a KV cache; every forward goes through the engine (FLOPs are charged)."""

    def __init__(self, engine: "Engine"):
        self.engine = engine
        self.cache = engine.new_cache()
        self.tokens: list[int] = []
        self.nodes: list[NodeSpan] = []
        self._node_ids: set[Hashable] = set()
        self.finish_reason: str | None = None  # of the last generate: "eos", "stop", "length" or "context"
        self._logits: torch.Tensor | None = None  # float32 [vocab] at the last cached position

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, ids: Sequence[int], node_id: Hashable | None = None) -> NodeSpan:
        """Prefill `ids` as a new node after everything cached; on error the session is unchanged."""
        node_id = self._new_node_id(node_id)
        ids = list(ids)
        self._logits = self.engine.run(ids, self.cache)[-1]
        return self._add_span(node_id, len(self.tokens), ids)

    def generate(self, max_new_tokens: int, stop: Sequence[str] | str | None = None, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, node_id: Hashable | None = None) -> str:
        """Decode up to `max_new_tokens` after the cached tokens; the generated tokens become one node.

        Ends at an EOS token (not kept), when a stop string appears (the text is cut before it; its tokens stay
        cached), at `max_new_tokens`, or when the context window is full (`finish_reason` says which)."""
        if self._logits is None:
            raise ValueError("generate needs a prompt: append tokens to the session first")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        check_sampling(temperature, top_p)
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        node_id = self._new_node_id(node_id)
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        tok = self.engine.tokenizer
        start, out = len(self.tokens), []
        self.finish_reason = "length"
        logits = self._logits
        for _ in range(max_new_tokens):
            next_id = sample(logits, temperature, top_p, generator)
            if next_id in tok.eos_ids:
                self.finish_reason = "eos"
                break
            if self.cache.length + 1 > self.engine.config.max_seq_len:
                self.finish_reason = "context"
                break
            logits = self.engine.run([next_id], self.cache, decode=True)[-1]
            out.append(next_id)
            if stops:
                text = tok.decode(out)
                hit = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
                if hit >= 0:
                    text, self.finish_reason = text[:hit], "stop"
                    break
        if self.finish_reason != "stop":
            text = tok.decode(out)
        self._logits = logits
        if out:
            self._add_span(node_id, start, out)
        return text

    def probe(self, choices: Sequence[str] = ("Yes", "No"), tokens: Sequence[int] | None = None) -> dict[str, float]:
        """Probabilities of single-token answers, normalised over `choices`, at the end of the session or after
        temporary `tokens` (e.g. a question) that are rolled back afterwards."""
        ids = [self.engine.tokenizer.token_id(c) for c in choices]
        if len(set(ids)) != len(ids):
            raise ValueError(f"choices {list(choices)} map to repeated token ids {ids}")
        if tokens:
            length = self.cache.length
            try:
                logits = self.engine.run(tokens, self.cache)[-1]
            finally:
                self.cache.truncate(length)
        elif self._logits is None:
            raise ValueError("probe needs a prompt: append tokens to the session first")
        else:
            logits = self._logits
        probs = torch.softmax(logits[ids].double(), dim=0)
        return {c: float(p) for c, p in zip(choices, probs)}

    def _new_node_id(self, node_id: Hashable | None) -> Hashable:
        if node_id is None:
            k = len(self.nodes)
            while f"n{k}" in self._node_ids:
                k += 1
            return f"n{k}"
        if node_id in self._node_ids:
            raise ValueError(f"node id {node_id!r} is already in this session")
        return node_id

    def _add_span(self, node_id: Hashable, start: int, ids: list[int]) -> NodeSpan:
        span = NodeSpan(node_id, start, start + len(ids))
        self.tokens += ids
        self.nodes.append(span)
        self._node_ids.add(node_id)
        return span
