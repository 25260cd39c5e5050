"""Evaluation datasets: every file under ``../shared/data`` read into one record type.

``load_dataset(name)`` finds ``<name>.jsonl`` in any sub-folder of the data directory (default: the project
root's ``../shared/data``; the environment variable ``NODEKV_DATA_DIR`` overrides it) and returns a
``LoadResult``: the good ``Record``s and a list of ``(id, reason)`` problems for the records it skipped
(invalid JSON, missing or empty question/document/answer, wrong types). A malformed record never stops a
run; a missing data directory or dataset file raises ``DataNotFoundError`` naming the path, and two good records
with one id a ``ValueError`` naming the id and both lines (runs key their answers by id).

Documents are built as LongBench builds them: multi-paragraph sets are joined as
``"Passage 1:\\n<title>\\n<text>\\n\\nPassage 2:\\n..."`` (sentences of a paragraph joined with one space).
LongBench's multi_news context is kept as published (its ``NEWLINE_CHAR`` markers included); its empty
``input`` becomes LongBench's instruction ``MULTI_NEWS_QUESTION``. QuALITY (L-Eval) instructions are split
into the question stem and ``options`` (texts without their "(A)" labels); the reference is the letter.
QMSum transcripts are ``"speaker: content"`` lines.

Ids: the source's own id where it has one (``_id`` / ``id``); otherwise stable positional ids: the
0-based line index (narrativeqa), ``"<doc>-<question>"`` for L-Eval files (one document, several
instructions), ``"<meeting>-g<k>"`` / ``"<meeting>-s<k>"`` for QMSum's general / specific queries;
``qmsum_general`` is QMSum's general queries alone (one per meeting: global summarisation, as GoR evaluates).

Counts on the shared data (records / problems):
    hotpotqa 150/0, musique 150/0, 2wikimqa 131/19 (19 records have no context),
    quality 130/0 (11 docs), scientific_qa 133/0 (17 docs), multidoc_qa 119/0 (17 docs),
    natural_question 88/0 (16 docs), gov_report_summ 10/0, meeting_summ 135/0 (17 docs),
    news_summ 9/0, tv_show_summ 10/0, multi_news 150/0, qmsum 272/0 (35 meetings), qmsum_general 35/0, narrativeqa 40/0.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Iterator, Union

from ..paths import DATA_ENV, data_dir
from .records import LoadResult, Record, Task
from .variable_tracking import PREFIX, is_variable_tracking, records, shape

__all__ = ["DATASETS", "DataNotFoundError", "LoadResult", "Record", "check_dataset", "default_data_dir",
           "find_dataset_file", "load_dataset"]

# dataset name (= file stem) -> task
DATASET_TASKS: dict[str, Task] = {
    "hotpotqa": "qa",
    "musique": "qa",
    "2wikimqa": "qa",
    "quality": "multiple_choice",
    "scientific_qa": "qa",
    "multidoc_qa": "qa",
    "natural_question": "qa",
    "gov_report_summ": "summary",
    "meeting_summ": "summary",
    "news_summ": "summary",
    "tv_show_summ": "summary",
    "multi_news": "summary",
    "qmsum": "summary",
    "qmsum_general": "summary",
    "narrativeqa": "qa",
}
# datasets read from another dataset's file (the name's records are a subset of that file's)
FILES: dict[str, str] = {"qmsum_general": "qmsum"}
DATASETS: tuple[str, ...] = tuple(DATASET_TASKS)

# LongBench's instruction for multi_news, whose `input` is empty (its prompt ends "Now, write a one-page
# summary of all the news."); used whenever a LongBench summarisation record has no question of its own.
MULTI_NEWS_QUESTION = "Write a one-page summary of all the news."

ENV_DATA_DIR = DATA_ENV


class DataNotFoundError(FileNotFoundError):
    """The data directory or a dataset file is missing (the message names the path)."""


class _Bad(ValueError):
    """A malformed record: the message is the reason reported with its id."""


def default_data_dir() -> Path:
    """$NODEKV_DATA_DIR, else ../shared/data beside the checkout (`nodekv.paths.data_dir`)."""
    return data_dir()


def find_dataset_file(name: str, data_dir: Union[str, Path, None] = None) -> Path:
    """The file ``<name>.jsonl`` (or the file `FILES` names) in any sub-folder of ``data_dir``."""
    if name not in DATASET_TASKS:
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)}, and the generated "
                         f"{PREFIX}_<hops>hop_<thousand tokens>k[_<chains>chain]")
    root = Path(data_dir) if data_dir is not None else default_data_dir()
    if not root.is_dir():
        problem = "is not a directory" if root.exists() else "does not exist"
        raise DataNotFoundError(f"data directory {root} {problem} (set {ENV_DATA_DIR} to another one)")
    stem = FILES.get(name, name)
    hits = sorted(root.rglob(f"{stem}.jsonl"))
    if not hits:
        raise DataNotFoundError(f"dataset {name!r}: no {stem}.jsonl under {root}")
    if len(hits) > 1:
        raise ValueError(f"dataset {name!r}: several files under {root}: {', '.join(map(str, hits))}")
    if not hits[0].is_file():
        raise DataNotFoundError(f"dataset {name!r}: {hits[0]} is not a file")
    return hits[0]


def check_dataset(name: str, data_dir: Union[str, Path, None] = None) -> None:
    """An error naming the problem (unknown name, missing data directory or file, a file without one good record,
    a record id twice) if `load_dataset(name, data_dir)` cannot give a run anything to do: the CLI checks before a
    model loads."""
    if is_variable_tracking(name):
        shape(name)
        return
    path = find_dataset_file(name, data_dir)
    loaded = load_dataset(name, data_dir)  # the whole file, for its ids (the largest shared file takes 0.04 s)
    if not loaded.records:
        first = f": the first, {loaded.problems[0][0]}, {loaded.problems[0][1]}" if loaded.problems else ""
        raise ValueError(f"{path} has no usable record ({len(loaded.problems)} malformed{first})")


# ---------------------------------------------------------------------------------------------- field checks

def _str(raw: dict, key: str, *, allow_empty: bool = False) -> str:
    if key not in raw or raw[key] is None:
        raise _Bad(f"missing {key!r}")
    value = raw[key]
    if not isinstance(value, str):
        raise _Bad(f"{key!r} is {type(value).__name__}, not str")
    if not allow_empty and not value.strip():
        raise _Bad(f"empty {key!r}")
    return value


def _list(raw: dict, key: str) -> list:
    if key not in raw or raw[key] is None:
        raise _Bad(f"missing {key!r}")
    value = raw[key]
    if not isinstance(value, list):
        raise _Bad(f"{key!r} is {type(value).__name__}, not list")
    return value


def _strings(values: list, what: str) -> tuple[str, ...]:
    for v in values:
        if not isinstance(v, str):
            raise _Bad(f"{what} contains {type(v).__name__}, not str")
    return tuple(values)


def _passages(pairs: list[tuple[str, str]]) -> str:
    """LongBench's join of titled paragraphs."""
    return "\n\n".join(f"Passage {i}:\n{title}\n{text}" for i, (title, text) in enumerate(pairs, 1))


def _record(dataset: str, id: str, document: str, question: str, references, options=(), supports=()) -> Record:
    if not document.strip():
        raise _Bad("empty document")
    if not question.strip():
        raise _Bad("empty question")
    refs = tuple(r for r in references if r.strip())
    if not refs:
        raise _Bad("no reference answer")
    return Record(id=id, dataset=dataset, document=document, question=question, references=refs,
                  options=tuple(options), task=DATASET_TASKS[dataset], supports=tuple(supports))


# ----------------------------------------------------------------------------------------------- per format
# A parser takes (dataset, raw record, line index) and yields Records or (id, reason) problems; raising
# _Bad skips the whole line with the id from `_line_id`.

Item = Union[Record, tuple[str, str]]


def _line_id(raw: dict, index: int) -> str:
    for key in ("_id", "id"):
        if isinstance(raw.get(key), (str, int)) and not isinstance(raw.get(key), bool):
            return str(raw[key])
    return str(index)


def _context_passages(raw: dict) -> tuple[str, tuple[str, ...]]:
    """HotpotQA / 2Wiki ``context``: [[title, [sentences]], ...], as the document and its supporting text: per
    passage named in ``supporting_facts`` ([[title, sentence index], ...]), its marked sentences (facts that name
    no sentence of the context are left out)."""
    pairs, sentences = [], {}
    for p in _list(raw, "context"):
        if not (isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], list)):
            raise _Bad("context entry is not [title, [sentences]]")
        sentences.setdefault(p[0], [s.strip() for s in _strings(p[1], "context sentences")])
        pairs.append((p[0], " ".join(s.strip() for s in p[1])))
    marked: dict[str, list[int]] = {}
    for fact in raw.get("supporting_facts") or []:
        if isinstance(fact, list) and len(fact) == 2 and isinstance(fact[1], int) \
                and 0 <= fact[1] < len(sentences.get(fact[0], ())):
            marked.setdefault(fact[0], []).append(fact[1])
    supports = tuple(" ".join(sentences[t][i] for i in sorted(set(ix))) for t, ix in marked.items())
    return _passages(pairs), supports


def _parse_context_qa(dataset: str, raw: dict, index: int) -> Iterator[Item]:  # hotpotqa, 2wikimqa
    if raw.get("context") is None:
        raise _Bad("missing 'context'")
    document, supports = _context_passages(raw)
    yield _record(dataset, _line_id(raw, index), document, _str(raw, "question"), [_str(raw, "answer")],
                  supports=supports)


def _parse_musique(dataset: str, raw: dict, index: int) -> Iterator[Item]:
    pairs, supports = [], []
    for p in _list(raw, "paragraphs"):
        if not isinstance(p, dict):
            raise _Bad("paragraph is not an object")
        pairs.append((_str(p, "title", allow_empty=True), _str(p, "paragraph_text", allow_empty=True)))
        if p.get("is_supporting") is True:
            supports.append(pairs[-1][1])
    aliases = raw.get("answer_aliases") or []
    if not isinstance(aliases, list):
        raise _Bad("'answer_aliases' is not a list")
    yield _record(dataset, _line_id(raw, index), _passages(pairs), _str(raw, "question"),
                  [_str(raw, "answer"), *_strings(aliases, "'answer_aliases'")], supports=supports)


_OPTION = re.compile(r"\n\s*\(([A-Z])\)\s*")
_ANSWER_LETTER = re.compile(r"\s*\(([A-Z])\)")


def _split_options(instruction: str) -> tuple[str, tuple[str, ...]]:
    """QuALITY (L-Eval): "question\\n\\n (A) ...\\n (B) ..." -> ("question", ("...", "...", ...))."""
    parts = _OPTION.split(instruction)
    stem, letters, texts = parts[0].strip(), parts[1::2], [t.strip() for t in parts[2::2]]
    if len(letters) < 2 or letters != [chr(ord("A") + i) for i in range(len(letters))]:
        raise _Bad("options not found as (A), (B), ... lines")
    return stem, tuple(texts)


def _parse_leval(dataset: str, raw: dict, index: int) -> Iterator[Item]:
    document = _str(raw, "input")
    instructions, outputs = _list(raw, "instructions"), _list(raw, "outputs")
    if len(instructions) != len(outputs):
        raise _Bad(f"{len(instructions)} instructions but {len(outputs)} outputs")
    for q, (instruction, output) in enumerate(zip(instructions, outputs)):
        rid = f"{index}-{q}"
        try:
            if not isinstance(instruction, str) or not isinstance(output, str):
                raise _Bad("instruction/output is not str")
            if DATASET_TASKS[dataset] == "multiple_choice":
                stem, options = _split_options(instruction)
                m = _ANSWER_LETTER.match(output)
                if not m or ord(m.group(1)) - ord("A") >= len(options):
                    raise _Bad(f"answer {output[:40]!r} is not one of the option letters")
                yield _record(dataset, rid, document, stem, [m.group(1)], options)
            else:
                yield _record(dataset, rid, document, instruction, [output])
        except _Bad as e:
            yield rid, str(e)


def _parse_longbench(dataset: str, raw: dict, index: int) -> Iterator[Item]:
    question = _str(raw, "input", allow_empty=True)
    if not question.strip() and DATASET_TASKS[dataset] == "summary":
        question = MULTI_NEWS_QUESTION
    yield _record(dataset, _line_id(raw, index), _str(raw, "context"), question,
                  _strings(_list(raw, "answers"), "'answers'"))


def _parse_qmsum(dataset: str, raw: dict, index: int) -> Iterator[Item]:
    lines = []
    for turn in _list(raw, "meeting_transcripts"):
        if not isinstance(turn, dict):
            raise _Bad("transcript turn is not an object")
        lines.append(f"{_str(turn, 'speaker', allow_empty=True)}: {_str(turn, 'content', allow_empty=True)}")
    document = "\n".join(lines)
    kinds = (("g", "general_query_list"),) + (() if dataset == "qmsum_general" else (("s", "specific_query_list"),))
    for kind, key in kinds:
        for k, query in enumerate(_list(raw, key)):
            rid = f"{index}-{kind}{k}"
            try:
                if not isinstance(query, dict):
                    raise _Bad("query is not an object")
                yield _record(dataset, rid, document, _str(query, "query"), [_str(query, "answer")])
            except _Bad as e:
                yield rid, str(e)


def _parse_narrativeqa(dataset: str, raw: dict, index: int) -> Iterator[Item]:
    answers = raw.get("answer")
    if isinstance(answers, str):
        answers = [answers]
    elif isinstance(answers, list):
        answers = _strings(answers, "'answer'")
    else:
        raise _Bad("missing 'answer'" if answers is None else f"'answer' is {type(answers).__name__}")
    yield _record(dataset, str(index), _str(raw, "passage"), _str(raw, "question"), answers)


_PARSERS: dict[str, Callable[[str, dict, int], Iterator[Item]]] = {
    "hotpotqa": _parse_context_qa,
    "2wikimqa": _parse_context_qa,
    "musique": _parse_musique,
    **{n: _parse_leval for n in ("quality", "scientific_qa", "multidoc_qa", "natural_question",
                                 "gov_report_summ", "meeting_summ", "news_summ", "tv_show_summ")},
    "multi_news": _parse_longbench,
    "qmsum": _parse_qmsum,
    "qmsum_general": _parse_qmsum,
    "narrativeqa": _parse_narrativeqa,
}


def load_dataset(name: str, data_dir: Union[str, Path, None] = None, limit: int | None = None) -> LoadResult:
    """Good records of dataset `name` (at most `limit`) and the (id, reason) of each record skipped. Variable
    tracking names (`variable_tracking`) are generated, not read."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if is_variable_tracking(name):
        return LoadResult(records(name, limit))
    path = find_dataset_file(name, data_dir)
    parse = _PARSERS[name]
    result = LoadResult()
    lines: dict[str, int] = {}  # record id -> its line: a run resumes by id, so two records may not share one
    with path.open("rb") as f:  # lines decoded one by one: a line that is not UTF-8 is one bad record
        for index, line in enumerate(f):
            if limit is not None and len(result.records) >= limit:
                break
            if not line.strip():
                continue
            try:
                raw = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as e:
                result.problems.append((str(index), f"not UTF-8 (byte 0x{e.object[e.start]:02x})"))
                continue
            except json.JSONDecodeError as e:
                result.problems.append((str(index), f"invalid JSON: {e}"))
                continue
            if not isinstance(raw, dict):
                result.problems.append((str(index), f"record is {type(raw).__name__}, not an object"))
                continue
            try:
                for item in parse(name, raw, index):
                    if isinstance(item, Record):
                        if limit is not None and len(result.records) >= limit:
                            break
                        if item.id in lines:
                            raise ValueError(f"{path} has the record id {item.id!r} twice (lines {lines[item.id]} "
                                             f"and {index + 1}): a run keys its answers by id")
                        lines[item.id] = index + 1
                        result.records.append(item)
                    else:
                        result.problems.append(item)
            except _Bad as e:
                result.problems.append((_line_id(raw, index), str(e)))
    return result
