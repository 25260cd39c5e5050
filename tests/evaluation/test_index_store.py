"""IndexStore: an index is built once, its cost (FLOPs, seconds, tokens the model ran) comes back with it when
loaded, a store written before tokens were counted still loads, a kv_reuse index is made from a saved kv-free
one by storing its nodes' KV, and processes sharing a store build an index once: the others wait for it, and a
dead builder's claim is taken over."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from nodekv.engine.flops import FlopAccount
from nodekv.evaluation import index_store
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


class _Slow(_Saving):
    """_Saving whose build takes a while, long enough for a second builder to arrive during it."""

    def index(self, document: str) -> str:
        time.sleep(0.3)
        return super().index(document)


@pytest.fixture
def fast_polls(monkeypatch):
    monkeypatch.setattr(index_store, "WAIT_POLL_S", 0.01)


def _claim(root: Path, doc: str, host: str, pid: int, age_s: float = 0.0) -> Path:
    """A claim file as another builder leaves it, last touched `age_s` ago."""
    path = root / f"m-{doc}.building"
    path.write_text(json.dumps({"host": host, "pid": pid}))
    os.utime(path, (time.time() - age_s,) * 2)
    return path


def test_two_builders_at_once_build_one_index(tmp_path, fast_polls):
    """Two builders that find the index missing at the same moment: one builds, the other waits and loads it (each
    thread here stands for a process: the claim is a file, whoever creates it first builds)."""
    account = FlopAccount()
    method = _Slow(account)
    start, got = threading.Barrier(2), []

    def build():
        start.wait()
        got.append(IndexStore(tmp_path, "m", SimpleNamespace(flops=account)).build_or_load(method, "doc"))

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert method.built == 1 and [g.index for g in got] == ["DOC", "DOC"] and got[0].flops == got[1].flops == 900
    assert not list(tmp_path.glob("*.building"))


def test_a_live_builder_elsewhere_is_waited_for(tmp_path, fast_polls, capsys):
    """A fresh claim from another host: nothing is built here; the index its holder stores is what comes back."""
    doc = document_hash("doc")
    claim = _claim(tmp_path, doc, "other-host", 4242)

    def finish():  # the other host's build ends
        time.sleep(0.2)
        (tmp_path / f"m-{doc}.idx").write_text("THEIRS")
        (tmp_path / f"m-{doc}.json").write_text(json.dumps([900, 1800, 1.5, 9]))
        claim.unlink()

    store = IndexStore(tmp_path, "m", SimpleNamespace(flops=FlopAccount()))
    assert store.builder(doc) == "pid 4242 on other-host"
    threading.Thread(target=finish).start()
    method = _Saving(FlopAccount())
    got = store.build_or_load(method, "doc")
    assert (got.index, got.flops, method.built) == ("THEIRS", 900, 0)
    assert "waiting for pid 4242 on other-host" in capsys.readouterr().err


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


@pytest.mark.parametrize("host, pid, age_s", [(socket.gethostname(), None, 0.0),  # this host, its process gone
                                              ("other-host", 4242, index_store.CLAIM_STALE_S + 60)])  # silent
def test_a_dead_builders_claim_is_taken_over(tmp_path, host, pid, age_s):
    doc = document_hash("doc")
    _claim(tmp_path, doc, host, pid or _dead_pid(), age_s)
    store = IndexStore(tmp_path, "m", SimpleNamespace(flops=FlopAccount()))
    assert store.builder(doc) is None
    method = _Saving(FlopAccount())
    assert store.build_or_load(method, "doc").index == "DOC" and method.built == 1
    assert not list(tmp_path.glob("*.building"))


def test_a_failed_build_gives_its_claim_back(tmp_path):
    class _Failing(_Saving):
        def index(self, document):
            raise RuntimeError("out of memory")

    store = IndexStore(tmp_path, "m", SimpleNamespace(flops=FlopAccount()))
    with pytest.raises(RuntimeError):
        store.build_or_load(_Failing(FlopAccount()), "doc")
    assert store.builder(document_hash("doc")) is None and not list(tmp_path.glob("*.building"))
    assert store.build_or_load(_Saving(FlopAccount()), "doc").index == "DOC"


def test_a_failed_load_leaves_no_claim(tmp_path):
    """An index that cannot be loaded raises, and leaves nothing that would make a later call wait on itself."""
    doc = document_hash("doc")
    (tmp_path / f"m-{doc}.idx").write_text("DOC")
    (tmp_path / f"m-{doc}.json").write_text(json.dumps([900, 0, 1.0, 9]))

    class _Unreadable(_Saving):
        def load_index(self, path):
            raise OSError("disk gone")

    store = IndexStore(tmp_path, "m", SimpleNamespace(flops=FlopAccount()))
    for _ in range(2):
        with pytest.raises(OSError):
            store.build_or_load(_Unreadable(FlopAccount()), "doc")
    assert not list(tmp_path.glob("*.building"))


def test_a_stored_index_loads_without_a_claim(tmp_path, monkeypatch):
    """The common path, an index already stored, creates no claim file (and starts no heartbeat thread)."""
    store = IndexStore(tmp_path, "m", SimpleNamespace(flops=FlopAccount()))
    store.build_or_load(_Saving(FlopAccount()), "doc")

    def no_claims(path):
        raise AssertionError(f"claimed {path} for an index already stored")

    monkeypatch.setattr(index_store._Claim, "take", staticmethod(no_claims))
    assert store.build_or_load(_Saving(FlopAccount()), "doc").index == "DOC"
