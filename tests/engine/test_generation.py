"""Generation on a tiny random model against HF's logits as the reference: `score` against HF's log-softmax, steered
decoding (allowed tokens, choices, logits processors) against brute-force argmax over the allowed set, the repetition
penalty against HF's processor and HF's greedy `generate`, log-probs, FLOPs and every finish reason, and the rollbacks
and errors around them."""
from __future__ import annotations

import random

import pytest
import torch

from conftest import tiny_engine
from nodekv.engine.flops import forward_flops
from nodekv.engine.sampling import RepetitionPenalty, SamplingParams, sample

PROMPT = [5, 17, 3, 99, 42, 8, 8, 61]
EOS = 100


@pytest.fixture(scope="module")
def tiny(hf_tiny):
    hf, path = hf_tiny
    return hf, tiny_engine(path, pages=96, page_size=4)


def hf_logits(hf, ids) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def brute_force_greedy(hf, prompt, n, allowed_at) -> tuple[list[int], str]:
    """Greedy decoding where each step takes the argmax of HF's logits over allowed_at(generated) (a set of ids)."""
    out = []
    for _ in range(n):
        logits = hf_logits(hf, prompt + out)[-1]
        allowed = sorted(allowed_at(out))
        token = allowed[int(logits[allowed].argmax())]
        if token == EOS:
            return out, "eos"
        out.append(token)
    return out, "length"


def test_score_is_hf_log_softmax_and_rolls_back(tiny):
    hf, eng = tiny
    s = eng.session()
    s.append(PROMPT)
    cont = [7, 0, 99, 13, 13]
    before = (s.cache.state(), list(s.tokens), s._last_logits().clone(), eng.pool.refcount[:])
    got = s.score(cont)
    ref = torch.log_softmax(hf_logits(hf, PROMPT + cont).double(), -1)[len(PROMPT) - 1:-1]
    want = ref.gather(1, torch.tensor(cont)[:, None])[:, 0]
    assert got.dtype == torch.float32 and got.shape == (len(cont),)
    assert (got.double() - want).abs().max() < 1e-4
    assert (s.cache.state(), s.tokens, eng.pool.refcount) == (before[0], before[1], before[3])
    assert torch.equal(s._last_logits(), before[2])
    assert torch.equal(s.score("<7><0><99><13><13>"), got)  # text is encoded by the tokenizer
    assert torch.equal(s.score(cont[:1]), got[:1])  # a single token needs no forward


def test_probe_is_score_normalised_over_choices(tiny):
    _, eng = tiny
    s = eng.session()
    s.append(PROMPT)
    p = s.probe(["<4>", "<9>"], tokens=[7, 7])
    lp = torch.tensor([s.score([7, 7, 4])[-1], s.score([7, 7, 9])[-1]]).double()
    assert abs(p["<4>"] - float(torch.softmax(lp, 0)[0])) < 1e-5
    assert s.probe(["<4>", "<9>"], tokens="<7><7>") == p  # text is encoded by the tokenizer, as score's
    assert s.probe(["<4>", "<9>"], tokens=torch.tensor([7, 7])) == p


def test_generation_logprobs_flops_and_node(tiny):
    hf, eng = tiny
    s = eng.session()
    s.append(PROMPT)
    gen = s.generate(6, node_id="answer")
    ref = torch.log_softmax(hf_logits(hf, PROMPT + gen.ids).double(), -1)[len(PROMPT) - 1:-1]
    assert max(abs(lp - float(ref[i, t])) for i, (t, lp) in enumerate(zip(gen.ids, gen.logprobs))) < 1e-4
    expected = sum(forward_flops(eng.config, 1, len(PROMPT) + i, 1) for i in range(len(gen.ids)))
    assert gen.flops == expected and gen.node_id == "answer" and s.nodes[-1].node_id == "answer"
    assert s.tokens[len(PROMPT):] == gen.ids and gen.finish_reason == "length"


@pytest.mark.parametrize("seed", range(6))
def test_allowed_tokens_equal_brute_force_argmax(tiny, seed):
    hf, eng = tiny
    rng = random.Random(seed)
    allowed = set(rng.sample(range(101), rng.randint(1, 30)))
    prompt = [rng.randrange(100) for _ in range(rng.randint(2, 12))]
    s = eng.session()
    s.append(prompt)
    gen = s.generate(8, allowed_tokens=allowed)
    assert set(gen.ids) <= allowed
    assert (gen.ids, gen.finish_reason) == brute_force_greedy(hf, prompt, 8, lambda out: allowed)


def test_constraint_changes_the_unconstrained_choice(tiny):
    _, eng = tiny
    s = eng.session()
    s.append(PROMPT)
    free = s.fork().generate(1).ids[0]
    assert s.generate(1, allowed_tokens=[free + 1, free + 2]).ids[0] in (free + 1, free + 2)


@pytest.mark.parametrize("seed", range(6))
def test_choices_yield_one_of_them_by_brute_force(tiny, seed):
    hf, eng = tiny
    rng = random.Random(100 + seed)
    choices = [[rng.randrange(100) for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(1, 5))]
    if seed == 0:  # one choice a prefix of another: EOS is allowed where the shorter one ends
        choices = [[3, 4], [3, 4, 5, 6]]
    texts = ["".join(f"<{t}>" for t in c) for c in choices]

    def allowed_at(out):
        nxt = {c[len(out)] for c in choices if c[:len(out)] == out and len(c) > len(out)}
        return nxt | ({EOS} if out in choices else set())

    s = eng.session()
    s.append(PROMPT)
    gen = s.generate(10, choices=texts)
    want, reason = brute_force_greedy(hf, PROMPT, 10, allowed_at)
    assert gen.ids == want and gen.ids in choices and gen.text in texts
    complete = not any(len(c) > len(want) and c[:len(want)] == want for c in choices)
    assert gen.finish_reason == ("stop" if complete else reason)


def test_logits_processor_steers_and_sees_generated_ids(tiny):
    hf, eng = tiny
    seen = []

    def no_repeats(ids, logits):
        seen.append(list(ids))
        logits[ids] = float("-inf")
        return logits

    s = eng.session()
    s.append(PROMPT)
    gen = s.generate(8, logits_processors=[no_repeats])
    assert len(set(gen.ids)) == len(gen.ids) and seen[0] == [] and seen[1] == gen.ids[:1]
    assert gen.ids == brute_force_greedy(hf, PROMPT, 8, lambda out: set(range(101)) - set(out))[0]
    assert s._logits[s.nodes[0].node_id].isfinite().all()  # the session's own logits are untouched


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_is_hfs(tiny, penalty):
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    hf, eng = tiny
    logits = torch.randn(101, generator=torch.Generator().manual_seed(0)) * 3
    generated = [7, 99, 7, 0]
    ref = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([PROMPT + generated]), logits[None].clone())[0]
    assert torch.equal(RepetitionPenalty(penalty, PROMPT, 101)(generated, logits.clone()), ref)

    s = eng.session()
    s.append(PROMPT)
    gen = s.generate(10, repetition_penalty=penalty)
    with torch.no_grad():
        want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=10, do_sample=False, repetition_penalty=penalty,
                           eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert gen.ids == want[:len(gen.ids)] and len(gen.ids) >= 3
    plain = eng.session()
    plain.append(PROMPT)
    assert plain.generate(10).ids[:len(gen.ids)] != gen.ids  # the penalty changed the greedy choice here
    for bad in (0.0, float("inf"), float("nan"), "1.2"):
        with pytest.raises(ValueError, match="repetition_penalty must be a finite number > 0, got "):
            s.generate(2, repetition_penalty=bad)
    with pytest.raises(ValueError, match="repetition_penalty must be a finite number > 0, got inf"):
        RepetitionPenalty(float("inf"), PROMPT, 101)


def test_sampling_params_is_one_value_for_every_generate_call(tiny):
    """A SamplingParams gives what its keywords give, in a session and across a batch; penalize_prompt=False
    penalises the generated tokens only (the reference: HF's logits, CTRL's penalty over the generated ids)."""
    from nodekv import SamplingParams

    hf, eng = tiny
    params = SamplingParams(8, temperature=0.9, top_p=0.8, seed=3, repetition_penalty=1.3)
    by_keywords, by_value = eng.session(), eng.session()
    for s in (by_keywords, by_value):
        s.append(PROMPT)
    assert by_value.generate(params).ids == by_keywords.generate(8, temperature=0.9, top_p=0.8, seed=3,
                                                                 repetition_penalty=1.3).ids
    batch = [eng.session() for _ in range(2)]
    for s in batch:
        s.append(PROMPT)
    assert [g.ids for g in eng.generate_batch(batch, params)] == [by_value.tokens[len(PROMPT):]] * 2

    generated_only = eng.session()
    generated_only.append(PROMPT)
    gen = generated_only.generate(SamplingParams(8, repetition_penalty=1.5, penalize_prompt=False))
    out = []
    for _ in range(len(gen.ids)):
        logits = hf_logits(hf, PROMPT + out)[-1].clone()
        if out:
            seen = torch.tensor(sorted(set(out)))
            logits[seen] = torch.where(logits[seen] > 0, logits[seen] / 1.5, logits[seen] * 1.5)
        out.append(int(logits.argmax()))
    assert gen.ids == out
    for bad, msg in [(dict(max_new_tokens=-1), "max_new_tokens"), (dict(top_p=0.0), "top_p"),
                     (dict(temperature=float("inf")), "temperature must be a finite number >= 0, got inf"),
                     (dict(temperature=float("nan")), "temperature must be a finite number >= 0, got nan"),
                     (dict(temperature="0.5"), "temperature must be a finite number >= 0, got '0.5'"),
                     (dict(temperature=True), "temperature must be a finite number >= 0, got True"),
                     (dict(top_p="0.5", temperature=1.0), r"top_p must be in \(0, 1\], got '0.5'"),
                     (dict(stop=("",)), "stop strings"), (dict(repetition_penalty=0.0), "repetition_penalty")]:
        with pytest.raises(ValueError, match=msg):
            SamplingParams(**bad)
    with pytest.raises(TypeError, match="unknown sampling option"):
        eng.session().generate(3, temprature=0.5)


def test_sampling_draws_from_a_float64_softmax_at_any_positive_temperature(monkeypatch):
    """The probabilities handed to the draw are softmax(logits / temperature) computed in float64 here; below the
    temperatures where that overflows, its limit: all the mass on greedy's token. Masked (-inf) logits get none."""
    drawn = []
    multinomial = torch.multinomial
    monkeypatch.setattr(torch, "multinomial", lambda probs, *a, **k: drawn.append(probs) or multinomial(probs, *a, **k))
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0)) * 8
    logits[[3, 17, 40]] = float("-inf")
    greedy = sample(logits)
    for temperature in (1e-45, 1e-3, 0.5, 1.0, 4.0, 1e30, 1e-320, 5e-324):
        token = sample(logits, temperature, generator=torch.Generator().manual_seed(1))
        want = torch.softmax(logits.double() / temperature, 0)
        if not want.isfinite().all():  # logits / temperature overflowed: the limit
            want = torch.nn.functional.one_hot(torch.tensor(greedy), 50).double()
        assert (drawn[-1].double() - want).abs().max() < 1e-6, temperature
        assert drawn[-1][[3, 17, 40]].sum() == 0
        if temperature < 1e-3:
            assert token == greedy


def test_a_tiny_temperature_generates_greedys_tokens_under_every_constraint(tiny):
    _, eng = tiny
    s = eng.session()
    s.append(PROMPT)
    for steering in ({}, {"allowed_tokens": [4, 9, 61, EOS]}, {"choices": ["<1><2>", "<1><5><6>", "<8>"]}):
        greedy = s.fork().generate(5, **steering)
        for temperature in (1e-45, 5e-324):
            assert s.fork().generate(5, temperature=temperature, seed=0, **steering).ids == greedy.ids
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0, got inf"):
        s.generate(3, temperature=float("inf"), choices=["<1>"])
    assert s.tokens == PROMPT and s._generation is None


def test_finish_reasons(tiny):
    _, eng = tiny
    s = eng.session()
    s.append(PROMPT)
    assert s.fork().generate(3).finish_reason == "length"
    empty = s.fork().generate(0)
    assert (empty.ids, empty.finish_reason, empty.node_id) == ([], "length", None)
    assert s.fork().generate(5, allowed_tokens=[EOS]).finish_reason == "eos"
    full = s.fork().generate(6)
    stop = full.text[full.text.index(">") + 1:][:3]  # starts inside the second token's text
    cut = s.fork().generate(6, stop=[stop, "never"])
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.index(stop)] and len(cut.ids) == 2
    assert s.fork().generate(6, choices=["<1><2>"]).finish_reason == "stop"
    long = eng.session()
    long.append(list(range(100)) + list(range(24)))
    gen = long.generate(10, allowed_tokens=range(100))
    assert gen.finish_reason == "window" and len(long) == 128 and len(gen.ids) == 4


def test_bad_options_name_the_problem_and_leave_the_session(tiny):
    _, eng = tiny
    s = eng.session()
    s.append(PROMPT)
    for kw, msg in [(dict(allowed_tokens=[]), "allowed_tokens is empty"),
                    (dict(allowed_tokens=[101]), "outside the vocabulary"),
                    (dict(choices=[""]), "choices must be non-empty"),
                    (dict(allowed_tokens=[1], choices=["<2>"]), "leave no token")]:
        with pytest.raises(ValueError, match=msg):
            s.generate(3, **kw)
        assert len(s) == len(PROMPT) and s._generation is None
    with pytest.raises(ValueError, match="at least one token"):
        s.score([])


def test_a_busy_session_refuses_other_work_until_cancelled(tiny):
    _, eng = tiny
    s = eng.session()
    s.append(PROMPT)
    before = (s.cache.state(), eng.pool.refcount[:])
    state = s.start_generation(5)
    eng.step([state])
    eng.step([state])
    for op in (lambda: s.append([1]), lambda: s.score([1]), lambda: s.fork(), lambda: s.generate(2)):
        with pytest.raises(RuntimeError, match="generation in progress"):
            op()
    state.cancel()
    assert (s.cache.state(), eng.pool.refcount) == before and state.done and state.result is None
    assert len(s.generate(2).ids) == 2


def test_a_failing_processor_leaves_the_sessions_as_they_were(tiny):
    _, eng = tiny
    s, t = eng.session(), eng.session()
    s.append(PROMPT)
    t.append(PROMPT[:3])
    before = [(x.cache.state(), list(x.tokens), list(x.nodes)) for x in (s, t)]

    def fails_later(ids, logits):
        if len(ids) == 2:
            raise RuntimeError("processor failed")
        return logits

    with pytest.raises(RuntimeError, match="processor failed"):
        eng.generate_batch([s, t], 5, collect=True, logits_processors=[fails_later])
    assert [(x.cache.state(), x.tokens, x.nodes) for x in (s, t)] == before
    assert not s.cache.collecting and not t.cache.collecting and s._generation is None


def test_a_refused_step_draws_nothing_from_a_seeded_generation(tiny):
    _, eng = tiny
    s = eng.session()
    s.append(PROMPT)
    alone = s.generate(6, temperature=1.0, seed=3).ids
    state = s.start_generation(6, temperature=1.0, seed=3)
    with pytest.raises(ValueError):
        eng.step([state, state])  # one cache twice in one forward: refused after the tokens were chosen
    while not state.done:
        eng.step([state])
    assert state.result.ids == alone


def test_one_string_is_not_taken_for_its_characters(tiny):
    _, eng = tiny
    s = eng.session()
    s.append(PROMPT)
    for op in (lambda: s.probe("Yes"), lambda: s.probe([]), lambda: s.generate(2, choices="Yes")):
        with pytest.raises(ValueError, match="choices must be a (non-empty )?list of strings"):
            op()
    assert s.tokens == list(PROMPT) and s._generation is None


def test_score_refuses_an_id_outside_the_vocabulary_even_the_last(tiny):
    _, eng = tiny
    s = eng.session()
    s.append(PROMPT)
    with pytest.raises(ValueError, match=f"token id {eng.config.vocab_size} is outside the vocabulary"):
        s.score([5, eng.config.vocab_size])
    assert s.tokens == list(PROMPT)


def test_cancelling_a_finished_generation_drops_only_its_own_node(tiny):
    """A finished generation's cancel takes its node back while it is the session's last; once another node follows,
    it refuses (before, it dropped the later node too)."""
    _, eng = tiny
    s = eng.session()
    s.append(PROMPT, node_id="prompt")
    state = s.start_generation(3, node_id="reply")
    while not state.done:
        eng.step([state])
    s.append([4, 5], node_id="after")
    before = (list(s.tokens), [n.node_id for n in s.nodes])
    with pytest.raises(ValueError, match=r"cannot cancel the generation of node 'reply': nodes \['after'\]"):
        state.cancel()
    assert (s.tokens, [n.node_id for n in s.nodes]) == before
    s.truncate("reply")
    running = s.start_generation(2)
    with pytest.raises(ValueError, match="cannot cancel the finished generation of node 'reply' while another"):
        state.cancel()
    running.cancel()
    state.cancel()
    assert s.tokens == list(PROMPT) and [n.node_id for n in s.nodes] == ["prompt"]


def test_a_processor_that_returns_other_than_logits_is_refused(tiny):
    _, eng = tiny
    s = eng.session()
    s.append(PROMPT)
    for wrong, got in ((lambda ids, logits: logits[None], r"\(1, \d+\)"), (lambda ids, logits: None, "NoneType")):
        with pytest.raises(ValueError, match=f"logits processor .* returned {got}, not logits of shape"):
            s.generate(3, logits_processors=[wrong])
        assert s.tokens == list(PROMPT) and s._generation is None


@pytest.mark.parametrize("seed", [-1, 2 ** 64, 1.5, True, "7"])
def test_a_seed_torch_cannot_take_is_refused(seed):
    with pytest.raises(ValueError, match="seed must be an int in \\[0, 2\\*\\*64\\) or None"):
        SamplingParams(seed=seed)


@pytest.mark.parametrize("fail_at", [1, 3])
def test_a_fork_whose_generation_fails_gives_back_the_page_it_copied(tiny, fail_at):
    """A fork shares its prefix's partly filled last page; the first step copies it on write. When a later step
    fails, the fork goes back to the shared page (before, it kept the copy) and every refcount is as it was."""
    _, eng = tiny
    prefix = eng.session()
    prefix.append(PROMPT[:5])  # page size 8: one partly filled page
    fork = prefix.fork()
    before = (fork.cache.state(), eng.pool.refcount[:], eng.pool.n_free)

    def fails(ids, logits):
        if len(ids) == fail_at:
            raise RuntimeError("processor failed")
        return logits

    with pytest.raises(RuntimeError, match="processor failed"):
        fork.generate(5, logits_processors=[fails])
    assert (fork.cache.state(), eng.pool.refcount, eng.pool.n_free) == before
    state = fork.start_generation(5)  # a cancel mid-way, and a release mid-way, give everything back too
    eng.step([state])
    state.cancel()
    assert (fork.cache.state(), eng.pool.refcount, eng.pool.n_free) == before
    with pytest.raises(ValueError, match="choices must be a list"):  # refused as it starts: nothing held
        fork.start_generation(5, choices="Yes")
    assert (fork.cache.state(), eng.pool.refcount, eng.pool.n_free) == before
    eng.step([fork.start_generation(5)])
    fork.release()
    prefix.release()
    assert eng.pool.n_free == eng.pool.n_pages


def test_a_failed_batch_gives_back_the_page_a_finished_fork_copied(tiny):
    """Two forks share their prefix's partly filled last page, and each copies it on its first step. When one fork
    has finished (EOS) and the other's next step fails, generate cancels both: the finished one must go back to the
    shared page too (before, it kept its copy: one page fewer free after a call that changed nothing)."""
    _, eng = tiny
    prefix = eng.session()
    prefix.append(PROMPT[:5])  # page size 4: the second page partly filled
    forks = [prefix.fork(), prefix.fork()]
    before = ([f.cache.state() for f in forks], eng.pool.refcount[:], eng.pool.n_free)
    calls = []

    def eos_then_fail(ids, logits):  # called for fork 0, then fork 1, at every step
        calls.append(len(ids))
        if len(calls) == 3:  # fork 0's second token: EOS, it finishes
            return torch.full_like(logits, float("-inf")).index_fill_(0, torch.tensor([EOS]), 0.0)
        if len(calls) == 4:  # fork 1's second token
            raise RuntimeError("processor failed")
        return logits

    with pytest.raises(RuntimeError, match="processor failed"):
        eng.generate_batch(forks, 5, logits_processors=[eos_then_fail])
    assert ([f.cache.state() for f in forks], eng.pool.refcount, eng.pool.n_free) == before
    assert [f.tokens for f in forks] == [PROMPT[:5]] * 2 and all(f._generation is None for f in forks)


def test_seeds_that_differ_by_2_to_the_32_draw_apart_and_small_seeds_are_torchs(tiny):
    """torch's CPU generator keeps a seed's low 32 bits: seed 7 and 7 + 2**32 drew one stream (and GoR's derived
    seeds, seed * 1_000_003 + n, met other runs' streams). A seed below 2**32 stays torch's own: its first draw is
    a multinomial from torch.Generator().manual_seed(seed) on the same probabilities."""
    from nodekv.engine.sampling import seeded_generator

    _, eng = tiny
    runs = {}
    for seed in (7, 7 + 2 ** 32):
        s = eng.session()
        s.append(PROMPT)
        runs[seed] = s.generate(12, temperature=1.5, seed=seed).ids
    assert runs[7] != runs[7 + 2 ** 32]
    probs = torch.softmax(torch.randn(101, generator=torch.Generator().manual_seed(1)), 0)
    for seed in (0, 7, 2 ** 32 - 1):
        assert torch.multinomial(probs, 1, generator=seeded_generator(seed)).item() == torch.multinomial(
            probs, 1, generator=torch.Generator().manual_seed(seed)).item()
