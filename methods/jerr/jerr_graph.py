"""JERR's entity DAG (jerr.txt §3.3) from what the LLM said about each chunk's synopsis: its information atoms (A.2),
its three core elements (A.3) and, for each pair of elements of one chunk, their relation attribute (A.4).

- `parse_atoms` / `parse_elements` read the replies: one item per line or (elements) per comma, list markers and
  labels stripped; a reply without the expected structure degrades (no atoms: the synopsis' sentences stand in;
  elements past three, empty or longer than `MAX_ELEMENT_WORDS` words are dropped) and says so in the build log.
- `merge_entities`: exact duplicates (Bloom filter + trie, `jerr_dedup`) then SimHash near-duplicates become one
  entity, named by its first mention, keeping every chunk it was seen in and those chunks' atoms.
- `add_edges`: proposals in order (chunk order, then pair order); an edge is dropped, with a log line, when its
  attribute says there is no relation, an end is not an entity, it is a self-loop or repeats an edge, or it would
  close a cycle (the earlier edges stand: breaking cycles by order of proposal is deterministic and keeps the
  relations read first).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..graph_view import GraphView
from .jerr_dedup import near_duplicate_groups, normalize, unique_names

MAX_ELEMENT_WORDS = 8
_MARKER = re.compile(r"^\s*(?:[-*•]+|\(?\d+[.)]|\(?[a-z][.)](?=\s))\s*", re.IGNORECASE)
_LABEL = re.compile(r"^\s*(?:information atoms?|atoms?|core components?|components?|elements?|keywords?)\s*:\s*",
                    re.IGNORECASE)
# A.3 defines its three kinds by example; small models answer "The fundamental nouns are: X, Y. The verbs are: ..."
# and often repeat the examples themselves
_KIND = re.compile(r"\b(?:the\s+)?(?:fundamental\s+|core\s+)?(?:nouns?|verbs?|adjectives?|components?|elements?)"
                   r"(?:\s+(?:are|is)\b\s*:?|\s*:)", re.IGNORECASE)
_PROMPT_WORDS = frozenset("people moments occurrences settings quantities activities conditions emotions nouns verbs "
                          "adjectives".split())
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_NO_RELATION = re.compile(r"^(?:none|no(?:ne)?\s+(?:relation|relationship|attributes?|connection)|n/?a|unknown)\W*$",
                          re.IGNORECASE)


@dataclass
class Entity:
    """A node: its name (first mention), the other names merged into it, and the chunks it occurs in."""

    name: str
    aliases: list[str] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)


@dataclass
class EntityGraph:
    """Entities, directed acyclic edges with their attribute, and the build log."""

    entities: list[Entity]
    edges: dict[tuple[int, int], str] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)

    def successors(self, node: int) -> list[int]:
        return [b for (a, b) in self.edges if a == node]


def _items(text: str, split_commas: bool) -> list[str]:
    text = _LABEL.sub("", text.strip())
    parts = [p for line in text.splitlines() for p in (line.split(",") if split_commas else [line])]
    return [_LABEL.sub("", _MARKER.sub("", p)).strip().strip('"\'').strip() for p in parts]


def parse_atoms(reply: str, synopsis: str, chunk: int, log: list[str]) -> list[str]:
    """The atoms of one chunk's A.2 reply, one per sentence; its synopsis' sentences when the reply has none."""
    atoms = [s.strip() for a in _items(reply, split_commas=False) for s in _SENTENCE_END.split(a) if s.strip()]
    if atoms:
        return atoms
    log.append(f"chunk {chunk}: no information atoms in the reply; its synopsis' sentences stand in")
    return [s.strip() for s in _SENTENCE_END.split(synopsis) if s.strip()]


def parse_elements(reply: str, chunk: int, log: list[str], k: int = 3) -> list[str]:
    """Up to `k` core elements of one chunk's A.3 reply: items split at line breaks, commas, semicolons and sentence
    ends, kind labels ("The verbs are:") and a leading "and" removed; "None", a heading ending in ":" and the
    prompt's own examples ("people", "moments", ...) are not elements."""
    pieces = re.split(r"[\n,;]|(?<=[.!?])\s", _KIND.sub("\n", reply))
    items = [re.sub(r"^and\b\s*", "", _MARKER.sub("", p).strip(" .\"'"), flags=re.IGNORECASE) for p in pieces]
    items = [x for x in items if x and not x.endswith(":") and not _NO_RELATION.match(x)]  # "...:" heads a list
    echoed = [x for x in items if x.casefold() in _PROMPT_WORDS]
    if echoed:
        log.append(f"chunk {chunk}: the reply repeats the prompt's examples ({', '.join(echoed)}); left out")
        items = [x for x in items if x.casefold() not in _PROMPT_WORDS]
    good = [x for x in items if normalize(x) and len(x.split()) <= MAX_ELEMENT_WORDS]
    if len(good) != len(items):
        log.append(f"chunk {chunk}: dropped {len(items) - len(good)} malformed element(s) "
                   f"(empty or over {MAX_ELEMENT_WORDS} words)")
    good = unique_names(good)
    if len(good) > k:
        log.append(f"chunk {chunk}: {len(good)} elements, kept the first {k}")
    if not good:
        log.append(f"chunk {chunk}: no core elements in the reply; the chunk adds no entity")
    return good[:k]


def merge_entities(elements: list[list[str]], threshold: int, log: list[str]) -> tuple[list[Entity], list[list[int]]]:
    """Entities from each chunk's elements (exact, then near-duplicate merging) and, per chunk, its entities' ids."""
    names = unique_names(e for chunk in elements for e in chunk)
    groups = near_duplicate_groups(names, threshold)
    entity_of: dict[str, int] = {}
    entities = []
    for g in groups:
        entities.append(Entity(names[g[0]], [names[i] for i in g[1:]]))
        entity_of.update({normalize(names[i]): len(entities) - 1 for i in g})
        if len(g) > 1:
            log.append(f"merged near-duplicates: {' | '.join(names[i] for i in g)}")
    per_chunk = []
    for c, chunk in enumerate(elements):
        ids = list(dict.fromkeys(entity_of[normalize(e)] for e in chunk))
        for i in ids:
            entities[i].chunks.append(c)
        per_chunk.append(ids)
    return entities, per_chunk


def add_edges(graph: EntityGraph, proposals: list[tuple[int, int, str]]) -> None:
    """Add (source, target, attribute) proposals to `graph` in order, keeping it acyclic (see the module)."""
    n = len(graph.entities)
    for a, b, attribute in proposals:
        attribute = " ".join(attribute.split()).strip(" .")
        why = ("it names no relation" if not attribute or _NO_RELATION.match(attribute) else
               "an end is not an entity" if not (0 <= a < n and 0 <= b < n) else
               "a self-loop" if a == b else
               "it repeats an edge" if (a, b) in graph.edges else
               "it would close a cycle" if _reaches(graph, b, a) else None)
        if why is None:
            graph.edges[(a, b)] = attribute
        else:
            graph.log.append(f"edge {_name(graph, a)} -> {_name(graph, b)} ({attribute!r}) dropped: {why}")


def _name(graph: EntityGraph, i: int) -> str:
    return graph.entities[i].name if 0 <= i < len(graph.entities) else f"#{i}"


def _reaches(graph: EntityGraph, start: int, goal: int) -> bool:
    seen, stack = {start}, [start]
    while stack:
        node = stack.pop()
        if node == goal:
            return True
        for nxt in graph.successors(node):
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return False


def depths(graph: EntityGraph) -> list[int]:
    """Each entity's depth: the longest path to it from a source of the DAG (Kahn's order)."""
    n = len(graph.entities)
    indegree, depth = [0] * n, [0] * n
    for _, b in graph.edges:
        indegree[b] += 1
    ready = [i for i in range(n) if indegree[i] == 0]
    while ready:
        node = ready.pop()
        for nxt in graph.successors(node):
            depth[nxt] = max(depth[nxt], depth[node] + 1)
            indegree[nxt] -= 1
            if indegree[nxt] == 0:
                ready.append(nxt)
    return depth


def view(graph: EntityGraph) -> GraphView:
    """The DAG as `graph_view` draws it: a column per depth, edges labelled with their attribute."""
    depth = depths(graph)
    count: dict[int, int] = {}
    for d in depth:
        count[d] = count.get(d, 0) + 1
    nodes = [(i, depth[i], " / ".join([e.name, *e.aliases]) + f" (chunks {', '.join(map(str, e.chunks))})")
             for i, e in enumerate(graph.entities)]
    return GraphView("JERR", "depth", nodes, [(a, b, None, attr) for (a, b), attr in graph.edges.items()],
                     {d: f"depth {d}: {k} entit{'y' if k == 1 else 'ies'}" for d, k in count.items()},
                     "Entities, merged names after a slash, placed by their longest path from a source; edges carry "
                     "the relation the model gave (A.4). Hover a node for its whole text, an edge for its relation.")

