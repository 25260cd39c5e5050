"""Sessions over the paged KV pool on tiny random models: node-by-node appends against one prefill and HF,
bit-exact probe rollback, copy-on-write forks and refcounts, a random-operation leak test, node attention mass
against HF's eager attention matrices, incremental FLOPs, and bad input."""
from __future__ import annotations

import random

import pytest
import torch

from conftest import MODEL_BACKENDS, refs_held, tiny_engine
from numerics import hf_attention
from nodekv.engine.errors import ContextOverflowError, PoolExhaustedError, SessionReleasedError
from nodekv.engine.flops import forward_flops


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def per_node(att_rows: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """Token-to-node sums of attention rows [n, T] for nodes [bounds[j], bounds[j+1])."""
    return torch.stack([att_rows[:, a:b].sum(1) for a, b in zip(bounds, bounds[1:])], 1)


def random_splits(rng: random.Random, total: int, parts: int) -> list[int]:
    cuts = sorted(rng.sample(range(1, total), parts - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, total])]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_node_by_node_appends_match_one_prefill_and_hf(hf_tiny, seed):
    hf, path = hf_tiny
    eng = tiny_engine(path, page_size=4)
    rng = random.Random(seed)
    ids = [rng.randrange(100) for _ in range(70)]
    ref = hf_logits(hf, ids)
    whole = eng.session()
    whole.append(ids)
    nodes = eng.session()
    for n in random_splits(rng, len(ids), 6):
        nodes.append(ids[len(nodes):len(nodes) + n])
    scale = ref.abs().max()
    assert (nodes._last_logits() - whole._last_logits()).abs().max() <= 1e-4 * scale
    assert (nodes._last_logits() - ref[-1]).abs().max() <= 1e-4 * scale
    a, b = nodes.generate(12), whole.generate(12)
    assert (a.text, a.ids, a.flops) == (b.text, b.ids, b.flops)
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-4
    with torch.no_grad():
        greedy = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(ids):].tolist()
    assert whole.tokens[len(ids):] == greedy[: len(whole.tokens) - len(ids)]


def test_probe_rollback_is_bit_identical_even_on_shared_pages(hf_tiny):
    hf, path = hf_tiny
    eng = tiny_engine(path, page_size=8)
    s = eng.session()
    s.append(list(range(1, 21)))  # 20 tokens: the last page is partly filled
    fork = s.fork()  # ... and shared, so the probe must copy it before writing
    pool = eng.pool
    before = (s.cache.state(), list(pool.refcount), pool.n_free, pool.k.clone(), pool.v.clone(),
              list(s.tokens), list(s.nodes), s._last_logits().clone())
    p = s.probe(["<3>", "<4>"], tokens=[9, 9, 9, 9, 9, 9])
    after = (s.cache.state(), list(pool.refcount), pool.n_free)
    assert after == before[:3]
    used = torch.zeros(pool.n_pages, dtype=torch.bool)
    used[s.cache.pages] = True  # the probe's own pages were freed; what sessions hold must be untouched
    # bit patterns, not values: unwritten slots of a partly filled page hold whatever memory held, NaNs included
    bits = lambda t: t[:, used].view(torch.uint8)  # noqa: E731
    assert torch.equal(bits(pool.k), bits(before[3])) and torch.equal(bits(pool.v), bits(before[4]))
    assert (s.tokens, s.nodes) == (before[5], before[6]) and torch.equal(s._last_logits(), before[7])
    ref = torch.softmax(hf_logits(hf, list(range(1, 21)) + [9] * 6)[-1, [3, 4]].double(), 0)
    assert abs(p["<3>"] - ref[0].item()) < 1e-5
    fork.release()
    s.release()
    assert pool.n_free == pool.n_pages


def test_fork_shares_pages_and_copies_on_write(hf_tiny):
    hf, path = hf_tiny
    eng = tiny_engine(path, page_size=8)
    pool = eng.pool
    prefix = list(range(30, 50))  # 20 tokens: pages 0, 1 full, page 2 holds 4 of 8
    base = eng.session()
    base.append(prefix, node_id="prompt")
    forks = [base.fork() for _ in range(3)]
    assert all(pool.refcount[p] == 4 for p in base.cache.pages)
    flops = eng.flops.total
    tails = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]
    for f, tail in zip(forks, tails):
        f.append(tail)
    full, partial = base.cache.pages[:2], base.cache.pages[2]
    assert all(pool.refcount[p] == 4 for p in full)  # full pages stay shared
    assert pool.refcount[partial] == 1  # each fork wrote into the partial page: each copied it
    assert all(f.cache.pages[:2] == full and f.cache.pages[2] != partial for f in forks)
    assert eng.flops.total - flops == sum(forward_flops(eng.config, len(t), len(prefix)) for t in tails)
    for f, tail in zip(forks, tails):
        ref = hf_logits(hf, prefix + tail)[-1]
        assert (f._last_logits() - ref).abs().max() <= 1e-4 * ref.abs().max()
    ref = hf_logits(hf, prefix)[-1]
    assert (base._last_logits() - ref).abs().max() <= 1e-4 * ref.abs().max()
    assert refs_held([base, *forks]) == pool.refcount
    for s in [base, *forks]:
        s.release()
    assert pool.n_free == pool.n_pages and not any(pool.refcount)


def test_random_operations_never_leak_pages(hf_tiny):
    _, path = hf_tiny
    eng = tiny_engine(path, pages=40, page_size=4)
    pool = eng.pool
    rng = random.Random(7)
    sessions = [eng.session()]
    for step in range(200):
        live = [s for s in sessions if not s.cache.released]
        if not live:
            sessions.append(eng.session())
            continue
        s = rng.choice(live)
        op = rng.choice(["append", "append", "probe", "fork", "truncate", "generate", "release", "batch_append",
                         "batch_generate"])
        group = rng.sample(live, rng.randint(1, len(live)))
        try:
            if op == "append":
                s.append([rng.randrange(100) for _ in range(rng.randint(1, 9))])
            elif op == "probe" and s.nodes:
                s.probe(["<1>", "<2>"], tokens=[rng.randrange(100) for _ in range(rng.randint(1, 6))])
            elif op == "fork":
                sessions.append(s.fork())
            elif op == "truncate" and s.nodes:
                s.truncate(rng.choice(s.nodes).node_id)
            elif op == "generate" and s.nodes:
                s.generate(rng.randint(1, 5))
            elif op == "release":
                s.release()
            elif op == "batch_append":
                eng.append_batch(group, [[rng.randrange(100) for _ in range(rng.randint(1, 9))] for _ in group])
            elif op == "batch_generate" and all(g.nodes for g in group):
                eng.generate_batch(group, rng.randint(1, 5))
        except (PoolExhaustedError, ContextOverflowError):
            pass  # the sessions stay as they were: checked below
        for g in sessions:
            assert g.cache.released or g.cache.length == len(g.tokens) == (g.nodes[-1].end if g.nodes else 0)
        assert refs_held(sessions) == pool.refcount, f"step {step}: {op}"
        assert pool.n_free == pool.refcount.count(0)
    for s in sessions:
        if not s.cache.released:
            s.release()
    assert pool.n_free == pool.n_pages and not any(pool.refcount)


@pytest.mark.parametrize("backend", MODEL_BACKENDS)
def test_node_mass_matches_hf_attention(hf_tiny, backend):
    hf, path = hf_tiny
    eng = tiny_engine(path, backend=backend, page_size=8)
    rng = random.Random(3)
    ids = [rng.randrange(100) for _ in range(45)]
    sizes = [10, 7, 1, 15, 12]
    s = eng.session()
    for k, n in enumerate(sizes):
        s.append(ids[len(s):len(s) + n], node_id=f"c{k}", collect=k != 1)  # node 1 is not collected
    att = hf_attention(hf, ids)
    bounds = [0, 10, 17, 18, 33, 45]
    for k in (0, 2, 3, 4):
        want = per_node(att[bounds[k]:bounds[k + 1]], bounds[: k + 2])
        torch.testing.assert_close(s.token_mass(f"c{k}").double(), want, atol=1e-5, rtol=0)
    s.token_mass("c0").zero_()  # a copy: the session's mass (and its forks') stays
    torch.testing.assert_close(s.token_mass("c0").double(), per_node(att[:10], bounds[:2]), atol=1e-5, rtol=0)
    m = s.node_mass()
    assert m.query_nodes == ["c0", "c2", "c3", "c4"] and m.key_nodes == [f"c{k}" for k in range(5)]
    want = torch.stack([torch.cat([per_node(att[bounds[k]:bounds[k + 1]], bounds[: k + 2]).mean(0),
                                   torch.zeros(4 - k, dtype=torch.float64)]) for k in (0, 2, 3, 4)])
    torch.testing.assert_close(m.sum.double(), want, atol=1e-5, rtol=0)
    torch.testing.assert_close(m.mean.double(), want / torch.tensor(sizes), atol=1e-5, rtol=0)
    masked = s.node_mass(exclude_self=True).sum
    assert masked[2, 3] == 0 and torch.equal(masked[2, :3], m.sum[2, :3])


@pytest.mark.parametrize("backend", MODEL_BACKENDS)
def test_decode_time_mass_matches_hf_attention(hf_tiny, backend):
    hf, path = hf_tiny
    eng = tiny_engine(path, backend=backend, page_size=8)
    s = eng.session()
    s.append(list(range(40, 52)), node_id="a")
    s.append(list(range(60, 69)), node_id="b")
    gen = s.generate(8, node_id="gen", collect=True)
    n = len(s.nodes[-1])
    assert n > 0 and gen.finish_reason in ("length", "eos")
    att = hf_attention(hf, s.tokens)
    bounds = [0, 12, 21, 21 + n]
    torch.testing.assert_close(s.token_mass("gen").double(), per_node(att[21:], bounds), atol=1e-5, rtol=0)


def test_collection_flops_and_appends_charge_only_the_new_node(hf_tiny):
    """Node k costs its own tokens attending to what is cached: the closed form below, far less than a re-prefill;
    collecting adds exactly the last layer's attention for the rows that pruning would skip."""
    _, path = hf_tiny
    eng = tiny_engine(path)
    c = eng.config
    per_token = (2 * c.dim * (c.q_dim + 2 * c.kv_dim) + 2 * c.q_dim * c.dim + 6 * c.dim * c.intermediate_size)
    per_key = 4 * c.n_heads * c.head_dim
    s = eng.session()
    past = 0
    for n, collect in [(13, False), (9, True), (20, False), (5, True)]:
        before = eng.flops.total
        s.append(list(range(n)), collect=collect)
        rows = range(n) if collect else range(n - 1, n)
        keys_all = sum(past + t + 1 for t in range(n))
        keys_last = sum(past + t + 1 for t in rows)
        want = (n * per_token * c.n_layers - (n - 1) * (per_token - 2 * c.dim * (c.q_dim + 2 * c.kv_dim))
                + per_key * ((c.n_layers - 1) * keys_all + keys_last) + 2 * c.dim * c.vocab_size)
        assert eng.flops.total - before == want
        assert past == 0 or want < forward_flops(c, past + n, 0)  # re-prefilling the whole prompt costs more
        past += n


def test_bad_input_leaves_sessions_usable(hf_tiny):
    hf, path = hf_tiny
    eng = tiny_engine(path, pages=6, page_size=4)  # 24 positions in the pool
    s = eng.session()
    s.append(list(range(10)), node_id="a")
    other = s.fork()
    with pytest.raises(PoolExhaustedError, match="pool exhausted"):
        s.append(list(range(20)))
    assert s.cache.state() == (10, other.cache.pages) and eng.pool.n_free == 3
    s.append([1, 2, 3], node_id="b")  # still usable
    ref = hf_logits(hf, list(range(10)) + [1, 2, 3])[-1]
    assert (s._last_logits() - ref).abs().max() <= 1e-4 * ref.abs().max()
    for bad, match in (("zz", r"cannot truncate to node 'zz': it is not in this session \(nodes: \['a', 'b'\]\)"),
                       (["a"], r"cannot truncate to node \['a'\]: it is not in this session")):
        with pytest.raises(ValueError, match=match):
            s.truncate(bad)
        assert len(s) == 13 and [n.node_id for n in s.nodes] == ["a", "b"]
    s.truncate("a")
    assert s.tokens == list(range(10)) and [n.node_id for n in s.nodes] == ["a"]
    with pytest.raises(ValueError, match="no attention mass for node 'a': it was not collected"):
        s.token_mass("a")
    with pytest.raises(ValueError, match="no attention mass for node 'b': it is not in this session"):
        s.token_mass("b")
    other.release()
    with pytest.raises(SessionReleasedError, match="released"):
        other.release()
    with pytest.raises(SessionReleasedError):
        other.append([1])
    with pytest.raises(SessionReleasedError):
        other.probe(["<1>", "<2>"])
    big = tiny_engine(path, pages=40, page_size=4)
    t = big.session()
    t.append(list(range(100)))
    with pytest.raises(ContextOverflowError, match="context window of 128"):
        t.append(list(range(29)))
    assert len(t) == 100 and t.cache.length == 100


def test_a_refused_call_on_a_fork_gives_back_the_page_it_copied(hf_tiny):
    """A fork whose last page is shared copies it on write; a call that fails after that copy (one batch member
    out of pages) or that only looks (a key deviation) must leave the pool and the page table as they were."""
    hf, path = hf_tiny
    eng = tiny_engine(path, pages=8, page_size=4)
    base = eng.session()
    base.append(list(range(10)))  # 3 pages, the last one half full
    fork, other = base.fork(), eng.session()
    pages, free, refcount = list(fork.cache.pages), eng.pool.n_free, list(eng.pool.refcount)
    with pytest.raises(PoolExhaustedError):
        eng.append_batch([fork, other], [[1, 2, 3], list(range(40))])
    assert (fork.cache.pages, eng.pool.n_free, eng.pool.refcount) == (pages, free, refcount)
    fork.key_deviation([3, 9])
    assert (fork.cache.pages, eng.pool.n_free, eng.pool.refcount) == (pages, free, refcount)
    fork.append([1, 2, 3])  # and it still reads what it shares with `base`
    ref = hf_logits(hf, list(range(10)) + [1, 2, 3])[-1]
    assert (fork._last_logits() - ref).abs().max() <= 1e-4 * ref.abs().max()


@pytest.mark.parametrize("ids", [[1.7, 2.9], [True, False], torch.tensor([1.0, 2.0]), "text"])
def test_token_ids_that_are_not_integers_are_refused(hf_tiny, ids):
    eng = tiny_engine(hf_tiny[1], pages=8, page_size=4)
    s = eng.session()
    with pytest.raises(ValueError, match="token ids must be integers|expected a 1-D sequence of token ids"):
        s.append(ids)
    assert s.tokens == [] and eng.pool.n_free == 8
    s.append(torch.tensor([3, 4]))
    assert s.tokens == [3, 4] and all(type(t) is int for t in s.tokens)


def test_the_prefix_cache_checks_ids_before_it_evicts(hf_tiny):
    eng = tiny_engine(hf_tiny[1], pages=8, page_size=4)
    eng.prefixes.capacity = 12
    eng.prefixes.fork([5] * 10).release()
    held = eng.pool.n_free
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.prefixes.fork([7] * 6 + [eng.config.vocab_size])
    assert eng.pool.n_free == held and eng.prefixes.tokens == 10  # the cached prefix is still there


def test_dropped_and_with_sessions_give_pages_back(hf_tiny):
    _, path = hf_tiny
    eng = tiny_engine(path, pages=8, page_size=4)
    for _ in range(5):  # each needs 5 of the 8 pages: only works if the previous one gave them back
        eng.session().append(list(range(20)))
    with eng.session() as s:
        s.append(list(range(20)))
        assert eng.pool.n_free == 3
    assert s.cache.released and eng.pool.n_free == 8
