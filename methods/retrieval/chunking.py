"""Chunking a document by LLM tokens: fixed windows with overlap (`chunk_tokens`), and chunks cut at paragraph or
sentence ends where one is near (`text_chunk_spans`, `chunk_text`)."""
from __future__ import annotations

import re
from typing import Protocol, Sequence

# Han ideographs and kana (a regex character range): scripts written without spaces, where a run of characters is
# a phrase rather than a word, so what counts words (BM25's terms, DICE's word chunks) takes each character as one
HAN_KANA = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002fa1f"


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def chunk_tokens(ids: Sequence[int], size: int, overlap: int = 0) -> list[tuple[int, int]]:
    """Spans ``(start, end)`` of consecutive windows of `size` tokens, each starting `size - overlap` after the
    previous; the last one ends at ``len(ids)`` and may be shorter. No empty span; ``[]`` for no tokens."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"chunk size must be a positive int, got {size!r}")
    if isinstance(overlap, bool) or not isinstance(overlap, int) or not 0 <= overlap < size:
        raise ValueError(f"overlap must be an int in [0, size={size}), got {overlap!r}")
    n, step, spans = len(ids), size - overlap, []
    start = 0
    while start < n:
        spans.append((start, min(start + size, n)))
        if start + size >= n:
            break
        start += step
    return spans


_PARAGRAPH_END = re.compile(r"\n[ \t]*\n\s*$")
_SENTENCE_END = re.compile(r"[.!?\u3002\uff01\uff1f][\"')\]\u201d\u2019]*\s*$")


def _boundary_rank(tail: str) -> int:
    """2 if text ending at a cut ends a paragraph (a blank line), 1 if it ends a sentence, else 0."""
    return 2 if _PARAGRAPH_END.search(tail) else 1 if _SENTENCE_END.search(tail) else 0


def _splits_char(ids: list[int], j: int, tokenizer: TextTokenizer) -> bool:
    """Whether cutting before ids[j] splits a character's bytes (byte-level BPE): decoding the two sides apart
    then makes more U+FFFD than decoding them together."""
    left, right = ids[max(0, j - 4):j], ids[j:j + 4]
    apart = tokenizer.decode(left) + tokenizer.decode(right)
    return apart.count("\ufffd") > tokenizer.decode(left + right).count("\ufffd")


def text_chunk_spans(ids: Sequence[int], tokenizer: TextTokenizer, size: int) -> list[tuple[int, int]]:
    """Token spans ``(start, end)`` covering `ids` without overlap, each of at most `size` tokens.

    Cut rule: a chunk ends at ``start + size`` unless a better cut lies in its last quarter (the
    ``max(1, size // 4)`` tokens before that point): the latest cut after a blank line (paragraph break), else
    the latest after a sentence end (``. ! ?``, maybe followed by closing quotes/brackets and whitespace), else
    ``start + size`` itself; the text before a cut is judged from its last two tokens, so "e.g." and "3.14"
    can pass for sentence ends. A cut that would split a character's bytes across tokens (byte-level BPE)
    moves back to the closest cut that does not (a character is split only when no such cut is left in the
    chunk, i.e. for `size` below a few tokens). So all chunks but the last normally hold at least
    ``size - size // 4`` tokens, a few fewer next to multi-token characters; none is empty.
    Cost: one single-token decode per token in the look-back windows plus three short decodes per cut.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"chunk size must be a positive int, got {size!r}")
    ids = list(ids)
    n, window, spans, start = len(ids), max(1, size // 4), [], 0
    while start < n:
        end = start + size
        if end >= n:
            spans.append((start, n))
            break
        lo = max(start + 1, end - window)
        pieces = {j: tokenizer.decode([ids[j - 1]]) for j in range(max(1, lo - 1), end + 1)}  # token before cut j
        ranks = {j: _boundary_rank(pieces.get(j - 1, "") + pieces[j]) for j in range(lo, end + 1)}
        best = max(range(end, lo - 1, -1), key=ranks.__getitem__)  # the latest of the highest rank
        end = best if ranks[best] > 0 else end
        end = next((j for j in range(end, start, -1) if not _splits_char(ids, j, tokenizer)), end)
        spans.append((start, end))
        start = end
    return spans


def chunk_text(text: str, tokenizer: TextTokenizer, size: int) -> list[str]:
    """Split `text` into chunks of about `size` LLM tokens (at most `size`), cut at token boundaries with a
    preference for paragraph, then sentence ends (rule: `text_chunk_spans`). Each chunk is the decoded text of
    its tokens, so ``"".join(chunks)`` is `text` (up to whitespace at the cuts for tokenizers whose decode
    strips a leading space). A document without tokens gives ``[]``."""
    if not isinstance(text, str):
        raise TypeError(f"chunk_text expects a str, got {type(text).__name__}")
    ids = tokenizer.encode(text)
    return [tokenizer.decode(ids[a:b]) for a, b in text_chunk_spans(ids, tokenizer, size)]
