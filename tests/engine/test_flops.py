"""FLOP account against independent counts: torch's FlopCounterMode on HF's forward, published parameter counts,
and a closed form for Llama-3.1-8B written out with literal numbers."""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from conftest import tiny_hf_model
from nodekv.cli import main as cli_main
from nodekv.engine.config import preset
from nodekv.engine.flops import (FlopAccount, forward_flop_parts, forward_flops, parameter_count,
                                 per_example_convention, per_token_convention)
from nodekv.engine.loader import load_checkpoint

PUBLISHED_PARAMS = {  # from the models' safetensors metadata / model cards
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "smollm2-135m": 134_515_008,
}


@pytest.mark.parametrize("name", list(PUBLISHED_PARAMS))
def test_parameter_count_matches_published(name):
    assert parameter_count(preset(name)) == PUBLISHED_PARAMS[name]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tiny_forward_flops_match_torch_flop_counter(kind, save_hf):
    """torch counts every matmul HF's eager forward runs: the projections and all-position lm_head as mm, the
    attention scores and their product with V as bmm over the full T×T square."""
    hf = tiny_hf_model(kind)
    hf.set_attn_implementation("eager")
    config = load_checkpoint(save_hf(hf)).config
    T = 37
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        hf(torch.arange(T)[None] % config.vocab_size)
    per_op = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    assert set(per_op) <= {"aten.mm", "aten.addmm", "aten.bmm"}  # addmm: projections with a bias (Qwen2)
    matmuls, attention, lm_head = forward_flop_parts(config, T, 0, n_logits=T)  # HF computes every position
    assert matmuls + lm_head == per_op["aten.mm"] + per_op.get("aten.addmm", 0)
    assert attention * 2 * T == per_op["aten.bmm"] * (T + 1)  # causal sees T(T+1)/2 of the T² key positions


def test_llama_8b_closed_form():
    c = preset("llama-3.1-8b")
    qkv = 4096 * 4096 + 2 * 4096 * 1024
    rest = 4096 * 4096 + 3 * 4096 * 14336
    for T, past in [(1, 0), (79457, 0), (512, 1000)]:
        visible = [past + t + 1 for t in range(T)] if T < 10_000 else None
        all_rows = sum(visible) if visible else T * (T + 1) // 2
        last_row = past + T
        # 31 full layers; the last one projects Q/K/V for all T tokens but attends and runs its MLP for one row
        expected = (2 * T * 31 * (qkv + rest) + 2 * T * qkv + 2 * rest
                    + 32 * 4 * 128 * (31 * all_rows + last_row) + 2 * 4096 * 128256)
        assert forward_flops(c, T, past, n_logits=1) == expected


def test_paper_conventions():
    c = preset("llama-3.1-8b")
    n_nonembed = 8_030_261_248 - 2 * 128256 * 4096
    assert per_token_convention(c, 8192) == 2 * n_nonembed + 2 * 32 * 8192 * 4096
    assert per_example_convention(c, 1000) == 2 * 8_030_261_248 * 1000 + 2 * 32 * 4096 * 1000 ** 2


def test_account_scopes_nest():
    acc = FlopAccount()
    acc.add(5, 5)
    with acc.scope("index"):
        acc.add(7, 1, decode=True)
        with acc.scope("query"):
            acc.add(11, 3)
    assert (acc.total, acc.scopes["index"], acc.scopes["query"]) == (23, 18, 11)
    assert (acc.prefill_tokens, acc.decode_tokens) == (8, 1)


def test_cli_flops(capsys):
    assert cli_main(["flops", "--model", "llama-3.1-8b", "--tokens", "79457"]) == 0
    out = capsys.readouterr().out
    assert f"{forward_flops(preset('llama-3.1-8b'), 79457):,}" in out
    assert f"{per_example_convention(preset('llama-3.1-8b'), 79457):,}" in out
    assert cli_main(["flops", "--model", "no-such-model", "--tokens", "3"]) == 2


def test_account_projects_the_same_forwards_to_another_config():
    big = preset("llama-3.1-8b")
    acc = FlopAccount(project_to={"llama-3.1-8b": big})
    with acc.scope("query"):
        acc.add(1, 100, shape=(100, 0, 1, False))
        acc.add(1, 1, decode=True, shape=(1, 100, 1, False))
    want = forward_flops(big, 100, 0, 1) + forward_flops(big, 1, 100, 1)
    assert acc.projected["llama-3.1-8b"] == acc.projected_scopes["llama-3.1-8b"]["query"] == want
