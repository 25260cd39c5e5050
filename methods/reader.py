"""The shared answer reader: one way to turn (question, what a method chose to read, the dataset's task) into an
answer, so that two methods differ only in what they read.

A method decides the context (chunks, nodes, facts, synopses); `Reader.read` puts it in the dataset's prompt
(LongBench's instruction, `prompts.PROMPTS`), in the model's chat template, middle-truncated to the window as
LongBench does, and answers:
- free text (QA, summaries): greedy decoding with the dataset's answer budget and stop strings; the dataset's
  repetition penalty counts the generated tokens only, never the prompt (a penalty over the prompt pushes a
  summary away from the document's own words);
- multiple choice: the option letter with the highest probability at the start of the answer (scored over the
  letters, not parsed from free text), together with contextual calibration (Zhao et al. 2021, "Calibrate
  Before Use"): the same prompt with a content-free context ("N/A" where the document goes; the question and its
  options kept) gives the letter prior of that prompt, and the calibrated answer is the argmax of
  p(letter) / prior(letter). The prior is computed once per question and charged to the "calibration" FLOP scope,
  not to the question's query.
Closed book (context None) reads the question alone, with the dataset's budget and stops.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Hashable, Sequence

from ..engine.engine import Engine
from ..engine.errors import ContextOverflowError
from ..engine.flops import forward_flops
from ..engine.model import QUANT_MAX_TOKENS
from ..engine.node_store import STORE_DTYPES, StoredNode, as_stored
from ..engine.session import NodeSpan, Session
from .options import Option
from .prompts import PromptSpec

QUESTION_ONLY = ("Answer the question as concisely as you can. Do not provide any explanation.\n\n"
                 "Question: {question}\n{options}\nAnswer:")
CONTENT_FREE = "N/A"  # Zhao et al.'s content-free input
CONTEXT_MARK = "\x00"  # where the context goes when a prompt is tokenised in pieces (`Reader.pieces`)
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
# every method's `reader` option: the shared reader, or the paper's own final step (the paper-exact rows)
READER_OPTION = Option("reader", str, "shared", "shared: the dataset's prompt over what the method read "
                       "(nodekv.methods.reader); paper: the paper's own answer step", choices=("shared", "paper"))
# the options of a method that can read its nodes from a node store (engine/node_store.py) instead of prefilling them.
# kv_reuse stays off by default: storing costs the index a prefill of the whole document, which Top-X exists to avoid
# for a document asked once, and PECAN's Yes/No probe stops early on placed nodes. `blend`'s defaults are the setting
# measured best on qwen2.5-1.5b (results/issue34): 15% of each node's first tokens repaired, nodes stored in document
# context (BM25 Top-5: F1 +1.8 on HotpotQA and +6.8 on MuSiQue against prefilling, at 4.5x fewer query FLOPs).
KV_REUSE_OPTIONS = (
    Option("kv_reuse", str, "off", "off: prefill the nodes read; reuse: place their KV, prefilled once at indexing, "
           "with no forward (engine/node_store.py); blend: reuse, then recompute the `repair` fraction of their "
           "tokens chosen by `repair_by`", choices=("off", "reuse", "blend")),
    Option("repair", float, 0.15, "with kv_reuse=blend: the fraction of placed tokens recomputed", low=0.0, high=1.0),
    Option("repair_by", str, "boundary", "with kv_reuse=blend: deviation, the tokens whose keys deviate most "
           "(CacheBlend); boundary, each node's first tokens (EPIC)", choices=("deviation", "boundary")),
    Option("kv_dtype", str, "float16", "with kv_reuse: how the nodes' KV is stored (int8: a scale per vector)",
           choices=STORE_DTYPES),
    Option("kv_context", str, "document", "with kv_reuse: none: each node prefilled alone, from an empty cache; "
           "document: the nodes prefilled one after another in index order (a document's chunks in its order), so "
           "each holds what came before it", choices=("none", "document")))


def kv_index_key(config) -> dict:
    """What a method config with KV_REUSE_OPTIONS adds to its index key: the stored KV's dtype and, when not the
    default, its context (nothing with kv_reuse=off)."""
    if config.kv_reuse == "off":
        return {}
    return {"kv_dtype": config.kv_dtype, **({"kv_context": config.kv_context} if config.kv_context != "none" else {})}


def store_kv_nodes(engine: Engine, nodes: Sequence[Sequence[int]], config) -> list[StoredNode]:
    """The KV of `nodes` (token ids, in index order) as a method with KV_REUSE_OPTIONS stores it: each alone or one
    after another (`kv_context`), in the numbers the store file gives back (`kv_dtype`)."""
    stored = (engine.store_nodes(nodes) if config.kv_context == "document"
              else [engine.store_node(ids) for ids in nodes])
    return [as_stored(node, config.kv_dtype) for node in stored]


@dataclass(frozen=True)
class Repair:
    """Which placed tokens to recompute with their context: `fraction` of them, chosen `by`
    - "deviation": those whose keys deviate most in the first layer that sees context (CacheBlend); choosing costs
      that layer's pass over the placed tokens;
    - "boundary": each node's first tokens, the fraction of its own length (EPIC: a node prefilled alone starts with
      an attention sink that, placed after other text, it should not have); choosing costs nothing."""

    fraction: float = 0.0
    by: str = "deviation"

    @classmethod
    def of(cls, config) -> "Repair":
        """What a method config with KV_REUSE_OPTIONS asks for: nothing unless kv_reuse=blend."""
        return cls(config.repair if config.kv_reuse == "blend" else 0.0, config.repair_by)

    def positions(self, s: Session, spans: Sequence[NodeSpan]) -> list[int]:
        """The positions to recompute, in order, among the placed nodes' `spans` in session `s`."""
        if self.by == "boundary":
            return [p for span in spans for p in range(span.start, span.start + round(self.fraction * len(span)))]
        placed = [p for span in spans for p in range(span.start, span.end)]
        count = round(self.fraction * len(placed))
        return sorted(placed[i] for i in s.key_deviation(placed).topk(count).indices.tolist()) if count else []


@dataclass
class Answer:
    """A method's answer to one question, with what it cost and what it looked at."""

    text: str
    nodes: list[Hashable]            # ids of the nodes (chunks, IPs) the answer was conditioned on
    trace: list[dict] = field(default_factory=list)
    # query-dependent FLOPs by the engine's account (the whole answer, every step); a prompt prefix a method caches
    # per engine (DICE's) is charged to the first answer that prefills it, never again
    flops: int = 0
    prompt_tokens: int = 0           # tokens of the prompt the answer was read from (DICE reader=paper: see Dice)
    generated_tokens: int = 0        # tokens the answer decoded (DICE reader=paper: see Dice)
    truncated: bool = False          # the prompt was cut in the middle to fit the window
    context: str | None = None       # the text the reader read (None: closed book, or not kept by the paper's step)
    choice_probs: list[float] | None = None  # multiple choice: p(letter) normalised over the option letters
    choice_prior: list[float] | None = None  # ... and the content-free prior they are calibrated by
    prompt_s: float | None = None    # the shared reader: seconds until the prompt was in the cache (to first token)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def calibrated_choice(probs: Sequence[float], prior: Sequence[float]) -> int:
    """Index of the largest probs[i] / prior[i] (contextual calibration; the first on ties)."""
    ratios = [p / q for p, q in zip(probs, prior)]
    return max(range(len(ratios)), key=lambda i: (ratios[i], -i))


class GrowingPrompt:
    """The prompts of reads whose context grows by appending (a search's answer after each step, as PECAN's
    calibration sweeps them), kept prefilled in one session: each read forks the prefix its prompt shares with the
    previous read's, so the context is prefilled about once over all the reads instead of once a read.

    Numerics: an answer equals a fresh read's bit for bit only where every piece of its prompt runs on the kernels
    the whole prompt runs on. On the CPU a step of up to QUANT_MAX_TOKENS tokens takes other ones (a quantised
    model's own; qwen2.5-1.5b's logits then differ by ~1e-5), so every piece prefilled here, the kept ones and the
    rest after the fork, is longer than `min_tail` tokens, and a prompt with no such split is read fresh: bit-exact
    on the C++ kernels (tests; qwen2.5-1.5b and SmolLM2 measured). torch's GEMM (the torch backend) blocks rows by
    the step's size, so there an answer is within rounding of a fresh read's.
    FLOPs: what a fresh read of a prompt would have run beyond what ran (the pieces' own logit rows counted against
    it) is added to the engine's `saved`, so a read's FLOPs plus that is a fresh read's."""

    def __init__(self, engine: Engine, min_tail: int = QUANT_MAX_TOKENS):
        self.engine, self.min_tail = engine, min_tail
        self.base = Session(engine)
        self.previous: list[int] = []

    def __enter__(self) -> "GrowingPrompt":
        return self

    def __exit__(self, *exc) -> None:
        self.base.release()

    def fork(self, ids: Sequence[int]) -> Session:
        """A session holding a prefix of `ids` to append the rest to (one longer than `min_tail`), after keeping
        the part `ids` shares with the previous prompt prefilled in the base session."""
        ids, base, cfg = list(ids), self.base, self.engine.config
        shared = common_prefix(self.previous, ids)
        self.previous = ids
        keep = len(base.nodes)  # the kept pieces still wholly inside the shared part and leaving a long enough rest
        while keep and (base.nodes[keep - 1].end > shared or len(ids) - base.nodes[keep - 1].end <= self.min_tail):
            keep -= 1
        if keep == 0 and base.nodes:
            base.release()
            self.base = base = Session(self.engine)
        elif keep < len(base.nodes):
            base.truncate(base.nodes[keep - 1].node_id)
        start = len(base)
        if shared - start > self.min_tail and len(ids) - shared > self.min_tail:
            base.append(ids[start:shared])
        ran = forward_flops(cfg, len(base) - start, start) if len(base) > start else 0
        fresh = forward_flops(cfg, len(ids))
        self.engine.flops.saved += fresh - ran - forward_flops(cfg, len(ids) - len(base), len(base))
        return base.fork()


def check_room(model: int, spec: PromptSpec, window: int | None = None) -> int:
    """The tokens a reader's prompt may take: the window (the model's `model` tokens, or `window` below it) less the
    answer's `max_new_tokens`; a ValueError when that leaves none."""
    window = min(model, window or model)
    if window <= spec.max_new_tokens:
        raise ValueError(f"an answer of up to {spec.max_new_tokens} tokens (max_new_tokens) leaves no room for a "
                         f"prompt in a window of {window} tokens")
    return window - spec.max_new_tokens


def check_prompt_fits(tokens: int, window: int, what: str, window_name: str = "the model's window") -> None:
    """A ContextOverflowError (a ValueError) naming `what` when its `tokens` exceed a window of `window` tokens (the
    model's, or a shorter one the method keeps to, named by `window_name`): a method that builds its own prompt around
    a question checks it before prefilling any part of it."""
    if tokens > window:
        raise ContextOverflowError(f"{what} takes {tokens} tokens, more than {window_name} of {window}")


class Reader:
    """Answers a question from a context in the dataset's prompt (`spec`); `window` caps the prompt plus the answer
    below the model's window (how a model with a shorter window reads)."""

    def __init__(self, engine: Engine, spec: PromptSpec, window: int | None = None):
        self.engine, self.spec, self.window = engine, spec, window
        self.room = check_room(engine.config.max_seq_len, spec, window)
        self._priors: dict[tuple, list[float]] = {}

    def prompt_spec(self, context: str | None) -> PromptSpec:
        """The dataset's prompt, or the question-only one for a closed-book read (context None)."""
        return replace(self.spec, template=QUESTION_ONLY) if context is None else self.spec

    def prompt_ids(self, context: str | None, question: str, options: Sequence[str] = ()) -> tuple[list[int], bool]:
        """The chat-templated prompt, cut in the middle so that it plus the answer fits the window. Returns (ids,
        truncated)."""
        spec, room = self.prompt_spec(context), self.room

        def chat(context_text: str) -> list[int]:
            content = spec.render(context_text, question, tuple(options))
            return self.engine.tokenizer.chat([{"role": "user", "content": content}])

        ids = chat(context or "")
        if len(ids) <= room:
            return ids, False
        bare = len(chat(""))
        if bare > room:  # a middle cut would eat the instructions and the question, not the context
            raise ValueError(f"the prompt takes {bare} tokens without its context, more than the {room} a window of "
                             f"{room + spec.max_new_tokens} leaves beside the answer's {spec.max_new_tokens}")
        half = room // 2
        return ids[:half] + ids[len(ids) - (room - half):], True

    def check_question(self, question: str, options: Sequence[str] = ()) -> None:
        """A ValueError when the prompt with `question` (and `options`) leaves no room for a context: for a caller to
        check before it builds an index to answer it from."""
        self.prompt_ids("", question, options)

    def shared_length(self, context: str | None, question: str, options: Sequence[str] = ()) -> int:
        """How many leading ids of this question's prompt every question about `context` shares: where prompts
        with other questions part from it (two sentinel questions say where the question begins; a middle cut moves
        with the question's length, so the head alone is shared then)."""
        ids = self.prompt_ids(context, question, options)[0]
        a, b = (self.prompt_ids(context, q, options)[0] for q in ("?", "!"))
        return common_prefix(ids, a[:common_prefix(a, b)])

    def read(self, context: str | None, question: str, options: Sequence[str] = (), nodes: Sequence[Hashable] = (),
             trace: list[dict] | None = None, shared_prefix: bool = False,
             growing: GrowingPrompt | None = None) -> Answer:
        """The answer to `question` from `context`, charged to the engine's "query" FLOP scope. `options` make it a
        multiple-choice read. With `shared_prefix`, the prompt up to the question is forked from the engine's
        prefix cache (prefilled by the first question about this context, skipped and counted as saved by the
        next); with `growing`, from the prompt the previous read through it left (`GrowingPrompt`)."""
        ids, truncated = self.prompt_ids(context, question, options)
        shared = min(self.shared_length(context, question, options), len(ids) - 1) if shared_prefix else 0
        prior = self.letter_prior(question, options) if options else None
        eng = self.engine
        before, start = eng.flops.scopes["query"], time.perf_counter()
        with eng.flops.scope("query"), (growing.fork(ids) if growing is not None
                                        else eng.prefixes.fork(ids[:shared], node_id="shared") if shared > 0
                                        else eng.session()) as s:
            s.append(ids[len(s):], node_id="prompt")
            prompt_s = time.perf_counter() - start
            text, generated, probs = self._reply(s, options)
        answer = Answer(text, list(nodes), trace or [], eng.flops.scopes["query"] - before, len(ids), generated,
                        truncated, context=context, prompt_s=prompt_s)
        if options:
            answer.choice_probs, answer.choice_prior = probs, prior
        return answer

    def pieces(self, question: str, options: Sequence[str] = ()) -> tuple[list[int], list[int]]:
        """(head, tail): the chat-templated prompt's ids before and after its context, tokenised apart, so that the
        passages between them can be tokenised (and prefilled) on their own (`passage_ids`, `read_stored`)."""
        tok = self.engine.tokenizer
        text = tok.render_chat([{"role": "user", "content": self.spec.render(CONTEXT_MARK, question, tuple(options))}])
        head, tail = text.split(CONTEXT_MARK)
        return tok.encode(head, parse_special=True), tok.encode(tail, parse_special=True)

    def passage_ids(self, passage: str) -> list[int]:
        """A passage of the context on its own: the blank line that separates passages, then its text."""
        return self.engine.tokenizer.encode("\n\n" + passage.strip())

    def read_stored(self, passages: Sequence[StoredNode | Sequence[int]], question: str, options: Sequence[str] = (),
                    nodes: Sequence[Hashable] = (), trace: list[dict] | None = None, repair: Repair = Repair(),
                    context: str | None = None) -> Answer:
        """`read` over passages stored once (`Engine.store_node` of `passage_ids`), placed between the prompt's
        `pieces` without a forward over their tokens; a passage given as token ids (a separator, text that changes
        per question) is prefilled where it stands. `nodes` name the stored passages, in order. repair: which placed
        tokens are recomputed with their context (fraction 0: pure reuse; 1: a prefill's numbers). `context` (the
        passages' text) is kept for the diagnostics. The query is charged what runs: the head, the prefilled
        passages, choosing and recomputing the repaired tokens, the tail and the answer."""
        head, tail = self.pieces(question, options)
        n = len(head) + sum(len(p.tokens if isinstance(p, StoredNode) else p) for p in passages) + len(tail)
        window = min(self.engine.config.max_seq_len, self.window or self.engine.config.max_seq_len)
        if n + self.spec.max_new_tokens > window:
            raise ValueError(f"{n} prompt tokens and the answer's {self.spec.max_new_tokens} do not fit the window of "
                             f"{window}: stored passages are never cut")
        prior = self.letter_prior(question, options) if options else None
        eng = self.engine
        before, start = eng.flops.scopes["query"], time.perf_counter()
        with eng.flops.scope("query"), eng.session() as s:
            if head:
                s.append(head, node_id="head")
            spans = []
            for p in passages:
                if isinstance(p, StoredNode):
                    spans.append(s.append_stored(p))
                else:
                    s.append(list(p))
            worst = repair.positions(s, spans)
            if worst:
                s.repair(worst)
            s.append(tail, node_id="prompt")
            prompt_s = time.perf_counter() - start
            text, generated, probs = self._reply(s, options)
        recomputed = [sum(span.start <= p < span.end for p in worst) for span in spans]
        per_node = [{"node": node, "reused": len(span) - r, "recomputed": r}
                    for node, span, r in zip(nodes or range(len(spans)), spans, recomputed)]
        answer = Answer(text, list(nodes), (trace or []) + [{"placed": sum(map(len, spans)), "repaired": len(worst),
                                                               "nodes": per_node}],
                        eng.flops.scopes["query"] - before, n, generated, False, context=context, prompt_s=prompt_s)
        if options:
            answer.choice_probs, answer.choice_prior = probs, prior
        return answer

    def _reply(self, s: Session, options: Sequence[str]) -> tuple[str, int, list[float] | None]:
        """(answer text, tokens generated, letter probabilities or None) after the prompt in `s`."""
        if options:
            probs = list(s.probe(list(LETTERS[:len(options)])).values())
            return LETTERS[max(range(len(probs)), key=lambda i: (probs[i], -i))], 0, probs
        gen = s.generate(self.spec.sampling)
        return gen.text.strip(), len(gen.ids), None

    def letter_prior(self, question: str, options: Sequence[str]) -> list[float]:
        """The letter probabilities this question's prompt gives with a content-free context ("N/A" where the
        document goes; computed once per question and options, charged to the "calibration" FLOP scope). A
        closed-book read divides by the same prior, so that every row is calibrated by the same numbers."""
        key = (question, tuple(options))
        if key not in self._priors:
            ids, _ = self.prompt_ids(CONTENT_FREE, question, options)
            with self.engine.flops.scope("calibration"), self.engine.session() as s:
                s.append(ids, node_id="prompt")
                self._priors[key] = list(s.probe(list(LETTERS[:len(options)])).values())
        return self._priors[key]
