"""The prompt every single-prompt method sends: LongBench's middle truncation to the model's window or a smaller one,
checked against slicing by hand."""
from __future__ import annotations

from types import SimpleNamespace

from nodekv.methods.base import prompt_ids
from nodekv.methods.baselines import FullContext
from nodekv.methods.prompts import PromptSpec


class ListTokenizer:
    """chat() gives one id per character of the rendered user turn."""

    def chat(self, messages):
        return [ord(c) for c in messages[0]["content"]]


def _engine(max_seq_len):
    return SimpleNamespace(tokenizer=ListTokenizer(), config=SimpleNamespace(max_seq_len=max_seq_len))


def test_the_middle_is_cut_to_the_model_window_or_a_smaller_one():
    spec, text = PromptSpec("{context}|{question}", max_new_tokens=10), "abcdefghij" * 10  # 100 characters
    whole = [ord(c) for c in text + "|q"]
    assert prompt_ids(_engine(1000), spec, text, "q") == (whole, False)
    assert prompt_ids(_engine(1000), spec, text, "q", window=112) == (whole, False)  # 102 + 10 fit exactly
    ids, cut = prompt_ids(_engine(1000), spec, text, "q", window=50)  # room 40: the first 20 and the last 20
    assert cut and ids == whole[:20] + whole[-20:]
    assert prompt_ids(_engine(50), spec, text, "q", window=4096) == (ids, True)  # the model's window is smaller
    assert FullContext(_engine(1000), window=50).config.window == 50


def test_answers_decode_with_the_prompts_repetition_penalty(hf_tiny):
    """generate_answer decodes as HF's greedy generate with the spec's repetition penalty; summaries carry one."""
    import torch

    from conftest import tiny_engine
    from nodekv.methods.base import generate_answer
    from nodekv.methods.prompts import prompt_for

    hf, path = hf_tiny
    eng, prompt = tiny_engine(path), [5, 17, 3, 99, 42, 8, 8, 61]
    texts = {}
    for penalty in (1.0, 1.3):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, repetition_penalty=penalty,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        answer = generate_answer(eng, prompt, PromptSpec("{context}", 10, repetition_penalty=penalty), [], False)
        texts[penalty] = answer.text
        assert answer.text == eng.tokenizer.decode(want[:answer.generated_tokens]).strip()
    assert texts[1.0] != texts[1.3]
    assert prompt_for("qmsum_general").repetition_penalty == 1.1 and prompt_for("hotpotqa").repetition_penalty == 1.0


def test_a_shared_prompt_prefix_is_prefilled_once_and_the_answers_stay_hfs(hf_tiny):
    """generate_answer with `shared`: every answer is HF's greedy one; the first prompt pays the prefix and the rest
    in two forwards, the second only the rest (by the FLOP formula), and the prefix's prefill is counted as saved."""
    import torch

    from conftest import tiny_engine
    from nodekv.engine.flops import forward_flops
    from nodekv.methods.base import generate_answer

    hf, path = hf_tiny
    eng, spec = tiny_engine(path), PromptSpec("{context}", 6)
    prefix, questions = [5, 17, 3, 99, 42, 8, 8, 61, 7, 23], ([11, 12, 13], [31, 32])
    for q in questions:
        prompt = prefix + q
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(prompt):].tolist()
        whole = generate_answer(eng, prompt, spec, [], False)
        saved = eng.flops.saved
        shared = generate_answer(eng, prompt, spec, [], False, shared=len(prefix))
        decode = whole.flops - forward_flops(eng.config, len(prompt))
        rest = forward_flops(eng.config, len(q), len(prefix)) + decode
        first = q is questions[0]
        assert shared.flops == rest + (forward_flops(eng.config, len(prefix)) if first else 0)
        assert eng.flops.saved - saved == (0 if first else forward_flops(eng.config, len(prefix)))
        assert whole.text == shared.text == eng.tokenizer.decode(want[:whole.generated_tokens]).strip()


def test_full_context_shares_the_prompt_up_to_the_question(monkeypatch):
    from nodekv.methods import baselines

    calls = []
    monkeypatch.setattr(baselines, "generate_answer", lambda *a, **k: calls.append(k["shared"]))
    spec, text = PromptSpec("{context}|{question}", max_new_tokens=10), "abcdefghij" * 10
    full = FullContext(_engine(1000), spec)
    full.answer(text, "why?")
    full.answer(text, "what?")
    assert calls == [101, 101]  # the document and "|"
    FullContext(_engine(1000), spec, window=50).answer(text, "why?")  # cut to 20 + 20: the head is shared
    FullContext(_engine(1000), spec, shared_prefix=False).answer(text, "why?")
    assert calls[2:] == [20, 0]
