"""Next-token choice from last-position logits: greedy, or temperature + nucleus (top-p) sampling, seeded."""
from __future__ import annotations

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
