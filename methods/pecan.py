"""PECAN (pecan.txt §3): attention-guided graph construction (`pecan_build`) and dynamic graph search on the
engine's node cache.

Search (§3.2, Table A2, App. B-C): the first-turn prompt and the query are prefilled once; the top level is
appended; then after each appended node a rolled-back probe ("Yes"/"No") decides whether to stop; the next node
maximises z_i = Σ_j r_j e_ji (r_j: the visited node's attention to the query, times its prompt position) plus its
embedding similarity to the query; the second-turn prompt then decodes the answer from the same cache.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Iterator

import torch

from ..engine.engine import Engine
from .base import Answer, chat_pieces
from .pecan_build import BUILD_VERSION, GraphBuilder
from .pecan_graph import Graph, next_node, positional_relevance
from .prompts import PromptSpec

FIRST_TURN = ("Can this question be answered by the following information? Response \"Yes\" or \"No\" in one word. "
              "Do not provide any explanation.\n\nQuestion:\n{}\n\nInformation:\n{}")
SECOND_TURN = "Given the above information and question, answer the question as concisely as you can."
# prompt_style="restate": small models lose the question by the end of a long first turn (they answer "Yes" or
# repeat a name), so the probe and the answer turn state it again; the cached prompt is the paper's either way
RESTATED_PROBE = ("\n\nCan the question \"{}\" be answered by the information above? Response \"Yes\" or \"No\" "
                  "in one word.")
RESTATED_SECOND_TURN = "Given the above information, answer this question as concisely as you can.\n\nQuestion: {}"
PROMPT_STYLES = ("paper", "restate")


@dataclass
class PecanConfig:
    """PECAN's hyper-parameters (paper defaults) and the Table 3 ablation switches."""

    chunk_tokens: int = 300
    batch_tokens: int = 8192       # s
    summary_tokens: int = 512      # generation budget of one batch summary
    max_levels: int = 5
    t_n: int = 1                   # stop patience
    t_p: float = 0.5               # confidence threshold on the normalised p(Yes)
    node_budget: int = 12          # nodes retrieved beyond the top level
    answer_tokens: int = 64
    attention: bool = True         # False: w/o attention-guided retrieval (embedding similarity only)
    embedding: bool = True         # False: w/o embedding similarity
    dynamic: bool = True           # False: w/o dynamic progress control (no probes, fixed_nodes retrieved)
    fixed_nodes: int = 4
    ip_graph: bool = True          # False: w/o IP graph (each batch summarised into one node, RAPTOR-like)
    prompt_style: str = "paper"    # "restate": the probe and the answer turn repeat the question (search only)

    def __post_init__(self):
        for f in fields(self):
            value, kind = getattr(self, f.name), {"int": int, "float": (int, float), "bool": bool, "str": str}[f.type]
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ValueError(f"PECAN option {f.name} must be {f.type}, got {value!r}")
        least = {"chunk_tokens": 1, "batch_tokens": 1, "summary_tokens": 1, "max_levels": 2, "t_n": 1,
                 "node_budget": 0, "answer_tokens": 1, "fixed_nodes": 0}
        for name, low in least.items():
            if getattr(self, name) < low:
                raise ValueError(f"PECAN option {name} must be >= {low}, got {getattr(self, name)}")
        if not 0.0 <= self.t_p <= 1.0:
            raise ValueError(f"PECAN option t_p must be in [0, 1], got {self.t_p}")
        if self.prompt_style not in PROMPT_STYLES:
            raise ValueError(f"PECAN option prompt_style must be one of {', '.join(PROMPT_STYLES)}, "
                             f"got {self.prompt_style!r}")


# App. E: the confidence threshold t_p the paper used per dataset with Llama-3.1-8B (t_n = 1 throughout).
PAPER_T_P = {"narrativeqa": 0.5, "qasper": 0.98, "hotpotqa": 0.5, "musique": 0.55}
INDEX_OPTIONS = ("chunk_tokens", "batch_tokens", "summary_tokens", "max_levels", "ip_graph")


@dataclass
class PecanIndex:
    """A document's graph, its nodes' embeddings and the log of how it was built."""

    graph: Graph
    vectors: torch.Tensor                                  # [nodes, 384] all-MiniLM-L6-v2
    config: dict
    log: list[str] = field(default_factory=list)


class Pecan:
    """index(document) builds the graph; answer(index, question) searches it and answers from the same cache.
    `search_engine` may be a different model than the one that built the graph (Table 2); `progress` shows a bar
    per level while the graph is built."""

    name = "pecan"

    def __init__(self, engine: Engine, prompt: PromptSpec | None = None, search_engine: Engine | None = None,
                 embedder=None, progress: bool = False, **config):
        known = [f.name for f in fields(PecanConfig)]
        unknown = sorted(set(config) - set(known))
        if unknown:
            raise ValueError(f"unknown PECAN option(s) {', '.join(unknown)}; known: {', '.join(known)}")
        self.engine, self.search_engine = engine, search_engine or engine
        self.config = PecanConfig(**config)
        self.prompt, self.progress = prompt, progress
        self._embedder = embedder

    @property
    def embedder(self):
        if self._embedder is None:
            from .embedder import Embedder

            self._embedder = Embedder()
        return self._embedder

    @staticmethod
    def dataset_defaults(dataset: str) -> dict:
        """Options the paper set per dataset (App. E's t_p), for the datasets it evaluated; explicit options win."""
        return {"t_p": PAPER_T_P[dataset]} if dataset in PAPER_T_P else {}

    @property
    def index_config(self) -> dict:
        """The options a graph depends on (the others only steer the search), so that ablations of the search
        share one index."""
        return {"build_version": BUILD_VERSION, **{k: v for k, v in asdict(self.config).items() if k in INDEX_OPTIONS}}

    # ---------------------------------------------------------------- construction
    def index(self, document: str) -> PecanIndex:
        graph, log = GraphBuilder(self.engine, self.config, self.progress).build(document)
        return PecanIndex(graph, self.embedder.encode([n.text for n in graph.nodes.values()]), asdict(self.config),
                          log)

    # ---------------------------------------------------------------- search
    def answer(self, index: PecanIndex, question: str, options: tuple[str, ...] = ()) -> Answer:
        eng, cfg = self.search_engine, self.config
        trace, yes_count = [], 0
        before = eng.flops.scopes["query"]
        with eng.flops.scope("query"), eng.session() as s:
            for step in self.search(s, index, question, options, probe=cfg.dynamic):
                trace.append(step)
                yes_count += step.get("p_yes", 0.0) > cfg.t_p
                if yes_count >= cfg.t_n:
                    trace.append({"stop": "yes"})
                    break
            text, generated = self.respond(s, question, options)
            prompt_tokens = len(s) - generated
        visited = [step["node"] for step in trace if "node" in step]
        return Answer(text, visited, trace, eng.flops.scopes["query"] - before, prompt_tokens, generated)

    def search(self, s, index: PecanIndex, question: str, options: tuple[str, ...] = (),
               probe: bool = True) -> Iterator[dict]:
        """Prefill the first turn and the query into the empty session `s`, then append nodes one at a time, top
        level first, then by z + similarity; yield a step after each append: {"node", "level", "z", "r"}, plus
        "p_yes" from a rolled-back probe once the whole top level is in (when `probe`). Ends with a step
        {"stop": "budget" | "graph exhausted" | "context full"} unless the caller stops first; "context full" when
        the next node would leave no room in the window for the probe, the second turn and the answer."""
        eng, cfg, graph = self.search_engine, self.config, index.graph
        tok = eng.tokenizer
        question = _with_options(question, options)
        head, info, probe_tail = chat_pieces(eng, [{"role": "user", "content": FIRST_TURN}])
        probe_ids = tok.encode(probe_tail, parse_special=True)
        if cfg.prompt_style == "restate":
            probe_ids = tok.encode(RESTATED_PROBE.format(question)) + probe_ids
        room = eng.config.max_seq_len - max(len(probe_ids), len(self._second_turn_ids(question))
                                            + self._answer_budget())
        sim = dict(enumerate((index.vectors @ self.embedder.encode([question])[0]).tolist()))
        s.append(tok.encode(head, parse_special=True), node_id="head")
        q_len = len(s.append(tok.encode(question), node_id="query"))
        s.append(tok.encode(info), node_id="info")
        visited, query_mass = [], []
        pending, n_top = list(graph.top_level), len(graph.top_level)
        while True:
            if pending:
                node, z = pending.pop(0), None
            else:
                picked = next_node(graph, visited, dict(zip(visited, positional_relevance(query_mass))), sim,
                                   cfg.attention, cfg.embedding)
                if picked is None or len(visited) - n_top >= self._limit():
                    yield {"stop": "graph exhausted" if picked is None else "budget"}
                    return
                node, z = picked
            ids = tok.encode("* " + graph.nodes[node].text.strip() + "\n")
            if len(s) + len(ids) > room:
                yield {"stop": "context full"}
                return
            s.append(ids, node_id=node, collect=True)
            visited.append(node)
            query_mass.append(float(s.token_mass(node)[:, 1].mean()) / q_len)  # node -> query, token-to-node mean
            step = {"node": node, "level": graph.nodes[node].level, "z": z, "r": query_mass[-1]}
            if probe and not pending:  # probes start once the whole top level is in
                step["p_yes"] = s.probe(["Yes", "No"], tokens=probe_ids)["Yes"]
            yield step

    def respond(self, s, question: str, options: tuple[str, ...] = ()) -> tuple[str, int]:
        """Append the second turn (Table A2) to a searched session and decode the answer: (text, tokens)."""
        s.append(self._second_turn_ids(_with_options(question, options)), node_id="second turn")
        stops = None if self.prompt is None else list(self.prompt.stop) or None
        text = s.generate(self._answer_budget(), stop=stops, node_id="answer")
        return text.strip(), len(s.nodes[-1]) if s.nodes[-1].node_id == "answer" else 0

    def _second_turn_ids(self, question: str) -> list[int]:
        eng = self.search_engine
        turn = SECOND_TURN if self.config.prompt_style == "paper" else RESTATED_SECOND_TURN.replace("{}", question)
        tail = chat_pieces(eng, [{"role": "user", "content": FIRST_TURN}, {"role": "assistant", "content": "Yes"},
                                 {"role": "user", "content": turn}])[-1]
        return eng.tokenizer.encode(tail, parse_special=True)

    def _answer_budget(self) -> int:
        return self.config.answer_tokens if self.prompt is None else self.prompt.max_new_tokens

    def save_index(self, index: PecanIndex, path) -> None:
        from .pecan_store import save

        save(index, path, self.engine)

    def load_index(self, path) -> PecanIndex:
        from .pecan_store import load

        return load(path, self.engine)

    def _limit(self) -> int:
        return self.config.node_budget if self.config.dynamic else self.config.fixed_nodes


def _with_options(question: str, options: tuple[str, ...]) -> str:
    """The question with its multiple-choice options, (A) ... (D), one per line."""
    return "\n".join([question, *(f"({chr(65 + i)}) {o}" for i, o in enumerate(options))])
