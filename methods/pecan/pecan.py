"""PECAN (pecan.txt §3): attention-guided graph construction (`pecan_build`) and dynamic graph search on the
engine's node cache.

Search (§3.2, Table A2, App. B-C): the first-turn prompt and the query are prefilled once; the top level is
appended; then after each appended node a rolled-back probe ("Yes"/"No") decides whether to stop; the next node
maximises z_i = Σ_j r_j e_ji (r_j: the visited node's attention to the query, times its prompt position) plus its
embedding similarity to the query. The shared reader then answers from the visited nodes (`reader=paper`: the
second-turn prompt decodes the answer from the same cache).

With `kv_reuse` (beyond the paper) each node's KV is stored at indexing and placed instead of prefilled, in the
search and in the reader (engine/node_store.py). A placed node's tokens never attended to the query, so r comes from
the tokens `blend` repairs (collected as they are recomputed); under pure `reuse` r is 0 and the search is by
embedding similarity alone (the paper's "w/o attention" ablation), though the probes still read the placed KV.
`kv_levels=chunks` places only the chunks and prefills the summary points.
"""
from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path
from typing import Iterator

from ...engine.engine import Engine
from ...engine.node_store import StoredNode
from ...paths import write_atomic
from ..base import Answer, Method
from ..chat_prompt import SLOT, ChatPrompt
from ..options import Option
from .pecan_build import BUILD_VERSION, GraphBuilder
from .pecan_graph import Z_SCALES, next_node, positional_relevance
from .pecan_store import FORMAT, PecanIndex, load, save, to_graphml, to_html
from ..prompts import PromptSpec
from ..reader import (KV_REUSE_OPTIONS, READER_OPTION, GrowingPrompt, Reader, Repair, check_prompt_fits,
                      kv_index_key, store_kv_nodes)

FIRST_TURN = ("Can this question be answered by the following information? Response \"Yes\" or \"No\" in one word. "
              "Do not provide any explanation.\n\nQuestion:\n{}\n\nInformation:\n{}")
SECOND_TURN = "Given the above information and question, answer the question as concisely as you can."
# prompt_style="restate": small models lose the question by the end of a long first turn (they answer "Yes" or
# repeat a name), so the probe and the answer turn state it again; the cached prompt is the paper's either way
RESTATED_PROBE = ("\n\nCan the question \"{}\" be answered by the information above? Response \"Yes\" or \"No\" "
                  "in one word.")
# ... and the answer turn restates it: with the dataset prompt's closing instruction and question where there is a
# dataset prompt (PromptSpec.instruction), else with this turn
RESTATED_SECOND_TURN = "Given the above information, answer this question as concisely as you can.\n\nQuestion: {}"
PROMPT_STYLES = ("paper", "restate")

# App. E: the confidence threshold t_p the paper used per dataset with Llama-3.1-8B (t_n = 1 throughout), keyed by
# our dataset files (Qasper is L-Eval's scientific_qa)
PAPER_T_P = {"narrativeqa": 0.5, "scientific_qa": 0.98, "hotpotqa": 0.5, "musique": 0.55}
# The options a graph depends on (the others only steer the search), so that ablations of the search share one index.
INDEX_OPTIONS = ("chunk_tokens", "batch_tokens", "summary_tokens", "max_levels", "ip_graph", "prime_summary")
GRAPH_WRITERS = {".graphml": to_graphml, ".html": to_html}


class Pecan(Method, name="pecan", title="PECAN"):
    """PECAN: a graph of chunks and summary points built by attention, searched per question.

    index(document) builds the graph; answer(index, question) searches it and answers from the same cache.
    `search_engine` may be a different model than the one that built the graph (Table 2); `progress` shows a bar
    per level while the graph is built."""

    # the paper's hyper-parameters and the Table 3 ablation switches
    options = (
        Option("chunk_tokens", int, 300, "tokens per level-1 chunk", low=1),
        Option("batch_tokens", int, 8192, "s: tokens of the nodes summarised together", low=1),
        Option("summary_tokens", int, 512, "generation budget of one batch summary", low=1),
        Option("max_levels", int, 5, "levels at most, the chunks' included", low=2),
        Option("t_n", int, 1, "stop patience: confident probes before the search stops", low=1),
        Option("t_p", float, 0.5, "confidence threshold on the normalised p(Yes)", low=0.0, high=1.0),
        Option("node_budget", int, 0, "nodes retrieved beyond the top level at most; 0: no budget, the window is "
               "the limit (the paper's rule)", low=0),
        Option("search_tokens", int, 8192, "s for the search: its session's tokens at most, the probe, second turn "
               "and answer included (§4 caps every step at s); 0: the model's window", low=0,
               before=0),
        Option("answer_tokens", int, 64, "answer budget when no dataset prompt gives one", low=1),
        Option("attention", bool, True, "false: w/o attention-guided retrieval (embedding similarity only)"),
        Option("embedding", bool, True, "false: w/o embedding similarity"),
        Option("dynamic", bool, True, "false: w/o dynamic progress control (no probes, fixed_nodes retrieved)"),
        Option("fixed_nodes", int, 4, "nodes retrieved beyond the top level when dynamic is false", low=0),
        Option("ip_graph", bool, True, "false: w/o IP graph (each batch summarised into one node, RAPTOR-like)"),
        Option("prime_summary", bool, True, "the summary turn starts with '* ' (false: the paper's bare turn)"),
        Option("prompt_style", str, "paper", "restate: the probe and the answer turn repeat the question",
               choices=PROMPT_STYLES),
        Option("candidates", str, "all", "all: every unvisited node is scored (§3.2.2); successors: children of "
               "visited nodes first", choices=("all", "successors")),
        Option("z_scale", str, "paper", "max: z divided by the largest z among the candidates, so that it weighs like "
               "cosine similarity; paper: Eq. (1) as it is", choices=Z_SCALES),
        READER_OPTION,
        *KV_REUSE_OPTIONS,
        Option("kv_levels", str, "all", "with kv_reuse: all: every node placed; chunks: only the level-1 chunks "
               "placed, the summary points prefilled (short, and a point stored after the whole document carries "
               "all of it into the Yes/No probe)", choices=("all", "chunks")),
    )
    can_save, index_file_format = True, FORMAT
    exports = {".graphml": "the graph as GraphML", ".html": "the graph drawn in an HTML page"}

    def __init__(self, engine: Engine, prompt: PromptSpec | None = None, progress: bool = False,
                 search_engine: Engine | None = None, embedder=None, **options):
        super().__init__(engine, prompt, progress, **options)
        self.search_engine = search_engine or engine
        if self.search_engine is not engine and self.config.kv_reuse != "off":
            raise ValueError("kv_reuse stores the nodes' KV with the model that builds the graph: it needs the search "
                             "to run on that model too (no search_engine)")
        self._embedder = embedder
        # the shared reader on another search model, kept so that its letter priors are too
        self._search_reader = None if self.search_engine is engine else Reader(self.search_engine, self.answer_prompt)

    @property
    def embedder(self):
        from ..retrieval.embedder import Embedder

        return self._embedder or Embedder.shared()

    @classmethod
    def dataset_defaults(cls, dataset: str) -> dict[str, tuple[float, str]]:
        """App. E's t_p for the datasets the paper evaluated (tuned there for Llama-3.1-8B); `nodekv calibrate`
        tunes it for a model (`nodekv.evaluation.pecan_calibration`)."""
        return {"t_p": (PAPER_T_P[dataset], "App. E (tuned for Llama-3.1-8B)")} if dataset in PAPER_T_P else {}

    def index_key(self) -> dict:
        key = {"build_version": BUILD_VERSION, **{k: v for k, v in asdict(self.config).items() if k in INDEX_OPTIONS}}
        return {**key, **kv_index_key(self.config)}

    # ---------------------------------------------------------------- construction
    def index(self, document: str) -> PecanIndex:
        graph, log = GraphBuilder(self.engine, self.config, self.progress).build(document)
        index = PecanIndex(graph, self.embedder.encode([n.text for n in graph.nodes.values()]), asdict(self.config),
                           log)
        return index if self.config.kv_reuse == "off" else self.store_kv(index)

    def store_kv(self, index: PecanIndex) -> PecanIndex:
        """Each node's KV as the search appends it (`_node_ids`)."""
        kv = {k: getattr(self.config, k) for k in ("kv_reuse", "kv_dtype", "kv_context")}
        nodes = list(index.graph.nodes)  # in id order: the chunks in document order, then each level's points
        stored = store_kv_nodes(self.engine, [self._node_ids(index.graph, n) for n in nodes], self.config)
        return replace(index, config={**index.config, **kv}, stored=dict(zip(nodes, stored)))

    # ---------------------------------------------------------------- search
    def answer(self, index: PecanIndex, question: str, options: tuple[str, ...] = ()) -> Answer:
        eng, cfg = self.search_engine, self.config
        trace, yes_count = [], 0
        if cfg.reader == "shared":  # a question the reader's prompt cannot hold is refused now, not after the search
            if options:  # the calibration scope's, not the query's, as `Reader.read` charges it
                self._answer_reader.letter_prior(question, options)
            else:
                self._answer_reader.prompt_ids("", question)
        before = eng.flops.scopes["query"]
        with eng.flops.scope("query"), eng.session() as s:
            for step in self.search(s, index, question, options, probe=cfg.dynamic):
                trace.append(step)
                yes_count += step.get("p_yes", 0.0) > cfg.t_p
                if yes_count >= cfg.t_n:
                    trace.append({"stop": "yes"})
                    break
            answer = self.conclude(s, index, trace, question, options)
        answer.flops = eng.flops.scopes["query"] - before
        return answer

    def conclude(self, s, index: PecanIndex, trace: list[dict], question: str,
                 options: tuple[str, ...] = (), growing: GrowingPrompt | None = None) -> Answer:
        """The answer after a search in session `s` whose steps are `trace`: the shared reader over the visited nodes
        (in the order the search appended them, read by the model that searched), or with reader=paper the second
        turn decoded in `s` itself (the caller truncates `s` to take it back). `growing`: the prompts of the
        answers after earlier steps of this search, kept prefilled (the shared reader's plain read only)."""
        visited = [step["node"] for step in trace if "node" in step]
        read = "\n".join("* " + index.graph.nodes[n].text.strip() for n in visited)
        if self.config.reader == "paper":
            text, generated = self.respond(s, question, options)
            return Answer(text, visited, trace, 0, len(s) - generated, generated, context=read)
        reader = self._answer_reader
        if index.stored is None:
            return reader.read(read, question, options, visited, trace, growing=growing)
        stored = [self._stored(index, n) for n in visited]
        passages = [self._node_ids(index.graph, n) if p is None else p for n, p in zip(visited, stored)]
        return reader.read_stored(passages, question, options, visited, trace, Repair.of(self.config), read)

    @property
    def _answer_reader(self) -> Reader:
        """The shared reader on the model that searches."""
        return self._search_reader or self.reader

    def search(self, s, index: PecanIndex, question: str, options: tuple[str, ...] = (),
               probe: bool = True) -> Iterator[dict]:
        """Prefill the first turn and the query into the empty session `s`, then append nodes one at a time, top
        level first, then by z + similarity; yield a step after each append: {"node", "level", "r"}, for a picked
        node also "z", "sim" and "by_sim" (the node similarity alone would have picked), plus
        "p_yes" from a rolled-back probe once the whole top level is in (when `probe`). Ends with a step
        {"stop": "budget" | "graph exhausted" | "context full"} unless the caller stops first; "context full" when
        the next node would leave no room in the search's window (`search_tokens`) for the probe, the second turn and
        the answer."""
        eng, cfg, graph = self.search_engine, self.config, index.graph
        first, probe_ids, room = self.search_prompt(question, options)
        sim = dict(enumerate((index.vectors @ self.embedder.encode([_with_options(question, options)])[0]).tolist()))
        s.append(first[0], node_id="head")
        q_len = len(s.append(first[1], node_id="query"))
        s.append(first[2], node_id="info")
        visited, query_mass = [], []
        pending, n_top = list(graph.top_level), len(graph.top_level)
        while True:
            why = {}
            if pending:
                node = pending.pop(0)
            else:
                picked = next_node(graph, visited, dict(zip(visited, positional_relevance(query_mass))), sim,
                                   cfg.attention, cfg.embedding, successors_only=cfg.candidates == "successors",
                                   z_scale=cfg.z_scale)
                limit = self._limit()
                if picked is None or (limit is not None and len(visited) - n_top >= limit):
                    yield {"stop": "graph exhausted" if picked is None else "budget"}
                    return
                node, why = picked.node, {"z": picked.z, "sim": picked.similarity, "by_sim": picked.by_similarity}
            stored = self._stored(index, node)
            ids = self._node_ids(graph, node) if stored is None else None
            n_tokens = len(ids if stored is None else stored)
            if len(s) + n_tokens > room:
                yield {"stop": "context full"}
                return
            placed = {}
            if stored is None:
                s.append(ids, node_id=node, collect=True)
            else:
                recomputed = self._place(s, stored, node)
                placed = {"reused": n_tokens - recomputed, "recomputed": recomputed}
            visited.append(node)
            # node -> query, token-to-node mean (over its repaired tokens when placed; none repaired: no attention)
            collected = stored is None or placed["recomputed"] > 0
            query_mass.append(float(s.token_mass(node)[:, 1].mean()) / q_len if collected else 0.0)
            step = {"node": node, "level": graph.nodes[node].level, **why, "r": query_mass[-1], **placed}
            if probe and not pending:  # probes start once the whole top level is in
                step["p_yes"] = s.probe(["Yes", "No"], tokens=probe_ids)["Yes"]
            yield step

    def search_prompt(self, question: str, options: tuple[str, ...] = ()) -> tuple[list[list[int]], list[int], int]:
        """What a search for `question` appends around its nodes: the first turn's ids in three parts (the head, the
        query node, the rest up to where the nodes go), the probe's ids, and the room for the first turn and the nodes:
        the search's window less the probe or the second turn and the answer, whichever is longer. A first turn the
        window cannot hold is refused (ContextOverflowError)."""
        eng, cfg = self.search_engine, self.config
        asked = _with_options(question, options)
        turn = ChatPrompt(eng.tokenizer, [{"role": "user", "content": FIRST_TURN}])
        before, query, after = turn.fill_parts(0, asked)
        info, probe_ids = turn.around(1)  # the nodes go between
        if cfg.prompt_style == "restate":
            probe_ids = eng.tokenizer.encode(RESTATED_PROBE.format(asked)) + probe_ids
        window = min(cfg.search_tokens or eng.config.max_seq_len, eng.config.max_seq_len)
        # the second turn as `respond` appends it: from the question and its options apart, not from `asked`, which
        # a restated turn would repeat the options after
        room = window - max(len(probe_ids), len(self._second_turn_ids(question, options)) + self._answer_budget())
        first = [turn.head + before, query, after + info]
        check_prompt_fits(sum(map(len, first)), window, "PECAN's first turn with this question", "the model's window"
                          if window == eng.config.max_seq_len else "the search's window (search_tokens)")
        return first, probe_ids, room

    def _stored(self, index: PecanIndex, node: int) -> StoredNode | None:
        """The node's stored KV if it is to be placed: the index holds KV, and the node is a chunk or kv_levels=all.
        None: it is prefilled."""
        if index.stored is None or (self.config.kv_levels == "chunks" and index.graph.nodes[node].level > 1):
            return None
        return index.stored[node]

    def _node_ids(self, graph, node: int) -> list[int]:
        """A node's tokens as the search appends it: "* text" and a newline."""
        return self.search_engine.tokenizer.encode("* " + graph.nodes[node].text.strip() + "\n")

    def _place(self, s, stored, node: int) -> int:
        """Place a stored node in the search session; with kv_reuse=blend, recompute its `repair` fraction of tokens
        (`Repair`), collecting their attention mass (the node's relevance r). Returns how many."""
        span = s.append_stored(stored, node_id=node)
        worst = Repair.of(self.config).positions(s, [span])
        if worst:
            s.repair(worst, collect=True)
        return len(worst)

    def respond(self, s, question: str, options: tuple[str, ...] = ()) -> tuple[str, int]:
        """Append the second turn (Table A2) to a searched session and decode the answer: (text, tokens)."""
        s.append(self._second_turn_ids(question, options), node_id="second turn")
        stops = None if self.prompt is None else list(self.prompt.stop) or None
        gen = s.generate(self._answer_budget(), stop=stops, node_id="answer")
        return gen.text.strip(), len(gen.ids)

    def _second_turn_ids(self, question: str, options: tuple[str, ...] = ()) -> list[int]:
        eng = self.search_engine
        if self.config.prompt_style == "paper":
            turn = SECOND_TURN
        elif self.prompt is not None:
            turn = self.prompt.instruction(question, options)
        else:
            turn = RESTATED_SECOND_TURN.replace("{}", _with_options(question, options))
        turns = ChatPrompt(eng.tokenizer, [{"role": "user", "content": FIRST_TURN},
                                           {"role": "assistant", "content": "Yes"}, {"role": "user", "content": SLOT}])
        return turns.around(1)[1] + turns.fill(2, turn)

    def _answer_budget(self) -> int:
        return self.config.answer_tokens if self.prompt is None else self.prompt.max_new_tokens

    def save_index(self, index: PecanIndex, path: str | Path) -> None:
        save(index, path, self.engine, self.config.kv_dtype)

    def load_index(self, path: str | Path) -> PecanIndex:
        """The saved index, with its node store opened (lazily) when kv_reuse is on."""
        return load(path, self.engine, kv=self.config.kv_reuse != "off")

    def export(self, index: PecanIndex, path: str | Path) -> None:
        write = GRAPH_WRITERS.get(Path(path).suffix)
        if write is None:
            return super().export(index, path)
        write_atomic(path, write(index.graph))

    def describe(self, index: PecanIndex) -> list[str]:
        levels = sorted({n.level for n in index.graph.nodes.values()})
        edges = sum(map(len, index.graph.edges.values()))
        return [f"{len(index.graph.nodes)} nodes on levels {levels}, {edges} edges", *index.log]

    def trace_lines(self, index: PecanIndex, trace: list[dict]) -> list[str]:
        lines = []
        for step in trace:
            if "node" not in step:
                lines.append(f"stop: {step['stop']}")
                continue
            node = index.graph.nodes[step["node"]]
            z = f" z={step['z']:.2e} sim={step['sim']:.3f}" if "z" in step else ""
            p = f" p_yes={step['p_yes']:.3f}" if "p_yes" in step else ""
            lines.append(f"  #{node.id} L{node.level}{z} r={step['r']:.4f}{p}  {' '.join(node.text.split())[:70]}")
        return lines

    def _limit(self) -> int | None:
        """Nodes beyond the top level at most; None: the window is the only limit."""
        if not self.config.dynamic:
            return self.config.fixed_nodes
        return self.config.node_budget or None


def _with_options(question: str, options: tuple[str, ...]) -> str:
    """The question with its multiple-choice options, (A) ... (D), one per line."""
    return "\n".join([question, *(f"({chr(65 + i)}) {o}" for i, o in enumerate(options))])
