"""Next-token choice from last-position logits: greedy, or temperature + nucleus (top-p) sampling, seeded; and the
repetition penalty that may come before it."""
from __future__ import annotations

from typing import Sequence

import torch


def check_sampling(temperature: float, top_p: float) -> None:
    if not temperature >= 0.0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def sample(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> int:
    """One token id from float32 logits [vocab]; temperature 0 is greedy (argmax, lowest id on ties)."""
    if temperature == 0.0:  # numpy's argmax (first maximum, like torch's) costs ~9 us here against torch's ~100
        return int(logits.numpy().argmax()) if logits.is_cpu and logits.dtype == torch.float32 else int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
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
        if not penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {penalty}")
        self.penalty = penalty
        self.context = torch.zeros(vocab_size, dtype=torch.bool)
        self.context[torch.as_tensor(list(context), dtype=torch.long)] = True

    def __call__(self, ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        seen = self.context.clone()
        seen[torch.as_tensor(ids, dtype=torch.long)] = True
        picked = logits[seen]
        logits[seen] = torch.where(picked > 0, picked / self.penalty, picked * self.penalty)
        return logits
