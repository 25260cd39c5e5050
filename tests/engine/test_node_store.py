"""Stored nodes (engine/node_store.py): a node prefilled once and placed at position p has the keys and values HF
transformers computes for the same tokens at positions p.. with nothing before them (position_ids), to 1e-5; placed
first, it and a question give a prefill's logits; placing charges no FLOPs, refuses a node of another model's shape
and leaves the session unchanged on error; a session ending in a stored node has no logits to generate from."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from conftest import tiny_engine, tiny_hf_model, write_tiny_gguf
from nodekv.bench.engine_runners import hf_cache_name
from nodekv.engine.errors import PoolExhaustedError
from nodekv.engine.node_store import StoredNode


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(HF model, nodekv engine) on the same fp32 weights: qwen2 (qkv bias, GQA 4:2)."""
    hf = tiny_hf_model("qwen2", seed=5)
    path = tmp_path_factory.mktemp("store") / "tiny-qwen2-f32.gguf"
    write_tiny_gguf(hf, path, "f32", arch="qwen2")
    return hf.eval(), tiny_engine(path, pages=64, page_size=8)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 101, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def cached_kv(session, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The session's K and V at positions [start, end): [layers, n, kv_heads, hd] each."""
    cache = session.cache
    pages = torch.tensor(cache.pages)
    k, v = (t[:, pages].permute(0, 1, 3, 2, 4).flatten(1, 2)[:, start:end] for t in (cache.pool.k, cache.pool.v))
    return k, v


def hf_kv(hf, tokens: list[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's K and V of `tokens` at positions start.. with no context: [layers, n, kv_heads, hd] each."""
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), position_ids=torch.arange(start, start + len(tokens))[None], use_cache=True)
    layers = out[hf_cache_name(hf)].layers
    return (torch.stack([getattr(layer, name)[0].transpose(0, 1) for layer in layers]) for name in ("keys", "values"))


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


@pytest.mark.parametrize("at", [0, 37, 150])
def test_a_placed_node_has_hf_keys_and_values_at_its_position(pair, at):
    hf, engine = pair
    node = engine.store_node(ids(21, 1))
    with engine.session() as s:
        if at:
            s.append(ids(at, 2))
        span = s.append_stored(node, node_id="doc")
        assert (span.start, span.end) == (at, at + 21) and len(s) == at + 21
        k, v = cached_kv(s, at, at + 21)
    want_k, want_v = hf_kv(hf, list(node.tokens), at)
    assert rel(k, want_k) <= 1e-5 and rel(v, want_v) <= 1e-5
    with engine.session() as s:  # placing leaves the node as it was: placed again, it gives the same keys
        if at:
            s.append(ids(at, 2))
        s.append_stored(node)
        assert torch.equal(cached_kv(s, at, at + 21)[0], k)


@pytest.mark.parametrize("at", [0, 19])
def test_nodes_stored_together_and_placed_in_order_have_the_hf_keys_and_values_of_their_sequence(pair, at):
    """store_nodes prefills the nodes as one sequence: placed in the same order at any offset, the three nodes hold
    HF's K and V of the whole sequence there (each node seeing the nodes before it), where a node stored alone
    does not."""
    hf, engine = pair
    parts = [ids(13, 21), ids(9, 22), ids(17, 23)]
    nodes = engine.store_nodes(parts)
    assert [list(n.tokens) for n in nodes] == parts
    with engine.session() as s:
        if at:
            s.append(ids(at, 24))
        for node in nodes:
            s.append_stored(node)
        k, v = cached_kv(s, at, at + 39)
    want_k, want_v = hf_kv(hf, [t for p in parts for t in p], at)
    assert rel(k, want_k) <= 1e-5 and rel(v, want_v) <= 1e-5
    alone = engine.store_node(parts[1])
    assert rel(alone.v, nodes[1].v) > 1e-2  # context changed the values: the test above can fail


def test_nodes_stored_together_are_cut_into_windows_at_node_boundaries(pair):
    _, engine = pair
    parts = [ids(13, 31), ids(9, 32), ids(17, 33)]
    nodes = engine.store_nodes(parts, window=25)  # 13 + 9 fit; the third starts a window of its own
    together, alone = engine.store_nodes(parts[:2]), engine.store_node(parts[2])
    for got, want in zip(nodes, [*together, alone]):
        assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)
    with pytest.raises(ValueError, match="a node of 17 tokens does not fit a window of 16"):
        engine.store_nodes(parts, window=16)


def test_a_node_placed_first_then_a_question_gives_the_prefill_logits(pair):
    _, engine = pair
    doc, question = ids(30, 3), ids(6, 4)
    node = engine.store_node(doc)
    with engine.session() as s:
        s.append_stored(node)
        with pytest.raises(ValueError, match="ends with stored node 'n0', which has no logits"):
            s.probe(("<1>", "<2>"))
        s.append(question)
        placed = s.probe(("<1>", "<2>"))
        scored = s.score(ids(3, 5))
    with engine.session() as s:
        s.append(doc + question)
        assert placed == pytest.approx(s.probe(("<1>", "<2>")), rel=1e-5)
        assert torch.allclose(scored, s.score(ids(3, 5)), atol=1e-5)


def test_placing_charges_no_flops_and_storing_charges_a_prefill(pair):
    _, engine = pair
    before = engine.flops.total
    node = engine.store_node(ids(12, 6))
    stored = engine.flops.total - before
    assert stored > 0
    with engine.session() as s:
        s.append(ids(5, 7))
        before = engine.flops.total
        s.append_stored(node)
        assert engine.flops.total == before


def test_a_node_of_another_shape_or_a_full_pool_leaves_the_session_unchanged(pair):
    _, engine = pair
    node = engine.store_node(ids(9, 8))
    assert node.model == engine.model_id
    wrong = StoredNode(node.tokens, node.k[:1], node.v[:1])  # one layer: stored by another model
    big = StoredNode(tuple(ids(200, 11)), torch.zeros(2, 200, 2, 16), torch.zeros(2, 200, 2, 16))
    hogs = [engine.session() for _ in range(2)]
    for h in hogs:
        h.append(ids(200, 10))  # 50 of the pool's 64 pages of 8
    with engine.session() as s:
        s.append(ids(10, 9))
        state, free = s.cache.state(), engine.pool.n_free
        with pytest.raises(ValueError, match="does not fit this model"):
            s.append_stored(wrong)
        vocab = engine.config.vocab_size
        with pytest.raises(ValueError, match=f"token id {vocab} is not in the vocabulary"):
            s.append_stored(StoredNode((1, vocab), node.k[:, :2], node.v[:, :2]))
        with pytest.raises(ValueError, match="at least one token"):
            s.append_stored(StoredNode((), node.k[:, :0], node.v[:, :0]))
        other = {**engine.model_id, "name": "another-model-of-these-shapes.gguf"}  # a fine-tune, say
        with pytest.raises(ValueError, match="stored by model another-model-of-these-shapes.gguf"):
            s.append_stored(StoredNode(node.tokens, node.k, node.v, other))
        with pytest.raises(ValueError, match="non-empty"):
            engine.store_nodes([[], [1]])
        with pytest.raises(PoolExhaustedError):
            s.append_stored(big)
        assert s.cache.state() == state and engine.pool.n_free == free and len(s.nodes) == 1
    for h in hogs:
        h.release()


MODEL = {"name": "tiny-qwen2-f32.gguf", "config": "abc"}


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
def test_a_store_file_round_trip_keeps_the_kv_within_its_dtype(pair, tmp_path, dtype):
    from nodekv.engine.node_store import NodeStore, write_node_store

    _, engine = pair
    nodes = {"a": engine.store_node(ids(13, 11)), "b": engine.store_node(ids(40, 12))}
    write_node_store(tmp_path / "kv", nodes, MODEL, dtype)
    store = NodeStore(tmp_path / "kv", MODEL)
    assert store.ids == ["a", "b"] and "a" in store and "c" not in store
    for name, node in nodes.items():
        got = store.get(name)
        assert got.tokens == node.tokens
        for t, ref in ((got.k, node.k), (got.v, node.v)):
            if dtype == "float32":
                assert torch.equal(t, ref)
            elif dtype == "float16":
                assert torch.equal(t, ref.half().float())
            else:  # within half a step of each vector's scale max|x| / 127
                bound = ref.abs().amax(-1, keepdim=True) / 254 * (1 + 1e-5)
                assert ((t - ref).abs() <= bound).all()
    per_token = {"float32": 4, "float16": 2, "int8": 1}[dtype]
    c = engine.config
    assert store.bytes_per_1k_tokens() >= 1000 * 2 * c.n_layers * c.n_kv_heads * c.head_dim * per_token
    for name, node in nodes.items():  # K and V, plus int8's fp32 scale per vector
        vectors = 2 * c.n_layers * len(node) * c.n_kv_heads
        assert store.nbytes(name) == vectors * (c.head_dim * per_token + (4 if dtype == "int8" else 0))


def mapped_resident_kib(path) -> int:
    """The resident KiB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line: range perms offset dev inode [path]
                inside = line.rstrip("\n").endswith(str(path))
            elif inside and head[0] == "Rss:":
                total += int(head[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc/self/smaps")
def test_reading_a_node_leaves_none_of_its_file_pages_resident(tmp_path):
    from nodekv.engine.node_store import NodeStore, write_node_store

    node = StoredNode(tuple(range(256)), torch.randn(4, 256, 2, 64), torch.randn(4, 256, 2, 64))  # 1 MiB in fp32
    write_node_store(tmp_path / "kv", {"a": node, "b": node}, MODEL, "float32")
    store = NodeStore(tmp_path / "kv", MODEL)
    got = store.get("a")
    assert torch.equal(got.k, node.k) and torch.equal(got.v, node.v)
    # what may stay: the pages the kernel maps around a read fault beyond the node's end (fault-around, 64 KiB by
    # default), all of them node b's; kept mapped, node a alone would be 1024 KiB
    assert mapped_resident_kib((tmp_path / "kv").resolve()) <= 128
    assert torch.equal(store.get("a").v, node.v)  # read again: mapped back in from the file


def test_two_ids_with_one_text_are_refused_not_merged(pair, tmp_path):
    from nodekv.engine.node_store import write_node_store

    node = pair[1].store_node(ids(4, 3))
    with pytest.raises(ValueError, match="two of them read '1'"):
        write_node_store(tmp_path / "x.kv", {1: node, "1": node}, MODEL)
    assert not (tmp_path / "x.kv").exists()


def test_a_truncated_corrupt_or_foreign_store_is_refused_by_name(pair, tmp_path):
    from nodekv.engine.node_store import NodeStore, NodeStoreError, write_node_store

    _, engine = pair
    path = tmp_path / "kv"
    write_node_store(path, {"a": engine.store_node(ids(9, 13))}, MODEL, "float16")
    data = path.read_bytes()
    with pytest.raises(NodeStoreError, match="was stored with model"):
        NodeStore(path, {"name": "other.gguf", "config": "abc"})
    (tmp_path / "short").write_bytes(data[:-5])
    with pytest.raises(NodeStoreError, match="truncated"):
        NodeStore(tmp_path / "short", MODEL)
    (tmp_path / "flipped").write_bytes(data[:-5] + bytes([data[-5] ^ 1]) + data[-4:])
    store = NodeStore(tmp_path / "flipped", MODEL)  # the header is fine: the node is refused when read
    with pytest.raises(NodeStoreError, match="node 'a' are corrupt"):
        store.get("a")
    (tmp_path / "text").write_text("not a store")
    with pytest.raises(NodeStoreError, match="not a node store file"):
        NodeStore(tmp_path / "text", MODEL)
    with pytest.raises(ValueError, match="store dtype must be one of"):
        write_node_store(tmp_path / "x", {}, MODEL, "bf16")
    size = int.from_bytes(data[8:16], "little")
    header, payload = json.loads(data[16:16 + size]), data[16 + size:]

    def edited(name: str, **changes) -> Path:
        text = json.dumps({k: v for k, v in {**header, **changes}.items() if v is not None}).encode()
        (tmp_path / name).write_bytes(data[:8] + len(text).to_bytes(8, "little") + text + payload)
        return tmp_path / name

    for name, changes, match in (("nopayload", {"payload_bytes": None}, "corrupt node store header: no payload_bytes"),
                                 ("bf16", {"dtype": "bfloat16"}, "corrupt node store header: dtype 'bfloat16'")):
        with pytest.raises(NodeStoreError, match=match):
            NodeStore(edited(name, **changes), MODEL)
    relabelled = NodeStore(edited("int8", dtype="int8"), MODEL)  # int8 reads the float16 bytes as another shape
    with pytest.raises(NodeStoreError, match="node 'a'.s bytes do not hold its shape"):
        relabelled.get("a")


def test_repairing_every_placed_token_gives_a_prefill(pair):
    """CacheBlend's repair at ratio 1: stored nodes placed after a prefix and recomputed at all their positions hold
    a prefill's keys and values, and the question after them gets a prefill's logits."""
    _, engine = pair
    prefix, a, b, question = ids(11, 20), ids(17, 21), ids(9, 22), ids(5, 23)
    nodes = [engine.store_node(a), engine.store_node(b)]
    with engine.session() as s:
        s.append(prefix)
        for node in nodes:
            s.append_stored(node)
        placed_k, _ = cached_kv(s, 0, len(s))
        before = engine.flops.total
        s.repair(range(len(prefix), len(s)))
        charged = engine.flops.total - before
        repaired_k, repaired_v = cached_kv(s, 0, len(s))
        s.append(question)
        logits = s.score(ids(3, 24))
    with engine.session() as s:
        s.append(prefix + a + b)
        want_k, want_v = cached_kv(s, 0, len(s))
        s.append(question)
        want = s.score(ids(3, 24))
    assert rel(placed_k[1:], want_k[1:]) > 1e-3  # placed without context, deeper layers differ
    assert rel(repaired_k, want_k) <= 1e-5 and rel(repaired_v, want_v) <= 1e-5
    assert torch.allclose(logits, want, atol=1e-4)
    from nodekv.engine.flops import forward_flop_parts, recompute_flops

    assert charged == recompute_flops(engine.config, list(range(len(prefix), len(prefix) + 26)))
    matmuls, attention, _ = forward_flop_parts(engine.config, 26, 0, n_logits=26, collect=True)
    assert recompute_flops(engine.config, list(range(26))) == matmuls + attention  # all rows of a prefill, no head


def test_repaired_tokens_have_the_node_mass_of_hf_eager_attention(pair):
    """repair(collect=True): each repaired token's attention mass per node, averaged over heads and layers, is the
    row HF's eager softmax gives the same token in a prefill of the whole (every placed token repaired, so the
    context is a prefill's); a partial repair records rows for its tokens only."""
    from numerics import hf_attention

    hf, engine = pair
    prefix, a, b = ids(11, 30), ids(17, 31), ids(9, 32)
    with engine.session() as s:
        s.append(prefix, node_id="p")
        for name, node in (("a", a), ("b", b)):
            s.append_stored(engine.store_node(node), node_id=name)
        s.repair(range(len(prefix), len(s)), collect=True)
        got = {name: s.token_mass(name).double() for name in ("a", "b")}
        with pytest.raises(ValueError, match="no attention mass for node .p.: it was not collected"):
            s.token_mass("p")
    att = hf_attention(hf, prefix + a + b)
    bounds = [0, 11, 28, 37]
    want = torch.stack([att[:, x:y].sum(1) for x, y in zip(bounds, bounds[1:])], 1)  # [T, nodes]
    assert (got["a"] - want[11:28, :2]).abs().max() <= 1e-5 and (got["b"] - want[28:37]).abs().max() <= 1e-5
    with engine.session() as s:
        s.append(prefix)
        span = s.append_stored(engine.store_node(a), node_id="a")
        s.repair([span.start + 3, span.start + 8], collect=True)
        assert s.token_mass("a").shape == (2, 2) and torch.allclose(s.token_mass("a").sum(1), torch.ones(2))


def test_a_partial_repair_rewrites_only_its_positions_and_bad_ones_are_refused(pair):
    _, engine = pair
    node = engine.store_node(ids(20, 25))
    with engine.session() as s:
        s.append(ids(6, 26))
        s.append_stored(node)
        k0, v0 = cached_kv(s, 0, len(s))
        for bad, match in (([9, 7], "one increasing position per token"),
                           ([6, 30], "cannot repair position 30: the session holds positions 0..25"),
                           ([-1, 8], "cannot repair position -1"), ([6.0], "positions must be integers"),
                           ([True], "positions must be integers")):
            with pytest.raises(ValueError, match=match):
                s.repair(bad)
        with pytest.raises(ValueError, match="cannot measure position 26"):
            s.key_deviation([26])
        last = engine.config.n_layers - 1
        for layer in (-1, last + 1, 1.5, True, None):
            with pytest.raises(ValueError, match=rf"^layer must be an int in 0\.\.{last}, got {layer!r}$"):
                s.key_deviation([6], layer=layer)
        with pytest.raises(ValueError, match=r"^layers must be an int in 1\.\.\d+ or None, got 1\.5$"):
            engine.recompute([s.tokens[6]], [6], s.cache, layers=1.5)
        assert s.key_deviation([]).shape == (0,)
        assert torch.equal(cached_kv(s, 0, len(s))[0], k0)
        s.repair([6, 7, 8])  # the node's first three tokens (the rule that repairs each node's start)
        k1, v1 = cached_kv(s, 0, len(s))
    assert torch.equal(k1[:, :6], k0[:, :6]) and torch.equal(k1[:, 9:], k0[:, 9:])
    assert not torch.equal(k1[1:, 6:9], k0[1:, 6:9])


def test_key_deviation_finds_the_tokens_that_missed_their_context_and_changes_nothing(pair):
    _, engine = pair
    a, b = engine.store_node(ids(12, 30)), engine.store_node(ids(12, 31))
    with engine.session() as s:
        s.append_stored(a)  # at position 0: its context is the one it was stored with
        s.append_stored(b)  # after a: stored without it
        k0, v0 = cached_kv(s, 0, 24)
        before = engine.flops.total
        dev = s.key_deviation(range(24), layer=1)
        charged = engine.flops.total - before
        assert torch.equal(cached_kv(s, 0, 24)[0], k0) and torch.equal(cached_kv(s, 0, 24)[1], v0)
        assert s.key_deviation(range(24), layer=0).max() <= 1e-6  # layer 0 sees no context: rounding alone
    assert dev.shape == (24,) and dev[:12].max() <= 1e-5 and dev[12:].min() > 1e-3
    from nodekv.engine.flops import forward_flop_parts

    c = engine.config
    one_layer = forward_flop_parts(c, 24, 0, n_logits=24, collect=True)
    per_layer = (one_layer[0] + one_layer[1]) // c.n_layers
    assert charged == per_layer + 24 * 2 * c.dim * (c.q_dim + 2 * c.kv_dim)  # layer 0 whole, layer 1's Q/K/V


@pytest.mark.parametrize("forked", [False, True])
def test_a_repair_gives_a_prefill_in_a_fork_that_shares_the_placed_pages(tmp_path, forked):
    """Three layers, so that a layer's attention over keys the repair has not rewritten would show in the next
    layer's keys (two layers hide it: layer 0's keys need no context, and the last layer's attention feeds none):
    repairing in a fork, whose first write copies the shared pages, reads the copies from then on; so does the key
    deviation in layer 2, which is the repaired key's distance from the placed one."""
    hf = tiny_hf_model("qwen2", seed=6, layers=3)
    write_tiny_gguf(hf, tmp_path / "three.gguf", "f32", arch="qwen2")
    engine = tiny_engine(tmp_path / "three.gguf", pages=64, page_size=8)
    prefix, node = ids(11, 40), ids(21, 41)
    with engine.session() as placed:
        placed.append(prefix)
        placed.append_stored(engine.store_node(node))
        s = placed.fork() if forked else placed
        placed_k = cached_kv(s, 0, len(s))[0][2, len(prefix):]
        deviation = s.key_deviation(range(len(prefix), len(s)), layer=2)
        s.repair(range(len(prefix), len(s)))
        got_k, got_v = cached_kv(s, 0, len(s))
        repaired_k = got_k[2, len(prefix):]
        want_deviation = (repaired_k - placed_k).flatten(1).norm(dim=1) / placed_k.flatten(1).norm(dim=1)
        if forked:
            s.release()
    with engine.session() as s:
        s.append(prefix + node)
        want_k, want_v = cached_kv(s, 0, len(s))
    assert rel(got_k, want_k) <= 1e-5 and rel(got_v, want_v) <= 1e-5
    assert torch.allclose(deviation, want_deviation, rtol=1e-4, atol=1e-6)


def test_repair_copies_pages_shared_with_a_fork_before_writing(pair):
    _, engine = pair
    with engine.session() as s:
        s.append(ids(8, 32))
        s.append_stored(engine.store_node(ids(10, 33)))
        fork = s.fork()
        k_fork = cached_kv(fork, 0, 18)[0]
        s.repair(range(8, 18))
        assert torch.equal(cached_kv(fork, 0, 18)[0], k_fork)  # the fork's pages are untouched
        assert not torch.equal(cached_kv(s, 0, 18)[0], k_fork)
        fork.release()


def test_nodes_and_indexes_of_other_weights_under_one_name_and_config_are_refused(tmp_path):
    """A fine-tune saved under the base model's file name has its config too: the weight fingerprint tells them
    apart. A node or index recorded before fingerprints were (no "weights") is still checked by name and config. A
    link to the model file names the file; another name is refused before a model loads."""
    from nodekv.engine.node_store import NodeStore, NodeStoreError, write_node_store
    from nodekv.methods.index_file import IndexFileError, check_index_file, read_index_file, write_index_file

    engines = []
    for seed in (5, 6):
        path = tmp_path / f"seed{seed}" / "model.gguf"
        path.parent.mkdir()
        write_tiny_gguf(tiny_hf_model("qwen2", seed=seed), path, "f32", arch="qwen2")
        engines.append(tiny_engine(path, pages=16, page_size=8))
    base, tuned = engines
    assert base.model_id.keys() == {"name", "config", "weights"}
    assert {k: v for k, v in base.model_id.items() if k != "weights"} == \
        {k: v for k, v in tuned.model_id.items() if k != "weights"}
    assert base.model_id["weights"] != tuned.model_id["weights"]
    assert tiny_engine(tmp_path / "seed5" / "model.gguf").model_id == base.model_id  # the same file: the same id
    link = tmp_path / "current.gguf"
    link.symlink_to(tmp_path / "seed5" / "model.gguf")
    assert tiny_engine(link).model_id == base.model_id  # a link names the file it reads

    node = base.store_node(ids(6, 1))
    old = {k: v for k, v in base.model_id.items() if k != "weights"}
    with tuned.session() as s:
        with pytest.raises(ValueError, match=r"stored by model model.gguf \(config [0-9a-f]{12}, weights"):
            s.append_stored(node)
        assert len(s.nodes) == 0
        s.append_stored(StoredNode(node.tokens, node.k, node.v, old))
    store = tmp_path / "nodes.kv"
    write_node_store(store, {"a": node}, base.model_id)
    assert NodeStore(store, base.model_id)["a"].model == base.model_id
    with pytest.raises(NodeStoreError, match="was stored with model"):
        NodeStore(store, tuned.model_id)

    index = tmp_path / "x.idx"
    write_index_file(index, "nodekv-test", 1, base, {"n": 1})
    assert read_index_file(index, "nodekv-test", 1, base, "test index") == {"n": 1}
    with pytest.raises(IndexFileError, match="built with model model.gguf"):
        read_index_file(index, "nodekv-test", 1, tuned, "test index")
    check_index_file(index, "nodekv-test", link, "test index")  # before a model loads, as at the read
    with pytest.raises(IndexFileError, match=r"built with model model.gguf .*, not renamed.gguf:"):
        check_index_file(index, "nodekv-test", tmp_path / "renamed.gguf", "test index")
    data = json.loads(index.read_text())
    data.pop("checksum")
    data["model"] = old
    data["checksum"] = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
    index.write_text(json.dumps(data))
    assert read_index_file(index, "nodekv-test", 1, tuned, "test index") == {"n": 1}
