"""Triton paged attention with node-mass output, and the paged KV write: the math of `reference.paged_attention` and
`reference.write_kv` (read their docstrings and the layout comment above them) as GPU kernels.

Layout (shared by every backend)::

    k_pages, v_pages  [layers, n_pages, kv_heads, page_size, head_dim]
    block_table       int32 [>= ceil(end / page_size)]: key position s is row s % page_size of page
                      block_table[s // page_size]
    node_bounds       int32 [N + 1], 0 = b[0] < ... < b[N] = end: key node j holds positions [b[j], b[j+1])

Queries are the last n positions before `end`; query i (position end - n + i) sees keys [0, end - n + i].

Attention (`_attn_fwd`) is flash attention (Dao et al. 2022, in the style of Triton's fused-attention tutorial): a
program owns BLOCK_M query rows of one KV head and walks the keys in blocks of BLOCK_N, keeping the running row max
m, the running denominator l and the unnormalised output acc (online softmax), so no [n, end] score matrix ever
exists. GQA packs the G = H / kv_heads query heads that share a KV head into the rows: row r of KV head h is query
i = r // G, head h * G + r % G, so one decode step (n = 1) is a G-row tile instead of G tiles of one row. Keys are
gathered through the block table one row each (page = block_table[s // P]), which is why any page size works.
Scores use exp2 with log2(e) / sqrt(hd) folded into one scale.

Split-KV (flash-decoding): when the (row block, KV head) grid is too small to fill the GPU (decode at long context),
the key range is cut into `num_splits` chunks run by separate programs, each writing a partial output normalised by
its own denominator and its log-sum-exp; `_attn_combine` then merges the splits with weights 2^(lse_s - lse).

Node mass: mass[i, j] += Σ_h Σ_{k in node j} p_h[i, k], p the softmax probabilities, i.e. softmax(QKᵀ)·M with
M[k, j] = 1 when key k is in node j: a second value matrix of N columns, computed in one pass or in two.

One pass (N <= ONE_PASS_MAX_NODES, the default there): `_attn_fwd` carries the open node's mass (the node of the last
key seen) like l: a [BLOCK_M] fp32 sum rescaled by alpha = 2^(m_old - m_new) whenever the running max moves, to which a
key block inside that node (every block but those that cross a bound, where nodes are longer than a key block) adds the
row sum of p that l already took: one compare of the block's end with the node's end, no reduction beyond the softmax's
own. The nodes that are finished sit in mass_acc [BLOCK_M, N_PAD] fp32 (N_PAD = max(16, next_power_of_2(N))), scaled by
2^-m_ref with m_ref the running max when a node last ended (the factor 2^(m_ref - m) is carried like l, rescaled by
alpha), so mass_acc is touched only in a block where nodes end: rescaled by that factor, it takes each ended node's open
sum plus its masked row sum over the [BLOCK_M, BLOCK_N] tile, and the node holding the block's last key opens. At the
end the open node closes the same way and mass_acc / l is the mass, so mass[i, j] = Σ_blocks 2^(m_block - m) Σ_{k in
node j, block} 2^(s_k - m_block) / l, every rescale by a factor <= 1. Over K keys in blocks of BLOCK_N with nodes longer
than a block, mass_acc is rescaled and selected into about N times instead of K / BLOCK_N (the previous kernel did both
in every block: 1.38x the time of an 8K prefill without mass on qwen2.5-1.5b's shapes, H100, results/gpu_h100.md; this
one is untimed on a GPU). The loop over ended nodes is a while behind the branch: a loop of data-dependent length in the
key loop itself made Triton's software pipeliner leave the key loop alone, and behind the branch it does not (sm_90
offline by `bench triton_compiled`, bf16, hd 128: 10 asynchronous copies at 3 stages with mass as without). A one-hot
product p · M_block also kept the loop pipelined, but was measured slower on an H100 even with M_block in bf16 (p split
into three bf16 parts for fp32 mass): 2.44x the time without mass on a 512-row chunk at 8K keys, against 1.77x for
masked sums (results/gpu_h100.md). A single split atomically adds each row's mass to mass[i, :] (the G heads of a query
in a tile and the other KV heads add to the same row), skipping nodes after the block's last visible key. With split-KV
each split stores its mass normalised by its own l into a [splits, n, H, N] fp32 buffer and `_attn_combine` merges it
with the output's weights 2^(lse_s - lse) before adding it. Extra memory: the registers of mass_acc, BLOCK_M × N_PAD /
(32 × num_warps) fp32 a thread (16 for a decode tile at N_PAD = 128, 16 for a 64-row tile at N_PAD = 32) and two
[BLOCK_M] vectors; offline (Triton 3.9 and 3.6, sm_90, bf16, hd 128) no spill at the default tiles for 32 nodes (GQA 6
or 4), and at 128 nodes a spill at 4 warps as before; with splits the buffer; no log-sum-exp, no node-id array and no
extra kernel launch.

Two passes (`_attn_mass`, N > ONE_PASS_MAX_NODES, whose accumulator would not fit registers, or mass_pass="two"):
a second pass over the key blocks using the final log-sum-exp from the attention pass, so p = 2^(s·scale - lse) is
exactly normalised when it is added and nothing depends on N. The program keeps the partial mass of the node still
open at the end of a block in registers and adds a node's mass to `mass` (tl.atomic_add, as other KV heads and
splits add to the same entries) once the node is finished, so a node costs one atomic per row, not one per key
block. A block inside the open node adds its row sum; only a block where nodes end compares node ids, behind a
branch, so the key loop is pipelined (sm_90 offline: 5 asynchronous copies, the keys'; 0 when the node loop ran in
every block, as when the pass was timed at 1.5-1.8x the time without mass). Extra memory: the [n, H] log-sum-exp
and an int32 node id per key position [end]; the pass costs a second QKᵀ (about +50% of the attention FLOPs) and
no PV product. `sdpa_prefill` runs the same pass after torch's SDPA, from the log-sum-exp SDPA returns, for a prefill
from an empty cache.

Limits: head_dim <= 256 (padded to a power of two >= 16, the smallest tl.dot tile; padding is masked); any page
size (keys are gathered per row); int64 offsets into the page pool. fp32 inputs use IEEE fp32 dots (not TF32) so
fp32 results match the fp32 reference; bf16/fp16 inputs use tensor-core dots with fp32 accumulation, and the
probabilities are rounded to the value dtype for the PV product, as in flash attention. Mass and log-sum-exp are
always fp32. Float atomics make the mass sum order (not the result beyond fp32 rounding) nondeterministic.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .reference import (check_block_table, check_kv_pair, check_node_bounds, check_page_shape, check_pages_writable,
                        overlaps)

__all__ = ["ONE_PASS_MAX_NODES", "check_tiles", "decode_attention", "paged_attention", "sdpa_prefill",
           "write_kv"]

# the most nodes summed inside the attention pass: a [BLOCK_M, N_PAD] fp32 accumulator held in registers, like acc
ONE_PASS_MAX_NODES = 128


# ---------------------------------------------------------------- paged KV write


@triton.jit(do_not_specialize=["layer", "first_pos"])
def _write_kv_kernel(K, V, KP, VP, BT, ENDS, layer, first_pos, stride_bt,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kpl, stride_kpp, stride_kph, stride_kpr,
                     stride_vpl, stride_vpp, stride_vph, stride_vpr,
                     HKV: tl.constexpr, HD: tl.constexpr, PAGE: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PER_SEQ: tl.constexpr):
    """One program per new token t: k[t], v[t] [HKV, HD] -> row pos % PAGE of page block_table[pos // PAGE], at pos =
    first_pos + t; PER_SEQ (one token of each of a batch's sequences): pos = ENDS[t] - 1 in table row t."""
    t = tl.program_id(0)
    if PER_SEQ:
        pos = tl.load(ENDS + t) - 1
        BT += t * stride_bt
    else:
        pos = first_pos + t
    page = tl.load(BT + pos // PAGE).to(tl.int64)
    row = pos % PAGE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < HKV) & (d < HD)
    k = tl.load(K + t.to(tl.int64) * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(V + t.to(tl.int64) * stride_vt + h * stride_vh + d, mask=mask)
    kp = KP + layer.to(tl.int64) * stride_kpl + page * stride_kpp + row * stride_kpr
    vp = VP + layer.to(tl.int64) * stride_vpl + page * stride_vpp + row * stride_vpr
    tl.store(kp + h * stride_kph + d, k.to(KP.dtype.element_ty), mask=mask)
    tl.store(vp + h * stride_vph + d, v.to(VP.dtype.element_ty), mask=mask)


def write_kv(k_pages: torch.Tensor, v_pages: torch.Tensor, layer: int, block_table: torch.Tensor, end: int,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Store k, v [T, kv_heads, hd] (any strides, last dim contiguous) at positions end - T .. end - 1 of one layer's
    pages (cast to the pages' dtype). Pages need a contiguous last dim; block_table (int32, best already on the
    pages' device: it is copied there otherwise) must cover positions [0, end)."""
    T, Hkv, hd = k.shape
    check_kv_pair(k, v, "write_kv")
    check_pages_writable(k_pages, v_pages, "write_kv")
    if T == 0:
        return
    block_table = _check_pages(k_pages, v_pages, block_table, end, Hkv, hd, "write_kv")
    check_block_table(block_table, end, k_pages, "write_kv")
    k, v = _last_contig(k), _last_contig(v)
    if not 0 <= layer < k_pages.shape[0] or end < T:
        raise ValueError(f"write_kv: layer {layer} / end {end} out of range for {T} tokens")
    _write_kv_kernel[(T,)](
        k, v, k_pages, v_pages, block_table, block_table, layer, end - T, 0,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_pages.stride()[:4], *v_pages.stride()[:4],
        HKV=Hkv, HD=hd, PAGE=k_pages.shape[3],
        BLOCK_H=triton.next_power_of_2(Hkv), BLOCK_D=triton.next_power_of_2(hd), PER_SEQ=False)


# ---------------------------------------------------------------- attention


@triton.jit
def _load_q(Q, stride_qn, stride_qh, kvh, r0, n, G: tl.constexpr, HD: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The q tile [BLOCK_M, BLOCK_D] of rows r0.. of KV head kvh (row r: query r // G, head kvh * G + r % G), the
    query index and head of each row, and the row mask."""
    r = r0 + tl.arange(0, BLOCK_M)
    i = r // G
    head = kvh * G + r % G
    d = tl.arange(0, BLOCK_D)
    row_ok = i < n
    q = tl.load(Q + i.to(tl.int64)[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & (d[None, :] < HD), other=0.0)
    return q, i, head, row_ok


@triton.jit
def _scores(q, KP, BT, kp_base, stride_kpp, stride_kpr, start, hi, qpos, qk_scale,
            HD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
            DOT_PRECISION: tl.constexpr):
    """Scaled (base-2) scores [BLOCK_M, BLOCK_N] of q against keys start.. (< hi), -inf where masked (causal or
    beyond hi), the key positions, the key mask and the keys' pages."""
    s = start + tl.arange(0, BLOCK_N)
    kmask = s < hi
    page = tl.load(BT + s // PAGE, mask=kmask, other=0).to(tl.int64)
    row_off = kp_base + page * stride_kpp + (s % PAGE) * stride_kpr  # [BLOCK_N]
    d = tl.arange(0, BLOCK_D)
    kt = tl.load(KP + row_off[None, :] + d[:, None], mask=kmask[None, :] & (d[:, None] < HD), other=0.0)
    qk = tl.dot(q, kt.to(q.dtype), input_precision=DOT_PRECISION)
    visible = kmask[None, :] & (s[None, :] <= qpos[:, None])
    return tl.where(visible, qk * qk_scale, float("-inf")), s, kmask, page


@triton.jit
def _node_of(starts, s):
    """The node of key position s: how many node starts (starts = b[0..N-1], padded with end) are <= s, less one."""
    return tl.sum((starts <= s).to(tl.int32), 0) - 1


@triton.jit(do_not_specialize=["layer", "n", "end", "split_len", "n_nodes", "n_splits"])
def _attn_fwd(Q, KP, VP, BT, O, L, NB, MB, ENDS, layer, n, end, split_len, n_nodes, n_splits, qk_scale,
              stride_bt, stride_qn, stride_qh,
              stride_kpl, stride_kpp, stride_kph, stride_kpr,
              stride_vpl, stride_vpp, stride_vph, stride_vpr,
              stride_os, stride_on, stride_oh, stride_ls, stride_ln, stride_lh,
              stride_ms, stride_mn, stride_mh, stride_mj,
              G: tl.constexpr, HD: tl.constexpr, PAGE: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              STORE_LSE: tl.constexpr, DOT_PRECISION: tl.constexpr,
              MASS: tl.constexpr, MASS_SPLITS: tl.constexpr, N_PAD: tl.constexpr, PER_SEQ: tl.constexpr):
    """Program (row block, KV head, split): online-softmax attention over keys [split * split_len,
    min((split + 1) * split_len, causal end of the block)). Writes acc / l to O[split] (O's dtype) and, with
    STORE_LSE, the base-2 log-sum-exp m + log2(l) of the scaled scores to L[split] (-inf and a zero output for a
    row that sees no key of this split).

    With MASS (one-pass node mass over n_nodes <= N_PAD nodes, NB = node_bounds): also mass_acc / l, the row's
    probabilities summed per node, at MB + split * stride_ms + i * stride_mn + head * stride_mh + j * stride_mj:
    stored for every node (MASS_SPLITS: a [splits, n, H, N] buffer that `_attn_combine` merges), else atomically
    added to mass[i, j] (stride_ms = stride_mh = 0: the heads of a query add to one row).

    PER_SEQ (`decode_attention`, n = 1): program axis 2 is (sequence b, split) = (pid // n_splits, pid % n_splits),
    and sequence b's one query is row b of Q / O / L, its keys [0, ENDS[b]) through table row b."""
    pid_m, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if PER_SEQ:
        seq = split // n_splits
        split = split % n_splits
        end = tl.load(ENDS + seq)
        BT += seq * stride_bt
        Q += seq * stride_qn
        O += seq * stride_on
        L += seq * stride_ln
    r0 = pid_m * BLOCK_M
    q, i, head, row_ok = _load_q(Q, stride_qn, stride_qh, kvh, r0, n, G, HD, BLOCK_M, BLOCK_D)
    qpos = end - n + i
    # keys the block's last real query sees, cut to this split
    i_last = tl.minimum(n - 1, (r0 + BLOCK_M - 1) // G)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, end - n + i_last + 1)
    kp_base = layer.to(tl.int64) * stride_kpl + kvh * stride_kph
    vp_base = layer.to(tl.int64) * stride_vpl + kvh * stride_vph
    d = tl.arange(0, BLOCK_D)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if MASS:
        cols = tl.arange(0, N_PAD)
        starts = tl.load(NB + cols, mask=cols < n_nodes, other=end)  # padding is > every key position
        j_open = _node_of(starts, tl.minimum(lo, end - 1))  # the node of the last key seen (first: the split's)
        b_next = tl.load(NB + j_open + 1)  # where it ends
        open_mass = tl.zeros([BLOCK_M], tl.float32)  # its mass so far, scaled like l_i
        mass_acc = tl.zeros([BLOCK_M, N_PAD], tl.float32)  # the ended nodes' mass, scaled by 2^-m_ref
        ref_scale = tl.full([BLOCK_M], 1.0, tl.float32)  # 2^(m_ref - m_i), m_ref the running max when a node last ended
    for start in range(lo, hi, BLOCK_N):
        qk, s, kmask, page = _scores(q, KP, BT, kp_base, stride_kpp, stride_kpr, start, hi, qpos, qk_scale,
                                     HD, PAGE, BLOCK_N, BLOCK_D, DOT_PRECISION)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet: p = alpha = 0
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        p_sum = tl.sum(p, 1)
        l_i = l_i * alpha + p_sum
        v_off = vp_base + page * stride_vpp + (s % PAGE) * stride_vpr
        v = tl.load(VP + v_off[:, None] + d[None, :], mask=kmask[:, None] & (d[None, :] < HD), other=0.0)
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
        if MASS:
            # p in fp32 (the l_i it is normalised by). The open node's sum is kept like l_i: a block inside it adds
            # the row sum l_i took. Only a block where nodes end touches mass_acc (see the module docstring)
            open_mass = open_mass * alpha
            ref_scale = ref_scale * alpha
            last = tl.minimum(start + BLOCK_N, hi)  # one past the block's last key
            if last <= b_next:
                open_mass += p_sum
            else:
                mass_acc = mass_acc * ref_scale[:, None]
                ref_scale = tl.full([BLOCK_M], 1.0, tl.float32)
                # node j_open ends in the block (or where it starts), then any node shorter than a block
                part = tl.sum(tl.where((s < b_next)[None, :], p, 0.0), 1)
                mass_acc = tl.where(cols[None, :] == j_open, mass_acc + (open_mass + part)[:, None], mass_acc)
                j_open += 1
                b_prev = b_next
                b_next = tl.load(NB + j_open + 1)
                while b_next < last:
                    part = tl.sum(tl.where(((s >= b_prev) & (s < b_next))[None, :], p, 0.0), 1)
                    mass_acc = tl.where(cols[None, :] == j_open, mass_acc + part[:, None], mass_acc)
                    j_open += 1
                    b_prev = b_next
                    b_next = tl.load(NB + j_open + 1)
                open_mass = tl.sum(tl.where((s >= b_prev)[None, :], p, 0.0), 1)
    if MASS:  # the open node closes: everything scaled like l_i
        mass_acc = mass_acc * ref_scale[:, None]
        mass_acc = tl.where(cols[None, :] == j_open, mass_acc + open_mass[:, None], mass_acc)

    empty = l_i == 0.0
    denom = tl.where(empty, 1.0, l_i)
    out = acc / denom[:, None]
    o_ptr = O + split.to(tl.int64) * stride_os + i.to(tl.int64)[:, None] * stride_on + head[:, None] * stride_oh \
        + d[None, :]
    tl.store(o_ptr, out.to(O.dtype.element_ty), mask=row_ok[:, None] & (d[None, :] < HD))
    if STORE_LSE:
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        tl.store(L + split * stride_ls + i * stride_ln + head * stride_lh, lse, mask=row_ok)
    if MASS:
        m_ptr = MB + split.to(tl.int64) * stride_ms + i.to(tl.int64)[:, None] * stride_mn \
            + head[:, None] * stride_mh + cols[None, :] * stride_mj
        if MASS_SPLITS:  # every node, zeros included: the buffer is uninitialised
            tl.store(m_ptr, mass_acc / denom[:, None], mask=row_ok[:, None] & (cols[None, :] < n_nodes))
        else:  # nodes after the block's last visible key (j_open's) got nothing: skip their atomics
            tl.atomic_add(m_ptr, mass_acc / denom[:, None], sem="relaxed",
                          mask=row_ok[:, None] & (cols[None, :] <= j_open))


@triton.jit(do_not_specialize=["n_splits", "n_nodes"])
def _attn_combine(PO, PL, O, L, PM, M, n_splits, n_nodes, stride_ps, stride_pn, stride_ph,
                  stride_qs, stride_qn, stride_qh, stride_on, stride_oh, stride_ln, stride_lh,
                  stride_pms, stride_pmn, stride_pmh, stride_pmj, stride_mn, stride_mj,
                  HD: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, STORE_LSE: tl.constexpr,
                  MASS: tl.constexpr, N_PAD: tl.constexpr):
    """Program (query, head): out = Σ_s 2^(lse_s - lse) O_s with lse = log2 Σ_s 2^lse_s over the splits; with
    MASS, the split masses PM[s, i, h] merged with the same weights and atomically added to M[i] (as the query's
    other heads are)."""
    i, h = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = s < n_splits
    lse_s = tl.load(PL + s * stride_qs + i * stride_qn + h * stride_qh, mask=smask, other=float("-inf"))
    m = tl.max(lse_s, 0)  # finite: split 0 holds key 0, which every query sees
    w = tl.exp2(lse_s - m)
    w_sum = tl.sum(w, 0)
    po = tl.load(PO + s[:, None] * stride_ps + i * stride_pn + h * stride_ph + d[None, :],
                 mask=smask[:, None] & (d[None, :] < HD), other=0.0)
    out = tl.sum(po * w[:, None], 0) / w_sum
    tl.store(O + i * stride_on + h * stride_oh + d, out.to(O.dtype.element_ty), mask=d < HD)
    if STORE_LSE:
        tl.store(L + i * stride_ln + h * stride_lh, m + tl.log2(w_sum))
    if MASS:
        j = tl.arange(0, N_PAD)
        pm = tl.load(PM + s[:, None] * stride_pms + i * stride_pmn + h * stride_pmh + j[None, :] * stride_pmj,
                     mask=smask[:, None] & (j[None, :] < n_nodes), other=0.0)
        tl.atomic_add(M + i * stride_mn + j * stride_mj, tl.sum(pm * w[:, None], 0) / w_sum, sem="relaxed",
                      mask=j < n_nodes)


@triton.jit(do_not_specialize=["layer", "n", "end", "split_len"])
def _attn_mass(Q, KP, BT, L, NODE, M, layer, n, end, split_len, qk_scale,
               stride_qn, stride_qh, stride_kpl, stride_kpp, stride_kph, stride_kpr,
               stride_ln, stride_lh, stride_mn, stride_mj,
               G: tl.constexpr, HD: tl.constexpr, PAGE: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Program (row block, KV head, split): the same key range as `_attn_fwd`; p = 2^(score - lse) with the final
    lse, summed per key node (NODE[s] is the node of key s) and added to M[i, node] once each node is finished."""
    pid_m, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    r0 = pid_m * BLOCK_M
    q, i, head, row_ok = _load_q(Q, stride_qn, stride_qh, kvh, r0, n, G, HD, BLOCK_M, BLOCK_D)
    qpos = end - n + i
    lse = tl.load(L + i * stride_ln + head * stride_lh, mask=row_ok, other=0.0)
    i_last = tl.minimum(n - 1, (r0 + BLOCK_M - 1) // G)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, end - n + i_last + 1)
    kp_base = layer.to(tl.int64) * stride_kpl + kvh * stride_kph
    m_row = M + i.to(tl.int64) * stride_mn

    open_mass = tl.zeros([BLOCK_M], tl.float32)  # mass of the node that contains the last key seen so far
    j_open = tl.load(NODE + tl.minimum(lo, end - 1))
    for start in range(lo, hi, BLOCK_N):
        qk, s, kmask, _ = _scores(q, KP, BT, kp_base, stride_kpp, stride_kpr, start, hi, qpos, qk_scale,
                                  HD, PAGE, BLOCK_N, BLOCK_D, DOT_PRECISION)
        p = tl.exp2(qk - lse[:, None])  # 0 where masked
        j_last = tl.load(NODE + tl.minimum(start + BLOCK_N, hi) - 1)
        if j_last == j_open:  # the block lies inside the open node: its whole row sum, no masks
            open_mass += tl.sum(p, 1)
        else:  # nodes j_open .. j_last - 1 end in this block: add them (the open one with its earlier part), close
            node = tl.load(NODE + s, mask=kmask, other=-1)
            for j in range(j_open, j_last):
                part = tl.sum(tl.where(node[None, :] == j, p, 0.0), 1)
                tl.atomic_add(m_row + j * stride_mj, open_mass + part, mask=row_ok)
                open_mass = tl.zeros([BLOCK_M], tl.float32)
            open_mass += tl.sum(tl.where(node[None, :] == j_last, p, 0.0), 1)
            j_open = j_last
    if lo < hi:
        tl.atomic_add(m_row + j_open * stride_mj, open_mass, mask=row_ok)


def _last_contig(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_pages(k_pages, v_pages, block_table, end, Hkv, hd, fn):
    if k_pages.dim() != 5 or v_pages.shape != k_pages.shape:
        raise ValueError(f"{fn}: pages must be [layers, n_pages, kv_heads, page_size, head_dim] and alike, got "
                         f"{tuple(k_pages.shape)} and {tuple(v_pages.shape)}")
    check_page_shape(k_pages, fn)
    if k_pages.shape[2] != Hkv or k_pages.shape[4] != hd:
        raise ValueError(f"{fn}: pages {tuple(k_pages.shape)} do not hold {Hkv} kv heads of dim {hd}")
    if k_pages.stride(-1) != 1 or v_pages.stride(-1) != 1:
        raise ValueError(f"{fn}: pages need a contiguous last dim")
    if block_table.dim() != 1 or block_table.dtype.is_floating_point:
        raise ValueError(f"{fn}: block_table must be a 1-D integer tensor, got {block_table.dtype} "
                         f"{tuple(block_table.shape)}")
    if block_table.shape[0] < -(-end // k_pages.shape[3]):
        raise ValueError(f"{fn}: block_table of {block_table.shape[0]} pages does not cover {end} positions")
    return block_table.to(device=k_pages.device, dtype=torch.int32)  # a no-op when it already is


def _blocks(rows: int, hd: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D): 16-row tiles for decode-sized row counts, 64 otherwise (tl.dot needs >= 16)."""
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    return block_m, 64, max(16, triton.next_power_of_2(hd))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_splits(programs: int, end: int, block_n: int, device: torch.device) -> int:
    """Split the keys when the grid would leave most SMs idle and each split still gets >= 4 key blocks."""
    if device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= sms:
        return 1
    return max(1, min(-(-2 * sms // programs), end // (4 * block_n), 64))


def _check_mass(mass: torch.Tensor | None, node_bounds: torch.Tensor | None, n: int, end: int, fn: str) -> int:
    """The node count N of mass float32 [n, N] and node_bounds over keys [0, end) (0 without mass), or a ValueError."""
    if mass is None:
        return 0
    if node_bounds is None:
        raise ValueError(f"{fn}: mass needs node_bounds")
    check_node_bounds(node_bounds, end, fn)
    N = node_bounds.shape[0] - 1
    if mass.shape != (n, N) or mass.dtype != torch.float32:
        raise ValueError(f"{fn}: mass must be float32 [{n}, {N}], got {mass.dtype} {tuple(mass.shape)}")
    if overlaps(mass):  # atomic adds to an expanded view would pile every row's mass into one
        raise ValueError(f"{fn}: mass is added to in place, so no two of its elements may share memory, got "
                         f"strides {mass.stride()}")
    return N


def _bounds_int32(node_bounds: torch.Tensor, end: int, device: torch.device) -> torch.Tensor:
    """node_bounds as the kernels read them: int32 on `device`, cut at `end`. A last bound past end may be any
    integer (say 2**31 for an open last node): cast as it is, it would wrap to a negative node start."""
    return node_bounds.to(device=device, dtype=torch.int64).clamp_(max=end).to(torch.int32)


def _constants(G: int, hd: int, k_pages: torch.Tensor, block_m: int, block_n: int, block_d: int,
               dtype: torch.dtype) -> dict:
    """The constexprs `_attn_fwd` and `_attn_mass` share: fp32 inputs take IEEE fp32 dots (not TF32)."""
    return {"G": G, "HD": hd, "PAGE": k_pages.shape[3], "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_D": block_d,
            "DOT_PRECISION": "ieee" if dtype == torch.float32 else None}


def check_tiles(tiles: tuple[int, ...], fn: str) -> None:
    """A ValueError naming `fn` unless `tiles` is (BLOCK_M, BLOCK_N, num_warps, num_stages) as `_attn_fwd` launches:
    blocks powers of two >= 16 (tl.dot's smallest tile), warps a power of two, stages >= 1."""
    if len(tiles) != 4 or any(t < 1 or t & (t - 1) for t in tiles[:3]) or min(tiles[:2]) < 16 or tiles[3] < 1:
        raise ValueError(f"{fn}: tiles must be (BLOCK_M, BLOCK_N, num_warps, num_stages): blocks >= 16 and warps "
                         f"powers of two, stages >= 1; got {tiles!r}")


def _mass_pass(mass_pass: str | None, n_nodes: int) -> str:
    """How node mass is summed: `mass_pass` checked, or by default "one" when the nodes fit the one-pass
    accumulator, else "two"."""
    if mass_pass not in (None, "one", "two"):
        raise ValueError(f"paged_attention: mass_pass must be 'one', 'two' or None, got {mass_pass!r}")
    if mass_pass == "one" and n_nodes > ONE_PASS_MAX_NODES:
        raise ValueError(f"paged_attention: mass_pass='one' holds at most {ONE_PASS_MAX_NODES} nodes, got {n_nodes}")
    return mass_pass or ("one" if n_nodes <= ONE_PASS_MAX_NODES else "two")


def paged_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, layer: int,
                    block_table: torch.Tensor, end: int, k_new: torch.Tensor | None = None,
                    v_new: torch.Tensor | None = None, node_bounds: torch.Tensor | None = None,
                    mass: torch.Tensor | None = None, *, num_splits: int | None = None,
                    mass_pass: str | None = None, tiles: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """Causal GQA attention of q [n, H, hd] (any strides, last dim contiguous) over the paged keys [0, end);
    returns a contiguous [n, H * hd] in q's dtype.

    k_new, v_new [T, kv_heads, hd], when given, are first stored at positions end - T .. end - 1 (`write_kv`).
    Scale 1/sqrt(hd). With mass (float32 [n, N]) and node_bounds (int32 [N + 1], 0 = b[0] < ... < b[N], b[N] >= end;
    refused otherwise where they are on the CPU, see `reference.check_node_bounds`):
    mass[i, j] += Σ_h Σ_{k in node j} softmax_h(q_i·K / sqrt(hd))[k] (callers divide by heads × layers).
    num_splits (keyword, optional) forces the number of key splits; by default it is chosen from the grid size and
    the GPU's SM count (always 1 off CUDA). mass_pass (keyword, optional) forces how mass is computed: "one" inside
    the attention pass (at most ONE_PASS_MAX_NODES nodes), "two" in a second pass over the keys; by default "one"
    when N <= ONE_PASS_MAX_NODES, else "two". Any other value is a ValueError. tiles (keyword, optional):
    (BLOCK_M, BLOCK_N, num_warps, num_stages) for the attention and mass passes (blocks powers of two >= 16, warps a
    power of two; what `bench triton_gpu --tiles` sweeps); by default `_blocks` and Triton's launch defaults."""
    n, H, hd = q.shape
    if not q.dtype.is_floating_point:
        raise ValueError(f"paged_attention: q must be a floating-point tensor, got {q.dtype}")
    if (k_new is None) != (v_new is None):
        raise ValueError("paged_attention: give both k_new and v_new or neither")
    Hkv = k_pages.shape[2]
    block_table = _check_pages(k_pages, v_pages, block_table, end, Hkv, hd, "paged_attention")
    check_block_table(block_table, end, k_pages, "paged_attention")
    if k_new is not None:
        check_kv_pair(k_new, v_new, "paged_attention")  # here, so that the refusal names the function called
        check_pages_writable(k_pages, v_pages, "paged_attention")
    if q.device != k_pages.device:
        raise ValueError(f"paged_attention: q on {q.device}, pages on {k_pages.device}")
    if H % Hkv:
        raise ValueError(f"paged_attention: {H} query heads are not a multiple of {Hkv} kv heads")
    if hd > 256:
        raise ValueError(f"paged_attention: head_dim {hd} > 256")
    if not n <= end or not 0 <= layer < k_pages.shape[0]:
        raise ValueError(f"paged_attention: {n} queries, end {end}, layer {layer} out of range")
    N = _check_mass(mass, node_bounds, n, end, "paged_attention")
    mass_pass = _mass_pass(mass_pass, N)  # checked even without mass: a bad value is an error either way
    one_pass, two_pass = mass is not None and mass_pass == "one", mass is not None and mass_pass == "two"
    G = H // Hkv
    block_m, block_n, block_d = _blocks(n * G, hd)
    launch = {}
    if tiles is not None:
        check_tiles(tiles, "paged_attention")
        block_m, block_n = tiles[:2]
        launch = {"num_warps": tiles[2], "num_stages": tiles[3]}
    if k_new is not None:  # every argument checked: nothing is written on a refusal
        write_kv(k_pages, v_pages, layer, block_table, end, k_new, v_new)
    out = torch.empty(n, H, hd, dtype=q.dtype, device=q.device)
    if n == 0:
        return out.view(0, H * hd)
    q = _last_contig(q)
    grid_m = triton.cdiv(n * G, block_m)
    splits = num_splits or _num_splits(grid_m * Hkv, end, block_n, q.device)
    split_len = triton.cdiv(triton.cdiv(end, splits), block_n) * block_n
    splits = triton.cdiv(end, split_len)
    if mass is not None:
        bounds = _bounds_int32(node_bounds, end, q.device)
        acc = mass if mass.device == q.device else torch.zeros(n, N, dtype=torch.float32, device=q.device)
    # unused pointers are `out`; the final lse is only needed by the second mass pass
    lse = torch.empty(n, H, dtype=torch.float32, device=q.device) if two_pass else out
    qk_scale = 1.0 / math.sqrt(hd) * math.log2(math.e)
    common = _constants(G, hd, k_pages, block_m, block_n, block_d, q.dtype)
    kp_strides, vp_strides = k_pages.stride()[:4], v_pages.stride()[:4]
    if splits == 1:
        o_buf, l_buf = out[None], lse[None] if two_pass else out[None, :, :, 0]
    else:
        o_buf = torch.empty(splits, n, H, hd, dtype=torch.float32, device=q.device)
        l_buf = torch.empty(splits, n, H, dtype=torch.float32, device=q.device)
    # one pass: a split's mass goes to a [splits, n, H, N] buffer for the combine, a single split's straight to mass
    if one_pass and splits > 1:
        m_buf = torch.empty(splits, n, H, N, dtype=torch.float32, device=q.device)
        m_strides = m_buf.stride()
    elif one_pass:
        m_buf, m_strides = acc, (0, acc.stride(0), 0, acc.stride(1))
    else:
        m_buf, m_strides = out, (0, 0, 0, 0)
    n_pad = max(16, triton.next_power_of_2(N)) if one_pass else 16
    _attn_fwd[(grid_m, Hkv, splits)](
        q, k_pages, v_pages, block_table, o_buf, l_buf, bounds if one_pass else out, m_buf, block_table,
        layer, n, end, split_len, N, splits, qk_scale,
        0, q.stride(0), q.stride(1), *kp_strides, *vp_strides,
        o_buf.stride(0), o_buf.stride(1), o_buf.stride(2), l_buf.stride(0), l_buf.stride(1), l_buf.stride(2),
        *m_strides, STORE_LSE=two_pass or splits > 1, MASS=one_pass, MASS_SPLITS=splits > 1, N_PAD=n_pad,
        PER_SEQ=False, **common, **launch)
    if splits > 1:
        _attn_combine[(n, H)](
            o_buf, l_buf, out, lse, m_buf, acc if one_pass else out, splits, N,
            o_buf.stride(0), o_buf.stride(1), o_buf.stride(2), l_buf.stride(0), l_buf.stride(1), l_buf.stride(2),
            out.stride(0), out.stride(1), lse.stride(0), lse.stride(1) if two_pass else 0,
            *m_strides, *(acc.stride() if one_pass else (0, 0)),
            HD=hd, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=triton.next_power_of_2(hd), STORE_LSE=two_pass,
            MASS=one_pass, N_PAD=n_pad)
    if two_pass:
        _launch_mass_pass(q, k_pages, layer, block_table, end, lse, bounds, acc, (grid_m, Hkv, splits), split_len,
                          common, launch)
    if mass is not None and acc is not mass:
        mass += acc.to(mass.device)
    return out.view(n, H * hd)


def _launch_mass_pass(q, k_pages, layer, block_table, end, lse, bounds, acc, grid, split_len, common,
                      launch) -> None:
    """Launch `_attn_mass`: add to acc [n, N] each row's p = 2^(score - lse) (lse [n, H], base 2) summed per node."""
    node_of_key = (torch.searchsorted(bounds, torch.arange(end, dtype=torch.int32, device=q.device), right=True)
                   - 1).to(torch.int32)
    _attn_mass[grid](
        q, k_pages, block_table, lse, node_of_key, acc, layer, q.shape[0], end, split_len,
        1.0 / math.sqrt(q.shape[2]) * math.log2(math.e), q.stride(0), q.stride(1), *k_pages.stride()[:4],
        lse.stride(0), lse.stride(1), acc.stride(0), acc.stride(1), **common, **launch)


def sdpa_prefill(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, layer: int,
                 block_table: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                 node_bounds: torch.Tensor | None = None, mass: torch.Tensor | None = None) -> torch.Tensor:
    """A prefill from an empty cache through torch's SDPA (flash attention), with node mass from a second pass.

    k_new, v_new [T, kv_heads, hd] are stored at positions 0 .. T - 1 (`write_kv`) and q [n, H, hd] attends to them:
    n = T, every position causally, or n = 1, the last position (which sees every key). Returns [n, H * hd] in q's
    dtype, as `paged_attention` with end = T. Without mass this is `F.scaled_dot_product_attention`. With mass
    (float32 [n, N]) and node_bounds, as in `paged_attention`, SDPA's flash kernel also returns each row's natural
    log-sum-exp, and `_attn_mass` adds p = exp(score - lse) per node in a second pass over the stored keys: a QKᵀ
    without the PV product, after the fastest attention torch has (on an H200 Triton's paged kernel took 1.7x SDPA's
    time without mass). The two passes' scores differ by fp32 rounding only (both accumulate in fp32).
    Limits: CUDA in bf16/fp16 (torch's flash kernel; fp32 on CUDA is refused) or any dtype on the CPU (where torch
    has a flash kernel for the CPU: what the tests run under the interpreter); queries and keys repeated per head
    for SDPA (GQA), which costs 2 x G x T x kv_heads x hd elements of memory a call."""
    n, H, hd = q.shape
    T, Hkv = k_new.shape[:2]
    if n not in (1, T) or v_new.shape != k_new.shape or H % Hkv or k_new.shape[2] != hd:
        raise ValueError(f"sdpa_prefill: q {tuple(q.shape)} must be every position of k_new, v_new "
                         f"{tuple(k_new.shape)}, {tuple(v_new.shape)} or the last one, with whole head groups")
    if q.device != k_pages.device:
        raise ValueError(f"sdpa_prefill: q on {q.device}, pages on {k_pages.device}")
    if q.is_cuda and q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"sdpa_prefill: torch's flash attention on CUDA takes bf16 or fp16, got {q.dtype}")
    N = _check_mass(mass, node_bounds, n, T, "sdpa_prefill")
    write_kv(k_pages, v_pages, layer, block_table, T, k_new, v_new)  # checks the pages and the table
    G = H // Hkv
    k, v = (t.to(q.dtype).repeat_interleave(G, dim=1).transpose(0, 1)[None] for t in (k_new, v_new))  # [1, H, T, hd]
    causal = n > 1  # one last query sees every key
    if mass is None:
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, is_causal=causal)
        return out[0].transpose(0, 1).reshape(n, H * hd)
    flash = (torch.ops.aten._scaled_dot_product_flash_attention if q.is_cuda
             else torch.ops.aten._scaled_dot_product_flash_attention_for_cpu)
    out, lse = flash(q.transpose(0, 1)[None], k, v, 0.0, causal)[:2]  # lse [1, H, n], natural log, fp32
    lse = (lse[0] * math.log2(math.e)).t()  # [n, H], base 2 like the Triton kernels' scores
    block_m, block_n, block_d = _blocks(n * G, hd)
    bounds = _bounds_int32(node_bounds, T, q.device)
    acc = mass if mass.device == q.device else torch.zeros(n, N, dtype=torch.float32, device=q.device)
    common = _constants(G, hd, k_pages, block_m, block_n, block_d, q.dtype)
    _launch_mass_pass(_last_contig(q), k_pages, layer, block_table.to(device=q.device, dtype=torch.int32), T, lse,
                      bounds, acc, (triton.cdiv(n * G, block_m), Hkv, 1), triton.cdiv(T, block_n) * block_n, common, {})
    if acc is not mass:
        mass += acc.to(mass.device)
    return out[0].transpose(0, 1).reshape(n, H * hd)


def decode_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, layer: int,
                     block_tables: torch.Tensor, ends: torch.Tensor, max_end: int, k_new: torch.Tensor,
                     v_new: torch.Tensor, *, num_splits: int | None = None) -> torch.Tensor:
    """One decode step of B sequences in one launch each for the KV write and the attention (plus the split
    combine): what `paged_attention` does for each sequence alone, without node mass.

    q [B, H, hd]: each sequence's new query; k_new, v_new [B, kv_heads, hd]: its new key and value, stored at
    position ends[b] - 1; block_tables int32 [B, >= pages of the longest] (row b: sequence b's pages, padded
    anywhere past its end); ends int32 [B] on the pages' device: each sequence's length with the new token; max_end:
    max(ends), the host's copy (it sizes the key splits without a device sync). Returns [B, H * hd] in q's dtype.
    One program per (KV head, sequence, key split); the splits are chosen as `paged_attention` chooses them for the
    longest sequence (shorter ones leave their later splits empty, which the combine weighs 0)."""
    B, H, hd = q.shape
    Hkv = k_pages.shape[2]
    if block_tables.dim() != 2 or block_tables.shape[0] != B or ends.shape != (B,):
        raise ValueError(f"decode_attention: {B} queries need block_tables [{B}, pages] and ends [{B}], got "
                         f"{tuple(block_tables.shape)} and {tuple(ends.shape)}")
    if k_new.shape != (B, Hkv, hd) or v_new.shape != k_new.shape:
        raise ValueError(f"decode_attention: k_new and v_new must be [{B}, {Hkv}, {hd}], got {tuple(k_new.shape)} "
                         f"and {tuple(v_new.shape)}")
    _check_pages(k_pages, v_pages, block_tables[0], max_end, Hkv, hd, "decode_attention")  # pages, table width
    check_pages_writable(k_pages, v_pages, "decode_attention")
    if ends.device.type == "cpu":  # each row's entries up to its own end (the padding past it is never read)
        for table, end in zip(block_tables, ends.tolist()):
            check_block_table(table, end, k_pages, "decode_attention")
    if H % Hkv or hd > 256 or not 0 <= layer < k_pages.shape[0]:
        raise ValueError(f"decode_attention: {H} heads over {Hkv} kv heads, head_dim {hd}, layer {layer}: unsupported")
    tables = block_tables.to(device=k_pages.device, dtype=torch.int32)
    ends = ends.to(device=k_pages.device, dtype=torch.int32)
    q, k_new, v_new = _last_contig(q), _last_contig(k_new), _last_contig(v_new)
    _write_kv_kernel[(B,)](
        k_new, v_new, k_pages, v_pages, tables, ends, layer, 0, tables.stride(0),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        *k_pages.stride()[:4], *v_pages.stride()[:4],
        HKV=Hkv, HD=hd, PAGE=k_pages.shape[3],
        BLOCK_H=triton.next_power_of_2(Hkv), BLOCK_D=triton.next_power_of_2(hd), PER_SEQ=True)
    G = H // Hkv
    block_m, block_n, block_d = _blocks(G, hd)
    splits = num_splits or _num_splits(B * Hkv, max_end, block_n, q.device)
    split_len = triton.cdiv(triton.cdiv(max_end, splits), block_n) * block_n
    splits = triton.cdiv(max_end, split_len)
    out = torch.empty(B, H, hd, dtype=q.dtype, device=q.device)
    if splits == 1:
        o_buf, l_buf = out[None], out[None, :, :, 0]  # l_buf: an unused pointer
    else:
        o_buf = torch.empty(splits, B, H, hd, dtype=torch.float32, device=q.device)
        l_buf = torch.empty(splits, B, H, dtype=torch.float32, device=q.device)
    _attn_fwd[(triton.cdiv(G, block_m), Hkv, B * splits)](
        q, k_pages, v_pages, tables, o_buf, l_buf, out, out, ends,
        layer, 1, max_end, split_len, 0, splits, 1.0 / math.sqrt(hd) * math.log2(math.e),
        tables.stride(0), q.stride(0), q.stride(1), *k_pages.stride()[:4], *v_pages.stride()[:4],
        o_buf.stride(0), o_buf.stride(1), o_buf.stride(2), l_buf.stride(0), l_buf.stride(1), l_buf.stride(2),
        0, 0, 0, 0, **_constants(G, hd, k_pages, block_m, block_n, block_d, q.dtype), STORE_LSE=splits > 1,
        MASS=False, MASS_SPLITS=False, N_PAD=16, PER_SEQ=True)
    if splits > 1:
        _attn_combine[(B, H)](
            o_buf, l_buf, out, out, out, out, splits, 0,
            o_buf.stride(0), o_buf.stride(1), o_buf.stride(2), l_buf.stride(0), l_buf.stride(1), l_buf.stride(2),
            out.stride(0), out.stride(1), 0, 0, 0, 0, 0, 0, 0, 0,
            HD=hd, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=triton.next_power_of_2(hd), STORE_LSE=False,
            MASS=False, N_PAD=16)
    return out.view(B, H * hd)
