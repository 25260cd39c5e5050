"""Integration: the registered Qwen2.5 GGUFs (0.5B, 1.5B) against HF transformers reading the same file in fp32.

The reference is `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` (transformers dequantises every tensor)
and `AutoTokenizer.from_pretrained(dir, gguf_file=...)`. HF's outputs are computed once per model and its model is
freed before nodekv's engine loads, so only one copy of the weights is in memory at a time.

Tokenizer: nodekv follows llama.cpp, which wrote the files. On every record of ../shared/data (782 records, 12.7M
characters, checked once when this was written; the tests use a sample) nodekv gives the same ids as transformers'
GGUF tokenizer and as Qwen's own tokenizer.json pipeline, and as test_tokenizer.py's transcription of llama.cpp's BPE
on the records under 20k characters. One deviation the GGUF tokenizers (llama.cpp, transformers, nodekv) share from
Qwen's tokenizer.json: it NFC-normalises text first, they do not, so text with decomposed characters ("e" + U+0301)
is tokenised differently. The shared data is all NFC.
"""
from __future__ import annotations

import gc
import json
import unicodedata
from pathlib import Path

import pytest
import torch

from conftest import SHARED_DATA

pytestmark = pytest.mark.model

MODELS = ["qwen2.5-0.5b", "qwen2.5-1.5b"]
DECODE_STEPS = 12  # prompt tokens fed one at a time after the rest is prefilled
NEW_TOKENS = 8     # greedy continuation compared with HF's generate (the 12 decode steps above are the finer check)


def _records(name: str, n: int) -> list[dict]:
    path = SHARED_DATA / name
    if not path.is_file():
        pytest.skip(f"{path} is absent")
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for _, line in zip(range(n), f)]


def _passages(pairs) -> str:
    """(title, text) pairs joined as LongBench does."""
    return "\n\n".join(f"Passage {i}:\n{title}\n{text}" for i, (title, text) in enumerate(pairs, 1))


def _hotpot(record: dict) -> str:
    return _passages((title, "".join(sentences)) for title, sentences in record["context"])


def _musique(record: dict) -> str:
    return _passages((p["title"], p["paragraph_text"]) for p in record["paragraphs"])


def _qmsum(record: dict) -> str:
    return "\n".join(f"{t['speaker']}: {t['content']}" for t in record["meeting_transcripts"])


def _texts() -> list[str]:
    """Several thousand characters from each shared data set: digits, newlines, non-ASCII, code-like tables."""
    cut = 12_000
    texts = [_hotpot(r)[:cut] for r in _records("multihop/hotpotqa.jsonl", 3)]
    texts += [_musique(r)[:cut] for r in _records("multihop/musique.jsonl", 3)]
    texts += [r["input"][:cut] for r in _records("leval/quality.jsonl", 2)]
    texts += [r["input"][:cut] for r in _records("leval/natural_question.jsonl", 2)]
    texts += [r["input"][:cut] for r in _records("leval/scientific_qa.jsonl", 2)]
    texts += [r["context"][:cut] for r in _records("longbench_v1/multi_news.jsonl", 2)]
    texts += [r["passage"] for r in _records("narrativeqa/narrativeqa.jsonl", 5)]
    texts += [_qmsum(r)[:cut] for r in _records("qmsum/qmsum.jsonl", 2)]
    texts += [r["input"][:cut] for r in _records("leval/meeting_summ.jsonl", 1)]
    return texts


TRICKY = [
    "3.14159 and 1,000,000 (2024-01-31) 12345678", "Ça va? naïve café – “quotes” — ß Ωmega ﬁ 🎉👨‍👩‍👧",
    "日本語のテキスト 中文 한국어 العربية", "a  b   1    2\n\n\n  indented\ttab\t\tx\r\ny", "I'M CAN'T they've",
    "def f(x):\n    return x**2  # comment\n", "a\u00a0b\u2003c\u200bd",
    # not NFC: the GGUF tokenizers (llama.cpp, transformers, nodekv) keep the decomposed form; Qwen's tokenizer.json
    # would NFC-normalise it first
    "cafe\u0301 A\u030a n\u0303",
]


@pytest.fixture(scope="module", params=MODELS)
def gguf(request) -> Path:
    """The model's GGUF from the registry; skipped when its packages are not installed."""
    from nodekv.engine.errors import ModelLoadError
    from nodekv.engine.models import resolve_model

    try:
        return resolve_model(request.param)
    except ModelLoadError as err:
        pytest.skip(str(err))


def _prompt() -> list[dict]:
    record = _records("multihop/hotpotqa.jsonl", 1)[0]
    context = _passages((t, "".join(s)) for t, s in record["context"][:2])
    return [{"role": "system", "content": "Answer the question from the passages."},
            {"role": "user", "content": f"{context}\n\nQuestion: {record['question']}"}]


@pytest.fixture(scope="module")
def hf(gguf):
    """HF's tokenizer and its reference outputs on one chat-templated HotpotQA prompt: the logits at every position
    and the greedy continuation. The HF model is freed on return."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from nodekv.bench.engine_runners import hf_from_gguf

    # tokenizer_type="qwen2" picks the class AutoTokenizer would (checked: same backend, template, special tokens)
    # without first parsing the model config out of the file with gguf's slow reader (~15-45 s)
    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, tokenizer_type="qwen2")
    model = hf_from_gguf(gguf)
    ids = list(tok.apply_chat_template(_prompt(), add_generation_prompt=True, tokenize=True, return_dict=True)
               ["input_ids"])
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
        greedy = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(ids):].tolist()
    del model
    gc.collect()
    return dict(tok=tok, ids=ids, logits=logits, greedy=greedy)


@pytest.fixture(scope="module")
def engine(gguf, hf):  # after `hf`, whose model is gone by then
    import nodekv

    return nodekv.load_engine(gguf, kv_tokens=4096)


def _close(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| relative to max |ref|: must be <= 1e-4."""
    return ((got - ref).abs().max() / ref.abs().max()).item()


def test_prefill_logits_match_hf(engine, hf):
    ids, ref = hf["ids"], hf["logits"]
    assert len(ids) > 300
    error = _close(engine.forward_logits(ids), ref)
    print(f"prefill of {len(ids)} tokens: max error / max|logit| = {error}")
    assert error <= 1e-4


def test_decode_logits_and_greedy_match_hf(engine, hf):
    """Prefill all but the last DECODE_STEPS prompt tokens into a session (its logits at the last position), feed
    those one at a time (1-token forwards: the decode path), compare each step's logits with HF's at that position,
    then greedy-decode NEW_TOKENS more."""
    ids, ref = hf["ids"], hf["logits"]
    n = len(ids) - DECODE_STEPS
    with engine.session() as s:
        s.append(ids[:n])
        errors = [_close(s._last_logits(), ref[n - 1])]  # the session's logits after its last node (private)
        for i in range(n, len(ids)):
            s.append([ids[i]])
            errors.append(_close(s._last_logits(), ref[i]))
        print(f"session prefill: {errors[0]}; decode: max error / max|logit| = {max(errors[1:])}")
        assert max(errors) <= 1e-4, errors
        gen = s.generate(NEW_TOKENS)
        ours = s.tokens[len(ids):]
    assert ours == hf["greedy"][:len(ours)]
    if gen.finish_reason == "eos":
        assert hf["greedy"][len(ours)] in engine.tokenizer.eos_ids
    else:
        assert len(ours) == NEW_TOKENS


def test_tokenizer_matches_hf_on_shared_data(engine, hf):
    tok, ref = engine.tokenizer, hf["tok"]
    texts = _texts() + TRICKY
    assert sum(len(t) for t in texts) > 100_000 and any(ord(c) > 127 for t in texts[:-len(TRICKY)] for c in t)
    assert not unicodedata.is_normalized("NFC", TRICKY[-1])
    for text in texts:
        ids = tok.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text[:80]
        assert tok.decode(ids) == text


def test_tokenizer_matches_qwen2_tokenizer_json_but_for_nfc(engine, gguf):
    """transformers' Qwen2Tokenizer on the file's vocabulary and merges is Qwen's own tokenizer.json pipeline: NFC,
    then the same split regex and byte-level BPE. It agrees with nodekv on NFC text; on other text nodekv (like
    llama.cpp and transformers' GGUF loader) tokenises the characters as written, Qwen's tokenizer their NFC form."""
    from transformers import Qwen2Tokenizer

    from nodekv.engine.gguf_file import read_gguf

    meta = read_gguf(gguf).metadata
    qwen = Qwen2Tokenizer(vocab={t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])},
                          merges=[tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]).backend_tokenizer
    tok = engine.tokenizer
    for text in _texts() + TRICKY[:-1]:
        assert tok.encode(text) == qwen.encode(text, add_special_tokens=False).ids, text[:80]
    text = TRICKY[-1]
    assert tok.encode(text) != qwen.encode(text, add_special_tokens=False).ids
    assert tok.encode(unicodedata.normalize("NFC", text)) == qwen.encode(text, add_special_tokens=False).ids


CHATS = [
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Which river flows through Zürich?\nAnswer in 3 words."}],
    [{"role": "user", "content": "What is 12 × 7?"}],  # no system message: Qwen's template adds its default one
    [{"role": "system", "content": "Answer from the passages."}, {"role": "user", "content": "Passage 1:\nÉcole\n…"},
     {"role": "assistant", "content": "It is a school."}, {"role": "user", "content": "And in 1999?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me   a joke  now"}, {"role": "assistant", "content": "No.\n\nSorry."}],
]


@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("k", range(len(CHATS)))
def test_chat_template_matches_hf(engine, hf, k, gen):
    messages = CHATS[k]
    want = hf["tok"].apply_chat_template(messages, add_generation_prompt=gen, tokenize=True, return_dict=True)
    ids = engine.tokenizer.chat(messages, add_generation_prompt=gen)
    assert ids == list(want["input_ids"])
    if k == 1:
        assert engine.tokenizer.decode(ids).startswith("<|im_start|>system\nYou are Qwen")
