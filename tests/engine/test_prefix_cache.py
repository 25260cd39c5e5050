"""Engine.prefixes: a prompt prefix prefilled once and forked; later forks are charged nothing for it (the skipped
prefill, by the FLOP formula, goes to flops.saved) and continue exactly as a session that prefilled it."""
from __future__ import annotations

import torch

from conftest import tiny_engine
from nodekv.engine.flops import forward_flops


def test_forks_of_a_cached_prefix_run_no_forward_and_continue_like_a_fresh_prefill(hf_tiny):
    _, path = hf_tiny
    eng = tiny_engine(path)
    prefix, rest = list(range(1, 21)), [30, 31, 32]
    a = eng.prefixes.fork(prefix)
    charged = eng.flops.total
    assert charged == forward_flops(eng.config, len(prefix)) and eng.flops.saved == 0
    b = eng.prefixes.fork(prefix)
    assert eng.flops.total == charged and eng.flops.saved == forward_flops(eng.config, len(prefix))
    assert a.tokens == b.tokens == prefix and [n.node_id for n in b.nodes] == ["prefix"]
    b.append(rest)
    fresh = eng.session()
    fresh.append(prefix)
    fresh.append(rest)
    torch.testing.assert_close(b.probe(["<5>", "<6>"], tokens=[7]), fresh.probe(["<5>", "<6>"], tokens=[7]),
                               rtol=0, atol=0)
    assert a.tokens == prefix  # a fork's append leaves the cached prefix and its other forks alone
    for s in (a, b, fresh):
        s.release()
    c = eng.prefixes.fork(prefix)  # the prefix outlives its forks
    assert len(eng.prefixes) == 1 and c.tokens == prefix
    c.release()
    eng.prefixes.clear()
    assert len(eng.prefixes) == 0 and sum(eng.pool.refcount) == 0


def test_the_cache_keeps_at_most_capacity_tokens_evicting_the_least_recently_forked(hf_tiny):
    _, path = hf_tiny
    eng = tiny_engine(path)  # 64 pages of 8 tokens: the default capacity is a quarter, 128 tokens
    assert eng.prefixes.capacity == 128
    eng.prefixes.capacity = 25
    a, b, c, d = ([k] * 10 for k in (1, 2, 3, 4))
    for ids in (a, b, a, c):  # a forked again after b: b is the least recent when c needs room
        eng.prefixes.fork(ids).release()
    assert [ids for ids, _ in eng.prefixes._sessions] == [tuple(a), tuple(c)] and eng.prefixes.tokens == 20
    saved = eng.flops.saved
    eng.prefixes.fork(b).release()  # evicted, so prefilled again
    assert eng.flops.saved == saved and [ids for ids, _ in eng.prefixes._sessions] == [tuple(c), tuple(b)]
    long = eng.prefixes.fork(d * 3)  # longer than the capacity: served, not kept
    assert long.tokens == d * 3 and eng.prefixes.tokens == 20
    long.release()
    assert sum(eng.pool.refcount) == 2 * 2  # the two cached 10-token prefixes, two 8-token pages each
    eng.prefixes.clear()
    assert sum(eng.pool.refcount) == 0


def test_a_prefix_an_earlier_process_paid_for_is_prefilled_but_booked_as_saved_once(hf_tiny):
    """A resumed evaluation's new engine is told the digests its earlier lines paid for (`prepaid`): the first fork
    prefills the prefix as usual but charges nothing (the prefill goes to saved, by the formula), the next forks
    are the cache's ordinary saved forks, and the KV is the same as a charged prefill's."""
    _, path = hf_tiny
    prefix = list(range(1, 21))
    first = tiny_engine(path)
    paid = first.prefixes.fork(prefix)
    assert first.prefixes.paid == [first.prefixes.digest((tuple(prefix), "prefix"))]
    later = tiny_engine(path)
    later.prefixes.prepaid.update(first.prefixes.paid)
    again = later.prefixes.fork(prefix)
    cost = forward_flops(later.config, len(prefix))
    assert (later.flops.total, later.flops.prefill_tokens, later.flops.saved) == (0, 0, cost)
    assert later.prefixes.paid == [] and later.prefixes.prepaid == set()
    later.prefixes.fork(prefix).release()
    assert (later.flops.total, later.flops.saved) == (0, 2 * cost)
    torch.testing.assert_close(again.probe(["<5>"], tokens=[7]), paid.probe(["<5>"], tokens=[7]), rtol=0, atol=0)
    for s in (paid, again):
        s.release()
