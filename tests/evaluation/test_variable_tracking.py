"""Variable tracking (RULER): the generated chains against an independent resolver of the assignments in the text,
their order, the length, determinism, the dataset name rule and the set metric."""
from __future__ import annotations

import re

import pytest

from nodekv.evaluation.datasets import load_dataset
from nodekv.evaluation.metrics import score
from nodekv.methods.prompts import prompt_for
from nodekv.evaluation.variable_tracking import PADDING, record, shape


def resolve(document: str, value: str) -> set[str]:
    """Every variable that ends up holding `value`, by following the assignments as a program would."""
    held = {}
    for name, rhs in re.findall(r"VAR ([A-Z]+) = (VAR [A-Z]+|\d+)\.", document):
        held[name] = held[rhs[4:]] if rhs.startswith("VAR ") else rhs
    return {n for n, v in held.items() if v == value}


@pytest.mark.parametrize("name", ["variable_tracking_2hop_2k", "variable_tracking_4hop_8k",
                                  "variable_tracking_2hop_2k_3chain"])
def test_the_references_are_exactly_the_variables_that_hold_the_value(name):
    hops, tokens, chains = shape(name)
    for r in load_dataset(name, limit=5).records:
        value = re.search(r"value (\d+)\.", r.question)[1]
        assert set(r.references) == resolve(r.document, value) and len(r.references) == hops + 1
        assert r.document.count("VAR ") == chains * (2 * hops + 1)  # every chain, nothing else
        assert r.document.count(PADDING) == tokens // 24 and r.task == "variables"


def test_records_are_deterministic_per_name_and_index_and_differ_across_them():
    a = record("variable_tracking_2hop_2k", 3)
    assert a == record("variable_tracking_2hop_2k", 3)
    assert a.references != record("variable_tracking_2hop_2k", 4).references
    assert a.references != record("variable_tracking_2hop_8k", 3).references
    assert len(load_dataset("variable_tracking_2hop_2k").records) == 50
    assert "Memorize and track" in prompt_for("variable_tracking_2hop_2k").template


@pytest.mark.parametrize("bad", ["variable_tracking_0hop_2k", "variable_tracking_2hop", "variable_tracking_x"])
def test_a_malformed_name_is_refused(bad):
    with pytest.raises(ValueError):
        (shape if "0hop" in bad else load_dataset)(bad)


def test_the_metric_compares_sets_of_names():
    r = record("variable_tracking_2hop_2k", 0)
    a, b, c = r.references
    assert score(r, f"{c}, {a} and {b}") == {"em": 1.0, "f1": 1.0, "recall": 1.0}
    got = score(r, f"VAR {a} and ZZZZZ")  # "VAR" is not a name: three letters
    assert got == {"em": 0.0, "f1": pytest.approx(2 * 1 / (2 + 3)), "recall": pytest.approx(1 / 3)}
