"""Sessions on a tiny random model: greedy decoding against HF generate, probes against softmax of HF logits,
rollback, stop conditions, FLOP charging, and bad input."""
from __future__ import annotations

import pytest
import torch

from conftest import cached_kv, tiny_engine, tiny_hf_model
from nodekv.engine.errors import ContextOverflowError
from nodekv.engine.flops import forward_flops


@pytest.fixture
def tiny(save_hf):
    hf = tiny_hf_model(max_positions=64)
    return hf, tiny_engine(save_hf(hf))


PROMPT = [5, 17, 3, 99, 42, 8, 8, 61]


def test_greedy_matches_hf_generate(tiny):
    hf, eng = tiny
    s = eng.session()
    s.append(PROMPT)
    gen = s.generate(20)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(PROMPT):].tolist()
    ours = s.tokens[len(PROMPT):]
    if 100 in ref:  # HF was told of no EOS; ours stops at id 100
        ref = ref[: ref.index(100)]
    assert ours == ref
    assert gen.text == eng.tokenizer.decode(ref) and gen.ids == ref


def test_probe_is_softmax_over_choices_and_rolls_back(tiny):
    hf, eng = tiny
    s = eng.session()
    s.append(PROMPT)
    state = (s.cache.state(), list(s.tokens), list(s.nodes), s._last_logits().clone())
    kv_before = cached_kv(s)
    extra = [7, 7, 1]
    p = s.probe(["<4>", "<9>"], tokens=extra)
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + extra])).logits[0, -1].double()
    ref = torch.softmax(logits[[4, 9]], 0)
    assert abs(p["<4>"] - ref[0].item()) < 1e-5 and abs(sum(p.values()) - 1) < 1e-12
    assert (s.cache.state(), s.tokens, s.nodes) == state[:3] and torch.equal(s._last_logits(), state[3])
    assert torch.equal(cached_kv(s), kv_before)
    # after the rollback the session continues exactly as if the probe never happened
    s.append([2, 3])
    with torch.no_grad():
        ref_last = hf(torch.tensor([PROMPT + [2, 3]])).logits[0, -1]
    assert (s._last_logits() - ref_last).abs().max() <= 1e-4 * ref_last.abs().max()


def test_sampling_is_seeded(tiny):
    _, eng = tiny
    runs = []
    for seed in (1, 1, 2):
        s = eng.session()
        s.append(PROMPT)
        s.generate(12, temperature=1.5, top_p=0.9, seed=seed)
        runs.append(s.tokens)
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_stop_string_and_eos(tiny):
    _, eng = tiny
    s = eng.session()
    s.append(PROMPT)
    full = s.generate(6).text
    second = full[full.index(">") + 1:]
    stop = second[: second.index(">") + 1]  # the second generated token's text
    s2 = eng.session()
    s2.append(PROMPT)
    gen = s2.generate(6, stop=stop)
    assert gen.text == full[: full.index(stop)] and gen.finish_reason == "stop" and len(gen.ids) == 2
    s3 = eng.session()
    s3.append(PROMPT)
    eng.tokenizer.eos_ids = (s.tokens[len(PROMPT)],)  # the first greedy token
    try:
        gen = s3.generate(6)
        assert (gen.text, gen.ids, gen.node_id, gen.finish_reason) == ("", [], None, "eos") and s3.tokens == PROMPT
    finally:
        del eng.tokenizer.eos_ids


def test_flops_charged_per_forward(tiny):
    _, eng = tiny
    c = eng.config
    eng.flops.reset()
    s = eng.session()
    with eng.flops.scope("query"):
        s.append(PROMPT)
        s.generate(3)
    expected = forward_flops(c, len(PROMPT), 0) + sum(forward_flops(c, 1, len(PROMPT) + i) for i in range(3))
    assert eng.flops.total == eng.flops.scopes["query"] == expected
    assert (eng.flops.prefill_tokens, eng.flops.decode_tokens) == (len(PROMPT), 3)


def test_context_overflow_leaves_session_usable(tiny):
    _, eng = tiny
    s = eng.session()
    s.append(list(range(60)))
    with pytest.raises(ContextOverflowError, match="65 tokens exceed the model's context window of 64"):
        s.append([1, 2, 3, 4, 5])
    with pytest.raises(ContextOverflowError):
        s.probe(["<1>", "<2>"], tokens=[1] * 10)
    assert s.cache.length == len(s.tokens) == 60
    gen = s.generate(10)
    assert gen.finish_reason in ("window", "eos") and len(s.tokens) <= 64


def test_bad_input(tiny):
    _, eng = tiny
    s = eng.session()
    with pytest.raises(ValueError, match="session is empty"):
        s.generate(4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        s.append([1, 2, 101])
    with pytest.raises(ValueError, match="non-empty"):
        s.append([])
    s.append([1, 2], node_id="a")
    with pytest.raises(ValueError, match="already in this session"):
        s.append([3], node_id="a")
    with pytest.raises(ValueError, match="temperature"):
        s.generate(2, temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        s.generate(2, top_p=0)
    with pytest.raises(ValueError, match="not a single token"):
        s.probe(["Yes", "No"])
    assert s.tokens == [1, 2] and s.cache.length == 2
