// Causal GQA attention over a paged KV cache, fp32, with an optional per-key-node attention mass.
// The pages hold floats, or IEEE halves (kv_half: half the memory and the bytes each step reads; a key
// block is converted to fp32 as it is read, and new keys and values are rounded to nearest even as they
// are stored), the arithmetic is fp32 either way.
//
// Layout (shared with kernels/reference.py, which defines the semantics): one layer's keys are
// k[page, g, row, :] of a [n_pages, kv_heads, page_size, hd] block; key position s of KV head g
// lives in page block_table[s / page_size] at row s % page_size (likewise values). The n queries
// are the last n positions before `end`: query i (position end - n + i) sees keys [0, end - n + i].
// Query head h uses KV head h / (H / kv_heads); scale 1/sqrt(hd).
//
// If k_new != nullptr, k_new[t, g, :] and v_new[t, g, :] (t < T, T >= n) are first stored at
// positions end - T + t. If mass != nullptr, mass[i, j] += sum_h sum_{k in node j} p_h(i -> k),
// node j being the keys [node_bounds[j], node_bounds[j + 1]): accumulated, never overwritten.
// Node mass costs O(n * n_nodes) memory plus per-thread scratch; no n x end matrix is formed.
//
// Two kernels, picked by the number of queries:
//  - few queries (n <= kDecodeMaxQueries), csrc/attention_decode.cpp: keys split in fixed chunks
//    of 128 whose partial softmaxes are merged by log-sum-exp, so that a single token's keys are
//    shared among the threads;
//  - many queries (prefill), csrc/attention_prefill.cpp: flash-style tiles of (query block, key
//    block) with K^T packed once per call and register-blocked FMA micro-kernels.
// Both split the work independently of the thread count, so the results do not depend on it.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cpu_common.h"

namespace nodekv::ops {

// Queries up to which the decode kernel runs; the tiled kernel takes more.
constexpr int64_t kDecodeMaxQueries = 16;

struct PagedArgs {
    const float* q;  // q[i, h, :] at q + i * q_stride_t + h * q_stride_h, i < n, h < H
    int64_t q_stride_t, q_stride_h;
    void* k_pages;  // this layer's [n_pages, kv_heads, page_size, hd] block of floats, or of halves
    void* v_pages;
    bool kv_half;  // the pages hold IEEE halves (uint16_t)
    int64_t n_pages, page_size;
    const int32_t* block_table;  // n_table entries, n_table * page_size >= end
    int64_t n_table;
    int64_t end;
    const float* k_new;  // nullptr: the pages already hold every position < end
    const float* v_new;
    int64_t k_new_stride_t, k_new_stride_h, v_new_stride_t, v_new_stride_h;
    int64_t T;  // rows of k_new / v_new
    int64_t n, H, kv_heads, hd;
    const int32_t* node_bounds;  // n_nodes + 1 entries; with mass only
    int64_t n_nodes;
    float* mass;  // [n, n_nodes] contiguous, or nullptr
    float* out;   // [n, H * hd] contiguous
    int n_threads;  // <= 0: omp_get_max_threads()

    // Address of key (value) position s of KV head g, in pages of E: float, or uint16_t for halves.
    template <class E = float>
    const E* k_row(int64_t s, int64_t g) const { return static_cast<const E*>(k_pages) + row_offset(s, g); }
    template <class E = float>
    const E* v_row(int64_t s, int64_t g) const { return static_cast<const E*>(v_pages) + row_offset(s, g); }
    int64_t row_offset(int64_t s, int64_t g) const {
        return ((block_table[s / page_size] * kv_heads + g) * page_size + s % page_size) * hd;
    }
    // kp[i], vp[i] = the key and value rows of position s0 + i of KV head g, i < count (one division
    // per page), in pages of E as for k_row.
    template <class E = float>
    void rows(int64_t s0, int64_t count, int64_t g, const E** kp, const E** vp) const {
        for (int64_t i = 0; i < count;) {
            const int64_t s = s0 + i, run = std::min(count - i, page_size - s % page_size), off = row_offset(s, g);
            for (int64_t k = 0; k < run; ++k, ++i) {
                kp[i] = static_cast<const E*>(k_pages) + off + k * hd;
                vp[i] = static_cast<const E*>(v_pages) + off + k * hd;
            }
        }
    }
    // k[i * hd, (i + 1) * hd), v likewise = the key and value of position s0 + i of KV head g as floats, i <
    // count: converted from halves (or copied from floats), one page's run at a time.
    void rows_to_floats(int64_t s0, int64_t count, int64_t g, float* k, float* v) const {
        for (int64_t i = 0; i < count;) {
            const int64_t s = s0 + i, run = std::min(count - i, page_size - s % page_size), off = row_offset(s, g);
            if (kv_half) {
                halves_to_floats(static_cast<const uint16_t*>(k_pages) + off, k + i * hd, run * hd);
                halves_to_floats(static_cast<const uint16_t*>(v_pages) + off, v + i * hd, run * hd);
            } else {
                std::copy_n(static_cast<const float*>(k_pages) + off, run * hd, k + i * hd);
                std::copy_n(static_cast<const float*>(v_pages) + off, run * hd, v + i * hd);
            }
            i += run;
        }
    }
    // Stores hd floats k, v at position s of KV head g (rounded to halves with kv_half).
    void store(int64_t s, int64_t g, const float* k, const float* v) const {
        const int64_t off = row_offset(s, g);
        if (kv_half) {
            floats_to_halves(k, static_cast<uint16_t*>(k_pages) + off, hd);
            floats_to_halves(v, static_cast<uint16_t*>(v_pages) + off, hd);
        } else {
            std::copy_n(k, hd, static_cast<float*>(k_pages) + off);
            std::copy_n(v, hd, static_cast<float*>(v_pages) + off);
        }
    }
};

// What paged_attention found wrong before touching anything (the caller explains it).
enum PagedStatus : int { kPagedOk = 0, kBadBlockTable = 1, kBadNodeBounds = 2 };

// Checks the block table entries in use (pages in [0, n_pages)) and, with mass, the node bounds
// (0 = b[0] < ... < b[n_nodes] = end); then stores k_new / v_new and runs the kernel for n.
int paged_attention(const PagedArgs& a);

// The two kernels (no checks, no writes); called by paged_attention.
void decode_attention(const PagedArgs& a);
void prefill_attention(const PagedArgs& a);

// The node holding key position s: the j with b[j] <= s < b[j + 1].
inline int64_t node_of(const int32_t* b, int64_t n_nodes, int64_t s) {
    int64_t lo = 0, hi = n_nodes;  // b[lo] <= s < b[hi]
    while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        (b[mid] <= s ? lo : hi) = mid;
    }
    return lo;
}

}  // namespace nodekv::ops
