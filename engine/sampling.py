"""How a generation chooses its tokens and when it ends (`SamplingParams`, one value that `Session.generate`,
`Engine.generate_batch` and the methods' prompt specs carry), the next-token choice from last-position logits
(greedy, or temperature + nucleus sampling, seeded) and the repetition penalty that may come before it."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Sequence

import torch


@dataclass(frozen=True)
class SamplingParams:
    """A generation's decoding settings (vLLM's idea: one value instead of the same keywords on every call).

    max_new_tokens: tokens at most; stop: strings that end the generation (the text is cut before the first one);
    temperature 0 is greedy (argmax), above it sampling with nucleus `top_p`, drawn from a generator seeded with
    `seed` (None: torch's global one); repetition_penalty: CTRL's (`RepetitionPenalty`), > 1 discourages repeats,
    over the generated tokens and, with `penalize_prompt` (HF's rule), the cached prompt's too."""

    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    penalize_prompt: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {self.max_new_tokens!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        check_sampling(self.temperature, self.top_p)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2 ** 64):
            raise ValueError(f"seed must be an int in [0, 2**64) or None (torch's global generator), got {self.seed!r}")
        check_penalty(self.repetition_penalty)

    @classmethod
    def of(cls, params: "SamplingParams | int", **changes: Any) -> "SamplingParams":
        """`params` itself, or max_new_tokens = `params` with the other fields from `changes` (`stop=None` is no
        stop); the keywords a generate call takes besides its steering options."""
        unknown = sorted(set(changes) - {f.name for f in fields(cls)})
        if unknown:
            raise TypeError(f"unknown sampling option(s) {', '.join(unknown)}")
        changes = {k: v for k, v in changes.items() if not (k == "stop" and v is None)}
        if isinstance(params, SamplingParams):
            return replace(params, **changes) if changes else params
        return cls(max_new_tokens=params, **changes)


def seeded_generator(seed: int) -> torch.Generator:
    """A CPU generator for `seed` in [0, 2**64). torch's CPU generator keeps the low 32 bits of a seed only, so seeds
    that differ by 2**32 would draw one stream: a seed of 2**32 or more is folded to 32 bits (the xor of its halves)
    first, and one below 2**32 is torch's own."""
    return torch.Generator().manual_seed((seed ^ (seed >> 32)) & 0xFFFFFFFF)


def check_sampling(temperature: float, top_p: float) -> None:
    """A ValueError for a temperature that is not a finite number >= 0 or a top_p outside (0, 1] (a bool is
    neither)."""
    def number(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    if not (number(temperature) and 0.0 <= temperature < math.inf):  # NaN fails the bounds too
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not (number(top_p) and 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")


def check_penalty(penalty: float) -> None:
    """A ValueError for a repetition penalty that is not a finite number > 0 (inf or NaN would make repeated tokens'
    logits 0, -inf or NaN)."""
    if not (isinstance(penalty, (int, float)) and 0.0 < penalty < math.inf):
        raise ValueError(f"repetition_penalty must be a finite number > 0, got {penalty!r}")


def sample(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> int:
    """One token id from float32 logits [vocab]; temperature 0 is greedy (argmax, lowest id on ties)."""
    if temperature == 0.0:  # numpy's argmax (first maximum, like torch's) costs ~9 us here against torch's ~100
        return int(logits.numpy().argmax()) if logits.is_cpu and logits.dtype == torch.float32 else int(logits.argmax())
    # the largest logit goes to 0 before the division, so that no logit overflows to +inf (NaN probabilities) under
    # a tiny temperature; in float64, where a positive temperature never rounds to 0 (float32's would below ~1e-45)
    probs = torch.softmax(((logits.double() - logits.max()) / temperature).float(), dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is < top_p
        keep = (sorted_probs.cumsum(0) - sorted_probs) < top_p
        sorted_probs = sorted_probs * keep
        return int(order[torch.multinomial(sorted_probs, 1, generator=generator)])
    return int(torch.multinomial(probs, 1, generator=generator))


class RepetitionPenalty:
    """The repetition penalty of CTRL (Keskar et al., 2019) as HF transformers applies it: the logit of every token id
    in the context (the cached prompt) or generated so far is divided by `penalty` where it is positive and multiplied
    by it where it is negative; > 1 discourages repeats. A logits processor (ids generated so far, logits) -> logits."""

    def __init__(self, penalty: float, context: Sequence[int], vocab_size: int):
        check_penalty(penalty)
        self.penalty = penalty
        self.context = torch.zeros(vocab_size, dtype=torch.bool)
        self.context[torch.as_tensor(list(context), dtype=torch.long)] = True

    def __call__(self, ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        seen = self.context.clone()
        seen[torch.as_tensor(ids, dtype=torch.long)] = True
        picked = logits[seen]
        logits[seen] = torch.where(picked > 0, picked / self.penalty, picked * self.penalty)
        return logits
