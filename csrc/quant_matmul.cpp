// Quantised-weight matmul drivers, templates over the formats of quant_formats.h; see quant_matmul.h for
// the contract.
//
// T == 1 (decode) is bound by the weight bytes read: each thread runs rows of blocks through the format's
// dot against a copy of x prepared once per call (per type), R rows at a time so that they share the x
// loads and give R independent accumulator chains. T > 1: each thread decodes a few weight rows to fp32
// (once per row and chunk of tokens) into a scratch buffer and runs a register-blocked rows x tokens
// micro-kernel over it. The scalar path decodes a row at a time and takes plain dot products.
#include "quant_matmul.h"

#include <algorithm>
#include <atomic>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_common.h"
#include "quant_formats.h"

namespace nodekv::quant {
namespace {

using formats::visit;

std::atomic<bool> g_force_scalar{false};

constexpr int kRowTile = 4;       // rows per inner-kernel step; thread work chunks are multiples of it
constexpr int kPrefetchRows = 8;  // one-token kernel: software prefetch distance in weight rows

bool use_avx2() { return cpu_has_avx2() && !g_force_scalar.load(std::memory_order_relaxed); }

// ---------------------------------------------------------------- scalar path

template <class F>
void decode_rows_scalar(const uint8_t* w, int64_t K, int64_t r0, int64_t r1, float* out) {
    const int64_t nb = K / F::kElems, row_bytes = nb * F::kBytes;
    for (int64_t r = r0; r < r1; ++r)
        for (int64_t b = 0; b < nb; ++b)
            F::decode(w + r * row_bytes + b * F::kBytes, out + (r - r0) * K + b * F::kElems);
}

template <class F>
void matmul_rows_scalar(const float* x, int64_t T, int64_t K, const uint8_t* w, const float* bias, float* y,
                        int64_t ldy, int64_t r0, int64_t r1, float* row) {
    for (int64_t r = r0; r < r1; ++r) {
        decode_rows_scalar<F>(w, K, r, r + 1, row);
        for (int64_t t = 0; t < T; ++t) {
            const float* xt = x + t * K;
            float acc[8] = {};  // 8 interleaved partial sums, like the SIMD path: less rounding error
            for (int64_t k = 0; k < K; k += 8)
                for (int i = 0; i < 8; ++i) acc[i] += xt[k + i] * row[k + i];
            const float sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
            y[t * ldy + r] = sum + (bias ? bias[r] : 0.0f);
        }
    }
}

// ---------------------------------------------------------------- AVX2 path

template <class F>
NKV_AVX2 void decode_rows_avx2(const uint8_t* w, int64_t K, int64_t r0, int64_t r1, float* out) {
    const int64_t nb = K / F::kElems, row_bytes = nb * F::kBytes;
    for (int64_t r = r0; r < r1; ++r)
        for (int64_t b = 0; b < nb; ++b)
            F::decode_avx2(w + r * row_bytes + b * F::kBytes, out + (r - r0) * K + b * F::kElems);
}

template <class F>
NKV_AVX2 void prepare_x(const float* x, int64_t K, float* xp) {
    for (int64_t b = 0; b < K / F::kElems; ++b) F::prepare(x + b * F::kElems, xp + b * F::kPrep);
}

// T == 1 over rows [r0, r1) of an N-row weight, R rows at a time; xp is prepare_x's copy of x.
template <class F, int R>
NKV_AVX2 void gemv_rows(const float* xp, int64_t K, const uint8_t* w, int64_t N, const float* bias, float* y,
                        int64_t r0, int64_t r1) {
    const int64_t nb = K / F::kElems, row_bytes = nb * F::kBytes;
    for (int64_t r = r0; r < r1; r += R) {
        __m256 tot[R];
        for (int j = 0; j < R; ++j) tot[j] = _mm256_setzero_ps();
        const uint8_t* wr = w + r * row_bytes;
        // Software prefetch of the rows kPrefetchRows ahead, walked linearly: the rows of a group
        // are contiguous and each block step covers R * kBytes more of them. The hardware
        // prefetcher alone leaves decode at about half the DRAM bandwidth.
        const bool prefetch = r + kPrefetchRows + R <= N;
        const char* pf = reinterpret_cast<const char*>(prefetch ? wr + kPrefetchRows * row_bytes : wr);
        for (int64_t b = 0; b < nb; ++b) {
            if (prefetch) {
                constexpr int kLines = (R * F::kBytes + 63) / 64;
                for (int i = 0; i < kLines; ++i) _mm_prefetch(pf + b * R * F::kBytes + 64 * i, _MM_HINT_T0);
            }
            const float* xb = xp + b * F::kPrep;
            for (int j = 0; j < R; ++j) tot[j] = F::dot(wr + j * row_bytes + b * F::kBytes, xb, tot[j]);
        }
        for (int j = 0; j < R; ++j) y[r + j] = hsum(tot[j]) + (bias ? bias[r + j] : 0.0f);
    }
}

template <class F>
NKV_AVX2 void gemv_range(const float* xp, int64_t K, const uint8_t* w, int64_t N, const float* bias, float* y,
                         int64_t r0, int64_t r1) {
    // Rows share a block's x loads while its x fits in registers (32-element blocks). A K-quant super-block's
    // does not: the compiler would hoist and spill it, and one row at a time measured 15-20% faster.
    constexpr int R = F::kPrep <= 64 ? kRowTile : 1;
    const int64_t r_main = r0 + (r1 - r0) / R * R;
    gemv_rows<F, R>(xp, K, w, N, bias, y, r0, r_main);
    gemv_rows<F, 1>(xp, K, w, N, bias, y, r_main, r1);
}

// acc[j][t] += ws[j, :] . x[t, :] for R decoded rows and TT tokens, then y[t, j] = hsum + bias.
template <int R, int TT>
NKV_AVX2 void micro(const float* ws, const float* x, int64_t K, const float* bias, float* y, int64_t ldy) {
    __m256 acc[R][TT];
    for (int j = 0; j < R; ++j)
        for (int t = 0; t < TT; ++t) acc[j][t] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        __m256 xv[TT];
        for (int t = 0; t < TT; ++t) xv[t] = _mm256_loadu_ps(x + t * K + k);
        for (int j = 0; j < R; ++j) {
            const __m256 wv = _mm256_loadu_ps(ws + j * K + k);
            for (int t = 0; t < TT; ++t) acc[j][t] = _mm256_fmadd_ps(wv, xv[t], acc[j][t]);
        }
    }
    for (int j = 0; j < R; ++j)
        for (int t = 0; t < TT; ++t) y[t * ldy + j] = hsum(acc[j][t]) + (bias ? bias[j] : 0.0f);
}

template <int R>
NKV_AVX2 void micro_tokens(const float* ws, const float* x, int64_t T, int64_t K, const float* bias, float* y,
                           int64_t ldy) {
    // Up to 3 tokens per pass (R=4 x 3 -> 12 accumulators + 3 x + 1 w = 16 ymm registers);
    // a remainder of 4 goes as 2 + 2, since one token per pass is bound by loads, not FMAs.
    int64_t t = 0;
    for (; T - t >= 3 && T - t != 4; t += 3) micro<R, 3>(ws, x + t * K, K, bias, y + t * ldy, ldy);
    for (; T - t >= 2; t += 2) micro<R, 2>(ws, x + t * K, K, bias, y + t * ldy, ldy);
    if (T - t == 1) micro<R, 1>(ws, x + t * K, K, bias, y + t * ldy, ldy);
}

template <class F>
NKV_AVX2 void gemm_range(const float* x, int64_t T, int64_t K, const uint8_t* w, const float* bias, float* y,
                         int64_t ldy, int64_t r0, int64_t r1, float* ws) {
    constexpr int R = kRowTile;
    // Tokens per pass: keep the x chunk (TC x K fp32) around 256 KiB so it stays in L2 while
    // every row tile streams over it; rows are re-decoded once per chunk.
    const int64_t TC = std::max<int64_t>(12, (int64_t{1} << 16) / K);
    for (int64_t t0 = 0; t0 < T; t0 += TC) {
        const int64_t tn = std::min(TC, T - t0);
        const float* xc = x + t0 * K;
        float* yc = y + t0 * ldy;
        for (int64_t r = r0; r < r1; r += R) {
            const int64_t rn = std::min<int64_t>(R, r1 - r);
            decode_rows_avx2<F>(w, K, r, r + rn, ws);
            const float* br = bias ? bias + r : nullptr;
            switch (rn) {
                case 4: micro_tokens<4>(ws, xc, tn, K, br, yc + r, ldy); break;
                case 3: micro_tokens<3>(ws, xc, tn, K, br, yc + r, ldy); break;
                case 2: micro_tokens<2>(ws, xc, tn, K, br, yc + r, ldy); break;
                default: micro_tokens<1>(ws, xc, tn, K, br, yc + r, ldy); break;
            }
        }
    }
}

// ---------------------------------------------------------------- dispatch

int resolve_threads(int n_threads, int64_t work_bytes, int64_t rows) {
    int nt = n_threads > 0 ? n_threads : omp_get_max_threads();
    // Below ~64 KiB of weights a fork/join costs more than it saves.
    if (work_bytes < (int64_t{1} << 16)) nt = 1;
    return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(nt, rows)));
}

// fn(segment, r0, r1, tid) over every segment's rows. They are handed out in contiguous chunks (multiples
// of kRowTile, within one segment), about 8 per thread, claimed dynamically: a thread slowed by a busy core
// or a cold cache does not hold up the others, and the whole weight is one parallel region. Each chunk
// still streams tens of KiB of consecutive weight rows, which is what the hardware prefetcher wants.
template <class Fn>
void parallel_segments(const Segment* segs, int n_segs, int nt, Fn&& fn) {
    nt = par::threads_after_guard(nt);
    if (nt <= 1) {
        for (int s = 0; s < n_segs; ++s) fn(s, int64_t{0}, segs[s].rows, 0);
        return;
    }
    int64_t tiles = 0;
    for (int s = 0; s < n_segs; ++s) tiles += (segs[s].rows + kRowTile - 1) / kRowTile;
    const int64_t chunk_rows = std::max<int64_t>(1, tiles / (int64_t{8} * nt)) * kRowTile;
    struct Chunk {
        int seg;
        int64_t r0, r1;
    };
    // Reused across calls (a decode step makes ~100); named by reference, since in the team's other threads the
    // name of a thread_local means their own instance.
    thread_local std::vector<Chunk> reused;
    std::vector<Chunk>& chunks = reused;
    chunks.clear();
    for (int s = 0; s < n_segs; ++s)
        for (int64_t r = 0; r < segs[s].rows; r += chunk_rows)
            chunks.push_back({s, r, std::min(segs[s].rows, r + chunk_rows)});
    par::run_team(static_cast<int64_t>(chunks.size()), nt, [&](int64_t c, int tid) {
        const Chunk& ch = chunks[static_cast<size_t>(c)];
        fn(ch.seg, ch.r0, ch.r1, tid);
    });
}

void check_k(QType qt, int64_t K) {
    const int64_t elems = block_elems(qt);
    if (K <= 0 || K % elems != 0)
        throw std::invalid_argument("quant: in_features must be a positive multiple of " + std::to_string(elems) +
                                    " for ggml type " + std::to_string(static_cast<int>(qt)) + ", got " +
                                    std::to_string(K));
}

}  // namespace

QType qtype_from_id(int id) {
    for (QType qt : {QType::Q4_0, QType::Q4_1, QType::Q5_0, QType::Q8_0, QType::Q4_K, QType::Q6_K})
        if (static_cast<int>(qt) == id) return qt;
    throw std::invalid_argument("quant: unsupported ggml type id " + std::to_string(id) +
                                " (supported: Q4_0=2, Q4_1=3, Q5_0=6, Q8_0=8, Q4_K=12, Q6_K=14)");
}

int64_t block_elems(QType qt) {
    return visit(qt, [](auto f) { return decltype(f)::kElems; });
}

int64_t block_bytes(QType qt) {
    return visit(qt, [](auto f) { return decltype(f)::kBytes; });
}

int64_t row_bytes(QType qt, int64_t K) {
    check_k(qt, K);
    return K / block_elems(qt) * block_bytes(qt);
}

void matmul(const float* x, int64_t T, int64_t K, const Segment* segs, int n_segs, const float* bias, float* y,
            int n_threads) {
    int64_t N = 0, bytes = 0;
    for (int s = 0; s < n_segs; ++s) {
        bytes += segs[s].rows * row_bytes(segs[s].qt, K);
        N += segs[s].rows;
    }
    if (T <= 0 || N <= 0) return;
    const bool avx2 = use_avx2();
    const int nt = resolve_threads(n_threads, bytes * T, N);
    std::vector<int64_t> row0(static_cast<size_t>(n_segs), 0);  // the first row of each segment in y and bias
    for (int s = 1; s < n_segs; ++s) row0[s] = row0[s - 1] + segs[s - 1].rows;
    const auto bias_of = [&](int s) { return bias ? bias + row0[s] : nullptr; };
    if (avx2 && T == 1) {
        // x prepared once per call for each type among the segments (reused across calls)
        thread_local std::vector<std::vector<float>> prepared;
        prepared.resize(std::max<size_t>(prepared.size(), static_cast<size_t>(n_segs)));
        std::vector<const float*> xp(static_cast<size_t>(n_segs));
        for (int s = 0; s < n_segs; ++s) {
            int first = 0;  // the first segment of this type
            while (segs[first].qt != segs[s].qt) ++first;
            if (first < s) {
                xp[s] = xp[first];
                continue;
            }
            visit(segs[s].qt, [&](auto f) {
                using F = decltype(f);
                std::vector<float>& buf = prepared[static_cast<size_t>(s)];
                buf.resize(static_cast<size_t>(K / F::kElems * F::kPrep));
                prepare_x<F>(x, K, buf.data());
                xp[s] = buf.data();
            });
        }
        parallel_segments(segs, n_segs, nt, [&](int s, int64_t r0, int64_t r1, int) {
            const Segment& g = segs[s];
            visit(g.qt, [&](auto f) {
                gemv_range<decltype(f)>(xp[s], K, g.w, g.rows, bias_of(s), y + row0[s], r0, r1);
            });
        });
        return;
    }
    // Per-thread fp32 scratch for decoded rows.
    const int64_t scratch_rows = avx2 ? kRowTile : 1;
    std::vector<float> scratch(static_cast<size_t>(nt * scratch_rows * K));
    parallel_segments(segs, n_segs, nt, [&](int s, int64_t r0, int64_t r1, int tid) {
        const Segment& g = segs[s];
        float* ws = scratch.data() + tid * scratch_rows * K;
        visit(g.qt, [&](auto f) {
            using F = decltype(f);
            if (avx2)
                gemm_range<F>(x, T, K, g.w, bias_of(s), y + row0[s], N, r0, r1, ws);
            else
                matmul_rows_scalar<F>(x, T, K, g.w, bias_of(s), y + row0[s], N, r0, r1, ws);
        });
    });
}

void dequantize(const uint8_t* w, int64_t N, int64_t K, QType qt, float* out, int n_threads) {
    const Segment seg{w, qt, N};
    const int64_t bytes = N * row_bytes(qt, K);
    if (N <= 0) return;
    const bool avx2 = use_avx2();
    const int nt = resolve_threads(n_threads, bytes, N);
    parallel_segments(&seg, 1, nt, [&](int, int64_t r0, int64_t r1, int) {
        visit(qt, [&](auto f) {
            using F = decltype(f);
            if (avx2)
                decode_rows_avx2<F>(w, K, r0, r1, out + r0 * K);
            else
                decode_rows_scalar<F>(w, K, r0, r1, out + r0 * K);
        });
    });
}

const char* active_isa() { return use_avx2() ? "avx2" : "scalar"; }

void set_force_scalar(bool on) { g_force_scalar.store(on, std::memory_order_relaxed); }

}  // namespace nodekv::quant
