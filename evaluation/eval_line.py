"""One record's eval line: the method's answer to the record's question with its metrics, the reader-independent
diagnostics (support read, the miss kind, calibrated multiple choice), its cost by the engine's FLOP account (and
projected to the llama-3.1-8b preset) and its wall time."""
from __future__ import annotations

import time

from ..engine.engine import Engine
from ..methods.base import Method
from ..methods.reader import LETTERS, calibrated_choice
from .index_store import PROJECT_TO, IndexStore, document_hash, processed_tokens
from .metrics import miss, score, support_read


def _reader_of(method: Method) -> str:
    """Which answer step a method's lines come from: "shared" (`reader.Reader`) or "paper" (its own)."""
    return getattr(method.config, "reader", "shared")


def scored(record, prediction: str, calibrated: str | None = None, read: list[bool] | None = None) -> dict:
    """A line's `metrics` for `prediction` (`score`, and the accuracy of the `calibrated` letter where the reader
    chose one), and with the supporting passages `read`, its `miss` kind: what `rescore` recomputes too."""
    metrics = score(record, prediction)
    if calibrated is not None:
        metrics["accuracy_calibrated"] = float(calibrated == record.references[0].strip().upper())
    return {"metrics": metrics, **({} if read is None else {"miss": miss(record.task, metrics, read)})}


def evaluate_record(engine: Engine, method: Method, record, indexes: dict, store: IndexStore) -> dict:
    """One record's eval line (an "error" line if its index or answer fails); `indexes` keeps the last document's
    index alive between calls."""
    doc = document_hash(record.document)
    line = {"id": record.id, "question": record.question, "references": list(record.references), "document": doc}
    acc = engine.flops
    try:
        if doc not in indexes:
            indexes.clear()  # records come grouped by document: keep one index alive
            indexes[doc] = store.build_or_load(method, record.document)
        built = indexes[doc]
        if record.options:  # the content-free letter prior is calibration, not the query's cost
            method.reader.letter_prior(record.question, record.options)
        before, before_8b, saved, tokens = acc.total, acc.projected[PROJECT_TO], acc.saved, processed_tokens(acc)
        paid = len(engine.prefixes.paid)
        t = time.perf_counter()
        with acc.scope("query"):
            answer = method.answer(built.index, record.question, record.options)
        wall = time.perf_counter() - t
    except Exception as e:  # one bad record never stops the run; the report counts it
        return {**line, "error": f"{type(e).__name__}: {e}"}
    diagnostics, calibrated, read = {}, None, None
    if answer.choice_probs is not None:
        calibrated = LETTERS[calibrated_choice(answer.choice_probs, answer.choice_prior)]
        diagnostics = {"choice_probs": answer.choice_probs, "choice_prior": answer.choice_prior,
                       "calibrated": calibrated}
    if record.supports:
        read = support_read(record.supports, answer.context)
        diagnostics.update(support=read, support_recall=sum(read) / len(read))
    return {**line, "prediction": answer.text, **scored(record, answer.text, calibrated, read), **diagnostics,
            "nodes": answer.nodes,
            "query_flops": acc.total - before, "query_flops_8b": acc.projected[PROJECT_TO] - before_8b,
            "query_flops_saved": acc.saved - saved, "prefixes_paid": engine.prefixes.paid[paid:],
            "query_tokens": processed_tokens(acc) - tokens,
            "index_flops": built.flops, "index_flops_8b": built.flops_8b, "index_s": round(built.seconds, 3),
            "index_tokens": built.tokens,
            "wall_s": round(wall, 3), "prompt_s": None if answer.prompt_s is None else round(answer.prompt_s, 3),
            "prompt_tokens": answer.prompt_tokens, "reader": _reader_of(method),
            "generated_tokens": answer.generated_tokens, "truncated": answer.truncated, "trace": answer.trace}
