"""Long-document QA methods and baselines, as policies on the engine: `get(name)(engine, **config)` gives an object
with `.index(document) -> Index` (query-independent, charged to the "index" FLOP scope by callers) and
`.answer(index, question) -> Answer`."""
from __future__ import annotations

from typing import Callable


def get(name: str) -> Callable:
    """The constructor of method `name`: "pecan", "full", "bm25", "dense"."""
    from . import baselines, pecan

    methods = {
        "pecan": pecan.Pecan,
        "full": baselines.FullContext,
        "bm25": lambda engine, **kw: baselines.TopK(engine, "bm25", **kw),
        "dense": lambda engine, **kw: baselines.TopK(engine, "dense", **kw),
    }
    if name not in methods:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(methods)}")
    return methods[name]


METHODS = ("pecan", "full", "bm25", "dense")
