"""What every method shares: the `Method` base class (its declared options, the registry it joins by declaring a
name, its optional hooks) and the Answer it returns (`reader`)."""
from __future__ import annotations

import functools
import inspect
import json
import re
import typing
from abc import ABC, abstractmethod
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, ClassVar, Sequence

from ..engine.engine import Engine
from ..engine.tokenizer import check_unicode
from .options import Option, config_class
from .prompts import PromptSpec, prompt_for
from .reader import LETTERS, Answer, Reader, check_room

REGISTERED: dict[str, type[Method]] = {}
"""Every Method subclass declared with a name, by name; `nodekv.methods.get` and `names` read it after importing
the built-in method modules and the `nodekv.methods` entry points."""


# characters that show nothing and that str.strip keeps: zero-width space, (non-)joiner, word joiner, BOM
_INVISIBLE = dict.fromkeys(map(ord, "\u200b\u200c\u200d\u2060\ufeff"))


def _blank(text: str) -> bool:
    """Whether `text` shows nothing: whitespace and invisible characters only."""
    return not text.translate(_INVISIBLE).strip()


def check_question(question: str) -> str:
    """`question`, or a ValueError if it is not text or is blank: every method's `answer` checks it before any
    prefill (`Method.__init_subclass__`), and the CLI before a model loads."""
    if not isinstance(question, str):
        raise ValueError(f"the question must be text, got {type(question).__name__}")
    if _blank(question):
        raise ValueError("the question is empty (nothing to ask)")
    return check_unicode(question, "the question")


def check_document(document: str, what: str = "the document") -> str:
    """`document`, or a ValueError naming `what` it is if it is not text, is blank or holds NUL characters (a
    binary file read as text): every method's `index` checks it before any prefill (`Method.__init_subclass__`),
    and the CLI before a model loads."""
    if not isinstance(document, str):
        raise ValueError(f"{what} must be text, got {type(document).__name__}")
    if _blank(document):
        raise ValueError(f"{what} is empty: nothing to index")
    nul = document.find("\0")
    if nul >= 0:
        raise ValueError(f"{what} holds NUL characters (the first at character {nul}): binary data, not text")
    return check_unicode(document, what)


def check_options(options: Sequence[str]) -> tuple[str, ...]:
    """`options` as a tuple, or a ValueError if they are not a multiple-choice question's options: distinct,
    non-blank strings, at most one per answer letter (none: an open question). Every method's `answer` checks them
    before any prefill (`Method.__init_subclass__`)."""
    if isinstance(options, str):  # iterating it would take each of its characters for an option
        raise ValueError(f"options must be a list of strings, got the one string {options!r}")
    if not isinstance(options, (list, tuple)) or not all(isinstance(o, str) for o in options):
        raise ValueError(f"options must be a list of strings, got {options!r}")
    if not all(o.strip() for o in options):
        raise ValueError(f"options must be non-empty strings, got {list(options)!r}")
    repeated = sorted({o for o in options if options.count(o) > 1})
    if repeated:  # two letters for one answer: which is right?
        raise ValueError(f"options must be distinct, got {', '.join(map(repr, repeated))} more than once")
    if len(options) > len(LETTERS):
        raise ValueError(f"options must be at most {len(LETTERS)} (one per answer letter), got {len(options)}")
    return tuple(check_unicode(o, f"option {letter}") for letter, o in zip(LETTERS, options))


def _checked(method, checks: Sequence[tuple[Callable[[Any], Any], str, int, Any]], returns: type = object):
    """`method` running each (check, name, position, default) of `checks` on its argument `name` (the `position`-th
    after self; `default` when not given) before it runs, and refusing a result that is not a `returns` (a plugin's
    answer given as a plain str would fail later, far from its cause); applied once to each class's own `answer`
    (the question, the options, the index, an Answer) and `index` (the document)."""
    if getattr(method, "checked", False):
        return method

    @functools.wraps(method)
    def checked(self, *args, **kwargs):
        for check, name, position, default in checks:
            check(args[position] if len(args) > position else kwargs.get(name, default))
        result = method(self, *args, **kwargs)
        if not isinstance(result, returns):
            raise ValueError(f"{self.title or type(self).__name__}'s {method.__name__} returned "
                             f"{type(result).__name__}, not {returns.__name__}")
        return result

    checked.checked = True
    return checked


def _index_check(answer) -> Callable[[Any], None]:
    """The check of the index `answer` is given: it must be of the type `answer` annotates its index with (its
    first argument after self; None is NoneType) -- what the method's `index` and `load_index` return. A document
    passed as the index, or another method's index, would fail deep inside the method with an AttributeError. No
    check where the annotation is not a class (Any, a generic) or does not resolve."""
    try:
        first = list(inspect.signature(answer).parameters)[1]
        wanted = typing.get_type_hints(answer).get(first)
    except (IndexError, NameError, TypeError):  # no index argument; a name its module does not hold
        wanted = None

    def check(index: Any) -> None:
        if isinstance(wanted, type) and not isinstance(index, wanted):
            kind = "None" if wanted is type(None) else f"a {wanted.__name__}"
            raise ValueError(f"the index must be {kind} (what the method's index or load_index returns), got "
                             f"{type(index).__name__}")

    return check


def _init_keywords(cls: type) -> set[str]:
    """The keyword arguments `cls(...)` takes itself (self, engine, prompt, progress and a subclass's own, such as
    an embedder): an option of the same name would clash with one of them rather than reach `configure`."""
    parameters = inspect.signature(cls.__init__).parameters.values()
    return {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


class Method(ABC):
    """A long-document QA policy on the engine: index a document once (query-independent), answer many questions
    about it.

    A subclass joins the registry by declaring its name, `class ClosedBook(Method, name="closed-book")`, and its
    options as `options = (Option(...), ...)`. `Method(engine, **options)` checks and types them into
    `self.config`, a dataclass with one field per option (`Config`); `engine` None makes a method that does no model
    work (its checks run). `prompt` is the dataset's prompt (None: the method's own), `progress` asks for progress
    bars while indexing. `answer` annotates its index with the type `index` returns: another is refused. A method
    that can save its indexes sets `can_save` and overrides `save_index` / `load_index`; the CLI names its index
    files DOCUMENT.<name>, and checks those of a method that names its `index_file_format` (`index_file`) before a
    model loads. A method that learns from other documents (GoR's GAT) sets `learns_across_documents` and overrides
    `fit`."""

    name: ClassVar[str] = ""
    title: ClassVar[str] = ""                   # how messages name the method (default: its name)
    options: ClassVar[tuple[Option, ...]] = ()
    Config: ClassVar[type]                      # made from `options` for each subclass
    can_save: ClassVar[bool] = False
    index_file_format: ClassVar[str | None] = None  # the header of its saved indexes, if it writes `index_file`s
    learns_across_documents: ClassVar[bool] = False  # `nodekv eval` calls fit() with the other documents first
    exports: ClassVar[dict[str, str]] = {}      # file suffix -> what `export` writes in that format

    def __init_subclass__(cls, name: str | None = None, title: str | None = None, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        if name is not None:
            if not re.fullmatch(r"[a-z0-9][a-z0-9_-]*", name):  # it is a CLI choice and an index file suffix
                raise ValueError(f"method name {name!r} must be lower-case letters, digits, '-' and '_'")
            taken = REGISTERED.get(name)
            if taken is not None and (taken.__module__, taken.__qualname__) != (cls.__module__, cls.__qualname__):
                raise ValueError(f"method name {name!r} is taken by {taken.__module__}.{taken.__qualname__}")
            cls.name, cls.title = name, title or name
        missing = [hook for hook in ("save_index", "load_index") if getattr(cls, hook) is getattr(Method, hook)]
        if cls.can_save and missing:  # else refused only once an index is built, to be saved
            raise ValueError(f"{cls.__module__}.{cls.__qualname__} sets can_save but does not override "
                             f"{' and '.join(missing)}")
        if "answer" in cls.__dict__:  # one check for every method, theirs and plugins' alike
            answer = cls.__dict__["answer"]
            cls.answer = _checked(answer, [(check_question, "question", 1, None), (check_options, "options", 2, ()),
                                           (_index_check(answer), "index", 0, None)], Answer)
        if "index" in cls.__dict__:
            cls.index = _checked(cls.__dict__["index"], [(check_document, "document", 0, None)])
        cls.Config = config_class(cls, cls.options, cls.title or cls.__name__, _init_keywords(cls))
        cls.Config()  # a declared default that its own option refuses fails here, at import
        if name is not None:  # last: a class that failed a check is neither listed nor holds its name
            REGISTERED[name] = cls

    def __init__(self, engine: Engine | None, prompt: PromptSpec | None = None, progress: bool = False,
                 **options: Any):
        if engine is not None and not isinstance(engine, Engine):  # a model's name, say: it has no tokenizer
            raise ValueError(f"engine must be an Engine (nodekv.load_engine(model) loads one) or None, got "
                             f"{type(engine).__name__} {engine!r:.60}")
        if prompt is not None and not isinstance(prompt, PromptSpec):  # a dataset's name: prompt_for gives its prompt
            raise ValueError(f"prompt must be a PromptSpec (nodekv.methods.prompts.prompt_for(dataset) gives one) or "
                             f"None, got {type(prompt).__name__} {prompt!r:.60}")
        self.engine, self.prompt, self.progress = engine, prompt, progress
        self.config = self.configure(**options)
        if engine is not None:  # an answer budget the window cannot hold fails now, not after an index is built
            check_room(engine.config.max_seq_len, self.answer_prompt, self.reader_window())

    @classmethod
    def configure(cls, **options: Any) -> Any:
        """`options` checked and typed into a `Config`; a ValueError names the method, the option and what it
        allows (the known options, for an unknown one)."""
        known = [o.name for o in cls.options]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(f"unknown {cls.title} option(s) {', '.join(unknown)}; known: {', '.join(known) or 'none'}")
        return cls.Config(**options)

    @property
    def answer_prompt(self) -> PromptSpec:
        """The prompt to answer in: the dataset's, else the generic document-QA one."""
        return self.prompt or prompt_for("")

    @property
    def reader(self) -> Reader:
        """The shared answer reader in the dataset's prompt (`reader.Reader`); its letter priors are kept."""
        reader = getattr(self, "_reader", None)
        if reader is None or (reader.spec, reader.window) != (self.answer_prompt, self.reader_window()):
            self._reader = reader = Reader(self.engine, self.answer_prompt, self.reader_window())
        return reader

    def reader_window(self) -> int | None:
        """Tokens the reader's prompt and answer must fit in, below the model's window (None: the model's)."""
        return None

    @classmethod
    def dataset_defaults(cls, dataset: str) -> dict[str, tuple[Any, str]]:
        """Options this method sets for `dataset` unless given explicitly, each as (value, where it comes from):
        say, a paper's per-dataset value."""
        return {}

    def index_key(self) -> dict:
        """The options an index depends on: saved indexes are shared by methods whose keys are equal."""
        return asdict(self.config)

    @abstractmethod
    def index(self, document: str) -> Any:
        """The query-independent index of `document` (callers charge it to the "index" FLOP scope)."""

    @abstractmethod
    def answer(self, index: Any, question: str, options: tuple[str, ...] = ()) -> Answer:
        """The answer to `question` from `index`; `options` are a multiple-choice question's choices."""

    def store_kv(self, index: Any) -> Any:
        """`index`, built with kv_reuse=off, with its nodes' KV prefilled and stored as `index(document)` stores it
        under this config's kv_reuse: a saved kv-free index then needs only this (`IndexStore.build_or_load`). Methods
        with KV_REUSE_OPTIONS override it."""
        raise ValueError(f"{self.title} does not store its nodes' KV")

    def fit(self, examples: Sequence[tuple[Any, Any]]) -> None:
        """Learn from other documents before answering: (index, record) pairs, the record's question and
        references included. With `learns_across_documents` set, `nodekv eval` deals the run's documents into
        folds and calls it before a fold's questions with the other folds' documents, never the ones answered."""

    def check_without_fit(self) -> None:
        """A ValueError if this method, so configured, cannot answer before a `fit` on other documents: a caller that
        never fits (`nodekv ask`, one document) calls it before any model work, rather than fail at the answer."""

    def save_index(self, index: Any, path: str | Path) -> None:
        raise ValueError(f"{self.title} cannot save its index")

    def load_index(self, path: str | Path) -> Any:
        raise ValueError(f"{self.title} cannot load a saved index")

    def export(self, index: Any, path: str | Path) -> None:
        """Write `index` to `path` for inspection, in the format its suffix names (a key of `exports`)."""
        raise ValueError(f"{self.title} cannot export its index as {Path(path).suffix or str(path)!r}; "
                         f"it exports: {', '.join(self.exports) or 'nothing'}")

    def describe(self, index: Any) -> list[str]:
        """Lines about an index for a person: a summary first (e.g. its size), then notes (e.g. a build log)."""
        return []

    def trace_lines(self, index: Any, trace: list[dict]) -> list[str]:
        """An answer's trace for a person, one line per step."""
        return [json.dumps(step) for step in trace]
