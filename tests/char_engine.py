"""A tiny model's engine that tokenises one character at a time: prompts whose token ids a test can write by hand
(the reader's, the index store's)."""
from __future__ import annotations

import torch


class CharTokenizer:
    """One id per character (printable ASCII: code point - 32; a line break: 95); chat() is the user turn's
    characters; id 100 is EOS, as in the tiny models' 101-token vocabulary."""

    eos_ids = (100,)

    def encode(self, text, parse_special=False):
        assert all(32 <= ord(c) < 127 or c == "\n" for c in text), text
        return [95 if c == "\n" else ord(c) - 32 for c in text]

    def decode(self, ids, skip_special=False):
        return "".join("\n" if i == 95 else chr(i + 32) for i in ids)

    def decode_stream(self, skip_special=False, context=()):
        from nodekv.engine.tokenizer import DecodeStream

        return DecodeStream(self, skip_special, context)

    def token_id(self, piece):
        (i,) = self.encode(piece)
        return i

    def render_chat(self, messages):
        return messages[0]["content"]

    def chat(self, messages):
        return self.encode(self.render_chat(messages))


def char_engine(path, backend: str = "torch"):
    """An Engine over the checkpoint at `path` (a tiny random model) that reads text one character a token."""
    from nodekv.engine.engine import Engine
    from nodekv.engine.loader import load_checkpoint
    from nodekv.engine.model import Llama
    from nodekv.engine.page_pool import PagePool

    ckpt = load_checkpoint(path)
    model = Llama(ckpt.config, ckpt.tensors, torch.float32, backend)
    return Engine(model, CharTokenizer(), PagePool(ckpt.config, model.dtype, 64, 8))
