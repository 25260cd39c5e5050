"""DICE, dynamic in-context editing (dice.txt §3), as a method: chunks, retrieval and the two algorithms
(`dice_algorithms`) on the engine (`dice_lm`).

Retrieval (§3.1): the document is cut into chunks of at most 80 words; a sub-question or drafted step recalls the
top chunks by bi-encoder (all-MiniLM-L6-v2; `recall=hybrid` fuses its ranking with BM25's, for exact tokens such as
variable names and numbers), the LLM re-ranks them (log p("Yes") that the passage is relevant:
the engine replaces the paper's cross-encoder) and the best `top_k` feed the step, in document order.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from ...engine.engine import Engine
from ...engine.node_store import StoredNode
from ..base import Answer, Method
from .dice_algorithms import ALGORITHMS, LM, Budget, Reasoning, Retrieved
from .dice_prompts import EXAMPLE_SETS
from ..options import Option
from ..prompts import PromptSpec
from ..reader import KV_REUSE_OPTIONS, READER_OPTION, Repair, store_kv_nodes
from ..retrieval import DenseIndex, HybridIndex
from ..retrieval.chunking import HAN_KANA


_WORDS = re.compile(rf"[{HAN_KANA}]|[^\s{HAN_KANA}]+")  # a Han or kana character is a word by itself


def word_chunks(document: str, words: int) -> list[str]:
    """Chunks of at most `words` words (whitespace-separated runs; each Han or kana character one word, so a Chinese
    or Japanese paragraph is cut too), each space between them one; a chunk never spans a blank line (a passage
    break)."""
    chunks = []
    for paragraph in re.split(r"\n\s*\n", document):
        spans = [m.span() for m in _WORDS.finditer(paragraph)]
        for first in range(0, len(spans), words):
            last = spans[min(first + words, len(spans)) - 1]
            chunks.append(" ".join(paragraph[spans[first][0]:last[1]].split()))
    return chunks


@dataclass
class DiceIndex:
    """The document's chunks and their bi-encoder index; with `kv_reuse`, each chunk's KV (its plain token ids)."""

    chunks: list[str]
    search: DenseIndex | HybridIndex
    stored: list[StoredNode] | None = None


class Dice(Method, name="dice", title="DICE"):
    """DICE: the LLM plans sub-questions (Alg. 1) or reasoning steps (Alg. 2), each answered from retrieved chunks;
    the shared reader answers from every retrieved chunk and (`notes`) the facts or thoughts (`reader=paper`: T's
    answer). With `kv_reuse` (beyond the paper) each chunk's KV is stored at indexing and placed where the re-rank,
    the fact extraction and the shared reader read the chunk; Alg. 2's reference, written into T, stays text.

    index(document) cuts and embeds the chunks; answer(index, question) runs the chosen algorithm. `embedder`
    replaces the packaged all-MiniLM-L6-v2; `lm` replaces the engine-backed LLM calls (tests script it).

    The Answer's `flops` are the whole run's. The planning, relevance and extraction prefixes are prefilled once per
    engine: the first answer that uses one pays for it, later ones do not, and the trace's last entry records the
    FLOPs this saved a run (`prefix_flops_saved`). With `reader=paper`, `prompt_tokens` and `generated_tokens` count
    every token the run prefilled and decoded (planning, re-rank, extraction, steps and answer), not those of one
    prompt and its answer as the shared reader's do."""

    options = (
        Option("algorithm", int, 2, "1: iterative QA with fact extraction; 2: knowledge-constrained decoding",
               choices=(1, 2)),
        Option("max_iterations", int, 5, "M: sub-questions or steps at most", low=1),
        Option("chunk_words", int, 80, "words per chunk at most", low=1),
        Option("top_k", int, 3, "chunks that feed each step (at most recall_k with rerank)", low=1),
        Option("recall", str, "dense", "dense: the bi-encoder recalls (the paper); hybrid: its ranking fused with "
               "BM25's", choices=("dense", "hybrid")),
        Option("recall_k", int, 10, "recalled candidates re-ranked by the LLM", low=1),
        Option("rerank", bool, True, "re-rank the recalled chunks by the LLM's relevance probe"),
        Option("step_tokens", int, 64, "token budget of a sub-question, a thought or a fact", low=1),
        Option("prompt_style", str, "paper", "restate: the answer is the reply to a new turn that states the question "
               "again with the dataset's answer instruction", choices=("paper", "restate")),
        Option("examples", str, "multihop", "few-shot examples: App. D's multi-hop questions, or chains of variable "
               "assignments (variable tracking)", choices=tuple(EXAMPLE_SETS)),
        Option("notes", bool, True, "the shared reader reads the facts (Alg. 1) or thoughts (Alg. 2) after the chunks; "
               "false: the chunks alone (the thoughts are the model's own claims, and can be wrong)"),
        READER_OPTION,
        *KV_REUSE_OPTIONS,
    )

    def __init__(self, engine: Engine, prompt: PromptSpec | None = None, progress: bool = False, embedder=None,
                 lm: LM | None = None, **options):
        super().__init__(engine, prompt, progress, **options)
        self._embedder, self._lm = embedder, lm

    @classmethod
    def configure(cls, **options: Any) -> Any:
        """`Method.configure`, with top_k at most recall_k under the re-rank: it keeps top_k of the recall_k chunks
        recalled, so a larger top_k would silently read recall_k chunks a step."""
        config = super().configure(**options)
        if config.rerank and config.top_k > config.recall_k:
            raise ValueError(f"DICE option top_k ({config.top_k}) must be at most recall_k ({config.recall_k}) "
                             f"with rerank: the re-rank keeps top_k of the recall_k chunks recalled")
        return config

    @property
    def lm(self) -> LM:
        if self._lm is None:
            from .dice_lm import EngineLM

            self._lm = EngineLM(self.engine, self.config.examples, Repair.of(self.config))
        return self._lm

    def index(self, document: str) -> DiceIndex:
        from ..retrieval.embedder import Embedder

        chunks = word_chunks(document, self.config.chunk_words)
        search = DenseIndex if self.config.recall == "dense" else HybridIndex
        index = DiceIndex(chunks, search(chunks, self._embedder or Embedder.shared()))
        return index if self.config.kv_reuse == "off" else self.store_kv(index)

    def store_kv(self, index: DiceIndex) -> DiceIndex:
        encode = self.engine.tokenizer.encode
        return replace(index, stored=store_kv_nodes(self.engine, [encode(c) for c in index.chunks], self.config))

    def retrieve(self, index: DiceIndex, query: str) -> Retrieved:
        """The `top_k` chunks for `query`: dense or hybrid recall, LLM re-rank (ties: the bi-encoder's order), then
        document order."""
        c = self.config
        hits = index.search.search(query, c.recall_k if c.rerank else c.top_k)
        stored = None if index.stored is None else [index.stored[i] for i, _ in hits]
        rerank = self.lm.relevance(query, [index.chunks[i] for i, _ in hits], stored) if c.rerank else \
            [None] * len(hits)
        ranked = sorted(range(len(hits)), key=lambda j: -rerank[j] if c.rerank else j)[:c.top_k]
        chosen = sorted(ranked, key=lambda j: hits[j][0])
        scores = [{"chunk": i, c.recall: round(score, 4), **({"rerank": round(r, 4)} if c.rerank else {})}
                  for (i, score), r in zip(hits, rerank)]
        return Retrieved([hits[j][0] for j in chosen], "\n".join(index.chunks[hits[j][0]] for j in chosen),
                         [scores[j] for j in chosen], scores if c.rerank else [],
                         [] if index.stored is None else [index.stored[hits[j][0]] for j in chosen])

    def answer(self, index: DiceIndex, question: str, options: tuple[str, ...] = ()) -> Answer:
        if options:
            raise ValueError("DICE answers open questions; multiple-choice options are not supported")
        c, acc = self.config, self.engine.flops
        before, saved, prefill, decode = acc.total, acc.saved, acc.prefill_tokens, acc.decode_tokens
        answer_tokens = self.answer_prompt.max_new_tokens
        # with the shared reader the loop only gathers: its own answer step decodes nothing
        budget = Budget(c.max_iterations, c.step_tokens, answer_tokens if c.reader == "paper" else 0,
                        step_room=3 * c.step_tokens + answer_tokens + 2 * c.top_k * c.chunk_words)
        answer_turn = self.answer_prompt.instruction(question) if c.prompt_style == "restate" else None
        run = ALGORITHMS[c.algorithm](self.lm, lambda q: self.retrieve(index, q), question, budget, answer_turn)
        run.trace[-1]["prefix_flops_saved"] = acc.saved - saved
        context = self.reader_context(index, run)
        if c.reader == "shared":
            if index.stored is None:
                answer = self.reader.read(context, question, (), run.chunks, run.trace)
            else:
                answer = self.reader.read_stored(self.reader_passages(index, run), question, (), run.chunks,
                                                 run.trace, Repair.of(c), context)
            answer.flops = acc.total - before
            return answer
        return Answer(run.answer, run.chunks, run.trace, acc.total - before, acc.prefill_tokens - prefill,
                      acc.decode_tokens - decode, context=context)

    def reader_context(self, index: DiceIndex, run: Reasoning) -> str:
        """What the shared reader reads: every chunk the steps retrieved, in document order, then (with `notes`) the
        facts or thoughts, one per line."""
        return "\n\n".join([*(index.chunks[i] for i in run.chunks), *self._notes(run)])

    def reader_passages(self, index: DiceIndex, run: Reasoning) -> list:
        """`reader_context` for `Reader.read_stored`: each chunk's stored KV, and as token ids the blank lines
        between them and the notes (which change with the question)."""
        encode = self.engine.tokenizer.encode
        passages = []
        for j, i in enumerate(run.chunks):
            passages += [encode("\n\n")] if j else []
            passages.append(index.stored[i])
        return passages + [encode("\n\n" + notes) for notes in self._notes(run)]

    def _notes(self, run: Reasoning) -> list[str]:
        """With `notes`, the facts or thoughts as one passage (none without, or when there are none)."""
        notes = [f"- {step[k]}" for step in run.trace for k in ("fact", "thought") if step.get(k)]
        return ["Notes:\n" + "\n".join(notes)] if notes and self.config.notes else []

    def trace_lines(self, index: DiceIndex, trace: list[dict]) -> list[str]:
        lines = []
        for step in trace:
            if "stop" in step:
                lines.append(f"stopped: {step['stop']}; answer: {step['answer']!r}")
                continue
            asked = step.get("subquestion", step.get("draft"))
            got = ", ".join(f"{s['chunk']}" + (f" ({s['rerank']:.2f})" if "rerank" in s else "")
                            for s in step.get("retrieved", ()))
            said = step.get("fact", step.get("thought", f"[{step.get('broken')}]"))
            lines.append(f"{step['step']}. {asked}\n   chunks {got or '-'}\n   -> {said}")
        return lines
