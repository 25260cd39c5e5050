"""Decoding: one session's generation in progress (`GenerationState`: steering, sampling, stop strings, finish), the
`Generation` it ends with, and the loop that advances several of them with one forward per token (`step`, `generate`).

A step takes each state's next token from the logits after its session's last token: the repetition penalty and the
logits processors first, then the constraint mask (`allowed_tokens`, `choices`), then greedy or temperature/top-p
sampling. The chosen tokens of all states run as one batched forward (`Engine.run_batch`), which gives each its next
logits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Collection, Hashable, Sequence

import torch

from .sampling import RepetitionPenalty, check_sampling, sample

if TYPE_CHECKING:
    from .engine import Engine
    from .session import Session

# fn(ids generated so far, logits [vocab]) -> logits: steers the next token (it may modify logits in place)
LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]

FINISH_REASONS = ("stop", "eos", "length", "window")


@dataclass(frozen=True)
class Generation:
    """What a generation produced. finish_reason: "stop" (a stop string appeared: `text` is cut before it, its tokens
    stay in `ids`; or a `choices` string was completed), "eos" (the end-of-sequence token, not kept), "length"
    (max_new_tokens) or "window" (the context window is full). logprobs[i] = log p(ids[i]) under the model itself,
    before processors, constraints and temperature; flops: the exact FLOPs of the forwards this generation ran."""

    text: str
    ids: list[int]
    node_id: Hashable | None  # the session node holding `ids` (None when nothing was generated)
    finish_reason: str
    logprobs: list[float]
    flops: int


class ChoiceTrie:
    """The token sequences of allowed strings as a trie: which tokens may come next, and where a string is complete."""

    def __init__(self, sequences: Sequence[Sequence[int]]):
        if not sequences or any(len(s) == 0 for s in sequences):
            raise ValueError("choices must be non-empty strings (at least one)")
        self.root: dict = {}
        for seq in sequences:
            node = self.root
            for t in seq:
                node = node.setdefault(t, {})
            node[None] = {}  # a string ends here

    @staticmethod
    def next_tokens(node: dict) -> list[int]:
        return [t for t in node if t is not None]

    @staticmethod
    def complete(node: dict) -> bool:
        return None in node


class GenerationState:
    """One session's generation in progress; `Session.start_generation` makes it, `step` advances it, and once it is
    `done`, `result` holds its `Generation` and the session holds the generated node. While it runs, the session
    refuses other work; `cancel` puts the session back as it was before."""

    def __init__(self, session: "Session", max_new_tokens: int, stop: Sequence[str] | str | None = None,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                 logits_processors: Sequence[LogitsProcessor] = (), allowed_tokens: Collection[int] | None = None,
                 choices: Sequence[str] | None = None, node_id: Hashable | None = None, collect: bool = False,
                 repetition_penalty: float = 1.0):
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        check_sampling(temperature, top_p)
        self.stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not s for s in self.stops):
            raise ValueError("stop strings must be non-empty")
        session._check_idle()
        self.session, self.max_new_tokens = session, max_new_tokens
        self.temperature, self.top_p = temperature, top_p
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        tok, vocab = session.engine.tokenizer, session.engine.config.vocab_size
        penalty = [] if repetition_penalty == 1.0 else [RepetitionPenalty(repetition_penalty, session.tokens, vocab)]
        self.processors = penalty + list(logits_processors or [])
        self.allowed = None if allowed_tokens is None else _token_mask(allowed_tokens, vocab)
        self.trie = None if choices is None else ChoiceTrie([tok.encode(c) for c in choices])
        self._trie_node = None if self.trie is None else self.trie.root
        self.logits = session._last_logits()
        self.node_id = session._new_node_id(node_id)
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.flops = 0
        self.result: Generation | None = None
        self._stream = tok.decode_stream(context=session.tokens[-8:])
        self._bounds = [s.start for s in session.nodes] + [len(session.tokens)] if collect else None
        self._mass_rows: list[torch.Tensor] = []  # one per accepted token
        self._pending_mass: torch.Tensor | None = None  # the chosen token's, filled by its forward
        self._nodes_before = len(session.nodes)
        self._cancelled = False
        session._begin_generation(self)

    @property
    def done(self) -> bool:
        return self.result is not None or self._cancelled

    def choose(self) -> int | None:
        """The next token, or None when the generation ends here (at EOS, the window's end, or max_new_tokens = 0)."""
        if self.max_new_tokens == 0:
            return self._finish("length")
        logits = self.logits
        if self.processors or self.allowed is not None or self.trie is not None:
            logits = logits.clone()  # the session keeps the model's logits of its last node
            for fn in self.processors:
                logits = fn(list(self.ids), logits)
            mask = self._mask()
            if mask is not None:
                logits = logits.masked_fill(~mask, float("-inf"))
        token = sample(logits, self.temperature, self.top_p, self.generator)
        if token in self.session.engine.tokenizer.eos_ids:
            return self._finish("eos")
        if self.session.cache.length + 1 > self.session.engine.config.max_seq_len:
            return self._finish("window")
        if self._bounds is not None:  # this token's attention mass to every node, the generated one included
            self._pending_mass = torch.zeros(1, len(self._bounds))
            bounds = torch.tensor(self._bounds + [self.session.cache.length + 1], dtype=torch.int32)
            self.session.cache.collect(bounds, self._pending_mass)
        return token

    def accept(self, token: int, logits: torch.Tensor, flops: int) -> None:
        """Record `token` (now cached), the logits after it and the FLOPs of its forward; end at a stop string or a
        completed choice."""
        self.logprobs.append(float(self.logits[token] - torch.logsumexp(self.logits, 0)))
        self.ids.append(token)
        if self._pending_mass is not None:
            self._mass_rows.append(self._pending_mass)
        self.logits, self.flops = logits, self.flops + flops
        before = len(self._stream.text)
        self._stream.push(token)
        if self.stops:
            text = self._stream.text
            start = max(0, before - max(map(len, self.stops)) + 1)  # earlier hits were looked for at earlier tokens
            hit = min((i for i in (text.find(s, start) for s in self.stops) if i >= 0), default=-1)
            if hit >= 0:
                self._finish("stop", text[:hit])
                return
        if self.trie is not None:
            self._trie_node = self._trie_node[token]
            if not ChoiceTrie.next_tokens(self._trie_node):
                self._finish("stop")
                return
        if len(self.ids) == self.max_new_tokens:
            self._finish("length")

    def cancel(self) -> None:
        """Stop here and put the session back as it was before the generation (a finished one loses its node too)."""
        if self._cancelled:
            return
        self._cancelled = True
        s = self.session
        s._end_generation(self)
        if not s.cache.released:
            s.cache.collect(None, None)
            s._keep_nodes(self._nodes_before)

    def _mask(self) -> torch.Tensor | None:
        """bool [vocab]: the tokens the constraints allow next (None: any)."""
        mask = self.allowed
        if self.trie is not None:
            ok = ChoiceTrie.next_tokens(self._trie_node)
            if ChoiceTrie.complete(self._trie_node):
                ok += list(self.session.engine.tokenizer.eos_ids)
            trie_mask = _token_mask(ok, self.logits.shape[0])
            mask = trie_mask if mask is None else mask & trie_mask
            if not mask.any():
                raise ValueError("allowed_tokens and choices leave no token to generate")
        return mask

    def _finish(self, reason: str, text: str | None = None) -> None:
        if text is None:
            self._stream.flush()
            text = self._stream.text
        s = self.session
        s._end_generation(self)
        mass = torch.cat(self._mass_rows) if self._bounds is not None and self.ids else None
        if self.ids:
            s._add_node(self.node_id, self.ids, self.logits, mass)
        self.result = Generation(text, self.ids, self.node_id if self.ids else None, reason, self.logprobs, self.flops)
        return None


def _token_mask(ids: Collection[int], vocab: int) -> torch.Tensor:
    ids = list(ids)
    if not ids:
        raise ValueError("allowed_tokens is empty")
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ValueError(f"allowed token id {bad[0]} is outside the vocabulary [0, {vocab})")
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[ids] = True
    return mask


def check_one_engine(engine: "Engine", sessions: Sequence["Session"]) -> None:
    """A batch runs one model: every session must be on `engine` (another engine's sessions hold another model's
    keys and values)."""
    if any(s.engine is not engine for s in sessions):
        raise ValueError("every session of a batch must belong to the engine that runs it")


def step(engine: "Engine", states: Sequence[GenerationState]) -> list[GenerationState]:
    """Advance every unfinished state by one token, all of them in one forward; returns those still running.
    If the forward fails, no state has advanced (every session is as it was before this step)."""
    check_one_engine(engine, [st.session for st in states])
    chosen: list[tuple[GenerationState, int]] = []
    outs, flops = [], []
    try:
        for st in states:
            token = None if st.done else st.choose()
            if token is not None:
                chosen.append((st, token))
        if chosen:
            outs, flops = engine.run_batch([[t] for _, t in chosen], [st.session.cache for st, _ in chosen],
                                           decode=True)
    finally:  # collection targets are per forward
        for st, _ in chosen:
            st.session.cache.collect(None, None)
    for (st, t), logits, f in zip(chosen, outs, flops):
        st.accept(t, logits[-1], f)
    return [st for st in states if not st.done]


def generate(engine: "Engine", sessions: Sequence["Session"], max_new_tokens: int, **options) -> list[Generation]:
    """Generate after each session, the sessions' decode steps batched as one forward per token; `options` as for
    `GenerationState`, except that `seed` may also be a sequence, one per session (independent draws from equal
    prompts). Each state is seeded as it would be alone, so the results equal generating in each session alone. On
    an error every session is as it was before the call."""
    check_one_engine(engine, sessions)
    seed = options.pop("seed", None)
    seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed] * len(sessions)
    if len(seeds) != len(sessions):
        raise ValueError(f"{len(seeds)} seeds for {len(sessions)} sessions: give one seed, or one per session")
    states: list[GenerationState] = []
    try:
        for s, one in zip(sessions, seeds):
            states.append(s.start_generation(max_new_tokens, seed=one, **options))
        running = states
        while running:
            running = step(engine, running)
    except BaseException:
        for st in states:
            st.cancel()
        raise
    return [st.result for st in states]
