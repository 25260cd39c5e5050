"""The shared answer reader: LongBench's middle truncation (slicing by hand), greedy answers against HF's model with
the repetition penalty over the generated tokens only (a brute-force reference loop), the shared prompt prefix,
multiple choice scored over letters and calibrated by the content-free prior (a scripted model), growing prompts
against fresh reads, and the same prompt from two methods that read the same context."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nodekv.engine.flops import FlopAccount, forward_flops
from nodekv.methods.baselines import BM25TopK, FullContext
from nodekv.methods.prompts import PromptSpec, prompt_for
from nodekv.methods.reader import CONTENT_FREE, Answer, GrowingPrompt, Reader, Repair, calibrated_choice
from char_engine import CharTokenizer, char_engine
from conftest import bare_engine, tiny_hf_model, write_tiny_gguf


def _ids_engine(max_seq_len):
    """No model: enough for prompt_ids (one id per character of the user turn)."""
    return bare_engine(tokenizer=CharTokenizer(), config=SimpleNamespace(max_seq_len=max_seq_len))


def _hf_greedy(hf, prompt: list[int], n: int, penalty: float) -> list[int]:
    """Greedy decoding by whole-sequence forwards of HF's model, CTRL's penalty on the generated ids only."""
    out = []
    for _ in range(n):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].clone()
        if out:
            seen = torch.tensor(sorted(set(out)))
            logits[seen] = torch.where(logits[seen] > 0, logits[seen] / penalty, logits[seen] * penalty)
        token = int(logits.argmax())
        if token == 100:
            break
        out.append(token)
    return out


def test_the_middle_is_cut_to_the_model_window_or_a_smaller_one():
    spec, text = PromptSpec("{context}|{question}", max_new_tokens=10), "abcdefghij" * 10  # 100 characters
    whole = CharTokenizer().encode(text + "|q")
    assert Reader(_ids_engine(1000), spec).prompt_ids(text, "q") == (whole, False)
    assert Reader(_ids_engine(1000), spec, window=112).prompt_ids(text, "q") == (whole, False)  # 102 + 10 fit
    ids, cut = Reader(_ids_engine(1000), spec, window=50).prompt_ids(text, "q")  # room 40: first 20, last 20
    assert cut and ids == whole[:20] + whole[-20:]
    assert Reader(_ids_engine(50), spec, window=4096).prompt_ids(text, "q") == (ids, True)  # the model's is smaller


def test_a_window_that_cannot_hold_the_answer_or_the_bare_prompt_is_refused():
    spec, text = PromptSpec("{context}|{question}", max_new_tokens=10), "abcdefghij" * 10
    for window in (5, 10):  # no room beside the answer: refused when the reader (and so the method) is made
        with pytest.raises(ValueError, match=f"up to 10 tokens .* no room for a prompt in a window of {window}"):
            Reader(_ids_engine(1000), spec, window=window)
        with pytest.raises(ValueError, match="no room for a prompt"):
            FullContext(_ids_engine(1000), prompt=spec, window=window)
    with pytest.raises(ValueError, match="no room for a prompt in a window of 50"):
        FullContext(_ids_engine(50), prompt=PromptSpec("{context}|{question}", max_new_tokens=64))
    question = "why" * 5  # the prompt without its context: 16 ids, more than room 15 of a window of 25
    assert Reader(_ids_engine(1000), spec, window=27).prompt_ids(text, question)[1]  # room 17: the context is cut
    with pytest.raises(ValueError, match="the prompt takes 16 tokens without its context, more than the 15"):
        Reader(_ids_engine(1000), spec, window=25).prompt_ids(text, question)


def test_the_prompt_up_to_the_question_is_what_questions_share():
    spec, text = PromptSpec("{context}|{question}", max_new_tokens=10), "abcdefghij" * 10
    assert Reader(_ids_engine(1000), spec).shared_length(text, "why?") == 101  # the document and "|"
    # cut to 20 + 20: the head; the tail starts where the question's length puts it
    assert Reader(_ids_engine(1000), spec, window=50).shared_length(text, "why?") == 20


def test_full_context_reads_with_its_window_and_shares_its_prefix(monkeypatch):
    calls = []
    monkeypatch.setattr(Reader, "read", lambda self, context, question, options=(), nodes=(), trace=None,
                        shared_prefix=False: calls.append((self.window, context, shared_prefix)) or Answer("", []))
    FullContext(_ids_engine(1000), PromptSpec("{context}|{question}", 10)).answer("doc", "why?")
    FullContext(_ids_engine(1000), PromptSpec("{context}|{question}", 10), window=50,
                shared_prefix=False).answer("doc", "why?")
    assert calls == [(None, "doc", True), (50, "doc", False)]


@pytest.mark.parametrize("penalty", [1.0, 1.5])
def test_free_text_answers_are_greedy_with_the_penalty_over_generated_tokens_only(hf_tiny, penalty):
    hf, path = hf_tiny
    eng, context = char_engine(path), "the cat sat on the mat, the cat sat"
    spec = PromptSpec("{context}|{question}", 12, repetition_penalty=penalty)
    answer = Reader(eng, spec).read(context, "who?")
    prompt = CharTokenizer().encode(context + "|who?")
    want = _hf_greedy(hf, prompt, 12, penalty)
    assert answer.text == CharTokenizer().decode(want).strip() and answer.prompt_tokens == len(prompt)
    assert answer.context == context
    if penalty != 1.0:  # the reference without the penalty differs here, so the penalty was applied
        assert want != _hf_greedy(hf, prompt, 12, 1.0)


def test_a_shared_prompt_prefix_is_prefilled_once_and_the_answers_stay_the_same(hf_tiny):
    """The first question pays the prefix and the rest, the second only the rest (by the FLOP formula), and the
    prefix's prefill is counted as saved; the answers equal HF's greedy ones."""
    hf, path = hf_tiny
    eng, spec, context = char_engine(path), PromptSpec("{context}|{question}", 6), "some shared document text"
    reader = Reader(eng, spec)
    for q in ("why", "who is it"):
        n_shared = reader.shared_length(context, q)
        prompt = CharTokenizer().encode(f"{context}|{q}")
        whole = reader.read(context, q)
        saved = eng.flops.saved
        shared = reader.read(context, q, shared_prefix=True)
        decode = whole.flops - forward_flops(eng.config, len(prompt))
        rest = forward_flops(eng.config, len(prompt) - n_shared, n_shared) + decode
        first = q == "why"
        assert shared.flops == rest + (forward_flops(eng.config, n_shared) if first else 0)
        assert eng.flops.saved - saved == (0 if first else forward_flops(eng.config, n_shared))
        assert whole.text == shared.text == CharTokenizer().decode(_hf_greedy(hf, prompt, 6, 1.0)).strip()


@pytest.mark.parametrize("weights", ["float32", "q8_0"])
def test_growing_prompts_answer_as_fresh_reads_with_each_node_prefilled_about_once(tmp_path, weights):
    """A search's answers after each step, read through one GrowingPrompt: every answer (its letter probabilities
    bit for bit) and its FLOPs plus the engine's `saved` equal a fresh read's, and together they run well under half
    the fresh reads' FLOPs. Nodes of 16 and 55 tokens make pieces of up to 32 tokens, which the CPU computes on
    other kernels: read with min_tail 0, some answer's probabilities differ from the fresh read's."""
    hf = tiny_hf_model(max_positions=512)
    path = tmp_path / "model.gguf" if weights == "q8_0" else tmp_path
    write_tiny_gguf(hf, path, "q8_0") if weights == "q8_0" else hf.save_pretrained(path)
    eng = char_engine(path, backend="cpu")  # the C++ kernels: a row's numbers whatever step holds it
    reader = Reader(eng, PromptSpec("{context}|{question}\n{options}", 4))
    nodes = [f"{i} a longer node, past what one quantised step takes." if i % 2 == 0 else f"{i} a short one"
             for i in range(12)]
    reads = [("\n".join("* " + n for n in nodes[:i]), options) for i in range(1, 13) for options in ((), ("x", "y"))]
    fresh = [reader.read(context, "which?", options) for context, options in reads]
    ran, differ = 0, []
    for min_tail in (32, 0):
        with GrowingPrompt(eng, min_tail) as growing:
            for (context, options), want in zip(reads, fresh):
                saved = eng.flops.saved
                got = reader.read(context, "which?", options, growing=growing)
                if min_tail:
                    assert (got.text, got.choice_probs) == (want.text, want.choice_probs)
                    assert got.flops + eng.flops.saved - saved == want.flops
                    ran += got.flops
                else:
                    differ.append(got.choice_probs != want.choice_probs)
    assert ran < sum(a.flops for a in fresh) / 2
    assert any(differ)


class ScriptedSession:
    """Letter probabilities by what the prompt holds: the content-free one, or a real one."""

    def __init__(self, probs):
        self.probs, self.ids = probs, []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def __len__(self):
        return len(self.ids)

    def append(self, ids, node_id=None):
        self.ids += list(ids)

    def probe(self, choices):
        text = CharTokenizer().decode(self.ids)
        table = self.probs["content-free" if text.startswith(CONTENT_FREE) else "document"]
        return dict(zip(choices, table))


def test_multiple_choice_is_the_most_probable_letter_calibrated_by_the_content_free_prior():
    probs = {"document": [0.40, 0.35, 0.15, 0.10], "content-free": [0.60, 0.20, 0.10, 0.10]}
    sessions = []

    def session():
        sessions.append(ScriptedSession(probs))
        return sessions[-1]

    eng = SimpleNamespace(tokenizer=CharTokenizer(), config=SimpleNamespace(max_seq_len=1000, vocab_size=101),
                          flops=FlopAccount(), session=session, prefixes=None)
    reader = Reader(eng, PromptSpec("{context}|{question}|{options}", 16))
    answer = reader.read("a story", "which?", ("w", "x", "y", "z"))
    assert answer.text == "A" and answer.generated_tokens == 0  # scored, not generated
    assert answer.choice_probs == probs["document"] and answer.choice_prior == probs["content-free"]
    prior_prompt = CharTokenizer().decode(sessions[0].ids)  # this question's prompt, "N/A" for the story
    assert prior_prompt == f"{CONTENT_FREE}|which?|" + "\n".join(f"({c}) {o}" for c, o in zip("ABCD", "wxyz"))
    # p / prior = .67, 1.75, 1.5, 1.0: B, not the raw A
    assert calibrated_choice(answer.choice_probs, answer.choice_prior) == 1
    reader.read("another story", "which?", ("w", "x", "y", "z"))
    assert len(sessions) == 3  # the same question's prior is computed once
    reader.read("a story", "why?", ("w", "x", "y", "z"))
    assert len(sessions) == 5  # another question has its own


def test_calibration_divides_by_the_prior():
    assert calibrated_choice([0.5, 0.5], [0.5, 0.5]) == 0  # ties: the first
    assert calibrated_choice([0.3, 0.7], [0.1, 0.9]) == 0  # 3.0 against 0.78
    assert calibrated_choice([0.3, 0.7], [0.5, 0.5]) == 1


def test_two_methods_reading_the_same_context_send_the_same_prompt(monkeypatch):
    """Full context on a one-chunk document and BM25 retrieving that chunk read the same text: one prompt."""
    sent = []

    def read(self, context, question, options=(), nodes=(), trace=None, shared_prefix=False):
        sent.append(self.prompt_ids(context, question, options)[0])
        return Answer("", list(nodes))

    monkeypatch.setattr(Reader, "read", read)
    eng, spec = _ids_engine(1000), prompt_for("hotpotqa")
    eng.tokenizer.decode = CharTokenizer().decode
    document = "Passage 1:\nRush\nNobody's Hero is a song by Rush."
    FullContext(eng, spec).answer(document, "Who sang Nobody's Hero?")
    bm25 = BM25TopK(eng, spec, k=3)
    bm25.answer(bm25.index(document), "Who sang Nobody's Hero?")
    assert len(sent) == 2 and sent[0] == sent[1]
    assert CharTokenizer().decode(sent[0]) == spec.render(document, "Who sang Nobody's Hero?")


def _stored_passages(path, passages: tuple[str, ...]):
    """(reader, stored passages, head, tail, the prompt's ids) on the char-token engine, the question "who?"."""
    eng = char_engine(path)
    reader = Reader(eng, PromptSpec("{context}|{question}", 6))
    stored = [eng.store_node(reader.passage_ids(p)) for p in passages]
    head, tail = reader.pieces("who?")
    return reader, stored, head, tail, head + [i for node in stored for i in node.tokens] + tail


def test_stored_passages_repaired_whole_answer_as_the_same_prompt_prefilled(hf_tiny):
    """read_stored places passages prefilled once between the prompt's pieces. With every placed token repaired it
    answers as HF's greedy loop on the same ids; pure reuse runs no forward over the passages."""
    hf, path = hf_tiny
    reader, stored, head, tail, ids = _stored_passages(path, ("the mill was built", " it burned down "))
    assert CharTokenizer().decode(ids) == "\n\nthe mill was built\n\nit burned down|who?"
    placed = len(ids) - len(head) - len(tail)
    whole = reader.read_stored(stored, "who?", nodes=[0, 1], repair=Repair(1.0), context="the passages")
    assert whole.text == CharTokenizer().decode(_hf_greedy(hf, ids, 6, 1.0)).strip()
    assert whole.prompt_tokens == len(ids) and whole.nodes == [0, 1] and whole.context == "the passages"
    sizes = [len(node) for node in stored]
    assert whole.trace == [{"placed": placed, "repaired": placed, "nodes": [
        {"node": i, "reused": 0, "recomputed": n} for i, n in enumerate(sizes)]}]
    reused = reader.read_stored(stored, "who?")
    assert reused.trace == [{"placed": placed, "repaired": 0, "nodes": [
        {"node": i, "reused": n, "recomputed": 0} for i, n in enumerate(sizes)]}]
    c = reader.engine.config
    decode = reused.flops - forward_flops(c, len(head)) - forward_flops(c, len(tail), len(ids) - len(tail))
    assert 0 <= decode < forward_flops(c, placed, len(head), n_logits=0)  # the passages' prefill was not run


def test_boundary_repair_recomputes_each_passages_first_tokens_without_a_deviation_pass(hf_tiny, monkeypatch):
    """repair_by boundary (EPIC) recomputes the first round(f n) tokens of each placed passage of n tokens, chooses
    them without the key deviation pass, and with f = 1 answers as HF's greedy loop on the prompt's ids."""
    from nodekv.engine.session import Session

    hf, path = hf_tiny
    reader, stored, head, tail, ids = _stored_passages(path, ("the mill was built", " it burned down in 1900 "))
    monkeypatch.setattr(Session, "key_deviation", lambda *a, **k: pytest.fail("boundary repair needs no deviation"))
    repaired = []
    repair = Session.repair
    monkeypatch.setattr(Session, "repair", lambda s, positions, **k: (repaired.append(list(positions)),
                                                                      repair(s, positions, **k)))
    answer = reader.read_stored(stored, "who?", repair=Repair(0.3, "boundary"))
    starts = [len(head), len(head) + len(stored[0])]
    firsts = [round(0.3 * len(node)) for node in stored]
    assert repaired == [[p for a, n in zip(starts, firsts) for p in range(a, a + n)]]
    assert [n["recomputed"] for n in answer.trace[-1]["nodes"]] == firsts and answer.trace[-1]["repaired"] == sum(firsts)
    whole = reader.read_stored(stored, "who?", repair=Repair(1.0, "boundary"))
    assert whole.text == CharTokenizer().decode(_hf_greedy(hf, ids, 6, 1.0)).strip()


def test_bm25_with_kv_reuse_stores_every_chunk_once_and_places_the_chosen(hf_tiny):
    _, path = hf_tiny
    eng = char_engine(path)
    method = BM25TopK(eng, PromptSpec("{context}|{question}", 4), k=2, chunk_tokens=12, kv_reuse="blend", repair=0.5,
                      repair_by="deviation")  # the fraction of all placed tokens (boundary rounds per node)
    index = method.index("the mill was built in 1821. it burned down in 1900. a school stands there now.")
    assert len(index.stored) == len(index.chunks) and all(len(n) > 0 for n in index.stored)
    answer = method.answer(index, "when did the mill burn?")
    last = answer.trace[-1]
    assert len(answer.nodes) == 2 and last["repaired"] == round(0.5 * last["placed"])
    assert [n["node"] for n in last["nodes"]] == answer.nodes
    assert sum(n["recomputed"] for n in last["nodes"]) == last["repaired"]
    assert sum(n["reused"] + n["recomputed"] for n in last["nodes"]) == last["placed"]
    with pytest.raises(ValueError, match="do not fit the window"):
        method.reader.read_stored(index.stored * 20, "q")


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_top_k_index_saved_with_its_kv_answers_as_the_one_built(hf_tiny, tmp_path, kv_dtype):
    """A Top-k index saved with its node store and loaded back answers exactly as the index built in memory (which
    holds its KV as the store gives it back); a missing or bad store is refused by name with kv_reuse, and the same
    index file still serves kv_reuse=off."""
    from nodekv.engine.node_store import NodeStoreError

    _, path = hf_tiny
    eng = char_engine(path)
    opts = dict(k=2, chunk_tokens=12, kv_reuse="blend", repair=0.5, kv_dtype=kv_dtype)
    method = BM25TopK(eng, PromptSpec("{context}|{question}", 4), **opts)
    built = method.index("the mill was built in 1821. it burned down in 1900. a school stands there now.")
    method.save_index(built, tmp_path / "doc.bm25")
    loaded = method.load_index(tmp_path / "doc.bm25")
    for i in range(len(built.chunks)):
        assert torch.equal(loaded.stored[i].k, built.stored[i].k) and torch.equal(loaded.stored[i].v, built.stored[i].v)
    question = "when did the mill burn?"
    want, got = method.answer(built, question), method.answer(loaded, question)
    assert (got.text, got.nodes, got.flops) == (want.text, want.nodes, want.flops)

    plain = BM25TopK(eng, PromptSpec("{context}|{question}", 4), k=2, chunk_tokens=12)
    (tmp_path / "doc.bm25.kv").write_bytes(b"NODEKVKV" + bytes(20))
    with pytest.raises(NodeStoreError, match="doc.bm25.kv"):
        method.load_index(tmp_path / "doc.bm25")
    assert plain.answer(plain.load_index(tmp_path / "doc.bm25"), question).nodes == want.nodes
    plain.save_index(plain.index("the mill was built in 1821."), tmp_path / "off.bm25")
    with pytest.raises(NodeStoreError, match="indexed with kv_reuse=off"):
        method.load_index(tmp_path / "off.bm25")


def test_top_k_indexes_are_shared_as_files_not_as_searches(hf_tiny, tmp_path):
    """A saved Top-k file is chunks: dense loads bm25's and searches them its own way, but neither method answers
    from the other's index in memory (it would search by the other's retriever), and a file cut at another
    chunk_tokens is refused by load_index (the CLI refuses that option on a saved index before loading)."""
    from nodekv.methods.baselines import DenseTopK
    from nodekv.methods.index_file import IndexFileError
    from nodekv.methods.retrieval import DenseIndex

    class Letters:  # an embedder of letter counts: dense retrieval without MiniLM
        def encode(self, texts, batch_size=64):
            return torch.tensor([[t.count(c) + 0.1 for c in "abcdefghijklmnopqrstuvwxyz"] for t in texts])

    _, path = hf_tiny
    eng = char_engine(path)
    spec = PromptSpec("{context}|{question}", 4)
    bm25 = BM25TopK(eng, spec, k=1, chunk_tokens=12)
    dense = DenseTopK(eng, spec, embedder=Letters(), k=1, chunk_tokens=12)
    bm25.save_index(bm25.index("the mill was built in 1821. it burned down in 1900."), tmp_path / "doc.bm25")
    loaded = dense.load_index(tmp_path / "doc.bm25")
    assert isinstance(loaded.search, DenseIndex) and dense.answer(loaded, "when did it burn?").nodes
    with pytest.raises(ValueError, match="^this index searches its chunks by DenseIndex, bm25 by BM25Index: index "
                                         "with bm25, or load the saved file with it$"):
        bm25.answer(loaded, "when did it burn?")
    with pytest.raises(IndexFileError, match="doc.bm25 holds chunks of 12 tokens, this bm25 cuts 6: load it with "
                                             "chunk_tokens=12, or index again"):
        BM25TopK(eng, spec, chunk_tokens=6).load_index(tmp_path / "doc.bm25")


def test_a_store_is_read_only_with_the_index_it_was_written_with(hf_tiny, tmp_path, monkeypatch):
    """Another index's store beside an index is refused (its nodes would be read for passages they do not hold); a
    save that dies before its files are renamed leaves the previous index and store as they were; an index saved
    again without KV takes its old store away (it would be offered for an index it does not belong to)."""
    from nodekv.engine.node_store import NodeStoreError
    from nodekv.methods import index_file

    _, path = hf_tiny
    eng = char_engine(path)
    spec = PromptSpec("{context}|{question}", 4)
    method = BM25TopK(eng, spec, k=2, chunk_tokens=12, kv_reuse="reuse", kv_dtype="float32")
    a = method.index("the mill was built in 1821. it burned down in 1900.")
    b = method.index("a school stands there now. the river runs past it.")
    method.save_index(a, tmp_path / "a.bm25")
    method.save_index(b, tmp_path / "b.bm25")
    (tmp_path / "a.bm25.kv").write_bytes((tmp_path / "b.bm25.kv").read_bytes())
    with pytest.raises(NodeStoreError, match="a.bm25.kv is not the node store written with"):
        method.load_index(tmp_path / "a.bm25")
    method.save_index(a, tmp_path / "a.bm25")

    def dies(*args, **kwargs):
        raise KeyboardInterrupt

    (tmp_path / "a.bm25.side").write_bytes(b"previous")  # a sidecar, as GoR writes its tensors
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with monkeypatch.context() as m:
        m.setattr(index_file, "write_index_file", dies)
        with pytest.raises(KeyboardInterrupt):
            method.save_index(b, tmp_path / "a.bm25")
        with pytest.raises(KeyboardInterrupt):
            index_file.write_index_files(tmp_path / "a.bm25", "nodekv-topk-index", 1, eng, {}, None,
                                         sidecars={tmp_path / "a.bm25.side": b"new"})
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # nothing replaced, no temporary left
    assert method.load_index(tmp_path / "a.bm25").chunks == a.chunks
    plain = BM25TopK(eng, spec, k=2, chunk_tokens=12)
    plain.save_index(plain.index("the mill was built in 1821."), tmp_path / "a.bm25")
    assert not (tmp_path / "a.bm25.kv").exists()


def test_kv_context_document_stores_each_chunk_after_the_ones_before_it(hf_tiny):
    """kv_context=document stores the chunks as one sequence in document order (Engine.store_nodes, checked against
    HF in tests/engine/test_node_store.py) and keys its index apart; kv_context=none keeps the keys of stores saved
    before the option existed."""
    _, path = hf_tiny
    eng = char_engine(path)
    spec, doc = PromptSpec("{context}|{question}", 4), "the mill was built in 1821. it burned down in 1900. a school."
    opts = dict(k=2, chunk_tokens=12, kv_reuse="reuse", kv_dtype="float32")
    method = BM25TopK(eng, spec, **opts, kv_context="document")
    index = method.index(doc)
    want = eng.store_nodes([method.reader.passage_ids(c) for c in index.chunks])
    assert len(index.chunks) > 2 and len(index.stored) == len(want)
    for got, node in zip(index.stored, want):
        assert torch.equal(got.k, node.k) and torch.equal(got.v, node.v)
    assert not torch.equal(index.stored[1].v, eng.store_node(method.reader.passage_ids(index.chunks[1])).v)
    assert method.index_key() == {"chunk_tokens": 12, "kv_dtype": "float32", "kv_context": "document"}
    assert BM25TopK(eng, spec, **opts).index_key() == method.index_key()  # document context is the default
    assert BM25TopK(eng, spec, **opts, kv_context="none").index_key() == {"chunk_tokens": 12, "kv_dtype": "float32"}
    assert BM25TopK(eng, spec, k=2, chunk_tokens=12).index_key() == {"chunk_tokens": 12, "kv_dtype": None}
