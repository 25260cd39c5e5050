"""Batched steps across sessions against the same sessions run one by one (and HF): decode of 1-8 sessions of
different lengths, some forked from one base, prefill of several prompts, node mass per session, seeded sampling,
sessions joining and leaving between steps, exact pool refcounts, and failures that leave every session as it was."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from conftest import MODEL_BACKENDS, needs_triton_interpreter, refs_held, tiny_engine, tiny_hf_model, write_tiny_gguf
from nodekv.engine.errors import PoolExhaustedError

EOS = 100


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    hf = tiny_hf_model(max_positions=128, seed=3)
    path = tmp_path_factory.mktemp("tiny-gguf") / "tiny-q8_0.gguf"
    write_tiny_gguf(hf, path, "q8_0")
    return path


def prompts(rng: random.Random, n: int) -> list[list[int]]:
    return [[rng.randrange(100) for _ in range(rng.randint(1, 30))] for _ in range(n)]


def make_sessions(eng, rng: random.Random, n: int):
    """n sessions: every third one forked from a shared base (continuing it with a node of its own), the others
    fresh; their lengths all differ."""
    base = eng.session()
    base.append([rng.randrange(100) for _ in range(13)])
    out = []
    for i, ids in enumerate(prompts(rng, n)):
        s = base.fork() if i % 3 == 1 else eng.session()
        s.append(ids)
        out.append(s)
    return base, out


@pytest.mark.parametrize("backend", MODEL_BACKENDS)  # triton: one decode_attention call a layer for the batch
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_batched_decode_equals_sequential(hf_tiny, backend, n):
    _, path = hf_tiny
    eng = tiny_engine(path, backend=backend, pages=160, page_size=4)
    base, batch = make_sessions(eng, random.Random(n), n)
    base2, alone = make_sessions(eng, random.Random(n), n)
    got = eng.generate_batch(batch, 10)
    want = [s.generate(10) for s in alone]
    for g, w, sb, sa in zip(got, want, batch, alone):
        assert (g.ids, g.text, g.finish_reason, g.flops) == (w.ids, w.text, w.finish_reason, w.flops)
        assert max((abs(a - b) for a, b in zip(g.logprobs, w.logprobs)), default=0) < 1e-5
        assert (sb._last_logits() - sa._last_logits()).abs().max() < 1e-5 * sa._last_logits().abs().max()
        assert sb.tokens == sa.tokens
    everyone = [base, base2, *batch, *alone]
    assert refs_held(everyone) == eng.pool.refcount
    for s in everyone:
        s.release()
    assert eng.pool.n_free == eng.pool.n_pages and not any(eng.pool.refcount)


def test_batched_decode_on_quantised_weights_is_bit_identical(gguf_path):
    eng = tiny_engine(gguf_path, pages=160, page_size=4)
    _, batch = make_sessions(eng, random.Random(5), 8)
    _, alone = make_sessions(eng, random.Random(5), 8)
    got = eng.generate_batch(batch, 12)
    want = [s.generate(12) for s in alone]
    assert got == [dataclasses.replace(w, node_id=g.node_id) for g, w in zip(got, want)]
    for sb, sa in zip(batch, alone):
        assert torch.equal(sb._last_logits(), sa._last_logits())


def test_batched_prefill_equals_sequential_and_hf(hf_tiny):
    hf, path = hf_tiny
    eng = tiny_engine(path, pages=160, page_size=4)
    rng = random.Random(1)
    base, batch = make_sessions(eng, rng, 5)
    new = prompts(rng, 5)
    alone = [s.fork() for s in batch]
    spans = eng.append_batch(batch, new, node_ids=[f"q{i}" for i in range(5)], collect=True)
    for s, ids, span in zip(alone, new, spans):
        s.append(ids, node_id=span.node_id, collect=True)
    for sb, sa in zip(batch, alone):
        assert sb.tokens == sa.tokens and sb.nodes == sa.nodes
        scale = sa._last_logits().abs().max()
        assert (sb._last_logits() - sa._last_logits()).abs().max() < 1e-5 * scale
        with torch.no_grad():
            ref = hf(torch.tensor([sb.tokens])).logits[0, -1]
        assert (sb._last_logits() - ref).abs().max() < 1e-4 * scale
        mb, ma = sb.node_mass(), sa.node_mass()
        assert mb.query_nodes == ma.query_nodes and torch.allclose(mb.sum, ma.sum, atol=1e-6)


def test_batched_decode_collects_mass_per_session(hf_tiny):
    _, path = hf_tiny
    eng = tiny_engine(path, pages=160, page_size=4)
    _, batch = make_sessions(eng, random.Random(2), 3)
    _, alone = make_sessions(eng, random.Random(2), 3)
    eng.generate_batch(batch, 6, node_id="gen", collect=True)
    for s in alone:
        s.generate(6, node_id="gen", collect=True)
    for sb, sa in zip(batch, alone):
        assert torch.allclose(sb.token_mass("gen"), sa.token_mass("gen"), atol=1e-6)


def test_seeded_sampling_in_a_batch_equals_alone(hf_tiny):
    _, path = hf_tiny
    eng = tiny_engine(path, pages=160, page_size=4)
    _, batch = make_sessions(eng, random.Random(3), 4)
    _, alone = make_sessions(eng, random.Random(3), 4)
    got = eng.generate_batch(batch, 8, temperature=1.3, top_p=0.9, seed=11)
    assert [g.ids for g in got] == [s.generate(8, temperature=1.3, top_p=0.9, seed=11).ids for s in alone]


def test_one_seed_per_session_draws_each_as_alone(hf_tiny):
    _, path = hf_tiny
    eng = tiny_engine(path, pages=160, page_size=4)
    base = eng.session()
    base.append([5, 9, 17, 23])
    batch, alone = [base.fork() for _ in range(3)], [base.fork() for _ in range(3)]
    got = eng.generate_batch(batch, 8, temperature=1.5, seed=[1, 2, 3])
    want = [s.generate(8, temperature=1.5, seed=k).ids for s, k in zip(alone, [1, 2, 3])]
    assert [g.ids for g in got] == want and len({tuple(w) for w in want}) > 1  # equal prompts, different draws
    with pytest.raises(ValueError, match="2 seeds for 3 sessions"):
        eng.generate_batch(batch, 2, temperature=1.5, seed=[1, 2])


def test_states_join_and_leave_between_steps(hf_tiny):
    _, path = hf_tiny
    eng = tiny_engine(path, pages=160, page_size=4)
    _, (a, b, c) = make_sessions(eng, random.Random(4), 3)
    _, alone = make_sessions(eng, random.Random(4), 3)
    plans = [(9, {}), (2, {"allowed_tokens": range(EOS)}), (5, {})]
    ra, rb = a.start_generation(9), b.start_generation(2, **plans[1][1])
    running = eng.step([ra, rb])
    rc = c.start_generation(5)  # joins after the first step
    running = eng.step(running + [rc])
    assert rb.done and rb not in running and rb.result.finish_reason == "length"
    while running:
        running = eng.step(running)
    for state, s, (n, kw) in zip((ra, rb, rc), alone, plans):
        assert state.result.ids == s.generate(n, **kw).ids


def test_pool_exhaustion_in_a_batch_leaves_every_session(hf_tiny):
    _, path = hf_tiny
    eng = tiny_engine(path, pages=12, page_size=4)
    sessions = [eng.session() for _ in range(3)]
    for s in sessions:
        s.append(list(range(10)))  # 3 pages each, 9 of 12 used
    before = [(s.cache.state(), list(s.tokens)) for s in sessions]
    refcount = eng.pool.refcount[:]
    with pytest.raises(PoolExhaustedError):
        eng.append_batch(sessions, [[1] * 7] * 3)  # needs 2 pages each
    with pytest.raises(PoolExhaustedError):
        eng.generate_batch(sessions, 20, allowed_tokens=range(EOS))
    assert [(s.cache.state(), s.tokens) for s in sessions] == before and eng.pool.refcount == refcount
    assert all(s._generation is None for s in sessions)
    assert [len(g.ids) for g in eng.generate_batch(sessions, 2, allowed_tokens=range(EOS))] == [2, 2, 2]


def test_bad_batches_name_the_problem(hf_tiny):
    _, path = hf_tiny
    eng = tiny_engine(path, pages=40, page_size=4)
    s, t = eng.session(), eng.session()
    s.append([1, 2, 3])
    with pytest.raises(ValueError, match="same cache twice"):
        eng.append_batch([s, s], [[1], [2]])
    with pytest.raises(ValueError, match="same cache twice"):  # before the first starts, not as the second does
        eng.generate_batch([s, s], 3)
    with pytest.raises(ValueError, match="one id sequence"):
        eng.append_batch([s, t], [[1]])
    with pytest.raises(ValueError, match="session is empty"):
        eng.generate_batch([s, t], 3)
    assert len(s) == 3 and s._generation is None and t._generation is None


def test_a_batch_runs_one_engine(hf_tiny):
    _, path = hf_tiny
    eng, other = tiny_engine(path, pages=40, page_size=4), tiny_engine(path, pages=40, page_size=4)
    s, t = eng.session(), other.session()
    s.append([1, 2, 3])
    t.append([1, 2, 3])
    for call in (lambda: eng.append_batch([s, t], [[4], [4]]), lambda: eng.generate_batch([s, t], 2),
                 lambda: eng.append_batch([], [])):
        with pytest.raises(ValueError, match="belong to the engine|one id sequence"):
            call()
    assert (len(s), len(t)) == (3, 3) and s._generation is None


@needs_triton_interpreter
def test_triton_decode_steps_attend_in_one_call_per_layer(hf_tiny, monkeypatch):
    """A batch's decode steps on the Triton backend take `decode_attention` once a layer, not a call per session;
    steps that collect node mass, and prompts, stay per session."""
    from nodekv.kernels import triton_ops

    _, path = hf_tiny
    eng = tiny_engine(path, backend="triton", pages=160, page_size=4)
    _, sessions = make_sessions(eng, random.Random(5), 3)
    calls = []
    batched = triton_ops.decode_attention
    monkeypatch.setattr(triton_ops, "decode_attention", lambda *a, **k: calls.append(a[0].shape[0]) or batched(*a, **k))
    eng.generate_batch(sessions, 4)
    # each of the 4 tokens is run (cached, with the logits after it): 4 forwards of 3 sessions, every layer
    assert calls == [3] * 4 * eng.config.n_layers
    calls.clear()
    eng.generate_batch(sessions, 3, collect=True)
    assert calls == []
