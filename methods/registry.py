"""Which methods exist. A method joins by declaring its name (`class ClosedBook(Method, name="closed-book")`);
the registry imports the built-in method modules when a method is first looked up, and the modules or classes
that installed packages name in the `nodekv.methods` entry-point group, so that a user's package adds methods
without touching nodekv:

    [project.entry-points."nodekv.methods"]
    my-method = "my_package.my_method"          # a module declaring `class MyMethod(Method, name="my-method")`
"""
from __future__ import annotations

import importlib
import importlib.metadata
import warnings

from .base import REGISTERED, Method

BUILTIN_MODULES = ("baselines", "dice", "gor", "jerr", "pecan")  # modules and method folders
ENTRY_POINT_GROUP = "nodekv.methods"


def get(name: str) -> type[Method]:
    """The class of method `name`, called as `get(name)(engine, **options)`."""
    _import_builtins()
    if name not in REGISTERED:
        _load_entry_points()
    if name not in REGISTERED:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(names())}")
    return REGISTERED[name]


def names() -> list[str]:
    """The registered methods' names, sorted."""
    _import_builtins()
    _load_entry_points()
    return sorted(REGISTERED)


def _import_builtins() -> None:
    for module in BUILTIN_MODULES:
        importlib.import_module(f"{__package__}.{module}")


def _load_entry_points() -> None:
    """Import what the entry points name (cheap once imported). A plugin that fails to load is reported and left
    out, so that it cannot break the other methods."""
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            entry.load()
        except Exception as e:  # any error in a third party's import
            warnings.warn(f"method plugin {entry.name} ({entry.value}) failed to load: {type(e).__name__}: {e}",
                          stacklevel=3)
