"""nodekv's attention inside an unmodified HF transformers model: per-node attention mass without T×T memory.

    import nodekv.hf
    nodekv.hf.register()                                      # attn_implementation="nodekv" now exists
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="nodekv")
    mass = nodekv.hf.NodeMassCollector([0, 120, 300, 410])    # node boundaries over the prompt's tokens
    out = model(input_ids, node_mass=mass)                    # logits as with sdpa
    mass.mean()                                               # [B, T, N]: head- and layer-averaged mass per node

Every attention layer runs nodekv's paged-attention kernel on HF's own key/value tensors (viewed as one page, no
copy): the fp32 C++ kernel on CPU float32, the torch reference otherwise. With a `NodeMassCollector` passed to the
forward, the kernel also adds each query token's attention on every node's keys, summed over heads, into [B, T, N]
— O(T·N) memory, never the T×T attention maps `output_attentions` returns. Keys past the last boundary (tokens
generated after the prompt) count as one more node.

Limits, each refused with a message: causal decoder attention without padding (a padding or custom mask is
refused), no dropout, the 1/√head_dim scale (Llama, Qwen2, Mistral), no sliding window or soft-capping. Needs
transformers' AttentionInterface and AttentionMaskInterface; tested with transformers 5.24, the version installed.
"""
from __future__ import annotations

from typing import Sequence

import torch

NAME = "nodekv"


class NodeMassCollector:
    """Collects attention mass per (query token, key node) across the layers of the forwards it is passed to.

    `bounds` are node boundaries over key positions: 0 = b[0] < b[1] < ... < b[N]; keys at b[N] and beyond are one
    more node. `sum` holds Σ over heads and layers, float32 [B, T, nodes]; `mean()` divides by heads × layers."""

    def __init__(self, bounds: Sequence[int]):
        b = [int(x) for x in bounds]
        if len(b) < 2 or b[0] != 0 or any(x >= y for x, y in zip(b, b[1:])):
            raise ValueError(f"node bounds must start at 0 and increase strictly, with at least one node: {b}")
        self.bounds = b
        self.sum: torch.Tensor | None = None
        self.layers = 0
        self.heads = 0

    def reset(self) -> None:
        """Forget what was collected (e.g. before the next forward)."""
        self.sum, self.layers, self.heads = None, 0, 0

    def mean(self) -> torch.Tensor:
        """float32 [B, T, nodes]: mass averaged over heads and layers (each row sums to 1 over nodes)."""
        if self.sum is None:
            raise ValueError("no attention has been collected: pass node_mass=this to the model's forward")
        return self.sum / (self.heads * self.layers)

    def _layer(self, first: bool, batch: int, queries: int, keys: int, heads: int, device: torch.device):
        """(bounds over `keys` keys as int32, this layer's [B, T, nodes] mass to add into) for one layer's forward;
        `first`: the model's first layer, where a forward begins."""
        if first and self.layers:
            raise ValueError("this NodeMassCollector already holds a forward's mass: call reset() before the next "
                             "forward")
        b = [x for x in self.bounds if x < keys] + [keys]
        if self.sum is None:
            self.sum = torch.zeros(batch, queries, len(self.bounds) - 1 + (keys > self.bounds[-1]), device=device)
        self.layers += 1
        self.heads = heads
        return torch.tensor(b, dtype=torch.int32), self.sum[..., :len(b) - 1]


def nodekv_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """HF's attention-function contract: query [B, H, T, D], key/value [B, Hkv, S, D] (the whole cache) ->
    (output [B, T, H, D], None). A `node_mass=NodeMassCollector(...)` forward kwarg collects mass per node."""
    from nodekv.kernels import backend_ops

    batch, heads, queries, dim = query.shape
    keys = key.shape[2]
    _check(module, attention_mask, dropout, scaling, dim, kwargs)
    collector: NodeMassCollector | None = kwargs.get("node_mass")
    ops = backend_ops("auto" if query.is_cpu else "torch", query.dtype)
    table = torch.zeros(1, dtype=torch.int32)
    bounds, mass = (None, None) if collector is None else \
        collector._layer(getattr(module, "layer_idx", 0) == 0, batch, queries, keys, heads, query.device)
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


def _check(module, attention_mask, dropout: float, scaling: float | None, dim: int, kwargs: dict) -> None:
    if dropout:
        raise ValueError(f"nodekv attention runs inference only: dropout must be 0, got {dropout}")
    if scaling is not None and abs(scaling - dim ** -0.5) > 1e-6 * dim ** -0.5:
        raise ValueError(f"nodekv attention scales scores by 1/sqrt(head_dim) = {dim ** -0.5:.6g}; this model asks "
                         f"for {scaling:.6g}")
    if getattr(module, "sliding_window", None) or kwargs.get("sliding_window") or kwargs.get("softcap"):
        raise ValueError("nodekv attention does not support sliding-window or soft-capped attention")
    if attention_mask is not None:
        raise ValueError("nodekv attention is causal attention without padding; this forward has an attention mask "
                         "(padded batch or a custom mask): run unpadded sequences, one per row of equal length")


def register() -> None:
    """Make attn_implementation="nodekv" available to HF models loaded afterwards (and to set_attn_implementation)."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as e:
        raise ImportError(f"nodekv.hf needs transformers with AttentionInterface and AttentionMaskInterface "
                          f"(tested with 5.24): {e}") from None

    AttentionInterface.register(NAME, nodekv_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # None for plain causal attention: no mask is built
