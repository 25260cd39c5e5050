"""Integration: the embedded SmolLM2-135M-Instruct GGUF against HF transformers reading the same file."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import SHARED_DATA
from numerics import hf_attention

pytestmark = pytest.mark.model

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three uses of copper."}],
    [{"role": "user", "content": "Explain why the sky is blue in two sentences."}],
]
RAW_PROMPT = "Once upon a time, in a small village by the mountains, there lived"


@pytest.fixture(scope="module")
def engine():
    import nodekv

    return nodekv.load_engine("smollm2-135m")


@pytest.fixture(scope="module")
def hf_model(engine):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from nodekv.bench.engine_runners import hf_from_gguf

    return hf_from_gguf(engine.path)


def test_logits_match_hf(engine, hf_model):
    ids = engine.tokenizer.chat(PROMPTS[2]) + engine.tokenizer.encode(" Copper is used in wiring, plumbing and")
    got = engine.forward_logits(ids)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()


@pytest.mark.parametrize("prompt", range(len(PROMPTS) + 1))
def test_greedy_continuation_matches_hf(engine, hf_model, prompt):
    tok = engine.tokenizer
    ids = tok.chat(PROMPTS[prompt]) if prompt < len(PROMPTS) else tok.encode(RAW_PROMPT)
    s = engine.session()
    s.append(ids)
    gen = s.generate(32)
    ours = s.tokens[len(ids):]
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(ids):].tolist()
    assert ours == ref[: len(ours)]
    if gen.finish_reason == "eos":
        assert ref[len(ours)] in tok.eos_ids
    else:
        assert len(ours) == 32


def test_bf16_top1_agreement_with_fp32(engine):
    """HF's own bf16-vs-fp32 top-1 agreement on these tokens is 97.5% on AMX machines and 97.95%
    on this AVX2 machine (measured by bench/engine_speed.py's former `--agreement`, commit 062f4df; too slow for
    the suite: HF's bf16 GEMMs run at ~16 GFLOP/s here). nodekv must do at least as well as the better of the two."""
    import nodekv

    path = SHARED_DATA / "leval" / "quality.jsonl"
    if not path.exists():
        pytest.skip(f"{path} is absent")
    story = json.loads(path.open().readline())["input"]
    ids = engine.tokenizer.encode(story)[:2000]
    fp32 = engine.forward_logits(ids).argmax(-1)
    bf16 = nodekv.load_engine("smollm2-135m", dtype="bfloat16").forward_logits(ids).argmax(-1)
    agreement = (fp32 == bf16).float().mean().item()
    assert agreement >= 0.9795, agreement


def test_cli_ask(tmp_path, capsys):
    from nodekv.cli import main

    doc = tmp_path / "doc.txt"
    doc.write_text("The lighthouse keeper of Port Ellen was named Agnes Morrow. She kept the light for forty years.")
    assert main(["ask", str(doc), "Who kept the lighthouse?", "--max-new-tokens", "12", "--model", "smollm2-135m"]) == 0
    out = capsys.readouterr().out
    assert "A: " in out and "FLOPs" in out and "tok/s" in out
    (tmp_path / "blank.txt").write_text("  \n")
    assert main(["ask", str(tmp_path / "blank.txt"), "Who?"]) == 2
    assert main(["ask", str(tmp_path / "missing.txt"), "Who?"]) == 2


def test_node_mass_matches_hf_eager_attentions(engine, hf_model):
    """A 1,000-token prompt of 8 nodes appended one by one with collection: every token's mass per node equals the
    same aggregate of HF's eager softmax matrices (output_attentions=True), averaged over heads and layers."""
    path = SHARED_DATA / "leval" / "quality.jsonl"
    if not path.exists():
        pytest.skip(f"{path} is absent")
    ids = engine.tokenizer.encode(json.loads(path.open().readline())["input"])[:1000]
    bounds = [0, 90, 230, 231, 400, 555, 700, 870, 1000]
    s = engine.session()
    for j in range(8):
        s.append(ids[bounds[j]:bounds[j + 1]], node_id=j, collect=True)
    s.generate(6, node_id="gen", collect=True)
    full = s.tokens
    mean = hf_attention(hf_model, full)
    bounds.append(len(full))
    for j, node in enumerate([*range(8), "gen"]):
        want = torch.stack([mean[bounds[j]:bounds[j + 1], a:b].sum(1) for a, b in zip(bounds, bounds[1:j + 2])], 1)
        torch.testing.assert_close(s.token_mass(node).double(), want, atol=1e-4, rtol=0)
    s.release()
