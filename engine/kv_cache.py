"""One token sequence's keys and values in the engine's page pool: a block table, a length, copy-on-write forks.

Tokens are packed densely (a node does not start on a page boundary): the kernels take any position through the
block table, so alignment would only waste pages. The one page that can be both shared and written to is the
partially filled last page; `begin` copies it first.
"""
from __future__ import annotations

from types import ModuleType

import torch

from ..kernels import reference
from .errors import ContextOverflowError, PoolExhaustedError, SessionReleasedError
from .page_pool import PagePool


class PagedKVCache:
    """A sequence over pool pages, with `begin`/`attend`/`commit` for the forward and node-mass collection."""

    def __init__(self, pool: PagePool, ops: ModuleType):
        """ops: the backend module whose `paged_attention` runs attention (reference, cpu_ops or triton_ops)."""
        self.pool, self.ops = pool, ops
        # the queries `ops` attends with: the pool's dtype, fp32 over half pages (which only a float32 model on the
        # CPU has: `load_engine(kv_dtype=...)`; the C++ kernels convert the halves as they read them)
        self._query_dtype = torch.float32 if pool.dtype == torch.float16 else pool.dtype
        self.max_len = pool.config.max_seq_len
        self.pages: list[int] = []
        self.length = 0
        self.released = False
        self._table: torch.Tensor | None = None
        self._held: list[int] = []  # pages `hold` keeps alive for a later `restore`
        self._begun = 0  # positions the last `begin` reserved, which `commit` may then count as cached
        # node-mass collection for the next forward: key node bounds int32 [N+1] and float32 [T, N] accumulator
        self._bounds: torch.Tensor | None = None
        self._mass: torch.Tensor | None = None

    @property
    def block_table(self) -> torch.Tensor | None:
        """int32 page ids of the positions reserved so far (valid after `begin`)."""
        return self._table

    @property
    def collector(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(node bounds, mass accumulator) of the running collection, or (None, None)."""
        return self._bounds, self._mass

    @property
    def collecting(self) -> bool:
        """True while a forward must attend from every new position (the model then skips no rows)."""
        return self._mass is not None

    def collect(self, node_bounds: torch.Tensor | None, mass: torch.Tensor | None) -> None:
        """Accumulate Σ_heads,layers attention mass of the next forward's queries into mass [T, N] (None: stop)."""
        self._bounds, self._mass = node_bounds, mass

    def begin(self, n_tokens: int) -> int:
        """Make room for n_tokens more positions (all or nothing); returns the position of the first."""
        self.check_live()
        if n_tokens < 0:
            raise ValueError(f"begin takes a number of new positions >= 0, got {n_tokens}")
        end = self.length + n_tokens
        if end > self.max_len:
            raise ContextOverflowError(f"{end} tokens exceed the model's context window of {self.max_len} "
                                       f"({self.length} cached + {n_tokens} new)")
        P = self.pool.page_size
        new_pages = -(-end // P) - len(self.pages)
        cow = self.length % P != 0 and self.pool.refcount[self.pages[-1]] > 1
        if new_pages + cow > self.pool.n_free:
            raise PoolExhaustedError(
                f"KV page pool exhausted: {self.length} cached + {n_tokens} new tokens need {new_pages + cow} more "
                f"pages of {P} tokens, {self.pool.n_free} of {self.pool.n_pages} are free; release sessions or "
                f"load the engine with a larger kv_tokens")
        if cow:
            self.pages[-1] = self.pool.copy(self.pages[-1])
        if new_pages > 0:
            self.pages += self.pool.alloc(new_pages)
        if cow or new_pages > 0 or self._table is None:
            self._table = self._new_table()
        self._begun = n_tokens
        return self.length

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store k, v ([T, kv_heads, hd]) after the cached tokens; causal attention over everything cached for
        q ([n, heads, hd]), the queries of the last n <= T new positions. Returns [n, heads * hd] in q's dtype.
        Queries in another dtype than the pool's (bf16 ones over fp32 or half pages: precision "bf16"'s prompts)
        attend through the torch reference, in their dtype (SDPA on the gathered keys), while k and v are stored as
        the pool keeps them; fp32 queries over half pages run the cache's ops."""
        ops = self.ops if q.dtype == self._query_dtype else reference
        return ops.paged_attention(q, self.pool.k, self.pool.v, layer, self._table, self.length + k.shape[0],
                                   k, v, self._bounds, self._mass)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        """Store k, v ([T, kv_heads, hd]) without attending, at `positions` (int64 [T], cached or reserved by
        `begin`; default: the T positions after the cached tokens): a stored node's keys and values placed as they
        are (`Engine.place_stored`), or recomputed ones written over them (`Llama.recompute`)."""
        if positions is None:
            positions = torch.arange(self.length, self.length + k.shape[0])
        self._check_positions(positions, self.length + self._begun, "write", "cached or reserved by begin")
        pages, offsets = self._slots(positions, writable=True)
        self.pool.k[layer, pages, :, offsets] = k.to(self.pool.k)
        self.pool.v[layer, pages, :, offsets] = v.to(self.pool.v)

    def read(self, layer: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the keys and values ([T, kv_heads, hd] each) cached at `positions` (int64 [T]) of `layer`."""
        self._check_positions(positions, self.length, "read", "cached")
        pages, offsets = self._slots(positions)
        return self.pool.k[layer, pages, :, offsets].clone(), self.pool.v[layer, pages, :, offsets].clone()

    @staticmethod
    def _check_positions(positions: torch.Tensor, end: int, fn: str, what: str) -> None:
        """A ValueError unless every position is in [0, end): unchecked, a negative one indexes from the end of the
        block table and a reserved one not yet written reads stale memory. A CUDA tensor's values are trusted, as
        the kernels trust block tables there: reading them would cost a device sync per layer."""
        if positions.device.type == "cpu" and positions.numel():
            lo, hi = map(int, positions.aminmax())
            if lo < 0 or hi >= end:
                raise ValueError(f"{fn}: positions must be {what}, in [0, {end}), got {lo} .. {hi}")

    def _slots(self, positions: torch.Tensor, writable: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(page ids, offsets in them) of `positions`; writable: pages shared with a fork are first copied, so that a
        write never shows in another sequence (as `begin` does for the last page)."""
        P = self.pool.page_size
        positions = positions.to(self.pool.device)
        index = positions // P
        if writable:
            for i in sorted(set(index.tolist())):
                if self.pool.refcount[self.pages[i]] > 1:
                    self.pages[i] = self.pool.copy(self.pages[i])
                    self._table = None
        if self._table is None:
            self._table = self._new_table()
        return self._table[index].long(), positions % P

    def _new_table(self) -> torch.Tensor:
        """The block table on the pool's device, where the attention kernels read it (one copy per change of pages,
        not one per layer)."""
        return torch.tensor(self.pages, dtype=torch.int32, device=self.pool.device)

    def commit(self, n_tokens: int) -> None:
        """Count n_tokens of the positions the last `begin` reserved (and the forward wrote) as cached."""
        if not 0 <= n_tokens <= self._begun:  # more would count pages never written, or not even allocated
            raise ValueError(f"commit of {n_tokens} positions after a begin of {self._begun}")
        self.length += n_tokens
        self._begun = 0

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on and give back the pages past it."""
        self.check_live()
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        keep = -(-length // self.pool.page_size)
        self.pool.free(self.pages[keep:])
        del self.pages[keep:]
        self.length, self._begun = length, 0
        self._table = None

    def state(self) -> tuple[int, list[int]]:
        """What `restore` needs to undo everything done after this call (probes roll back with it)."""
        return self.length, list(self.pages)

    def restore(self, state: tuple[int, list[int]]) -> None:
        """Back to `state` exactly: the same length and the same pages (copy-on-write copies made since are freed)."""
        length, pages = state
        for i, (old, new) in enumerate(zip(pages, self.pages)):
            if old != new:  # copied on write since: our reference moved to the copy
                self.pool.share([old])
                self.pool.free([new])
                self.pages[i] = old
        self.truncate(length)
        del self.pages[len(pages):]

    def hold(self) -> tuple[int, list[int]]:
        """`state()`, still fit to `restore` after forwards in between (a generation's steps): the shared last page a
        write would copy gets one more reference, so that no other owner can change or free it, until `let_go`
        (or `release`). A page no one else holds is not held: nothing copies it, and holding it would."""
        if self._held:
            raise RuntimeError("this cache already holds a state")
        state = self.state()
        self._held = [p for p in self.pages[self.length // self.pool.page_size:] if self.pool.refcount[p] > 1]
        self.pool.share(self._held)
        return state

    def let_go(self) -> None:
        """Drop what `hold` kept."""
        held, self._held = self._held, []
        self.pool.free(held)

    def fork(self) -> "PagedKVCache":
        """A cache holding the same tokens on the same pages (shared until one of them writes)."""
        self.check_live()
        other = PagedKVCache(self.pool, self.ops)
        self.pool.share(self.pages)
        other.pages, other.length = list(self.pages), self.length
        return other

    def release(self) -> None:
        """Give every page back to the pool; the cache is unusable afterwards."""
        self.check_live()
        self.let_go()
        self.pool.free(self.pages)
        self.pages, self.length, self.released, self._table = [], 0, True, None

    def __del__(self):
        # a dropped cache gives its pages back, so forgetting release() cannot drain the pool
        if not getattr(self, "released", True):
            try:
                self.release()
            except Exception:
                pass

    def check_live(self) -> None:
        if self.released:
            raise SessionReleasedError("this session was released; its KV pages are back in the pool")
