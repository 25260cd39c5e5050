"""Long-document QA methods and baselines, as policies on the engine: `get(name)(engine, **config)` gives an object
with `.index(document) -> Index` (query-independent, charged to the "index" FLOP scope by callers) and
`.answer(index, question) -> Answer`."""
from __future__ import annotations

from typing import Callable


def get(name: str) -> Callable:
    """The constructor of method `name`: "full", "bm25", "dense" (more arrive with the methods' issues)."""
    from . import baselines

    methods = {
        "full": baselines.FullContext,
        "bm25": lambda engine, **kw: baselines.TopK(engine, "bm25", **kw),
        "dense": lambda engine, **kw: baselines.TopK(engine, "dense", **kw),
    }
    if name not in methods:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(methods)}")
    return methods[name]


METHODS = ("full", "bm25", "dense")
