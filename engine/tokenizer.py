"""The model's own tokenizer, built from its files: GGUF metadata (``tokenizer.ggml.*``) or an HF directory
(``tokenizer.json`` + ``tokenizer_config.json``). Encoding runs on the `tokenizers` library; chat templates are
rendered with jinja2 the way transformers renders them. transformers itself is not used at run time.

GGUF conventions follow llama.cpp, which wrote the file:

* ``tokenizer.ggml.model`` ``gpt2`` is byte-level BPE with the file's merges; ``llama`` is SentencePiece-style
  BPE whose merges are implied by the token scores, with byte fallback (``<0x0A>`` tokens).
* ``tokenizer.ggml.pre`` names the pre-tokenizer: the list of regexes llama.cpp splits text with before BPE.
  Note that transformers' own GGUF loader has no entry for ``smollm`` and falls back to the plain GPT-2 regex;
  llama.cpp (and the original SmolLM ``tokenizer.json``) first isolate every digit. The two differ on text like
  ``"a  1"`` (``['a', 'ĠĠ', '1']`` here and in llama.cpp, ``['a', 'Ġ', 'Ġ', '1']`` in transformers' GGUF loader).
* token types: 3 (control) are special tokens, 4 (user-defined) are added tokens matched whole in any text.
* no Unicode normalisation, as llama.cpp and transformers' GGUF loader: Qwen2's own ``tokenizer.json`` first
  normalises to NFC, so text in decomposed form (an accent as a combining mark, as macOS and some PDFs write it)
  gets other ids here than from Qwen's tokenizer; `unicodedata.normalize("NFC", text)` before encoding gives its ids.
"""
from __future__ import annotations

import json
import os
import re
import secrets
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from .config import config_flag
from .errors import ModelLoadError
from .gguf_file import read_gguf

if TYPE_CHECKING:  # pragma: no cover
    import tokenizers

__all__ = ["Tokenizer", "DecodeStream"]

# llama.cpp token types (tokenizer.ggml.token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# ---------------------------------------------------------------------------------------------------------------
# Pre-tokenizer regexes, as llama.cpp applies them (llama-vocab.cpp, llm_tokenizer_bpe): each regex in turn splits
# every piece the previous ones left, matches and the text between them both becoming pieces ("isolated").
# ---------------------------------------------------------------------------------------------------------------
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# llama.cpp spells the tokenizer.json's (?i:'s|'t|...) with explicit case classes; so do we
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = _CONTRACTIONS + (r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _CONTRACTIONS + (r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                          r"|\s*[\r\n]+|\s+(?!\S)|\s+")

_PRE_SPLITS: dict[str, tuple[str, ...]] = {}
for _names, _splits in (
    (("default",), (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
    (("gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "roberta-bpe"), (_GPT2,)),
    (("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"), (r"\p{N}", _GPT2)),
    (("llama-bpe", "llama3", "llama-v3", "falcon3", "dbrx", "smaug-bpe"), (_LLAMA3,)),
    (("qwen2", "stablelm2", "deepseek-r1-qwen", "megrez"), (_QWEN2,)),
):
    for _name in _names:
        _PRE_SPLITS[_name] = _splits
# llama.cpp: llama3-style vocabularies use a word found whole in the vocabulary without running merges
_IGNORE_MERGES = {"llama-bpe", "llama3", "llama-v3", "falcon3"}
# llama.cpp turns BOS on for these unless the file says otherwise
_ADD_BOS_DEFAULT = {"llama-bpe", "llama3", "llama-v3", "falcon3"}

# Tokens llama.cpp also treats as end of generation when they are special (llama_vocab::impl::load, EOG set)
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>",
    "<｜end▁of▁sentence｜>", "<end_of_utterance>", "<|return|>", "<|call|>",
})

# ---------------------------------------------------------------------------------------------------------------
# Building tokenizers.Tokenizer objects from GGUF vocabularies
# ---------------------------------------------------------------------------------------------------------------
def _added_tokens(tokens: Sequence[str], types: Sequence[int]) -> tuple[list, list]:
    from tokenizers import AddedToken

    special = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty in (TOKEN_CONTROL, TOKEN_UNKNOWN) and t]
    user = [AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types) if ty == TOKEN_USER_DEFINED and t]
    return special, user


def _first_ids(tokens: Sequence[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a repeated token keeps its first id
    return vocab


def _build_bpe(tokens: Sequence[str], merges: Sequence[str], pre: str) -> "tokenizers.Tokenizer":
    """Byte-level BPE (tokenizer.ggml.model == 'gpt2') with llama.cpp's pre-tokenizer `pre`."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    if pre not in _PRE_SPLITS:
        raise ModelLoadError(
            f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre={pre!r}; supported: {', '.join(sorted(_PRE_SPLITS))}")
    vocab = _first_ids(tokens)
    pairs = []
    for m in merges:
        cut = m.find(" ", 1)  # as llama.cpp: the first space after the first character
        if cut < 0:
            raise ModelLoadError(f"malformed GGUF merge {m!r} (expected 'left right')")
        a, b = m[:cut], m[cut + 1:]
        if a in vocab and b in vocab and a + b in vocab:
            pairs.append((a, b))
    backend = Backend(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False,
                                 ignore_merges=pre in _IGNORE_MERGES))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _PRE_SPLITS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def _build_spm(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int],
               add_space_prefix: bool) -> "tokenizers.Tokenizer":
    """SentencePiece-style BPE (tokenizer.ggml.model == 'llama'), like llama.cpp's SPM tokenizer: the text has
    spaces replaced by '▁' (and one '▁' prepended to every text piece when `add_space_prefix`), pairs merge by
    the score of the token they make, characters outside the vocabulary fall back to <0xXX> byte tokens.

    As in llama.cpp (and the legacy Llama/Mistral tokenizer.json), the text after a special or user-defined token
    gets its own '▁' prefix, so "<s> hi" does not round-trip exactly through decode (only the first is stripped).
    """
    from tokenizers import decoders, models, normalizers
    from tokenizers import Tokenizer as Backend

    if len(scores) != len(tokens):
        raise ModelLoadError(f"GGUF tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
    vocab = _first_ids(tokens)
    pieces = {t for t, ty in zip(tokens, types) if ty in (TOKEN_NORMAL, TOKEN_USER_DEFINED, 0)}
    ranked = []
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if t not in pieces or vocab[t] != i:
            continue
        for k in range(1, len(t)):
            if t[:k] in pieces and t[k:] in pieces:
                ranked.append((-float(scores[i]), i, k))
    ranked.sort()  # best score first; ties by token id, then split point
    pairs = [(tokens[i][:k], tokens[i][k:]) for _, i, k in ranked]
    unk = next((t for t, ty in zip(tokens, types) if ty == TOKEN_UNKNOWN), None)
    has_bytes = any(ty == TOKEN_BYTE for ty in types)
    backend = Backend(models.BPE(vocab, pairs, unk_token=unk, fuse_unk=True, byte_fallback=has_bytes))
    norms = [normalizers.Prepend("▁")] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence(norms + [normalizers.Replace(" ", "▁")])
    decs = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        decs.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(decs)
    return backend


# ---------------------------------------------------------------------------------------------------------------
# Chat templates
# ---------------------------------------------------------------------------------------------------------------
def _compile_template(source: str):
    """Compile a chat template in the sandbox transformers uses (trim_blocks, lstrip_blocks, loopcontrols,
    raise_exception, a tojson that keeps non-ASCII, strftime_now, a no-op {% generation %} block)."""
    import json as _json
    from datetime import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return _json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def read_json(path: Path) -> dict:
    """A JSON file holding an object (config.json, tokenizer_config.json, ...), or a ModelLoadError naming the file:
    unreadable, not UTF-8, not JSON, or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot read JSON ({e})") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def check_unicode(text: str, what: str = "text") -> str:
    """`text`, or a ValueError naming `what` it is if it holds a lone surrogate: what Python decodes undecodable
    bytes to (a non-UTF-8 command-line argument), which has no UTF-8 form, so the tokenizers library would raise a
    puzzling TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} holds the lone surrogate U+{ord(text[e.start]):04X} at offset {e.start}, which is "
                         "not Unicode text (bytes that were not UTF-8?)") from None
    return text


def _token_ids(ids: Iterable[Any]) -> list[int]:
    """`ids` (ints, numpy/torch integers, or a 1-D numpy/torch integer array) as Python ints; a ValueError naming the
    first that is not an integer in [0, 2**32) -- the tokenizers library's id type: int() would cut 3.7 to 3 and
    read "5" or True as an id, and an id past 2**32 raised OverflowError inside the library."""
    values = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    for k, i in enumerate(values):
        if hasattr(i, "tolist"):  # a numpy or torch scalar: its Python value
            i = values[k] = i.tolist()
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < 2 ** 32:
            raise ValueError(f"token id {i!r} at position {k} is not an integer in [0, 2**32)")
    return values


def _id_list(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


# ---------------------------------------------------------------------------------------------------------------
class Tokenizer:
    """A model's tokenizer: text <-> token ids, and chat prompts rendered with the model's own template.

    Build it with `Tokenizer.from_gguf(path)` or `Tokenizer.from_dir(hf_dir)`.

    * `encode(text)` adds nothing (no BOS unless `add_bos=True`) and, like llama.cpp's plain tokenization,
      treats control tokens written in the text (``"<|im_end|>"``) as ordinary text; pass `parse_special=True`
      to turn them into their ids. User-defined added tokens are always matched whole.
    * `chat(messages)` renders the chat template and encodes it with the template's control tokens parsed, adding
      no BOS beyond what the template writes -- the ids transformers' ``apply_chat_template(tokenize=True)``
      gives, except that control tokens written in a message's content stay text, as in `encode`.
    * `decode(ids)` is the inverse of `encode`: `decode(encode(x)) == x` (byte-level BPE always; SentencePiece
      vocabularies strip the dummy-prefix space only at the start, as llama.cpp does).

    Attributes: `vocab_size`, `bos_id`, `eos_id` (the file's EOS), `eos_ids` (every id that ends generation:
    EOS, ids declared in generation_config.json / EOT keys, and special end-of-turn tokens such as
    ``<|im_end|>``/``<|endoftext|>``/``<|eot_id|>``, as llama.cpp does), `add_bos` (the model's own flag),
    `chat_template`, `special_ids`.
    """

    def __init__(self, backend: "tokenizers.Tokenizer", *, vocab_size: int | None = None, bos_id: int | None = None,
                 eos_ids: Iterable[int] = (), add_bos: bool = False, add_eos: bool = False,
                 chat_template: str | None = None, special_tokens: Mapping[str, str | None] | None = None,
                 source: str = "") -> None:
        self._tok = backend
        self.vocab_size: int = int(vocab_size if vocab_size is not None else backend.get_vocab_size(True))
        self.bos_id: int | None = bos_id
        eos = list(dict.fromkeys(int(e) for e in eos_ids if e is not None and 0 <= int(e) < self.vocab_size))
        self.eos_id: int | None = eos[0] if eos else None
        added = backend.get_added_tokens_decoder()
        self.special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        # llama.cpp's end-of-generation set: special tokens that close a turn
        eos += [i for i in sorted(self.special_ids) if added[i].content in _EOG_TEXTS and i not in eos]
        self.eos_ids: tuple[int, ...] = tuple(eos)
        self.add_bos: bool = bool(add_bos)
        self.add_eos: bool = bool(add_eos)
        self.chat_template: str | None = chat_template or None
        self.special_tokens: dict[str, str | None] = dict(special_tokens or {})
        self.source = source
        self._compiled: tuple[str, Any] | None = None

    def __repr__(self) -> str:
        return (f"Tokenizer({self.source or '?'}: vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
                f"eos_ids={self.eos_ids}, add_bos={self.add_bos}, chat_template={self.chat_template is not None})")

    # -- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, path: str | os.PathLike, metadata: Mapping[str, Any] | None = None) -> "Tokenizer":
        """Build the tokenizer a GGUF file describes in its ``tokenizer.ggml.*`` metadata.

        `metadata`, the file's already parsed key/values (`read_gguf(path).metadata`), saves reading it again.
        Raises ModelLoadError on missing metadata or a tokenizer model / pre-tokenizer this does not support.
        """
        path = Path(path)
        meta = metadata if metadata is not None else read_gguf(path).metadata
        where = str(path)
        model = meta.get("tokenizer.ggml.model")
        if model is None:
            raise ModelLoadError(f"{where}: GGUF has no tokenizer metadata (missing tokenizer.ggml.model)")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ModelLoadError(f"{where}: GGUF tokenizer metadata is missing tokenizer.ggml.tokens")
        tokens = [str(t) for t in tokens]
        n = len(tokens)
        types = meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * n
        if len(types) != n:
            raise ModelLoadError(f"{where}: tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
        pre = str(meta.get("tokenizer.ggml.pre") or "default")
        add_bos_default = False
        if model == "gpt2":
            merges = meta.get("tokenizer.ggml.merges")
            if merges is None:
                raise ModelLoadError(f"{where}: BPE (gpt2) GGUF tokenizer is missing tokenizer.ggml.merges")
            try:
                backend = _build_bpe(tokens, merges, pre)
            except ModelLoadError as e:
                raise ModelLoadError(f"{where}: {e}") from None
            add_bos_default = pre in _ADD_BOS_DEFAULT
        elif model == "llama":
            scores = meta.get("tokenizer.ggml.scores")
            if scores is None:
                raise ModelLoadError(f"{where}: SentencePiece (llama) GGUF tokenizer is missing tokenizer.ggml.scores")
            try:
                backend = _build_spm(tokens, scores, types, bool(meta.get("tokenizer.ggml.add_space_prefix", True)))
            except ModelLoadError as e:
                raise ModelLoadError(f"{where}: {e}") from None
            add_bos_default = True
        else:
            raise ModelLoadError(f"{where}: unsupported GGUF tokenizer model tokenizer.ggml.model={model!r} "
                                 "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece BPE)")
        special, user = _added_tokens(tokens, types)
        if special:
            backend.add_special_tokens(special)
        if user:
            backend.add_tokens(user)

        def tid(key: str) -> int | None:
            v = meta.get(f"tokenizer.ggml.{key}")
            return int(v) if isinstance(v, int) and 0 <= v < n else None

        bos, eos, unk, pad = tid("bos_token_id"), tid("eos_token_id"), tid("unknown_token_id"), tid("padding_token_id")
        names = {"bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": pad}
        return cls(backend, vocab_size=n, bos_id=bos,
                   eos_ids=[eos, tid("eot_token_id"), tid("eom_token_id")],
                   add_bos=config_flag(meta, "tokenizer.ggml.add_bos_token", where, add_bos_default),
                   add_eos=config_flag(meta, "tokenizer.ggml.add_eos_token", where, False),
                   chat_template=meta.get("tokenizer.chat_template"),
                   special_tokens={k: tokens[v] if v is not None else None for k, v in names.items()},
                   source=where)

    @classmethod
    def from_model(cls, path: str | os.PathLike) -> "Tokenizer":
        """The tokenizer of a model path as `load_engine` takes it (resolved): a HF directory's files, or a .gguf
        file's metadata."""
        return cls.from_dir(path) if Path(path).is_dir() else cls.from_gguf(path)

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        """Build the tokenizer of an HF model directory: ``tokenizer.json``, with ``tokenizer_config.json``
        (special tokens, ``add_bos_token``, chat template), ``chat_template.jinja`` and the EOS ids of
        ``generation_config.json`` / ``config.json`` when present."""
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as Backend

        path = Path(path)
        if not path.is_dir():
            raise ModelLoadError(f"{path}: not a directory (expected an HF model directory with tokenizer.json)")
        tj = path / "tokenizer.json"
        if not tj.is_file():
            extra = " (only a SentencePiece tokenizer.model, which is not supported)" \
                if (path / "tokenizer.model").is_file() else ""
            raise ModelLoadError(f"{path}: missing tokenizer.json{extra}")
        try:
            backend = Backend.from_file(str(tj))
        except Exception as e:  # tokenizers raises plain Exception on a bad file
            raise ModelLoadError(f"{tj}: cannot load tokenizer.json ({e})") from e
        cfg_file = path / "tokenizer_config.json"
        cfg = read_json(cfg_file) if cfg_file.is_file() else {}

        # added tokens listed only in tokenizer_config.json (older saves)
        for spec in (cfg.get("added_tokens_decoder") or {}).values():
            content = _token_text(spec)
            if isinstance(spec, Mapping) and content is not None and backend.token_to_id(content) is None:
                tok = AddedToken(content, special=bool(spec.get("special")), normalized=False)
                (backend.add_special_tokens if spec.get("special") else backend.add_tokens)([tok])

        def tok_id(name: str) -> int | None:
            text = _token_text(cfg.get(name))
            return backend.token_to_id(text) if text is not None else None

        bos, eos = tok_id("bos_token"), tok_id("eos_token")
        eos_ids = [eos]
        for extra in ("generation_config.json", "config.json"):
            if (path / extra).is_file():
                eos_ids += _id_list(read_json(path / extra).get("eos_token_id"))

        add_bos = config_flag(cfg, "add_bos_token", str(cfg_file))
        if add_bos is None:  # e.g. Llama 3: the post-processor adds BOS
            plain = backend.encode("a", add_special_tokens=False).ids
            full = backend.encode("a", add_special_tokens=True).ids
            add_bos = bos is not None and len(full) > len(plain) and full[0] == bos

        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default") or next(iter(named.values()), None)
        if not template and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        if not template and (path / "chat_template.json").is_file():
            template = read_json(path / "chat_template.json").get("chat_template")
        specials = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        return cls(backend, bos_id=bos, eos_ids=eos_ids, add_bos=add_bos,
                   add_eos=config_flag(cfg, "add_eos_token", str(cfg_file), False),
                   chat_template=template if isinstance(template, str) else None, special_tokens=specials,
                   source=str(path))

    # -- encode / decode ----------------------------------------------------------------------------------
    @cached_property
    def _tok_text(self) -> "tokenizers.Tokenizer":
        """A copy of the backend that leaves special tokens written in the text as text."""
        from tokenizers import Tokenizer as Backend

        copy = Backend.from_str(self._tok.to_str())
        copy.encode_special_tokens = True
        return copy

    def encode(self, text: str, add_bos: bool = False, *, parse_special: bool = False) -> list[int]:
        """Token ids of `text`; BOS first only when `add_bos`. Control tokens written in `text` are encoded as
        text unless `parse_special` (user-defined added tokens are always matched)."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        backend = self._tok if parse_special else self._tok_text
        ids = backend.encode(check_unicode(text), add_special_tokens=False).ids
        if add_bos:
            if self.bos_id is None:
                raise ValueError("add_bos=True but this tokenizer has no BOS token")
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of token ids; special (control) tokens are written out unless `skip_special`. Ids past the
        vocabulary (e.g. padding rows of a larger embedding) decode to nothing; an id that is not an integer in
        [0, 2**32) (negative, a float, a bool) is a ValueError. numpy and torch integer arrays are taken."""
        return self._tok.decode(_token_ids(ids), skip_special_tokens=skip_special)

    @cached_property
    def byte_level(self) -> bool:
        """Whether the decoder is byte-level BPE's, which writes the bytes of all the ids as one UTF-8 text, each
        invalid sequence as U+FFFD (Rust's from_utf8_lossy, as Python's ``bytes.decode("utf-8", "replace")``)."""
        from tokenizers.decoders import ByteLevel

        return isinstance(self._tok.decoder, ByteLevel)

    @cached_property
    def byte_fallback(self) -> bool:
        """Whether the decoder is SentencePiece-style BPE's, whose <0xXX> byte tokens decode run by run: a run of
        them that makes valid UTF-8 as a whole is its text, any other one U+FFFD per byte (the tokenizers library's
        ByteFallback, as in transformers' fast Llama tokenizer; sentencepiece would keep a run's valid characters)."""
        decoder = self._tok.decoder
        state = json.loads(decoder.__getstate__()) if decoder is not None else {}  # as tokenizer.json holds it
        return any(d.get("type") == "ByteFallback" for d in state.get("decoders", [state]))

    def fallback_byte(self, token_id: int) -> int | None:
        """The byte a <0xXX> token stands for under a byte_fallback decoder (which reads any token so spelled as
        one); None for another token."""
        piece = self._tok.id_to_token(token_id)
        if piece is None or len(piece) != 6 or not (piece.startswith("<0x") and piece.endswith(">")):
            return None
        try:
            return int(piece[3:5], 16)
        except ValueError:
            return None

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of one id (byte-level spelling for BPE vocabularies)."""
        return self._tok.id_to_token(_token_ids([token_id])[0])

    def token_id(self, piece: str) -> int:
        """The single id `piece` encodes to (special tokens included), e.g. ``token_id("Yes")``; ValueError if
        it encodes to zero or several ids."""
        ids = self._tok.encode(check_unicode(piece), add_special_tokens=False).ids
        if len(ids) != 1:
            raise ValueError(f"{piece!r} is not a single token: it encodes to {len(ids)} ids {ids}")
        return ids[0]

    # -- chat ---------------------------------------------------------------------------------------------
    def _template(self):
        """The compiled chat template (recompiled if `chat_template` was reassigned)."""
        if self.chat_template is None:
            raise ValueError(f"the model has no chat template ({self.source or 'tokenizer'})")
        if self._compiled is None or self._compiled[0] != self.chat_template:
            import jinja2

            try:
                self._compiled = (self.chat_template, _compile_template(self.chat_template))
            except jinja2.TemplateError as e:
                raise ValueError(f"the model's chat template does not compile: {e}") from e
        return self._compiled[1]

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    **template_kwargs: Any) -> str:
        """The prompt text the model's chat template makes of `messages` (``[{"role": ..., "content": ...}]``).
        Extra keyword arguments become template variables (e.g. ``enable_thinking=False``). A template's own
        ``raise_exception`` (or any other rendering error) raises ValueError with its message."""
        import jinja2

        if isinstance(messages, Mapping) or not all(isinstance(m, Mapping) for m in messages):
            raise TypeError("messages must be a list of {'role': ..., 'content': ...} dicts")
        template = self._template()
        variables = {k: v for k, v in self.special_tokens.items() if v is not None}
        variables.update(tools=None, documents=None)
        variables.update(template_kwargs)
        try:
            return template.render(messages=[dict(m) for m in messages],
                                   add_generation_prompt=add_generation_prompt, **variables)
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            # the template's own raise_exception(), or a message it cannot handle (e.g. non-string content)
            raise ValueError(f"chat template: {e}") from e

    def chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
             **template_kwargs: Any) -> list[int]:
        """Token ids of the rendered chat prompt: the template's own control tokens (``<|im_start|>``) become their
        ids. A control token's text inside a message's content stays text, as `encode` leaves it: a document that
        quotes ``<|im_end|>`` cannot end the user's turn. (transformers and llama.cpp parse it; the ids differ from
        theirs only for such content.)"""
        hidden: list[str] = []
        # ASCII letters and digits, which no escaping filter touches (`tojson` writes NUL as \u0000, `e` rewrites
        # < and >), matched in any case (`upper`); random, so that no content spells it
        mark = f"nodekvmark{secrets.token_hex(6)}z"

        def hide(match: re.Match) -> str:
            hidden.append(match.group(0))
            return f"{mark}{len(hidden) - 1}{mark}"

        def hide_in(message: Any) -> Any:  # render_chat refuses what is not a message
            if isinstance(message, Mapping) and isinstance(message.get("content"), str):
                return dict(message, content=specials.sub(hide, message["content"]))
            return message

        specials = self._special_texts
        safe = messages if specials is None or isinstance(messages, (Mapping, str)) else list(map(hide_in, messages))
        text = check_unicode(self.render_chat(safe, add_generation_prompt, **template_kwargs))
        if not hidden:  # the common case: one encode, exactly transformers' ids
            return self._tok.encode(text, add_special_tokens=False).ids
        # the text between the template's control tokens, content's own written back, is encoded with them as text
        hidden_at = re.compile(re.escape(mark) + r"(\d+)" + re.escape(mark), re.IGNORECASE)
        ids: list[int] = []
        for k, piece in enumerate(specials.split(text)):
            if k % 2:
                ids.append(self._tok.token_to_id(piece))
            elif piece:
                ids += self._tok_text.encode(hidden_at.sub(lambda m: hidden[int(m.group(1))], piece),
                                             add_special_tokens=False).ids
        return ids

    def split_special(self, text: str) -> list[str]:
        """`text` cut at the control tokens written in it: [text, control, text, ..., text], the control tokens at
        the odd places (a single item when there is none). Encoding apart at these cuts gives `encode(text,
        parse_special=True)`'s ids: no token spans a control token."""
        specials = self._special_texts
        return [text] if specials is None else specials.split(text)

    @cached_property
    def _special_texts(self) -> "re.Pattern | None":
        """The control tokens' texts, longest first (so one that contains another wins), as one capturing regex."""
        added = self._tok.get_added_tokens_decoder()
        texts = sorted({added[i].content for i in self.special_ids}, key=len, reverse=True)
        return re.compile("(" + "|".join(map(re.escape, texts)) + ")") if texts else None

    def decode_stream(self, skip_special: bool = False, context: Sequence[int] = ()) -> "DecodeStream":
        """A DecodeStream over this tokenizer (see DecodeStream)."""
        return DecodeStream(self, skip_special=skip_special, context=context)


class DecodeStream:
    """Incremental detokenization for generation: `push(id)` returns the text the new token completes.

    Text is only released once it no longer ends in an incomplete UTF-8 sequence (a byte-level token can hold
    half a character), and under a SentencePiece byte-fallback decoder once a run of byte tokens ends or can no
    longer be valid UTF-8 (it decodes whole), so concatenating the pushes gives ``decode(ids)``. Each push decodes
    only a short window of recent ids, so a long generation costs O(length), not O(length^2). `context` (e.g. the
    last prompt ids) is decoded for spacing only and never returned, except a character it leaves incomplete (a
    generation cut in the middle of one, then continued): that comes out whole with the push that completes it.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False, context: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.ids: list[int] = _token_ids(context)[-6:]
        self._prefix = 0
        self._read = len(self.ids)
        self.text = ""
        # a byte-level decoder: later bytes change only the one U+FFFD of a final incomplete character, the text
        # before it is final (a stand-in tokenizer that only decodes says nothing: held text waits)
        self._byte_level = getattr(tokenizer, "byte_level", False)
        # a byte-fallback (SentencePiece) decoder reads each run of <0xXX> tokens whole: the run at the end of the
        # ids so far, and whether it already holds a byte no later one can make valid UTF-8
        self._byte_fallback = getattr(tokenizer, "byte_fallback", False)
        self._run = bytearray()
        self._run_dead = False
        for token_id in self.ids if self._byte_fallback else ():
            self._extend_run(token_id)

    def push(self, token_id: int) -> str:
        """Add one generated id; return the newly completed text ('' while a character is still incomplete). An id
        `Tokenizer.decode` refuses is refused here before it joins the stream."""
        self.ids += _token_ids([token_id])
        if self._byte_fallback:
            return self._push_byte_fallback(self.ids[-1])
        new = self._unread()
        if new and not new.endswith("\ufffd"):
            return self._release(new, len(self.ids))
        # bytes that make no character (a run of lone continuation bytes) would be held, and decoded again at every
        # push, until flush; a byte-level decoder can change only the held text's last U+FFFD, so the text of the
        # ids before the last one is final when it stops short of that
        if self._byte_level and len(self.ids) - 1 > self._read:
            done = self._unread(len(self.ids) - 1)
            if done and len(done) < len(new) and new.startswith(done):
                return self._release(done, len(self.ids) - 1)
        return ""

    def _extend_run(self, token_id: int) -> None:
        """Track the run of byte tokens that the ids end in, now that they end in `token_id`."""
        byte = self.tokenizer.fallback_byte(token_id)
        if byte is None:
            self._run, self._run_dead = bytearray(), False
        elif not self._run_dead:
            self._run.append(byte)
            try:
                self._run.decode("utf-8")
            except UnicodeDecodeError as e:  # a character cut at the end may still be completed; any other fault not
                self._run_dead = e.reason != "unexpected end of data"

    def _push_byte_fallback(self, token_id: int) -> str:
        """push() under a byte-fallback decoder: a run of byte tokens decodes whole, so a later byte can turn the
        run's valid text into U+FFFDs; its text is held until the run ends or holds a byte that no later one can
        mend. From then on each byte of the run is one U+FFFD, released without decoding (a long run stays linear);
        the window the ids are decoded in keeps starting before the run."""
        dead = self._run_dead
        self._extend_run(token_id)
        if dead and self._run_dead:
            self._read = len(self.ids)
            self.text += "\ufffd"
            return "\ufffd"
        if self._run and not self._run_dead:
            return ""
        return self._release(self._unread(), len(self.ids))

    def _release(self, new: str, read: int) -> str:
        """Return `new`, the text the ids up to `read` add, as released."""
        self._prefix, self._read = self._read, read
        self.text += new
        return new

    def flush(self) -> str:
        """Release whatever is held back (an incomplete character comes out as U+FFFD)."""
        new = self._unread()
        self._prefix = self._read = len(self.ids)
        self.text += new
        return new

    def _unread(self, end: int | None = None) -> str:
        """The text the ids after `_read` (up to `end`) add: where the read ids decode with a U+FFFD for bytes the
        later ones complete (an incomplete character at the end of `context`), from that character on, not from its
        length."""
        dec = self.tokenizer.decode
        prefix = dec(self.ids[self._prefix:self._read], self.skip_special)
        full = dec(self.ids[self._prefix:end], self.skip_special)
        return full[len(os.path.commonprefix([prefix, full])):]
