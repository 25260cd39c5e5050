"""PECAN's attention graph construction (pecan.txt §3.1, Table A1).

Level-1 nodes are chunks of ~300 tokens; nodes are batched in order while the batch fits in s tokens (capped by the
window); each batch is summarised into bullet-point information points (IPs), generated with decode-time attention
collection, and each IP becomes a node one level up with edges to the batch's nodes (token-to-node mean attention
over the IP's tokens, normalised). Stopping rule (§3.1): levels repeat until a level fits in one batch of s tokens
(its summary is the top level) or `max_levels` is reached. Size is measured in tokens, not nodes: a batch of long
chunks often gives more, much shorter IPs, and counting nodes would stop there with a top level of many batches,
which the search then appends in document order until the window is full. A batch whose summary yields no usable point
(empty, or only repeats and loops) has its nodes carried up unchanged; when no batch of a level yields one, the
level below is the top.
"""
from __future__ import annotations

import torch
from tqdm import tqdm

from ...engine.engine import Engine
from ..chat_prompt import ChatPrompt
from .pecan_graph import Graph, edge_weights, looping, parse_ips
from ..retrieval import text_chunk_spans

# Part of every index's key: bump it when a change here changes the graphs built from the same options.
BUILD_VERSION = 3

SUMMARY_PROMPT = (
    "Summary the following information. Each segment is separated by a new line symbol.\n\n{}\nSplit your summary "
    "into different summary points according to the semantic information in these information points. It is not "
    "necessary to generate each summary point for each information point. Gather and organize information into "
    "summary points. In each summary point, try to avoid using pronouns like he/she/they and instead use full names. "
    "Generate in the format of:\n* summary point\n* summary point\n* summary point\n\nDo not provide any explanation "
    "and start the summary directly.")


PRIMER = "* "  # the start of the summary's first bullet, when prime_summary


class GraphBuilder:
    """Builds a document's graph with `engine` under PECAN's options (a `Pecan.Config`: chunk_tokens,
    batch_tokens, summary_tokens, max_levels, ip_graph); `progress` shows a bar per level."""

    def __init__(self, engine: Engine, config, progress: bool = False):
        self.engine, self.config, self.progress = engine, config, progress

    def build(self, document: str) -> tuple[Graph, list[str]]:
        """The graph of `document` and its build log (level sizes and every fallback taken)."""
        tok, cfg = self.engine.tokenizer, self.config
        ids = tok.encode(document)
        graph, log = Graph(), []
        level = [graph.add(1, tok.decode(ids[a:b])).id for a, b in text_chunk_spans(ids, tok, cfg.chunk_tokens)]
        overhead = sum(map(len, self._summary_pieces()))
        budget = min(cfg.batch_tokens, self.engine.config.max_seq_len - overhead - cfg.summary_tokens)
        for depth in range(2, cfg.max_levels + 1):
            batches = self._batches(graph, level, budget)
            bar = tqdm(batches, desc=f"level {depth}", unit="batch", disable=not self.progress)
            summaries = [self._summarise(graph, batch, depth, log) for batch in bar]
            if not any(summaries):
                log.append(f"level {depth}: no usable summary in {len(batches)} batches, level {depth - 1} is the top")
                break
            upper = []
            for batch, ips in zip(batches, summaries):
                if not ips:  # the level must still cover this batch: its nodes go up unchanged
                    log.append(f"level {depth} batch of nodes {batch[0]}..{batch[-1]}: inputs carried up")
                upper += ips or [self._carry(graph, i, depth) for i in batch]
            sizes = self._tokens(graph, level), self._tokens(graph, upper)
            log.append(f"level {depth}: {len(upper)} nodes ({sizes[1]} tokens) from {len(level)} ({sizes[0]} tokens) "
                       f"in {len(batches)} batches")
            if len(batches) == 1:
                break
            if sizes[1] >= sizes[0]:
                log.append(f"level {depth}: did not shrink in tokens")
            level = upper
        else:
            log.append(f"max_levels {cfg.max_levels} reached: the top level spans "
                       f"{len(self._batches(graph, level, budget))} batches")
        return graph, log

    def _summary_pieces(self) -> tuple[list[int], list[int]]:
        """The summary prompt's ids before and after its input nodes."""
        prompt = ChatPrompt(self.engine.tokenizer, [{"role": "user", "content": SUMMARY_PROMPT}])
        before, after = prompt.around(0)
        return prompt.head + before, after

    def _input_ids(self, graph: Graph, i: int) -> list[int]:
        """Node i as an input of a summary: one bullet, as Table A1 shows them."""
        return self.engine.tokenizer.encode("* " + " ".join(graph.nodes[i].text.split()) + "\n")

    def _tokens(self, graph: Graph, level: list[int]) -> int:
        return sum(len(self._input_ids(graph, i)) for i in level)

    def _batches(self, graph: Graph, level: list[int], budget: int) -> list[list[int]]:
        batches, size = [[]], 0
        for i in level:
            n = len(self._input_ids(graph, i))
            if batches[-1] and size + n > budget:
                batches.append([])
                size = 0
            batches[-1].append(i)
            size += n
        return batches

    def _summarise(self, graph: Graph, batch: list[int], depth: int, log: list[str]) -> list[int]:
        """One batch -> IP nodes one level up, with attention edges to the batch's nodes."""
        eng, tok, cfg = self.engine, self.engine.tokenizer, self.config
        head, tail = self._summary_pieces()
        lengths = []
        where = f"level {depth} batch of nodes {batch[0]}..{batch[-1]}"
        with eng.session() as s:
            s.append(head, node_id="head")
            for i in batch:
                lengths.append(len(s.append(self._input_ids(graph, i), node_id=i)))
            # priming the answer with the first bullet keeps small models from answering in prose or with a preamble
            s.append(tail + tok.encode(PRIMER) if cfg.prime_summary else tail, node_id="tail")
            summary = s.generate(cfg.summary_tokens, node_id="summary", collect=True)
            text, generated = summary.text, summary.ids
            mass = s.token_mass("summary")[:, 1:1 + len(batch)] if generated else None
        if cfg.ip_graph:
            ips, how, dropped = parse_ips(PRIMER + text if cfg.prime_summary else text)
            if dropped:
                log.append(f"{where}: {dropped} repeated, looping or too-short points dropped, {len(ips)} kept")
        else:
            ips, how = ([text.strip()], "whole summary") if text.strip() and not looping(text) else ([], "empty")
        if how in ("lines", "sentences"):
            log.append(f"{where}: no bullet list, IPs taken as {how}")
        if summary.finish_reason == "length" and len(ips) > 1 and text.rstrip().endswith(ips[-1]):
            log.append(f"{where}: summary hit {cfg.summary_tokens} tokens, its cut-off last point dropped")
            ips = ips[:-1]
        if not ips:
            log.append(f"{where}: no usable summary")
            return []
        per_token = mass / torch.tensor(lengths, dtype=torch.float32)  # token-to-node mean
        out = []
        for ip, rows in zip(ips, _ip_token_rows(tok, generated, text, ips)):
            node = graph.add(depth, ip)
            if rows:
                weights = edge_weights(per_token[rows].mean(0, keepdim=True))[0]
            else:  # the IP could not be located in the output (cannot happen for parsed text; kept exact anyway)
                weights = torch.full((len(batch),), 1.0 / len(batch))
                log.append(f"{where}: IP {node.id} not found in the output, uniform edges")
            graph.edges[node.id] = {i: float(w) for i, w in zip(batch, weights) if w > 0}
            out.append(node.id)
        return out

    def _carry(self, graph: Graph, i: int, depth: int) -> int:
        """A copy of node i one level up, with an edge to i alone."""
        node = graph.add(depth, graph.nodes[i].text)
        graph.edges[node.id] = {i: 1.0}
        return node.id


def _ip_token_rows(tok, generated: list[int], text: str, ips: list[str]) -> list[list[int]]:
    """For each IP (a substring of the generated text, in order), the indices of the generated tokens it spans."""
    ends = [len(tok.decode(generated[:k + 1])) for k in range(len(generated))]  # where each token's text ends
    rows, cursor = [], 0
    for ip in ips:
        start = text.find(ip, cursor)
        if start < 0:
            rows.append([])
            continue
        end = cursor = start + len(ip)
        rows.append([k for k in range(len(ends)) if ends[k] > start and (ends[k - 1] if k else 0) < end])
    return rows
