"""IndexStore: an index is built once, its cost (FLOPs, seconds, tokens the model ran) comes back with it when
loaded, a store written before tokens were counted still loads, and a kv_reuse index is made from a saved kv-free
one by storing its nodes' KV."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from nodekv.engine.flops import FlopAccount
from nodekv.evaluation.index_store import IndexStore, document_hash
from char_engine import char_engine


class _Saving:
    """A method whose index is the document upper-cased; building it 'runs' 7 prefill and 2 decode tokens."""

    can_save = True
    config = SimpleNamespace()  # no kv_reuse option

    def __init__(self, account: FlopAccount):
        self.account, self.built = account, 0

    def index(self, document: str) -> str:
        self.built += 1
        self.account.add(700, 7)
        self.account.add(200, 2, decode=True)
        return document.upper()

    def save_index(self, index: str, path: Path) -> None:
        Path(path).write_text(index)

    def load_index(self, path: Path) -> str:
        return Path(path).read_text()


def test_built_once_and_cost_kept(tmp_path):
    account = FlopAccount()
    method = _Saving(account)
    store = IndexStore(tmp_path, "m", SimpleNamespace(flops=account))
    account.add(5000, 50)  # the model's earlier work is not the index's
    first = store.build_or_load(method, "doc")
    again = store.build_or_load(method, "doc")
    assert method.built == 1
    assert (first.index, first.flops, first.tokens) == ("DOC", 900, 9)
    assert (again.index, again.flops, again.flops_8b, again.tokens) == ("DOC", 900, 0, 9)
    assert account.scopes["index"] == 900


def test_store_without_token_counts_loads(tmp_path):
    doc = document_hash("doc")
    (tmp_path / f"m-{doc}.idx").write_text("OLD")
    (tmp_path / f"m-{doc}.json").write_text(json.dumps([900, 1800, 1.5]))  # written before tokens were counted
    account = FlopAccount()
    method = _Saving(account)
    got = IndexStore(tmp_path, "m", SimpleNamespace(flops=account)).build_or_load(method, "doc")
    assert (got.index, got.flops, got.flops_8b, got.seconds, got.tokens, method.built) == ("OLD", 900, 1800, 1.5,
                                                                                        None, 0)


def test_index_saved_without_its_cost_is_built_again(tmp_path):
    """A process killed between saving an index and writing its cost leaves a document the next run builds again."""
    doc = document_hash("doc")
    (tmp_path / f"m-{doc}.idx").write_text("HALF WRITT")
    account = FlopAccount()
    method = _Saving(account)
    store = IndexStore(tmp_path, "m", SimpleNamespace(flops=account))
    assert store.cost(doc) is None
    assert store.build_or_load(method, "doc").index == "DOC" and method.built == 1
    assert (tmp_path / f"m-{doc}.idx").read_text() == "DOC"
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"m-{doc}.idx", f"m-{doc}.json"]  # no temporary left
    assert store.cost(doc)[0] == 900


def test_kv_index_from_a_saved_kv_free_one_is_the_built_one_at_the_sum_of_the_costs(hf_tiny, tmp_path):
    """With kv_reuse on, a document whose kv_reuse=off index the store holds is not indexed again: its chunks' KV
    is stored (one prefill of each chunk's passage ids, by the forward FLOP formula), the index equals one built
    from the document with kv_reuse on, and its cost is the kv-free index's plus that prefill."""
    import torch

    from nodekv.engine.flops import forward_flops
    from nodekv.methods.baselines import BM25TopK
    from nodekv.methods.prompts import PromptSpec

    _, path = hf_tiny
    eng = char_engine(path)
    doc = "the mill was built in 1821. it burned down in 1900. a school stands there now."
    spec, opts = PromptSpec("{context}|{question}", 4), dict(k=2, chunk_tokens=12, kv_dtype="float32")
    off = BM25TopK(eng, spec, **opts)
    kv_free = IndexStore.for_method(tmp_path, eng, off).build_or_load(off, doc)

    blend = BM25TopK(eng, spec, kv_reuse="blend", kv_context="none", **opts)  # each chunk's prefill alone, counted below
    want = blend.index(doc)
    blend.index = None  # the document is not indexed again
    got = IndexStore.for_method(tmp_path, eng, blend).build_or_load(blend, doc)
    assert got.index.chunks == want.chunks and len(got.index.stored) == len(want.stored)
    for g, w in zip(got.index.stored, want.stored):
        assert g.tokens == w.tokens and torch.equal(g.k, w.k) and torch.equal(g.v, w.v)
    prefill = sum(forward_flops(eng.config, len(blend.reader.passage_ids(c)), n_logits=0) for c in want.chunks)
    assert got.flops == kv_free.flops + prefill
    assert got.tokens == kv_free.tokens + sum(len(blend.reader.passage_ids(c)) for c in want.chunks)
    again = IndexStore.for_method(tmp_path, eng, blend).build_or_load(blend, doc)  # now saved under its own key
    assert (again.flops, again.tokens) == (got.flops, got.tokens)
