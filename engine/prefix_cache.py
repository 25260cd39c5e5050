"""Shared prompt prefixes: a prompt prefilled once per engine and forked for every use, so that a few-shot prompt, or
a document that several questions are asked about, is paid for once however many questions and steps start from it."""
from __future__ import annotations

from typing import Hashable, Sequence

from .flops import forward_flops
from .runner import ModelRunner
from .session import Session


class PrefixCache:
    """Sessions holding common prompt prefixes, keyed by their token ids. `fork(ids)` returns a new session that
    starts with them, on the same KV pages (copied on write). The first fork of a prefix prefills it, charged to
    the engine's FLOP account as usual; every later fork runs no forward and adds the prefill it skipped to
    `engine.flops.saved`. The cache holds at most `capacity` tokens (default: a quarter of the engine's KV pool, one
    context window for the default pool): a new prefix first evicts the least recently forked ones, and a prefix
    longer than `capacity` is not kept."""

    def __init__(self, engine: ModelRunner, capacity: int | None = None):
        self.engine = engine
        self.capacity = engine.pool.n_pages * engine.pool.page_size // 4 if capacity is None else capacity
        self._sessions: dict[tuple, Session] = {}  # (ids, node id) -> the prefilled prefix, least recent first

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def tokens(self) -> int:
        """Tokens the cached prefixes hold."""
        return sum(len(ids) for ids, _ in self._sessions)

    def fork(self, ids: Sequence[int], node_id: Hashable = "prefix") -> "Session":
        """A new session whose first node, `node_id`, holds `ids` (prefilled here only the first time)."""
        key = (tuple(self.engine._check_ids(ids).tolist()), node_id)  # bad ids fail before anything is evicted
        base = self._sessions.pop(key, None)
        if base is None:
            keep = len(key[0]) <= self.capacity
            while keep and self._sessions and self.tokens + len(key[0]) > self.capacity:
                self._sessions.pop(next(iter(self._sessions))).release()
            base = Session(self.engine)
            try:
                base.append(key[0], node_id=node_id)
            except BaseException:
                base.release()
                raise
            if not keep:
                return base
        else:
            self.engine.flops.saved += forward_flops(self.engine.config, len(key[0]))
        self._sessions[key] = base
        return base.fork()

    def clear(self) -> None:
        """Release every cached prefix (sessions forked from them keep their own references to the pages)."""
        for s in self._sessions.values():
            s.release()
        self._sessions.clear()
