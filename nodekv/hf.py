"""nodekv's attention inside an unmodified HF transformers model: per-node attention mass without T×T memory.

    import nodekv.hf
    nodekv.hf.register()                                      # attn_implementation="nodekv" now exists
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="nodekv")
    mass = nodekv.hf.NodeMassCollector([0, 120, 300, 410])    # node boundaries over the prompt's tokens
    with torch.no_grad():                                     # inference only
        out = model(input_ids, node_mass=mass)                # logits as with sdpa
    mass.mean()                                               # [B, T, N]: head- and layer-averaged mass per node

Every attention layer runs nodekv's paged-attention kernel on HF's own key/value tensors (viewed as one page, no
copy): the fp32 C++ kernel on CPU float32, the torch reference otherwise. With a `NodeMassCollector` passed to the
forward, the kernel also adds each query token's attention on every node's keys, summed over heads, into [B, T, N]
— O(T·N) memory, never the T×T attention maps `output_attentions` returns. Keys past the last boundary (tokens
generated after the prompt) count as one more node.

Limits, each refused with a message: causal self-attention without padding (a padding or custom mask, a static
cache, an encoder's or a cross-attention layer are refused; queries over a dynamic cache attend from its end),
inference only (no gradients, no dropout, no attention maps), the 1/√head_dim scale (Llama, Qwen2, Mistral), no
sliding window or soft-capping. A collector passed to a forward that failed holds nothing. Needs transformers'
AttentionInterface and AttentionMaskInterface; tested with transformers 5.24, the version installed.
"""
from __future__ import annotations

import operator
import weakref
from typing import Iterable

import torch

NAME = "nodekv"


class NodeMassCollector:
    """Collects attention mass per (query token, key node) across the layers of the forwards it is passed to.

    `bounds` are node boundaries over key positions: 0 = b[0] < b[1] < ... < b[N]; keys at b[N] and beyond are one
    more node. `sum` holds Σ over heads and layers, float32 [B, T, nodes]; `mean()` divides by heads × layers."""

    def __init__(self, bounds: Iterable[int]):
        b = _int_bounds(bounds)
        if len(b) < 2 or b[0] != 0 or any(x >= y for x, y in zip(b, b[1:])):
            raise ValueError(f"node bounds must start at 0 and increase strictly, with at least one node: {b}")
        self.bounds = b
        self.reset()

    def reset(self) -> None:
        """Forget what was collected (e.g. before the next forward)."""
        self.sum: torch.Tensor | None = None
        self.layers = self.heads = 0
        self._first: weakref.ref | None = None  # the forward's first attention layer: seen again, a forward begins
        self._failed: str | None = None

    def mean(self) -> torch.Tensor:
        """float32 [B, T, nodes]: mass averaged over heads and layers (each row sums to 1 over nodes)."""
        if self._failed is not None:
            raise ValueError(f"the forward this collector was passed to failed ({self._failed}): it holds no mass; "
                             "reset() it and run the forward again")
        if self.sum is None:
            raise ValueError("no attention has been collected: pass node_mass=this to the forward of a model whose "
                             "attn_implementation is \"nodekv\" (after nodekv.hf.register())")
        return self.sum / (self.heads * self.layers)

    def _layer(self, module: torch.nn.Module, batch: int, queries: int, keys: int, heads: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(bounds over `keys` keys as int32, this layer's [B, T, nodes] mass to add into) for `module`'s forward.
        Its first layer seen a second time is the next forward, refused until `reset` (the layers' indices say
        nothing: a hybrid model's first attention layer need not be layer 0)."""
        if self._first is not None and self._first() is module:
            raise ValueError("this NodeMassCollector already holds a forward's mass: call reset() before the next "
                             "forward")
        if keys < self.bounds[-1]:
            raise ValueError(f"node bounds run to {self.bounds[-1]}, past this forward's {keys} keys")
        if self._first is None:
            self._first = weakref.ref(module)
        b = self.bounds + ([keys] if keys > self.bounds[-1] else [])
        if self.sum is None:
            self.sum = torch.zeros(batch, queries, len(b) - 1, device=device)
        self.layers += 1
        self.heads = heads
        return torch.tensor(b, dtype=torch.int32), self.sum

    def _fail(self, error: BaseException) -> None:
        """A forward that raised: what the layers before collected is not a forward's mass."""
        self.reset()
        self._failed = f"{type(error).__name__}: {error}"


def _int_bounds(bounds: Iterable[int]) -> list[int]:
    """`bounds` as Python ints, or a ValueError: a float, bool or string is not a boundary (int() would cut it)."""
    if isinstance(bounds, (str, bytes)):
        raise ValueError(f"node bounds must be a sequence of ints, got the string {bounds!r}")
    try:
        items = list(bounds)
    except TypeError:
        raise ValueError(f"node bounds must be a sequence of ints, got {type(bounds).__name__}") from None
    out = []
    for x in items:
        try:
            if isinstance(x, bool):
                raise TypeError
            out.append(operator.index(x))
        except TypeError:
            raise ValueError(f"node bounds must be ints, got {x!r}") from None
    return out


def nodekv_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """HF's attention-function contract: query [B, H, T, D], key/value [B, Hkv, S, D] (the whole cache) ->
    (output [B, T, H, D], None). A `node_mass=NodeMassCollector(...)` forward kwarg collects mass per node."""
    batch, heads, queries, _ = query.shape
    collector = kwargs.get("node_mass")
    if collector is not None and not isinstance(collector, NodeMassCollector):
        raise ValueError(f"node_mass must be a nodekv.hf.NodeMassCollector, got {type(collector).__name__}")
    bounds, mass = (None, None) if collector is None else \
        collector._layer(module, batch, queries, key.shape[2], heads, query.device)
    try:
        _check(module, query, key.shape[2], attention_mask, dropout, scaling, kwargs)
        return _attention(query, key, value, bounds, mass)
    except BaseException as e:
        if collector is not None:
            collector._fail(e)
        raise


def _attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: torch.Tensor | None,
               mass: torch.Tensor | None) -> tuple[torch.Tensor, None]:
    """`nodekv_attention` once checked: each batch row through the paged-attention kernel, its keys one page."""
    from nodekv.kernels import backend_ops

    batch, heads, queries, dim = query.shape
    keys = key.shape[2]
    ops = backend_ops("auto" if query.is_cpu else "torch", query.dtype)
    table = torch.zeros(1, dtype=torch.int32)
    outs = []
    for b in range(batch):
        k_pages, v_pages = key[b].contiguous()[None, None], value[b].contiguous()[None, None]  # one page of S rows
        row_mass = None
        if mass is not None:  # the kernel adds into a contiguous [T, N]: a copy per row, added back after
            row_mass = mass[b].contiguous()
        out = ops.paged_attention(query[b].transpose(0, 1), k_pages, v_pages, 0, table, keys, node_bounds=bounds,
                                  mass=row_mass)
        if mass is not None:
            mass[b] = row_mass
        outs.append(out.view(queries, heads, dim))
    return torch.stack(outs), None


def _check(module, query: torch.Tensor, keys: int, attention_mask, dropout: float, scaling: float | None,
           kwargs: dict) -> None:
    dim = query.shape[-1]
    if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        raise ValueError("nodekv attention is causal self-attention; this layer is not causal (an encoder's, or "
                         "cross-attention)")
    if torch.is_grad_enabled() and query.requires_grad:
        raise ValueError("nodekv attention runs inference only (its kernel keeps no gradient): run the model under "
                         "torch.no_grad() or torch.inference_mode()")
    if kwargs.get("output_attentions"):
        raise ValueError("nodekv attention returns no attention maps (output_attentions=True): pass a "
                         "NodeMassCollector for per-node mass, or load the model with attn_implementation=\"eager\"")
    if dropout:
        raise ValueError(f"nodekv attention runs inference only: dropout must be 0, got {dropout}")
    if scaling is not None and abs(scaling - dim ** -0.5) > 1e-6 * dim ** -0.5:
        raise ValueError(f"nodekv attention scales scores by 1/sqrt(head_dim) = {dim ** -0.5:.6g}; this model asks "
                         f"for {scaling:.6g}")
    if getattr(module, "sliding_window", None) or kwargs.get("sliding_window") or kwargs.get("softcap"):
        raise ValueError("nodekv attention does not support sliding-window or soft-capped attention")
    if attention_mask is not None:
        raise ValueError("nodekv attention is causal attention without padding; this forward has an attention mask "
                         "(padded batch, a custom mask or a static cache's unfilled tail): run unpadded sequences, one "
                         "per row of equal length, over a dynamic cache")
    # HF builds no mask for a static cache's first forward (SDPA's is_causal aligns queries to the keys' start), so
    # its unfilled tail shows only in the positions: the kernel aligns queries to the keys' end
    positions = kwargs.get("position_ids")
    last = int(positions[..., -1].max()) if isinstance(positions, torch.Tensor) else keys - 1
    if last + 1 < keys:
        raise ValueError(f"nodekv attention takes the queries for the last of the keys; this forward's last query is "
                         f"at position {last} of {keys} keys (a static cache's unfilled tail): use a dynamic cache")


def register() -> None:
    """Make attn_implementation="nodekv" available to HF models loaded afterwards (and to set_attn_implementation)."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as e:
        raise ImportError(f"nodekv.hf needs transformers with AttentionInterface and AttentionMaskInterface "
                          f"(tested with 5.24): {e}") from None

    def causal_or_mask(*args, **kwargs) -> torch.Tensor | None:
        """sdpa_mask's mask, or None (no mask) where it is plain causal attention of the last q of the kv positions
        with nothing padded: the kernel aligns queries to the end of the keys, as SDPA's is_causal cannot, so
        sdpa_mask builds one whenever 1 < q < kv (a prompt continued over HF's cache)."""
        mask = sdpa_mask(*args, **kwargs)
        if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.shape[-2] <= mask.shape[-1]:
            q, kv = mask.shape[-2:]
            if bool((mask == torch.ones(q, kv, dtype=torch.bool, device=mask.device).tril(kv - q)).all()):
                return None
        return mask

    AttentionInterface.register(NAME, nodekv_attention)
    AttentionMaskInterface.register(NAME, causal_or_mask)  # None for plain causal attention: no mask is built
