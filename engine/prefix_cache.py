"""Shared prompt prefixes: a prompt prefilled once per engine and forked for every use, so that a few-shot prompt is
paid for once however many questions and steps start from it."""
from __future__ import annotations

from typing import TYPE_CHECKING, Hashable, Sequence

from .flops import forward_flops

if TYPE_CHECKING:
    from .engine import Engine
    from .session import Session


class PrefixCache:
    """Sessions holding common prompt prefixes, keyed by their token ids. `fork(ids)` returns a new session that
    starts with them, on the same KV pages (copied on write). The first fork of a prefix prefills it, charged to
    the engine's FLOP account as usual; every later fork runs no forward and adds the prefill it skipped to
    `engine.flops.saved`. Cached prefixes keep their pages until `clear`."""

    def __init__(self, engine: "Engine"):
        self.engine = engine
        self._sessions: dict[tuple, Session] = {}  # (ids, node id) -> the prefilled prefix

    def __len__(self) -> int:
        return len(self._sessions)

    def fork(self, ids: Sequence[int], node_id: Hashable = "prefix") -> "Session":
        """A new session whose first node, `node_id`, holds `ids` (prefilled here only the first time)."""
        key = tuple(int(i) for i in ids)
        base = self._sessions.get((key, node_id))
        if base is None:
            base = self.engine.session()
            base.append(key, node_id=node_id)
            self._sessions[(key, node_id)] = base
        else:
            self.engine.flops.saved += forward_flops(self.engine.config, len(key))
        return base.fork()

    def clear(self) -> None:
        """Release every cached prefix (sessions forked from them keep their own references to the pages)."""
        for s in self._sessions.values():
            s.release()
        self._sessions.clear()
