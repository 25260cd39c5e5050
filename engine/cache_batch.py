"""Several sequences run as one forward: their new tokens are stacked as rows for the matmuls, and each sequence's
rows attend to its own cache (its own block table, length and node-mass collector).

Everything in the forward except attention is row by row, so a batch computes what its sequences would compute one
by one; attention is where the rows go back to their sequences: one call per sequence, or, for a decode step (one
token each, no node mass) on a backend with `decode_attention` (Triton), one call for the batch, over the block
tables padded into one [B, pages] tensor made once per forward on the pool's device.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .kv_cache import PagedKVCache


class CacheBatch:
    """The caches of a batched forward and the row layout: sequence i owns `counts[i]` consecutive rows."""

    def __init__(self, caches: Sequence[PagedKVCache], counts: Sequence[int]):
        check_distinct(caches)
        self.caches, self.counts = list(caches), list(counts)
        self.kept = list(counts)  # rows per sequence that reach the final layer's attention (see `keep_rows`)
        self._decode_args: tuple | None = ()  # `decode_attention`'s arguments, None where it does not serve; () unknown

    @property
    def collecting(self) -> bool:
        return any(c.collecting for c in self.caches)

    def begin(self) -> torch.Tensor:
        """Make room in every cache (all or nothing: on an error no cache keeps what this call reserved); returns the
        absolute position of every row, int64 [sum(counts)]."""
        states, starts = [c.state() for c in self.caches], []
        try:
            for cache, n in zip(self.caches, self.counts):
                starts.append(cache.begin(n))
        except BaseException:
            for cache, state in zip(self.caches, states[:len(starts)]):
                cache.restore(state)  # not truncate: a copy-on-write copy of a shared last page goes back too
            raise
        return torch.cat([torch.arange(s, s + n) for s, n in zip(starts, self.counts)])

    def keep_rows(self, per_sequence: int | None) -> torch.Tensor:
        """The rows whose outputs are wanted: the last `per_sequence` of each sequence (None: all of them). Their
        counts become `kept`, which `attend` reads when it is handed only those rows' queries."""
        self.kept = [n if per_sequence is None else min(n, per_sequence) for n in self.counts]
        ends = torch.tensor(self.counts).cumsum(0).tolist()
        return torch.cat([torch.arange(e - k, e) for e, k in zip(ends, self.kept)])

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """`PagedKVCache.attend` per sequence: k, v hold every row; q holds every row or only the kept ones."""
        batched = self._decode_batch()
        if batched is not None:
            pool = self.caches[0].pool
            return self.caches[0].ops.decode_attention(q, pool.k, pool.v, layer, *batched, k, v)
        q_counts = self.counts if q.shape[0] == sum(self.counts) else self.kept
        outs = [cache.attend(layer, qi, ki, vi) for cache, qi, ki, vi in
                zip(self.caches, q.split(q_counts), k.split(self.counts), v.split(self.counts))]
        return torch.cat(outs)

    def _decode_batch(self) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """(block tables [B, pages], ends [B], max end) for `decode_attention`, or None where this forward is not a
        decode step it serves: one token per sequence, two or more sequences of one pool, no node mass collected,
        and a backend that has it."""
        if self._decode_args == ():
            caches = self.caches
            if len(caches) < 2 or any(n != 1 for n in self.counts) or self.collecting or \
                    any(type(c) is not PagedKVCache or c.pool is not caches[0].pool for c in caches) or \
                    not hasattr(caches[0].ops, "decode_attention"):
                self._decode_args = None
            else:
                tables = torch.nn.utils.rnn.pad_sequence([c.block_table for c in caches], batch_first=True)
                ends = [c.length + 1 for c in caches]
                self._decode_args = tables, torch.tensor(ends, dtype=torch.int32, device=tables.device), max(ends)
        return self._decode_args

    def commit(self, n_tokens: int) -> None:
        """Every cache keeps its rows (n_tokens: all the batch's rows, as `KVCache.commit` is called)."""
        if n_tokens != sum(self.counts):
            raise ValueError(f"a batch of {sum(self.counts)} rows cannot commit {n_tokens}")
        for cache, n in zip(self.caches, self.counts):
            cache.commit(n)


def check_distinct(caches: Sequence[PagedKVCache]) -> None:
    """A ValueError where a cache comes twice: one sequence cannot take two rows of a batch."""
    if len({id(c) for c in caches}) != len(caches):
        raise ValueError("a batch cannot hold the same cache twice (fork the session instead)")
