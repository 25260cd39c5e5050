// Small fp32 CPU kernels for few-token forward steps (decode, speculative chunks): RMSNorm,
// RoPE and SwiGLU's silu(gate) * up (attention over the paged KV cache: paged_attention.h).
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

}  // namespace nodekv::ops
