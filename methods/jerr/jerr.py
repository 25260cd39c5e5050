"""JERR (jerr.txt) as a method: synopses, an entity DAG and a graph search, on the engine.

index(document): chunks of `chunk_tokens` LLM tokens (2K; 600 for QuALITY, as §4.1 sets), a synopsis of each (A.1),
the synopsis' information atoms (A.2) and three core elements (A.3), all in batched turns; the elements merged
into entities and linked into a DAG whose edges carry the A.4 attribute of each pair of one chunk's elements
(`jerr_graph`). Every LLM reply that lacks the expected structure leaves a line in the build log.
answer(index, question): the question's keywords (the model's that are words of the question; its longer words when
none is); the entities whose texts (name, aliases, atoms of their chunks) hold a keyword start the search; MCTS
(`jerr_search`: UCB with constant `c`, `iterations`, walks of `depth` nodes rewarded by the share of keywords found
along them, or by the model's relevance probe, p(Yes)) or personalised PageRank picks `top_k` entities; their chunks'
synopses, and in full the chunks the model asks to re-read (`reread`), are what the shared reader reads (`read=pages`,
a fix attempt: `full_pages` of those chunks in full instead, at about the same tokens; `reader=paper`: the A.5 prompt,
multiple choice answered by the letter the model finds most probable after "Answer: (", or the A.6 prompt).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

from ...engine.engine import Engine
from ...paths import write_atomic
from ..base import Answer, Method
from .. import graph_view
from ..index_file import read_index_file, write_index_file
from .jerr_graph import Entity, EntityGraph, add_edges, merge_entities, parse_atoms, parse_elements, view
from .jerr_lm import JerrLM
from .jerr_prompts import ATOMS, EDGE, ELEMENTS, KEYWORDS, LOOKUP, OPEN_ANSWER, QUALITY_ANSWER, SYNOPSIS
from .jerr_search import MCTS, pagerank_top
from ..options import Option
from ..prompts import PromptSpec
from ..reader import LETTERS, READER_OPTION, Reader
from ..retrieval import text_chunk_spans

FORMAT, VERSION = "nodekv-jerr-index", 1
_WORDS = re.compile(r"\w+")


@dataclass
class JerrIndex:
    """A document's chunks, their synopses and atoms, and the entity DAG with its build log."""

    chunks: list[str]
    synopses: list[str]
    atoms: list[list[str]]
    graph: EntityGraph

    def entity_text(self, i: int) -> str:
        e = self.graph.entities[i]
        return " ".join([e.name, *e.aliases, *(a for c in e.chunks for a in self.atoms[c])])


class Jerr(Method, name="jerr", title="JERR"):
    """JERR: an entity DAG over the document's synopses, searched by MCTS (or PageRank) for the nodes that answer.

    `lm` replaces the engine-backed LLM calls (`jerr_lm.JerrLM`; tests script it)."""

    can_save, index_file_format = True, FORMAT
    exports = {".graphml": "the entity DAG as GraphML", ".html": "the entity DAG drawn in an HTML page"}
    options = (
        Option("chunk_tokens", int, 2000, "LLM tokens per chunk", low=1),
        Option("synopsis_tokens", int, 256, "tokens of a synopsis at most", low=1),
        Option("atom_tokens", int, 256, "tokens of a chunk's information atoms at most", low=1),
        Option("element_tokens", int, 48, "tokens of a chunk's core elements at most", low=1),
        Option("edge_tokens", int, 8, "tokens of an edge attribute at most", low=1),
        Option("simhash_threshold", int, 3, "near-duplicate entities differ in at most this many SimHash bits", low=0,
               high=63),  # of the fingerprint's 64 (jerr_dedup.near_duplicate_groups)
        Option("search", str, "mcts", "mcts, or pagerank (the paper's ablation)", choices=("mcts", "pagerank")),
        Option("reward", str, "keywords", "MCTS walk reward: the share of keywords found along it, or the model's "
               "relevance probe of its texts", choices=("keywords", "model")),
        Option("iterations", int, 50, "MCTS iterations", low=1),
        Option("c", float, 1.0, "UCB exploration constant", low=0.0),
        Option("depth", int, 3, "nodes in a simulated walk at most", low=1),
        Option("top_k", int, 5, "entities whose chunks feed the answer", low=1),
        Option("reread", bool, True, "let the model ask for chunks to be read again in full (read=synopses)"),
        Option("read", str, "synopses", "what the reader reads of the chosen entities' pages: their synopses and the "
               "pages the model asks to re-read (the paper), or `full_pages` pages in full, the pages most chosen "
               "entities hold first, with no synopsis and no look-up turn", choices=("synopses", "pages")),
        Option("full_pages", int, 2, "pages read in full under read=pages (two of QuALITY's 600-token pages read "
               "about the tokens of the paper's synopses)", low=1),
        Option("seed", int, 0, "seed of the MCTS walks"),
        READER_OPTION,
    )

    def __init__(self, engine: Engine, prompt: PromptSpec | None = None, progress: bool = False, lm=None,
                 **options):
        super().__init__(engine, prompt, progress, **options)
        self.lm = lm or JerrLM(engine)

    @classmethod
    def dataset_defaults(cls, dataset):
        return {"chunk_tokens": (600, "jerr.txt §4.1")} if dataset == "quality" else {}

    def index_key(self) -> dict:
        c = self.config
        return {k: getattr(c, k) for k in ("chunk_tokens", "synopsis_tokens", "atom_tokens", "element_tokens",
                                           "edge_tokens", "simhash_threshold")}

    def index(self, document: str) -> JerrIndex:
        c, tok = self.config, self.engine.tokenizer
        ids = tok.encode(document)
        chunks = [tok.decode(ids[a:b]) for a, b in text_chunk_spans(ids, tok, c.chunk_tokens)]
        synopses = self.lm.replies([SYNOPSIS.format(ch) for ch in chunks], c.synopsis_tokens)
        atom_replies = self.lm.replies([ATOMS.format(s) for s in synopses], c.atom_tokens)
        element_replies = self.lm.replies([ELEMENTS.format(s) for s in synopses], c.element_tokens)
        log: list[str] = []
        atoms = [parse_atoms(r, s, i, log) for i, (r, s) in enumerate(zip(atom_replies, synopses))]
        elements = [parse_elements(r, i, log) for i, r in enumerate(element_replies)]
        entities, per_chunk = merge_entities(elements, c.simhash_threshold, log)
        graph = EntityGraph(entities, log=log)
        pairs = [(ch, a, b) for ch, ids_ in enumerate(per_chunk) for x, a in enumerate(ids_) for b in ids_[x + 1:]]
        turns = [EDGE.format(_facts(atoms[ch], entities[a]), _facts(atoms[ch], entities[b]), entities[a].name,
                             entities[b].name) for ch, a, b in pairs]
        attributes = [r.split("\n")[0] for r in self.lm.replies(turns, c.edge_tokens)]
        add_edges(graph, [(a, b, attr) for (_, a, b), attr in zip(pairs, attributes)])
        return JerrIndex(chunks, synopses, atoms, graph)

    def keywords(self, question: str) -> list[str]:
        """The model's keywords of `question` that are the question's own words (a small model also lists words of
        the instruction); the question's words of four letters or more when none is."""
        reply = self.lm.replies([KEYWORDS.format(question)], 32)[0]
        own = set(_WORDS.findall(question.casefold()))
        words = [k.strip(" .\"'").casefold() for k in re.split(r"[,\n]", reply)]
        # a keyword of no word ("-", "**") would be a subset of every text and count as found in every entity
        found = [k for k in dict.fromkeys(words)
                 if _WORDS.search(k) and set(_WORDS.findall(k)) <= own and len(k.split()) <= 4]
        return found or [w for w in dict.fromkeys(_WORDS.findall(question.casefold())) if len(w) > 3]

    def select(self, index: JerrIndex, question: str, keywords: list[str]) -> tuple[list[int], dict]:
        """The `top_k` entities for the question, and how the search went."""
        c, n = self.config, len(index.graph.entities)
        texts = [set(_WORDS.findall(index.entity_text(i).casefold())) for i in range(n)]

        def hits(nodes) -> set[str]:
            words = set().union(*(texts[v] for v in nodes))
            return {k for k in keywords if set(_WORDS.findall(k)) <= words}

        share = {i: len(hits([i])) / len(keywords) for i in range(n)} if keywords else {}
        starts = [i for i in range(n) if share.get(i, 0) > 0]
        if c.search == "pagerank":
            return pagerank_top(list(range(n)), list(index.graph.edges), share, c.top_k), {"starts": len(starts)}
        if not starts:  # no entity holds a keyword: start from the DAG's sources
            targets = {b for _, b in index.graph.edges}
            starts = [i for i in range(n) if i not in targets]
        if c.reward == "keywords":
            def reward(paths):
                return [len(hits(p)) / max(len(keywords), 1) for p in paths]
        else:
            def reward(paths):  # p(Yes), on the keyword share's [0, 1] scale so that `c` means the same
                texts = ["\n".join(index.entity_text(v) for v in p) for p in paths]
                return [math.exp(x) for x in self.lm.relevance(question, texts)]
        search = MCTS(starts, index.graph.successors, reward, c.c, c.depth, c.seed).run(c.iterations)
        return search.top(c.top_k), {"starts": len(starts), "tree_visits": search.root.visits}

    def answer(self, index: JerrIndex, question: str, options: tuple[str, ...] = ()) -> Answer:
        acc, c = self.engine.flops, self.config
        if options and c.reader == "shared":  # the calibration scope's, not the query's, as `Reader.read` charges it
            self.reader.letter_prior(question, options)
        start = acc.total  # keywords, the search's probes and the look-up are the query's too
        keywords = self.keywords(question)
        chosen, how = self.select(index, question, keywords)
        if c.read == "pages":
            pages = full = sorted(_ranked_pages(index.graph, chosen)[:c.full_pages])
        else:
            pages = sorted({ch for i in chosen for ch in index.graph.entities[i].chunks})
            full = self._reread(index, question, pages) if c.reread and pages else []
        notes = "\n".join(f"- {index.graph.entities[i].name}" for i in chosen)
        text = "\n\n".join(f"[page {p}] " + (index.chunks[p] if p in full else index.synopses[p]) for p in pages)
        context = f"Relevant nodes:\n{notes}\n\n{'Pages' if c.read == 'pages' else 'Synopses'}:\n{text}"
        trace = [{"keywords": keywords, **how, "nodes": [index.graph.entities[i].name for i in chosen],
                  "pages": pages, "reread": full}]
        if c.reader == "shared":
            return replace(self.reader.read(context, question, options, chosen, trace), flops=acc.total - start)
        if options:  # A.5: the letter the model finds most probable after "Answer: ("
            spec = PromptSpec(QUALITY_ANSWER.replace("{}", "{context}", 1).replace("{} {}", "{question} {options}"),
                              1)
            ids, truncated = Reader(self.engine, spec).prompt_ids(context, question, options)
            letter, probs = self.lm.letter(ids, LETTERS[:len(options)])
            trace[0]["letters"] = {k: round(v, 4) for k, v in probs.items()}
            return Answer(f"({letter})", chosen, trace, acc.total - start, len(ids), 0, truncated, context)
        spec = replace(self.answer_prompt, template=OPEN_ANSWER.replace("{}", "{context}", 1).replace("{}",
                                                                                                   "{question}"))
        return replace(Reader(self.engine, spec).read(context, question, (), chosen, trace), flops=acc.total - start)

    def _reread(self, index: JerrIndex, question: str, pages: list[int]) -> list[int]:
        listing = "\n".join(f"Page {p}: {index.synopses[p]}" for p in pages)
        reply = self.lm.replies([LOOKUP.format(listing, question)], 16)[0]
        return sorted({int(x) for x in re.findall(r"\d+", reply) if int(x) in pages})

    def save_index(self, index: JerrIndex, path) -> None:
        g = index.graph
        write_index_file(path, FORMAT, VERSION, self.engine, {
            "chunks": index.chunks, "synopses": index.synopses, "atoms": index.atoms, "log": g.log,
            "entities": [[e.name, e.aliases, e.chunks] for e in g.entities],
            "edges": [[a, b, attr] for (a, b), attr in g.edges.items()]})

    def load_index(self, path: str | Path) -> JerrIndex:
        d = read_index_file(path, FORMAT, VERSION, self.engine, "JERR index")
        graph = EntityGraph([Entity(n, a, c) for n, a, c in d["entities"]],
                            {(a, b): attr for a, b, attr in d["edges"]}, d["log"])
        return JerrIndex(d["chunks"], d["synopses"], d["atoms"], graph)

    def export(self, index: JerrIndex, path: str | Path) -> None:
        write = {".graphml": graph_view.to_graphml, ".html": graph_view.to_html}.get(Path(path).suffix)
        if write is None:
            return super().export(index, path)
        write_atomic(path, write(view(index.graph)))

    def describe(self, index: JerrIndex) -> list[str]:
        g = index.graph
        return [f"{len(index.chunks)} chunks, {len(g.entities)} entities, {len(g.edges)} edges", *g.log]


def _ranked_pages(graph: EntityGraph, chosen: list[int]) -> list[int]:
    """The pages of the `chosen` entities (best first), those held by the most of them first, then by the best rank
    among the entities holding them: a page where several chosen entities meet before a protagonist's every page."""
    held: dict[int, list[int]] = {}
    for rank, i in enumerate(chosen):
        for page in graph.entities[i].chunks:
            held.setdefault(page, []).append(rank)
    return sorted(held, key=lambda p: (-len(held[p]), held[p][0], p))


def _facts(atoms: list[str], entity: Entity) -> str:
    """The chunk's atoms that mention the entity (all of them when none does), as one string."""
    names = [entity.name.casefold(), *(a.casefold() for a in entity.aliases)]
    mention = [a for a in atoms if any(n in a.casefold() for n in names)]
    return " ".join(mention or atoms)
