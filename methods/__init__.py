"""Long-document QA methods and baselines, as policies on the engine: `get(name)(engine, **options)` gives a
`Method` (methods/base.py) with `.index(document) -> Index` (query-independent, charged to the "index" FLOP scope
by callers) and `.answer(index, question) -> Answer`; `names()` lists the registered methods."""
from .registry import get, names

__all__ = ["get", "names"]
