"""Declared method options: each has a type, a default, an allowed range or set of choices and a one-line help.
A method's options are checked and typed when it is built, so a bad one fails at once with a message that names
the method, the option and what it allows; strings (as `--option KEY=VALUE` gives them) are read by the declared
type."""
from __future__ import annotations

import keyword
import math
from dataclasses import dataclass, field, make_dataclass
from typing import Any, Collection

TYPES = (int, float, bool, str)
BOOL_WORDS = {"true": True, "1": True, "false": False, "0": False}


@dataclass(frozen=True)
class Option:
    """One option of a method, e.g. `Option("k", int, 5, "chunks retrieved", low=1)`."""

    name: str
    type: type                  # int, float, bool or str
    default: Any
    help: str = ""
    low: float | None = None    # inclusive bounds of an int or float option
    high: float | None = None
    choices: tuple = ()         # the values allowed, when they are few
    before: Any = None          # the value that runs as the code did before this option existed, if one does: a run
                                # file written then resumes under it (`evaluation.runner.check_resumable`)

    def __post_init__(self):
        if self.type not in TYPES:
            raise TypeError(f"option {self.name}: type must be int, float, bool or str, got {self.type!r}")

    def check(self, value: Any, method: str) -> Any:
        """`value` as the declared type, or a ValueError naming `method`, this option and what it allows."""
        typed = self._typed(value)
        if typed is None:  # a bool's words are nodekv's own choice: name them
            kind = f"bool ({', '.join(BOOL_WORDS)})" if self.type is bool else self.type.__name__
            raise ValueError(f"{method} option {self.name} must be {kind}, got {value!r}")
        if self.type is float and not math.isfinite(typed):  # NaN passes every bound; inf ("1e999") makes NaN scores
            raise ValueError(f"{method} option {self.name} must be a finite number, got {value!r}")
        if self.choices and typed not in self.choices:
            raise ValueError(f"{method} option {self.name} must be one of {', '.join(map(str, self.choices))}, "
                             f"got {value!r}")
        if (self.low is not None and typed < self.low) or (self.high is not None and typed > self.high):
            raise ValueError(f"{method} option {self.name} must be {self._bounds()}, got {value!r}")
        return typed

    def allowed(self) -> str:
        """What the option takes, for help texts: "int >= 1", "float in [0, 1]", "str: paper | restate"."""
        if self.choices:
            return f"{self.type.__name__}: {' | '.join(map(str, self.choices))}"
        return " ".join(filter(None, [self.type.__name__, self._bounds()]))

    def _bounds(self) -> str:
        if self.low is not None and self.high is not None:
            return f"in [{self.low:g}, {self.high:g}]"
        if self.low is not None:
            return f">= {self.low:g}"
        return "" if self.high is None else f"<= {self.high:g}"

    def _typed(self, value: Any) -> Any:
        """`value` converted to the declared type where nothing is lost (a str read by the type, an int as a
        float, 0 or 1 as a bool: the CLI reads --option x=1 as JSON's 1), else None. A bool is not taken for an
        int, nor 2.0 for 2."""
        kind = self.type
        if isinstance(value, str) and kind is not str:
            text = value.strip().lower()
            if kind is bool:
                return BOOL_WORDS.get(text)
            try:
                return kind(text)
            except ValueError:
                return None
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if kind is bool and type(value) is int and value in (0, 1):
            return bool(value)
        if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
            return value
        return None


def config_class(owner: type, options: tuple[Option, ...], method: str, reserved: Collection[str] = ()) -> type:
    """`owner.Config`: a dataclass with one field per option (default: the option's) that checks and types every
    value when an instance is made; `method` is how its messages name the method. A ValueError names `owner` and
    an option whose name is no Python identifier, is a keyword, repeats, or is one of `reserved` (the keywords
    that `owner(...)` takes itself, which the option's value would never reach)."""
    seen: set[str] = set()
    for option in options:
        problem = ("is not a Python identifier" if not option.name.isidentifier() else
                   "is a Python keyword" if keyword.iskeyword(option.name) else
                   "is declared twice" if option.name in seen else
                   f"is one of {owner.__name__}(...)'s own keyword arguments: {', '.join(sorted(reserved))}"
                   if option.name in reserved else "")
        if problem:
            raise ValueError(f"{owner.__module__}.{owner.__qualname__}: option name {option.name!r} {problem}")
        seen.add(option.name)

    def check(self) -> None:
        for option in options:
            setattr(self, option.name, option.check(getattr(self, option.name), method))

    fields = [(o.name, o.type, field(default=o.default)) for o in options]
    namespace = {"__post_init__": check, "__module__": owner.__module__, "__qualname__": f"{owner.__qualname__}.Config"}
    return make_dataclass("Config", fields, namespace=namespace)
