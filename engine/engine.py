"""The engine: a loaded model, its tokenizer and FLOP account, and the one place where forwards run."""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch

from .config import ModelConfig
from .flops import FlopAccount, forward_flops
from .kv_cache import ContiguousKVCache
from .loader import default_model_path, load_checkpoint
from .model import KVCache, Llama
from .session import Session

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

BACKENDS = ("auto", "torch")  # auto: C++ CPU kernels where they apply (fp32); torch: the torch reference only
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


class Engine:
    """A model ready to run: `session()` for cached prompts, `forward_logits` for scoring, `flops` for cost."""

    def __init__(self, model: Llama, tokenizer: Tokenizer, path: Path | None = None):
        self.model = model
        self.config: ModelConfig = model.config
        self.tokenizer = tokenizer
        self.path = path
        self.flops = FlopAccount()

    def session(self) -> Session:
        """An empty session on this engine."""
        return Session(self)

    def new_cache(self, capacity: int = 256) -> ContiguousKVCache:
        """An empty KV cache using the same kernels as the model."""
        return ContiguousKVCache(self.config, self.model.dtype, capacity, cpu_kernels=self.model.cpu_kernels)

    @torch.inference_mode()
    def run(self, ids: Sequence[int], cache: KVCache, logits: str | None = "last", decode: bool = False):
        """Forward `ids` after what `cache` holds and charge its exact FLOPs; logits as in `Llama.forward`."""
        tokens = self._check_ids(ids)
        n_past = cache.length
        out = self.model.forward(tokens, cache, logits)
        n_logits = 0 if out is None else out.shape[0]
        self.flops.add(forward_flops(self.config, len(tokens), n_past, n_logits), len(tokens), decode)
        return out

    def forward_logits(self, ids: Sequence[int]) -> torch.Tensor:
        """float32 logits [len(ids), vocab] at every position of `ids` run from an empty cache."""
        return self.run(ids, self.new_cache(capacity=len(ids)), logits="all")

    def _check_ids(self, ids: Sequence[int]) -> torch.Tensor:
        tokens = torch.as_tensor(ids, dtype=torch.long) if not isinstance(ids, torch.Tensor) else ids.long()
        if tokens.ndim != 1 or tokens.numel() == 0:
            raise ValueError(f"expected a non-empty 1-D sequence of token ids, got shape {list(tokens.shape)}")
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= self.config.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.config.vocab_size})")
        return tokens


def load_engine(model: str | os.PathLike | None = None, dtype: str = "float32", backend: str = "auto",
                threads: int | None = None) -> Engine:
    """Load a Llama-family model (HF directory or .gguf file; None = the embedded SmolLM2-135M-Instruct GGUF)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if threads is not None:
        torch.set_num_threads(threads)
    from .tokenizer import Tokenizer

    path = Path(model) if model is not None else default_model_path()
    ckpt = load_checkpoint(path)
    if ckpt.gguf_metadata is None:
        tokenizer = Tokenizer.from_dir(ckpt.path)
    else:
        tokenizer = Tokenizer.from_gguf(ckpt.path, ckpt.gguf_metadata)
    model = Llama(ckpt.config, ckpt.tensors, DTYPES[dtype], cpu_kernels=backend == "auto")
    return Engine(model, tokenizer, ckpt.path)
