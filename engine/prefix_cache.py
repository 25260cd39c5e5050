"""Shared prompt prefixes: a prompt prefilled once per engine and forked for every use, so that a few-shot prompt, or
a document that several questions are asked about, is paid for once however many questions and steps start from it."""
from __future__ import annotations

import contextlib
import hashlib
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
    longer than `capacity` is not kept.

    Across processes (a resumed evaluation): `paid` lists the digests (`digest`) of the prefixes this cache has
    prefilled and charged, in order; a digest put in `prepaid` marks a prefix an earlier process paid for, and its
    first prefill here is booked as saved (`FlopAccount.uncharged`), so that a run costs what it would have cost
    uninterrupted."""

    def __init__(self, engine: ModelRunner, capacity: int | None = None):
        self.engine = engine
        self.capacity = engine.pool.n_pages * engine.pool.page_size // 4 if capacity is None else capacity
        self._sessions: dict[tuple, Session] = {}  # (ids, node id) -> the prefilled prefix, least recent first
        self.paid: list[str] = []
        self.prepaid: set[str] = set()

    @staticmethod
    def digest(key: tuple) -> str:
        """A prefix's (ids, node id) key as 16 hex digits: what eval lines record of the prefixes they paid."""
        return hashlib.sha256(repr(key).encode()).hexdigest()[:16]

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
            digest = self.digest(key)
            repaid = digest in self.prepaid
            try:
                with self.engine.flops.uncharged() if repaid else contextlib.nullcontext():
                    base.append(key[0], node_id=node_id)
            except BaseException:
                base.release()
                raise
            if repaid:
                self.prepaid.discard(digest)  # paid once: another prefill of it (after an eviction) is charged
            else:
                self.paid.append(digest)
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
