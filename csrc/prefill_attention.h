// Causal GQA attention for prefill (many new tokens at once), fp32, flash-style tiling.
//
// Same math and cache layout as ops::decode_attention (cpu_ops.h), built for hundreds to
// thousands of query tokens: work is split into tasks of (KV head, block of query tokens), each
// holding the rows of all G = H / kv_heads query heads that share the KV head. A task walks the
// key blocks from position 0 up to its last token's position (blocks fully above the diagonal
// are skipped), computes the score tile S = Q K^T with a register-blocked FMA kernel (K block
// packed transposed once per block), updates a running max and sum per row (online softmax, in
// base 2 with scale * log2(e) folded into the packed Q), and accumulates O += P V. P, the
// probabilities of one (row block, key block) tile, sits in a scratch tile between the softmax
// and the P V step, so another per-key matrix can be accumulated from it later.
#pragma once

#include <cstdint>

namespace nodekv::ops {

struct PrefillArgs {
    const float* q;  // q[t, h, :] at q + t * q_stride_t + h * q_stride_h, t < n, h < H
    int64_t q_stride_t, q_stride_h;
    const float* k_cache;  // one layer: key of KV head g at position s at k_cache + (g * capacity + s) * hd
    const float* v_cache;
    int64_t capacity;
    int64_t n, H, kv_heads, hd, start;  // query t is at position start + t and sees [0, start + t]
    float* out;                          // out[t, h * hd + i], [n, H * hd] contiguous
    int n_threads;                       // <= 0: omp_get_max_threads()
};

void prefill_attention(const PrefillArgs& a);

}  // namespace nodekv::ops
