"""Decoding: one session's generation in progress (`GenerationState`: steering, sampling, stop strings, finish), the
`Generation` it ends with, and the loop that advances several of them with one forward per token (`step`, `generate`).

A step takes each state's next token from the logits after its session's last token: the repetition penalty and the
logits processors first, then the constraint mask (`allowed_tokens`, `choices`), then greedy or temperature/top-p
sampling. The chosen tokens of all states run as one batched forward (`Engine.run_batch`), which gives each its next
logits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Hashable, Literal, Sequence

import torch

from .cache_batch import check_distinct
from .runner import DecodingSession, ModelRunner
from .sampling import RepetitionPenalty, SamplingParams, sample, seeded_generator

# fn(ids generated so far, logits [vocab]) -> logits: steers the next token (it may modify logits in place)
LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]

FinishReason = Literal["stop", "eos", "length", "window"]


@dataclass(frozen=True)
class Generation:
    """What a generation produced. finish_reason: "stop" (a stop string appeared: `text` is cut before it, its tokens
    stay in `ids`; or a `choices` string was completed), "eos" (the end-of-sequence token, not kept), "length"
    (max_new_tokens) or "window" (the context window is full). logprobs[i] = log p(ids[i]) under the model itself,
    before processors, constraints and temperature; flops: the exact FLOPs of the forwards this generation ran."""

    text: str
    ids: list[int]
    node_id: Hashable | None  # the session node holding `ids` (None when nothing was generated)
    finish_reason: FinishReason
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


# what a generation tells its session when it ends: (state, generated ids, logits after them, their attention mass)
# on finishing; (state, None, None, None) on a cancel. The session settles its own state (`Session.start_generation`).
Settle = Callable[["GenerationState", "list[int] | None", "torch.Tensor | None", "torch.Tensor | None"], None]


class GenerationState:
    """One session's generation in progress; `Session.start_generation` makes it, `step` advances it, and once it is
    `done`, `result` holds its `Generation` and the session holds the generated node. While it runs, the session
    refuses other work; `cancel` puts the session back as it was before.

    `logits` are the model's after the session's last token, `node_id` the id the generated node will take, `settle`
    the session's callback for the end; steering: `logits_processors`, `allowed_tokens`, `choices`; `collect` records
    each generated token's attention mass to every node."""

    def __init__(self, session: DecodingSession, params: SamplingParams, logits: torch.Tensor, node_id: Hashable,
                 settle: Settle, logits_processors: Sequence[LogitsProcessor] = (),
                 allowed_tokens: Collection[int] | None = None, choices: Sequence[str] | None = None,
                 collect: bool = False):
        self.session, self.params, self.settle = session, params, settle
        self.max_new_tokens, self.stops = params.max_new_tokens, list(params.stop)
        self.generator = seeded_generator(params.seed) if params.seed is not None else None
        tok, vocab = session.engine.tokenizer, session.engine.config.vocab_size
        seen = session.tokens if params.penalize_prompt else ()
        penalty = [] if params.repetition_penalty == 1.0 else [RepetitionPenalty(params.repetition_penalty, seen,
                                                                                 vocab)]
        self.processors = penalty + list(logits_processors or [])
        self.allowed = None if allowed_tokens is None else _token_mask(allowed_tokens, vocab)
        if isinstance(choices, str):  # iterating it would allow each of its characters
            raise ValueError(f"choices must be a list of strings, got the one string {choices!r}")
        self.trie = None if choices is None else ChoiceTrie([tok.encode(c) for c in choices])
        self._trie_node = None if self.trie is None else self.trie.root
        self.logits, self.node_id = logits, node_id
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.flops = 0
        self.result: Generation | None = None
        self._stream = tok.decode_stream(context=session.tokens[-8:])
        self._bounds = [s.start for s in session.nodes] + [len(session.tokens)] if collect else None
        self._mass_rows: list[torch.Tensor] = []  # one per accepted token
        self._pending_mass: torch.Tensor | None = None  # the chosen token's, filled by its forward
        self._cancelled = False
        # `generate` settles finishes after its last step: until then a failure cancels this state as a running one,
        # back onto the pages its session held since it began (a settled finish lets them go: `PagedKVCache.hold`)
        self._settle_late = False
        self._unsettled: tuple | None = None  # (ids, logits, mass) of a finish not yet settled

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
                shape = logits.shape
                logits = fn(list(self.ids), logits)
                if not isinstance(logits, torch.Tensor) or logits.shape != shape:
                    got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
                    raise ValueError(f"logits processor {fn!r} returned {got}, not logits of shape {tuple(shape)}")
            mask = self._mask()
            if mask is not None:
                logits = logits.masked_fill(~mask, float("-inf"))
        token = sample(logits, self.params.temperature, self.params.top_p, self.generator)
        if token in self.session.engine.tokenizer.eos_ids:
            return self._finish("eos")
        if self.session.cache.length + 1 > self.session.engine.config.max_seq_len:
            return self._finish("window")
        if self._bounds is not None:  # this token's attention mass to every node, the generated one included
            device = self.session.engine.device  # where the attention kernels add to it
            self._pending_mass = torch.zeros(1, len(self._bounds), device=device)
            bounds = torch.tensor(self._bounds + [self.session.cache.length + 1], dtype=torch.int32, device=device)
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
        """Stop here and put the session back as it was before the generation (a finished one loses its node too,
        while it is still the session's last: a ValueError once other nodes follow it)."""
        if self._cancelled:
            return
        self.settle(self, None, None, None)
        self._cancelled, self._unsettled = True, None

    def _settle_finish(self) -> None:
        """Settle a finish that `_settle_late` kept back."""
        if self._unsettled is not None:
            finish, self._unsettled = self._unsettled, None
            self.settle(self, *finish)

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
        mass = torch.cat(self._mass_rows) if self._bounds is not None and self.ids else None
        if self._settle_late:
            self._unsettled = (self.ids, self.logits, mass)
        else:
            self.settle(self, self.ids, self.logits, mass)
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


def check_one_engine(engine: ModelRunner, sessions: Sequence[DecodingSession]) -> None:
    """A batch runs one model: every session must be on `engine` (another engine's sessions hold another model's
    keys and values)."""
    if any(s.engine is not engine for s in sessions):
        raise ValueError("every session of a batch must belong to the engine that runs it")


def step(engine: ModelRunner, states: Sequence[GenerationState]) -> list[GenerationState]:
    """Advance every unfinished state by one token, all of them in one forward; returns those still running.
    If the forward fails, no state has advanced (every session is as it was before this step)."""
    check_one_engine(engine, [st.session for st in states])
    chosen: list[tuple[GenerationState, int]] = []
    outs, flops = [], []
    draws = [(st.generator, st.generator.get_state()) for st in states if st.generator is not None and not st.done]
    try:
        for st in states:
            token = None if st.done else st.choose()
            if token is not None:
                chosen.append((st, token))
        if chosen:
            outs, flops = engine.run_batch([[t] for _, t in chosen], [st.session.cache for st, _ in chosen],
                                           decode=True)
    except BaseException:  # a seeded generation retried after this draws what it would have drawn
        for generator, state in draws:
            generator.set_state(state)
        raise
    finally:  # collection targets are per forward
        for st, _ in chosen:
            st.session.cache.collect(None, None)
    for (st, t), logits, f in zip(chosen, outs, flops):
        st.accept(t, logits[-1], f)
    return [st for st in states if not st.done]


def generate(engine: ModelRunner, sessions: Sequence[DecodingSession], params: SamplingParams,
             seeds: Sequence[int | None] | None = None, **steering) -> list[Generation]:
    """Generate after each session with `params`, the sessions' decode steps batched as one forward per token;
    `seeds`, one per session, replace params.seed (independent draws from equal prompts); `steering` as for
    `Session.start_generation`. Each state is seeded as it would be alone, so the results equal generating in each
    session alone. On an error every session is as it was before the call."""
    check_one_engine(engine, sessions)
    check_distinct([s.cache for s in sessions])  # before any session starts: the second start would find it busy
    seeds = [params.seed] * len(sessions) if seeds is None else list(seeds)
    if len(seeds) != len(sessions):
        raise ValueError(f"{len(seeds)} seeds for {len(sessions)} sessions: give one seed, or one per session")
    states: list[GenerationState] = []
    try:
        for s, seed in zip(sessions, seeds):
            one = params if seed == params.seed else SamplingParams.of(params, seed=seed)
            states.append(s.start_generation(one, **steering))
            states[-1]._settle_late = True  # a later failure takes back what finished states copied on write too
        running = states
        while running:
            running = step(engine, running)
        for st in states:
            st._settle_finish()
    except BaseException:
        for st in states:
            st.cancel()
        raise
    return [st.result for st in states]
