// Small fp32 CPU kernels for few-token forward steps (decode, speculative chunks): RMSNorm,
// RoPE, SwiGLU's silu(gate) * up, and causal GQA attention over a contiguous KV cache.
//
// At one token these ops move a few KiB each, so what they replace is mostly per-op framework
// overhead: one call here does what took 2-6 torch ops. All pointers are fp32, rows
// contiguous (strides are in elements); the callers (kernels/cpu_ops.py) validate shapes.
// An AVX2/FMA path is chosen at run time where the CPU has it, else a scalar one runs.
#pragma once

#include <cstdint>

namespace nodekv::ops {

// y[t, :] = x[t, :] / sqrt(mean(x[t, :]^2) + eps) * w, for t < T, rows of d floats.
// y may alias x. Single-threaded.
void rms_norm(const float* x, int64_t T, int64_t d, const float* w, float eps, float* y);

// x[t, :] += delta[t, :] in place, then y = rms_norm(x): the residual add fused with the norm
// that follows it. y may alias delta but not x.
void add_rms_norm(float* x, const float* delta, int64_t T, int64_t d, const float* w, float eps, float* y);

// In-place rotate-half RoPE on x[t, h, :] = x + t * stride_t + h * stride_h (hd contiguous
// floats, hd even), for t < T, h < n_heads:
//   x[i] <- x[i] * cos[t, i] + x[(i + hd/2) % hd] * sin_signed[t, i]
// with cos, sin_signed [T, hd] contiguous, sin_signed = [-sin, sin] per row. Evaluated as
// separate fp32 products and a sum (no FMA): bit-identical to the torch expression
// x * cos + x.roll(hd/2, -1) * sin_signed.
void rope(float* x, int64_t T, int64_t n_heads, int64_t hd, int64_t stride_t, int64_t stride_h,
          const float* cos, const float* sin_signed);

// y[t, i] = silu(gu[t, i]) * gu[t, I + i] for i < I (gate and up halves of a fused projection),
// silu(g) = g / (1 + exp(-g)). gu [T, 2I], y [T, I]. Single-threaded.
void silu_mul(const float* gu, int64_t T, int64_t I, float* y);

// Causal grouped-query attention of T new tokens at positions start .. start+T-1.
//
// Cache of one layer: key of KV head g at position s at k_cache + g * capacity * hd + s * hd
// (likewise v_cache), i.e. a [kv_heads, capacity, hd] block. Query head h uses KV head
// h / (H / kv_heads); query token t sees positions [0, start + t]; scale 1/sqrt(hd).
// If k_new != nullptr, k_new[t, g, :] and v_new[t, g, :] are first written to positions
// start + t of the cache. out[t, h * hd + i], [T, H * hd] contiguous.
//
// Positions are split in fixed chunks of 128 whose partial results are merged by log-sum-exp;
// within a chunk the softmax runs online over blocks that stay in L1. The chunks of all KV
// heads are shared among up to n_threads threads when the work is large enough; the split does
// not depend on the thread count, so neither do the results. Scratch: hd + 2 floats per query
// row and chunk (150 KB for one SmolLM2 token at 8192 positions). Scores are fp32 and
// max-subtracted, sums accumulate in fp32.
struct AttentionArgs {
    const float* q;  // q[t, h, :] at q + t * q_stride_t + h * q_stride_h
    int64_t q_stride_t, q_stride_h;
    float* k_cache;
    float* v_cache;
    int64_t capacity;
    const float* k_new;  // nullptr: the cache already holds positions start .. start+T-1
    const float* v_new;
    int64_t k_new_stride_t, k_new_stride_h, v_new_stride_t, v_new_stride_h;
    int64_t T, H, kv_heads, hd, start;
    float* out;
    int n_threads;  // <= 0: omp_get_max_threads()
};
void decode_attention(const AttentionArgs& a);

// "avx2" or "scalar": the path these kernels take now.
const char* active_isa();

// Whether the AVX2 path is taken now (the CPU has it and set_force_scalar is off); shared with
// prefill_attention.
bool avx2_active();

// Testing hook: force the scalar kernels even where AVX2 is available.
void set_force_scalar(bool on);

}  // namespace nodekv::ops
