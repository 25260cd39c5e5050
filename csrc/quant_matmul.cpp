// Quantised-weight matmul kernels; see quant_matmul.h for the formats and the contract.
//
// Decode (T == 1) is bound by the weight bytes read, so the T == 1 kernel reads every block
// once and does little arithmetic per block, with q' = q - 8 for the nibble formats:
//   y_n = sum_b d_b * (sum_i x_i q'_i) + m'_b * (sum_i x_i)     (m' = m + 8d for Q4_1, else 0)
// with the per-block sums of x computed once per call. For T > 1 each thread decodes a few
// weight rows to fp32 (once per row and chunk of tokens) into a scratch buffer and runs a
// register-blocked rows x tokens micro-kernel over it.
#include "quant_matmul.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_common.h"

namespace nodekv::quant {
namespace {

std::atomic<bool> g_force_scalar{false};

constexpr int kRowTile = 4;       // rows per inner-kernel step; thread work chunks are multiples of it
constexpr int kPrefetchRows = 8;  // one-token kernel: software prefetch distance in weight rows

bool use_avx2() { return cpu_has_avx2() && !g_force_scalar.load(std::memory_order_relaxed); }

inline uint16_t load_u16(const uint8_t* p) {
    uint16_t v;
    std::memcpy(&v, p, 2);
    return v;
}

// IEEE half -> float, exact for every input (subnormals, inf, nan included).
inline float half_to_float(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    const uint32_t mant = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        const float v = static_cast<float>(mant) * (1.0f / 16777216.0f);  // mant * 2^-24
        return sign ? -v : v;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// Per-format block description, shared by the scalar and AVX2 code.
struct Q4_0Fmt {
    static constexpr int64_t kBytes = 18;
    static constexpr int64_t kQsOffset = 2;
    static constexpr bool kHasMin = false;
};
struct Q4_1Fmt {
    static constexpr int64_t kBytes = 20;
    static constexpr int64_t kQsOffset = 4;
    static constexpr bool kHasMin = true;
};
struct Q8_0Fmt {
    static constexpr int64_t kBytes = 34;
    static constexpr int64_t kQsOffset = 2;
    static constexpr bool kHasMin = false;
};

// ---------------------------------------------------------------- scalar path

template <class F>
void decode_block_scalar(const uint8_t* blk, float* out) {
    const float d = half_to_float(load_u16(blk));
    if constexpr (std::is_same_v<F, Q8_0Fmt>) {
        const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
        for (int i = 0; i < 32; ++i) out[i] = d * static_cast<float>(q[i]);
    } else if constexpr (std::is_same_v<F, Q4_0Fmt>) {
        const uint8_t* q = blk + 2;
        for (int j = 0; j < 16; ++j) {
            out[j] = d * static_cast<float>(static_cast<int>(q[j] & 0x0f) - 8);
            out[j + 16] = d * static_cast<float>(static_cast<int>(q[j] >> 4) - 8);
        }
    } else {
        const float m = half_to_float(load_u16(blk + 2));
        const uint8_t* q = blk + 4;
        for (int j = 0; j < 16; ++j) {
            out[j] = d * static_cast<float>(q[j] & 0x0f) + m;
            out[j + 16] = d * static_cast<float>(q[j] >> 4) + m;
        }
    }
}

template <class F>
void decode_rows_scalar(const uint8_t* w, int64_t K, int64_t r0, int64_t r1, float* out) {
    const int64_t nb = K / kBlockSize, row_bytes = nb * F::kBytes;
    for (int64_t r = r0; r < r1; ++r)
        for (int64_t b = 0; b < nb; ++b)
            decode_block_scalar<F>(w + r * row_bytes + b * F::kBytes, out + (r - r0) * K + b * kBlockSize);
}

template <class F>
void matmul_rows_scalar(const float* x, int64_t T, int64_t K, const uint8_t* w, int64_t N,
                        const float* bias, float* y, int64_t r0, int64_t r1, float* row) {
    for (int64_t r = r0; r < r1; ++r) {
        decode_rows_scalar<F>(w, K, r, r + 1, row);
        for (int64_t t = 0; t < T; ++t) {
            const float* xt = x + t * K;
            float acc[8] = {};  // 8 interleaved partial sums, like the SIMD path: less rounding error
            for (int64_t k = 0; k < K; k += 8)
                for (int i = 0; i < 8; ++i) acc[i] += xt[k + i] * row[k + i];
            const float sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
            y[t * N + r] = sum + (bias ? bias[r] : 0.0f);
        }
    }
}

// ---------------------------------------------------------------- AVX2 path

// The 32 quants of a block as floats as stored (nibbles in 0..15, Q8_0 int8), in element
// order: q[0] = elements 0..7, q[1] = 8..15, q[2] = 16..23, q[3] = 24..31.
template <class F>
NKV_AVX2 inline void unpack_q(const uint8_t* blk, __m256 q[4]) {
    if constexpr (std::is_same_v<F, Q8_0Fmt>) {
        for (int i = 0; i < 4; ++i) {
            const __m128i b8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + F::kQsOffset + 8 * i));
            q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b8));
        }
    } else {
        // Nibble byte k goes to the low byte of dword k: low nibble = element k, high = k + 16.
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + F::kQsOffset));
        const __m256i bytes = _mm256_broadcastsi128_si256(raw);
        const __m256i b0 = _mm256_shuffle_epi8(
            bytes, _mm256_setr_epi32(0x80808000, 0x80808001, 0x80808002, 0x80808003, 0x80808004, 0x80808005,
                                     0x80808006, 0x80808007));
        const __m256i b1 = _mm256_shuffle_epi8(
            bytes, _mm256_setr_epi32(0x80808008, 0x80808009, 0x8080800a, 0x8080800b, 0x8080800c, 0x8080800d,
                                     0x8080800e, 0x8080800f));
        const __m256i lo_mask = _mm256_set1_epi32(0x0f);
        q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(b0, lo_mask));
        q[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b1, lo_mask));
        q[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));
        q[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
    }
}

// For the one-token kernel: nibbles as centered floats q - 8 (16 (q - 8) for the high nibbles),
// permuted so that each 128-bit lane covers 4 consecutive elements:
//   q[0] = elements 0..3, 8..11   q[1] = 4..7, 12..15   q[2] = 16..19, 24..27   q[3] = 20..23, 28..31
// prepare_x applies the same order to x once per call, with the factor 1/16 on q[2], q[3]'s
// positions. Centering matters for accuracy: with q in 0..15, d * sum(x q) and m * sum(x) are
// two large terms that cancel when sum(x) is large.
//
// No shifts or int->float conversions: each dword gets a nibble byte in its low byte and 0x4B
// in its top byte, so masking leaves the float 2^23 + q (low nibble) or 2^23 + 16 q (high
// nibble), and one exact subtraction gives q - 8 or 16 (q - 8).
template <class F>
NKV_AVX2 inline void unpack_q_gemv(const uint8_t* blk, __m256 q[4]) {
    if constexpr (std::is_same_v<F, Q8_0Fmt>) {
        unpack_q<F>(blk, q);
    } else {
        // Both 128-bit lanes hold the 16 nibble bytes; lane 0 reads bytes 0..7 and lane 1 bytes
        // 8..15, so the 0x4B bytes go where each lane does not read: lane 0's dword 3, lane 1's dword 0.
        const __m256i raw = _mm256_broadcastsi128_si256(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + F::kQsOffset)));
        const __m256i src = _mm256_blend_epi32(raw, _mm256_set1_epi32(0x4b4b4b4b), 0x18);
        const __m256i v0 = _mm256_shuffle_epi8(  // nibble bytes 0..3 | 8..11
            src, _mm256_setr_epi32(0x0f808000, 0x0f808001, 0x0f808002, 0x0f808003, 0x00808008, 0x00808009,
                                   0x0080800a, 0x0080800b));
        const __m256i v1 = _mm256_shuffle_epi8(  // nibble bytes 4..7 | 12..15
            src, _mm256_setr_epi32(0x0f808004, 0x0f808005, 0x0f808006, 0x0f808007, 0x0080800c, 0x0080800d,
                                   0x0080800e, 0x0080800f));
        const __m256i lo = _mm256_set1_epi32(static_cast<int>(0xff00000fu));
        const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xff0000f0u));
        const __m256 lo_bias = _mm256_set1_ps(8388616.0f);  // 2^23 + 8
        const __m256 hi_bias = _mm256_set1_ps(8388736.0f);  // 2^23 + 16 * 8
        q[0] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_and_si256(v0, lo)), lo_bias);
        q[1] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_and_si256(v1, lo)), lo_bias);
        q[2] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_and_si256(v0, hi)), hi_bias);
        q[3] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_and_si256(v1, hi)), hi_bias);
    }
}

// [d, m, 0, 0] of a block as stored (m = 0 for the formats without a min).
template <class F>
NKV_AVX2 inline __m128 load_dm(const uint8_t* blk) {
    if constexpr (F::kHasMin) {
        uint32_t dm;
        std::memcpy(&dm, blk, 4);
        return _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dm)));
    } else {
        return _mm_cvtph_ps(_mm_cvtsi32_si128(load_u16(blk)));
    }
}

template <class F>
NKV_AVX2 void decode_rows_avx2(const uint8_t* w, int64_t K, int64_t r0, int64_t r1, float* out) {
    const int64_t nb = K / kBlockSize, row_bytes = nb * F::kBytes;
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* wr = w + r * row_bytes;
        float* o = out + (r - r0) * K;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* blk = wr + b * F::kBytes;
            __m256 q[4];
            unpack_q<F>(blk, q);  // uncentered: the same roundings as ggml's dequantisation
            const __m128 dm = load_dm<F>(blk);
            const __m256 d = _mm256_broadcastss_ps(dm);
            for (int i = 0; i < 4; ++i) {
                __m256 v;
                if constexpr (std::is_same_v<F, Q4_1Fmt>)
                    v = _mm256_fmadd_ps(d, q[i], _mm256_broadcastss_ps(_mm_movehdup_ps(dm)));
                else if constexpr (std::is_same_v<F, Q4_0Fmt>)  // d * (q - 8): exact, as ggml
                    v = _mm256_mul_ps(d, _mm256_sub_ps(q[i], _mm256_set1_ps(8.0f)));
                else
                    v = _mm256_mul_ps(d, q[i]);
                _mm256_storeu_ps(o + b * kBlockSize + 8 * i, v);
            }
        }
    }
}

// T == 1: R rows at a time share the x loads and give R independent accumulator chains.
// Per block y += d * sum(x q') + m' * sum(x) with q' = q - 8 and, for Q4_1, m' = m + 8d;
// `x` is prepare_x's copy for the nibble formats. `sx8` holds {0, sx_b, 0, ..., 0} per block
// (sx_b = sum of x over block b), so the m' term is one FMA into lane 1 of the accumulator.
template <class F, int R>
NKV_AVX2 void gemv_rows(const float* x, const float* sx8, int64_t K, const uint8_t* w, int64_t N,
                        const float* bias, float* y, int64_t r0, int64_t r1) {
    const int64_t nb = K / kBlockSize, row_bytes = nb * F::kBytes;
    const __m256 eight = _mm256_setr_ps(0.0f, 8.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f);
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
            const float* xb = x + b * kBlockSize;
            if (prefetch) {
                constexpr int kLines = (R * F::kBytes + 63) / 64;
                for (int i = 0; i < kLines; ++i) _mm_prefetch(pf + b * R * F::kBytes + 64 * i, _MM_HINT_T0);
            }
            for (int j = 0; j < R; ++j) {
                const uint8_t* blk = wr + j * row_bytes + b * F::kBytes;
                __m256 q[4];
                unpack_q_gemv<F>(blk, q);
                __m256 a = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));
                a = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xb + 8), a);
                a = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xb + 16), a);
                a = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb + 24), a);
                const __m128 dm = load_dm<F>(blk);
                const __m256 d = _mm256_broadcastss_ps(dm);
                tot[j] = _mm256_fmadd_ps(d, a, tot[j]);
                if constexpr (F::kHasMin) {
                    // [., m + 8d, 0, ...]: m' before it meets the accumulator, where m and 8d
                    // would otherwise cancel (m + 8d is exact for all but extreme d/m ratios).
                    const __m256 mp = _mm256_fmadd_ps(d, eight, _mm256_zextps128_ps256(dm));
                    tot[j] = _mm256_fmadd_ps(mp, _mm256_loadu_ps(sx8 + 8 * b), tot[j]);
                }
            }
        }
        for (int j = 0; j < R; ++j) y[r + j] = hsum(tot[j]) + (bias ? bias[r + j] : 0.0f);
    }
}

template <class F>
NKV_AVX2 void gemv_range(const float* x, const float* sx8, int64_t K, const uint8_t* w, int64_t N,
                         const float* bias, float* y, int64_t r0, int64_t r1) {
    constexpr int R = kRowTile;
    const int64_t r_main = r0 + (r1 - r0) / R * R;
    gemv_rows<F, R>(x, sx8, K, w, N, bias, y, r0, r_main);
    gemv_rows<F, 1>(x, sx8, K, w, N, bias, y, r_main, r1);
}

// acc[j][t] += ws[j, :] . x[t, :] for R decoded rows and TT tokens, then y[t, j] = hsum + bias.
template <int R, int TT>
NKV_AVX2 void micro(const float* ws, const float* x, int64_t K, const float* bias, float* y,
                    int64_t ldy) {
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
NKV_AVX2 void micro_tokens(const float* ws, const float* x, int64_t T, int64_t K,
                           const float* bias, float* y, int64_t ldy) {
    // Up to 3 tokens per pass (R=4 x 3 -> 12 accumulators + 3 x + 1 w = 16 ymm registers);
    // a remainder of 4 goes as 2 + 2, since one token per pass is bound by loads, not FMAs.
    int64_t t = 0;
    for (; T - t >= 3 && T - t != 4; t += 3) micro<R, 3>(ws, x + t * K, K, bias, y + t * ldy, ldy);
    for (; T - t >= 2; t += 2) micro<R, 2>(ws, x + t * K, K, bias, y + t * ldy, ldy);
    if (T - t == 1) micro<R, 1>(ws, x + t * K, K, bias, y + t * ldy, ldy);
}

template <class F>
NKV_AVX2 void gemm_range(const float* x, int64_t T, int64_t K, const uint8_t* w, int64_t N,
                         const float* bias, float* y, int64_t r0, int64_t r1, float* ws) {
    constexpr int R = kRowTile;
    // Tokens per pass: keep the x chunk (TC x K fp32) around 256 KiB so it stays in L2 while
    // every row tile streams over it; rows are re-decoded once per chunk.
    const int64_t TC = std::max<int64_t>(12, (int64_t{1} << 16) / K);
    for (int64_t t0 = 0; t0 < T; t0 += TC) {
        const int64_t tn = std::min(TC, T - t0);
        const float* xc = x + t0 * K;
        float* yc = y + t0 * N;
        for (int64_t r = r0; r < r1; r += R) {
            const int64_t rn = std::min<int64_t>(R, r1 - r);
            decode_rows_avx2<F>(w, K, r, r + rn, ws);
            const float* br = bias ? bias + r : nullptr;
            switch (rn) {
                case 4: micro_tokens<4>(ws, xc, tn, K, br, yc + r, N); break;
                case 3: micro_tokens<3>(ws, xc, tn, K, br, yc + r, N); break;
                case 2: micro_tokens<2>(ws, xc, tn, K, br, yc + r, N); break;
                default: micro_tokens<1>(ws, xc, tn, K, br, yc + r, N); break;
            }
        }
    }
}

// One-token kernel inputs for the nibble formats: x in unpack_q_gemv's order per block, high-
// nibble positions scaled by 1/16 (exact), into xp; and {0, sx, 0, ..., 0} per block into sx8.
NKV_AVX2 void prepare_x(const float* x, int64_t K, float* xp, float* sx8) {
    const __m256 sixteenth = _mm256_set1_ps(0.0625f);
    for (int64_t b = 0; b < K / kBlockSize; ++b) {
        const float* xb = x + b * kBlockSize;
        float* o = xp + b * kBlockSize;
        const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8);
        const __m256 x2 = _mm256_loadu_ps(xb + 16), x3 = _mm256_loadu_ps(xb + 24);
        _mm256_storeu_ps(o, _mm256_permute2f128_ps(x0, x1, 0x20));  // elements 0..3, 8..11
        _mm256_storeu_ps(o + 8, _mm256_permute2f128_ps(x0, x1, 0x31));  // 4..7, 12..15
        _mm256_storeu_ps(o + 16, _mm256_mul_ps(_mm256_permute2f128_ps(x2, x3, 0x20), sixteenth));
        _mm256_storeu_ps(o + 24, _mm256_mul_ps(_mm256_permute2f128_ps(x2, x3, 0x31), sixteenth));
        const float sx = hsum(_mm256_add_ps(_mm256_add_ps(x0, x1), _mm256_add_ps(x2, x3)));
        _mm256_storeu_ps(sx8 + 8 * b, _mm256_setr_ps(0.0f, sx, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f));
    }
}

// ---------------------------------------------------------------- dispatch

int resolve_threads(int n_threads, int64_t work_bytes, int64_t rows) {
    int nt = n_threads > 0 ? n_threads : omp_get_max_threads();
    // Below ~64 KiB of weights a fork/join costs more than it saves.
    if (work_bytes < (int64_t{1} << 16)) nt = 1;
    return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(nt, rows)));
}

// Rows are handed out in contiguous chunks, about 8 per thread, claimed dynamically: a thread
// slowed by a busy core or a cold cache does not hold up the others. Each chunk still streams
// tens of KiB of consecutive weight rows, which is what the hardware prefetcher wants.
template <class Fn>
void parallel_rows(int64_t N, int64_t align, int nt, Fn&& fn) {
    nt = par::threads_after_guard(nt);
    if (nt <= 1) {
        fn(int64_t{0}, N, 0);
        return;
    }
    const int64_t units = (N + align - 1) / align;
    const int64_t per_chunk = std::max<int64_t>(1, units / (int64_t{8} * nt));
    const int64_t n_chunks = (units + per_chunk - 1) / per_chunk;
    par::run_team(n_chunks, nt, [&](int64_t c, int tid) {
        fn(c * per_chunk * align, std::min(N, (c + 1) * per_chunk * align), tid);
    });
}

template <class F>
void matmul_typed(const float* x, int64_t T, int64_t K, const uint8_t* w, int64_t N,
                  const float* bias, float* y, int n_threads) {
    const bool avx2 = use_avx2();
    const int nt = resolve_threads(n_threads, N * (K / kBlockSize) * F::kBytes * T, N);
    if (avx2 && T == 1) {
        const float* xk = x;
        const float* sx8 = nullptr;
        if constexpr (!std::is_same_v<F, Q8_0Fmt>) {
            // Reused across calls: a decode step makes ~100 of them.
            thread_local std::vector<float> xp, sx;
            xp.resize(static_cast<size_t>(K));
            sx.resize(static_cast<size_t>(K / kBlockSize * 8));
            prepare_x(x, K, xp.data(), sx.data());
            xk = xp.data();
            sx8 = sx.data();
        }
        parallel_rows(N, kRowTile, nt, [&](int64_t r0, int64_t r1, int) {
            gemv_range<F>(xk, sx8, K, w, N, bias, y, r0, r1);
        });
        return;
    }
    // Per-thread fp32 scratch for decoded rows.
    const int64_t scratch_rows = avx2 ? kRowTile : 1;
    std::vector<float> scratch(static_cast<size_t>(nt * scratch_rows * K));
    parallel_rows(N, kRowTile, nt, [&](int64_t r0, int64_t r1, int tid) {
        float* ws = scratch.data() + tid * scratch_rows * K;
        if (avx2)
            gemm_range<F>(x, T, K, w, N, bias, y, r0, r1, ws);
        else
            matmul_rows_scalar<F>(x, T, K, w, N, bias, y, r0, r1, ws);
    });
}

template <class F>
void dequantize_typed(const uint8_t* w, int64_t N, int64_t K, float* out, int n_threads) {
    const bool avx2 = use_avx2();
    const int nt = resolve_threads(n_threads, N * (K / kBlockSize) * F::kBytes, N);
    parallel_rows(N, 1, nt, [&](int64_t r0, int64_t r1, int) {
        if (avx2)
            decode_rows_avx2<F>(w, K, r0, r1, out + r0 * K);
        else
            decode_rows_scalar<F>(w, K, r0, r1, out + r0 * K);
    });
}

void check_k(int64_t K) {
    if (K <= 0 || K % kBlockSize != 0)
        throw std::invalid_argument("quant: in_features must be a positive multiple of 32, got " +
                                    std::to_string(K));
}

}  // namespace

QType qtype_from_id(int id) {
    switch (id) {
        case static_cast<int>(QType::Q4_0): return QType::Q4_0;
        case static_cast<int>(QType::Q4_1): return QType::Q4_1;
        case static_cast<int>(QType::Q8_0): return QType::Q8_0;
    }
    throw std::invalid_argument("quant: unsupported ggml type id " + std::to_string(id) +
                                " (supported: Q4_0=2, Q4_1=3, Q8_0=8)");
}

int64_t block_bytes(QType qt) {
    switch (qt) {
        case QType::Q4_0: return Q4_0Fmt::kBytes;
        case QType::Q4_1: return Q4_1Fmt::kBytes;
        case QType::Q8_0: return Q8_0Fmt::kBytes;
    }
    throw std::invalid_argument("quant: bad QType");
}

void matmul(const float* x, int64_t T, int64_t K, const uint8_t* w, int64_t N, QType qt,
            const float* bias, float* y, int n_threads) {
    check_k(K);
    if (T <= 0 || N <= 0) return;
    switch (qt) {
        case QType::Q4_0: return matmul_typed<Q4_0Fmt>(x, T, K, w, N, bias, y, n_threads);
        case QType::Q4_1: return matmul_typed<Q4_1Fmt>(x, T, K, w, N, bias, y, n_threads);
        case QType::Q8_0: return matmul_typed<Q8_0Fmt>(x, T, K, w, N, bias, y, n_threads);
    }
}

void dequantize(const uint8_t* w, int64_t N, int64_t K, QType qt, float* out, int n_threads) {
    check_k(K);
    if (N <= 0) return;
    switch (qt) {
        case QType::Q4_0: return dequantize_typed<Q4_0Fmt>(w, N, K, out, n_threads);
        case QType::Q4_1: return dequantize_typed<Q4_1Fmt>(w, N, K, out, n_threads);
        case QType::Q8_0: return dequantize_typed<Q8_0Fmt>(w, N, K, out, n_threads);
    }
}

const char* active_isa() { return use_avx2() ? "avx2" : "scalar"; }

void set_force_scalar(bool on) { g_force_scalar.store(on, std::memory_order_relaxed); }

}  // namespace nodekv::quant
