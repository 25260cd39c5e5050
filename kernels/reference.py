"""Torch reference of the forward's kernels (elementwise ops, paged KV write, paged attention with node mass): the
oracle the C++ (`cpu_ops`) and Triton (`triton_ops`) backends are tested against, and the path for bf16 and
`backend="torch"`. Each function returns its result; it may reuse its input's storage."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def overlaps(t: torch.Tensor) -> bool:
    """Whether two elements of t may share memory (an expanded view), which a kernel writing t in place must refuse:
    unless each dim, by increasing stride, steps past everything the dims inside it span. (Interleaved layouts that
    do not overlap count as overlapping.) Shapes and strides only: no device sync."""
    if t.numel() == 0:
        return False
    span = 1  # elements from the first to the last of the dims so far, inclusive
    for stride, size in sorted(zip(t.stride(), t.shape)):
        if size > 1:
            if stride < span:
                return True
            span += (size - 1) * stride
    return False


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, d] -> x / sqrt(mean(x², -1) + eps) * weight."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rope(qk: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on qk [T, heads, hd] with cos, sin_signed [T, hd] (sin_signed = [-sin, sin]):
    qk * cos + rotate_half(qk) * sin, where rotate_half(x) * sin == roll(x, hd/2) * sin_signed."""
    cos, sin_signed = cos[:, None, :], sin_signed[:, None, :]
    return qk * cos + qk.roll(qk.shape[-1] // 2, -1) * sin_signed


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate | up) -> silu(gate) * up [T, I], computed in gate_up's storage."""
    gate, up = gate_up.chunk(2, -1)
    return F.silu(gate, inplace=True).mul_(up)


def add_rms_norm_(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The residual add fused with the norm after it: x += delta in place, then rms_norm(x, weight, eps)."""
    x += delta
    return rms_norm(x, weight, eps)


# ---------------------------------------------------------------- paged KV and attention with node mass
#
# Layout shared by every backend (torch reference, C++ `cpu_ops`, Triton):
#   k_pages, v_pages  [layers, n_pages, kv_heads, page_size, head_dim], the model dtype
#   block_table       int32 [>= ceil(end / page_size)]: key position s lives in page block_table[s // page_size]
#                     at row s % page_size (entries are page ids of the pool: `check_block_table`)
#   node_bounds       int32 [N + 1], 0 = b[0] < b[1] < ... < b[N] = end: key node j holds positions [b[j], b[j+1])
#                     (here and in Triton the last node may go on past end: b[N] >= end; `check_node_bounds`)
# Queries are the last n positions before `end`; query i (position end - n + i) sees keys [0, end - n + i].

# Bytes of scores the chunked reference may hold at once (queries are processed in chunks of this size).
SCORE_CHUNK_BYTES = 16 << 20


def check_node_bounds(node_bounds: torch.Tensor, end: int, fn: str) -> None:
    """A ValueError naming the problem unless node_bounds is a 1-D integer tensor of >= 2 bounds that, on the CPU,
    rise strictly from 0 to at least `end`, so that every key is in one node. A CUDA tensor's values are trusted:
    reading them would cost a device sync per call (sessions build them rising from 0 to the keys' end)."""
    if node_bounds.dim() != 1 or node_bounds.dtype.is_floating_point or node_bounds.shape[0] < 2:
        raise ValueError(f"{fn}: node_bounds must be a 1-D integer tensor of at least 2 bounds, got "
                         f"{node_bounds.dtype} {tuple(node_bounds.shape)}")
    if node_bounds.device.type == "cpu":
        b = node_bounds.tolist()
        if b[0] != 0 or b[-1] < end or any(x >= y for x, y in zip(b, b[1:])):
            raise ValueError(f"{fn}: node_bounds must rise strictly from 0 to at least end={end}, got "
                             f"{b if len(b) <= 12 else b[:6] + ['...'] + b[-6:]}")


def check_page_shape(pages: torch.Tensor, fn: str) -> None:
    """A ValueError unless pages [layers, n_pages, kv_heads, page_size, head_dim] have kv_heads, page_size and
    head_dim >= 1: the kernels divide by each of them."""
    if 0 in pages.shape[2:]:
        raise ValueError(f"{fn}: pages must have kv_heads, page_size and head_dim >= 1, got shape "
                         f"{list(pages.shape)}")


def check_pages_writable(k_pages: torch.Tensor, v_pages: torch.Tensor, fn: str) -> None:
    """A ValueError unless no two elements of k_pages, nor of v_pages, share memory: a KV write into an expanded
    (stride-0) pool would land in every page sharing the row, which Triton did silently and torch only warns about
    (the C++ kernel takes contiguous pages only). Shapes and strides only: no device sync."""
    for name, pages in (("k_pages", k_pages), ("v_pages", v_pages)):
        if overlaps(pages):
            raise ValueError(f"{fn}: {name} is written in place, so no two of its elements may share memory, got "
                             f"shape {list(pages.shape)} strides {pages.stride()}")


def check_kv_pair(k: torch.Tensor, v: torch.Tensor | None, fn: str) -> None:
    """A ValueError unless v is a tensor of k's shape: a KV write stores both, and torch's indexed write would
    broadcast a v of one row into every row."""
    if not isinstance(v, torch.Tensor) or v.shape != k.shape:
        got = tuple(v.shape) if isinstance(v, torch.Tensor) else v
        raise ValueError(f"{fn}: v must be a tensor of k's shape {tuple(k.shape)}, got {got}")


def check_block_table(block_table: torch.Tensor, end: int, pages: torch.Tensor, fn: str) -> None:
    """A ValueError naming the entry unless, on the CPU, the block_table entries that hold positions [0, end) are
    pages of `pages` [layers, n_pages, ...]. A CUDA tensor's values are trusted, as node_bounds' are: reading them
    would cost a device sync per call (caches build their tables from the pool's own page ids). Unchecked, a
    negative id would index from the end of the pool and read another sequence's keys."""
    if block_table.device.type == "cpu":
        n_pages, used = pages.shape[1], block_table[: -(-end // pages.shape[3])]
        bad = ((used < 0) | (used >= n_pages)).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            raise ValueError(f"{fn}: block_table[{i}] = {int(used[i])} is not a page of the pool's {n_pages}")


def write_kv(k_pages: torch.Tensor, v_pages: torch.Tensor, layer: int, block_table: torch.Tensor, end: int,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Store k, v [T, kv_heads, hd] at positions end - T .. end - 1 of one layer's pages."""
    check_kv_pair(k, v, "write_kv")
    check_pages_writable(k_pages, v_pages, "write_kv")
    P = k_pages.shape[3]
    pos = torch.arange(end - k.shape[0], end, device=block_table.device)
    pages, rows = block_table[pos // P].long(), pos % P
    k_pages[layer, pages, :, rows] = k.to(k_pages.dtype)
    v_pages[layer, pages, :, rows] = v.to(v_pages.dtype)


def gather_kv(pages: torch.Tensor, layer: int, block_table: torch.Tensor, end: int) -> torch.Tensor:
    """One layer's keys (or values) for positions [0, end) as a contiguous [kv_heads, end, hd] tensor."""
    P = pages.shape[3]
    blocks = pages[layer, block_table[: -(-end // P)].long()]  # [n_blocks, kv_heads, P, hd]
    return blocks.transpose(0, 1).reshape(pages.shape[2], -1, pages.shape[4])[:, :end]


def paged_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, layer: int,
                    block_table: torch.Tensor, end: int, k_new: torch.Tensor | None = None,
                    v_new: torch.Tensor | None = None, node_bounds: torch.Tensor | None = None,
                    mass: torch.Tensor | None = None) -> torch.Tensor:
    """Causal GQA attention of q [n, H, hd] over the paged keys [0, end); returns [n, H * hd] in q's dtype.

    k_new, v_new [T, kv_heads, hd], when given, are first stored at positions end - T .. end - 1. Scale 1/sqrt(hd).
    mass (float32 [n, N]) += Σ_h Σ_{k in node j} softmax_h(q_i·K / sqrt(hd))[k]: the attention mass of every query
    on every key node, summed over heads (callers divide by heads × layers). Without mass this is torch's SDPA on the
    gathered keys; with it, queries run in chunks so at most SCORE_CHUNK_BYTES of scores exist at once."""
    if (k_new is None) != (v_new is None):
        raise ValueError("paged_attention: give both k_new and v_new or neither")
    check_page_shape(k_pages, "paged_attention")
    check_block_table(block_table, end, k_pages, "paged_attention")  # checked before anything is written
    if k_new is not None:
        check_kv_pair(k_new, v_new, "paged_attention")  # here, so that the refusal names the function called
        check_pages_writable(k_pages, v_pages, "paged_attention")
    if mass is not None:
        if node_bounds is None:
            raise ValueError("paged_attention: mass needs node_bounds")
        check_node_bounds(node_bounds, end, "paged_attention")
    if k_new is not None:
        write_kv(k_pages, v_pages, layer, block_table, end, k_new, v_new)
    n, H, hd = q.shape
    keys, values = gather_kv(k_pages, layer, block_table, end), gather_kv(v_pages, layer, block_table, end)
    if n == 0:
        return q.new_empty(0, H * hd)
    start = end - n
    if mass is None:
        # 4-D inputs: with 3-D ones torch falls back to its (T x T-materialising) math kernel
        # from an empty cache the mask is plain causal: is_causal takes SDPA's flash path, an explicit mask does not
        fresh = n == end
        mask = None if n == 1 or fresh else _visible(end, start, end, q.device)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None].to(q.dtype),
                                             values[None].to(q.dtype), attn_mask=mask, is_causal=fresh and n > 1,
                                             enable_gqa=True)
        return out[0].transpose(0, 1).reshape(n, H * hd)
    return _attention_with_mass(q, keys, values, torch.arange(start, end, device=q.device), node_bounds, mass)


def attention_at(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                 node_bounds: torch.Tensor | None = None, mass: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of queries q [n, H, hd] at any increasing `positions` (int64 [n]) over keys, values
    [kv_heads, end, hd] (gathered, `gather_kv`): query i sees keys [0, positions[i]]. Returns [n, H * hd] in q's
    dtype; mass as for `paged_attention`. The recompute of tokens in the middle of a cache (`Llama.recompute`)."""
    n, H, hd = q.shape
    if mass is not None:
        if node_bounds is None:
            raise ValueError("attention_at: mass needs node_bounds")
        check_node_bounds(node_bounds, keys.shape[1], "attention_at")
        return _attention_with_mass(q, keys, values, positions, node_bounds, mass)
    visible = positions[:, None] >= torch.arange(keys.shape[1], device=q.device)[None, :]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None].to(q.dtype), values[None].to(q.dtype),
                                         attn_mask=visible, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(n, H * hd)


def _attention_with_mass(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                         node_bounds: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Attention in fp32 with each query's mass per key node added to mass [n, N], queries in chunks so that at most
    SCORE_CHUNK_BYTES of scores exist at once (node_bounds checked by the caller)."""
    n, H, hd = q.shape
    Hkv, end = keys.shape[0], keys.shape[1]
    G = H // Hkv
    # by search, not by repeating each node's length: the last node may go on far past the keys (b[N] >= end)
    node_of_key = torch.searchsorted(node_bounds.to(q.device, torch.int64), torch.arange(end, device=q.device),
                                     right=True) - 1
    kf, vf = keys.float(), values.float()
    out = torch.empty(n, H, hd, dtype=torch.float32, device=q.device)
    chunk = max(1, SCORE_CHUNK_BYTES // (4 * H * end))
    for c0 in range(0, n, chunk):
        c1 = min(n, c0 + chunk)
        qc = q[c0:c1].float().view(c1 - c0, Hkv, G, hd).permute(1, 2, 0, 3)  # [Hkv, G, c, hd]
        scores = (qc @ kf[:, None].transpose(-1, -2)) / math.sqrt(hd)  # [Hkv, G, c, end]
        visible = torch.arange(end, device=q.device)[None, :] <= positions[c0:c1, None]
        p = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[c0:c1] = (p @ vf[:, None]).permute(2, 0, 1, 3).reshape(c1 - c0, H, hd)
        mass[c0:c1].index_add_(1, node_of_key, p.sum((0, 1)))
    return out.reshape(n, H * hd).to(q.dtype)


def _visible(end: int, first: int, last: int, device: torch.device) -> torch.Tensor:
    """Causal mask [last - first, end] of queries at positions first .. last - 1 over keys [0, end)."""
    return torch.arange(end, device=device)[None, :] <= torch.arange(first, last, device=device)[:, None]
