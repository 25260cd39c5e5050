// Quantised-weight matmul drivers, templates over the formats of quant_formats.h; see quant_matmul.h for
// the contract.
//
// Every (row, token) output is one accumulator that runs the format's dot over the row's blocks in order and ends as
// hsum + bias, computed the same way whatever the number of tokens, the chunking or the thread: a token's outputs are
// bit for bit those it gets alone, so a batch of decode steps reproduces sequential ones. One token (decode) is bound
// by the weight bytes and the instructions to unpack them: each block is read once, R rows at a time so that the rows
// share the x loads. More tokens are bound by FMAs: each block is unpacked once per pass of up to kTokens tokens and
// FMAed into all of their accumulators. With AVX-512, from kPairsMinTokens on, two tokens per 512-bit FMA (Pairs);
// below, the K-quants' two rows per 512-bit register (row pairs: one instruction unpacks both rows' blocks; on a
// Cascade Lake Xeon, qwen2.5-1.5b's matmuls of 1 to 7 tokens 1.2-1.5x faster than AVX2's); each lane's arithmetic the
// AVX2 one's. x is prepared once per call (per type). The scalar path decodes a row at a time and takes plain dot
// products, also per token.
#include "quant_matmul.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_common.h"
#include "quant_formats.h"
#define NKV_FORMATS_512
#include "quant_formats.h"  // again, built for AVX-512: namespace formats512
#undef NKV_FORMATS_512

namespace nodekv::quant {
namespace {

using formats::visit;

template <class F>
struct Int8;

// visit for the drivers: fn(F{}) on the exact path, fn(Int8<F>{}) on the int8 one.
template <class Fn>
decltype(auto) visit(QType qt, bool int8, Fn&& fn) {
    return visit(qt, [&](auto f) {
        using F = decltype(f);
        return int8 ? fn(Int8<F>{}) : fn(F{});
    });
}

constexpr int kRowTile = 4;  // rows per one-token kernel step; thread work chunks are multiples of it
// Tokens per pass of the several-token kernel: a block's 4 unpacked vectors, its scale, a partial sum and 8
// accumulators fill the 16 ymm registers (fewer passes of more tokens, or more of fewer, measured slower; the
// K-quants' accumulators spill a little at 8 and still beat 4 to 6).
constexpr int kTokens = 8;
constexpr int64_t kCallTokens = 64;      // tokens per run of the kernels (matmul splits longer inputs)
constexpr int kSweepRows = 8;            // rows per sweep over a chunk of K (matmul_range); the prefetch distance
constexpr int64_t kXChunkFloats = 4096;  // a sweep's chunk of prepared x (16 KiB) stays in the 32 KiB L1 cache
// Tokens from which the exact path runs them in pairs on AVX-512 (Pairs): the same bits either way, but each block's
// unpacked weights are first copied into both halves of 512-bit registers, which fewer tokens do not repay (on a
// Xeon with 512-bit FMA units, qwen2.5-1.5b's Q4_K and Q6_K projections: 0.8-0.9x AVX2 at 2 tokens, 1.0x at 4,
// 1.15-1.6x at 8 to 32). Fewer tokens take row pairs, where the format has them.
constexpr int64_t kPairsMinTokens = 8;

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

// The int8 path (Precision::kInt8): x quantised per block (formats::XQ32 / XQ256), each row's integer dots summed
// over its blocks in order, per token.
template <class F>
void matmul_rows_scalar_int8(const typename F::XQ* xq, int64_t T, int64_t K, const uint8_t* w, const float* bias,
                             float* y, int64_t ldy, int64_t r0, int64_t r1) {
    const int64_t nb = K / F::kElems, row_bytes = nb * F::kBytes;
    for (int64_t r = r0; r < r1; ++r)
        for (int64_t t = 0; t < T; ++t) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; ++b) acc += F::dot_i8_scalar(w + r * row_bytes + b * F::kBytes, xq[t * nb + b]);
            y[t * ldy + r] = acc + (bias ? bias[r] : 0.0f);
        }
}

// ---------------------------------------------------------------- AVX2 path

// A format's int8 path as a format for the drivers below: its prepared x is the quantised blocks (kPrep floats'
// room each, never read as floats) and its dot the integer one.
template <class F>
struct Int8 {
    using XQ = typename F::XQ;
    static_assert(XQ::kElems == F::kElems && sizeof(XQ) % sizeof(float) == 0, "one quantised x block per block");
    static constexpr QType kType = F::kType;
    static constexpr int64_t kElems = F::kElems, kBytes = F::kBytes, kPrep = sizeof(XQ) / sizeof(float);
    NKV_AVX2 static void prepare(const float* x, float* xp) { formats::quantize_avx2(x, reinterpret_cast<XQ*>(xp)); }
    template <int TT>
    NKV_AVX2 static void dot(const uint8_t* blk, const float* xp, int64_t ldx, __m256* acc) {
        F::template dot_i8<TT>(blk, reinterpret_cast<const XQ*>(xp), ldx / kPrep, acc);
    }
};

// Int8<F> with the format's VNNI dot where it has one (the same bits, tested): the drivers in namespace avx512 run it.
// (The detection names a call, not &F::dot_i8_vnni: a pointer to a function with a target attribute as a template
// argument drops the attribute, and GCC warns.)
template <class F, class = void>
struct Int8Vnni : Int8<F> {
    static constexpr bool kVnni = false;
};
template <class F>
struct Int8Vnni<F, std::void_t<decltype(F::template dot_i8_vnni<1>(nullptr, nullptr, 0, nullptr))>> : Int8<F> {
    static constexpr bool kVnni = true;
    template <int TT>
    NKV_AVX512 static void dot(const uint8_t* blk, const float* xp, int64_t ldx, __m256* acc) {
        F::template dot_i8_vnni<TT>(blk, reinterpret_cast<const typename F::XQ*>(xp), ldx / Int8<F>::kPrep, acc);
    }
};
static_assert(Int8Vnni<formats::Q8_0>::kVnni && Int8Vnni<formats::Q5_0>::kVnni && Int8Vnni<formats::Q4_0>::kVnni &&
                  Int8Vnni<formats::Q4_K>::kVnni && !Int8Vnni<formats::Q6_K>::kVnni,
              "the VNNI dots are found where the formats define them");

// A format's exact path over token pairs (formats512::PairX) as a format for the drivers: its prepared x is a pair
// block per block (kPrep twice the format's), and its dot runs the 512-bit FMAs of two tokens at once, each lane's
// arithmetic the one-token dot's (the same bits, tested). On cores with 512-bit FMA units a several-token step then
// issues half the FMAs; fewer tokens are bound by unpacking the weights, not FMAs (row pairs, below).
template <class F>
struct Pairs {
    static constexpr QType kType = F::kType;
    static constexpr int64_t kElems = F::kElems, kBytes = F::kBytes, kPrep = 2 * F::kPrep;
    static constexpr int kTokensPerX = 2;  // and __m512 accumulators, one per two tokens (AccOf)
    static_assert(F::kPrep % 8 == 0, "PairX interleaves x in runs of 8 floats");
    template <int TT>
    NKV_AVX512 static void dot(const uint8_t* blk, const float* xp, int64_t ldx, __m512* acc) {
        F::template dot<TT>(blk, formats512::PairX{xp}, ldx, acc);
    }
};

// A driver format's accumulator type and tokens per accumulator and per prepared x row: __m256 and 1, or for Pairs
// (the formats with kTokensPerX) __m512 and 2. (Detected by an int member: a vector type as a template argument
// loses its alignment attribute, which GCC warns of.)
template <class F, class = void>
struct AccOf {
    using type = __m256;
    static constexpr int kTokens = 1;
};
template <class F>
struct AccOf<F, std::void_t<decltype(F::kTokensPerX)>> {
    using type = __m512;
    static constexpr int kTokens = F::kTokensPerX;
};

// Token t's sum from its row's accumulators a.
NKV_AVX2 inline float token_sum(const __m256* a, int t) { return hsum(a[t]); }
NKV_AVX512 inline float token_sum(const __m512* a, int t) {
    return hsum(t % 2 ? _mm512_extractf32x8_ps(a[t / 2], 1) : _mm512_castps512_ps256(a[t / 2]));
}

template <class F>
NKV_AVX2 void decode_rows_avx2(const uint8_t* w, int64_t K, int64_t r0, int64_t r1, float* out) {
    const int64_t nb = K / F::kElems, row_bytes = nb * F::kBytes;
    for (int64_t r = r0; r < r1; ++r)
        for (int64_t b = 0; b < nb; ++b)
            F::decode_avx2(w + r * row_bytes + b * F::kBytes, out + (r - r0) * K + b * F::kElems);
}

// xp[t] = the format's prepared copy of x[t], for T tokens of ldx = K / kElems * kPrep floats each.
template <class F>
NKV_AVX2 void prepare_x(const float* x, int64_t T, int64_t K, float* xp) {
    const int64_t nb = K / F::kElems;
    for (int64_t t = 0; t < T; ++t)
        for (int64_t b = 0; b < nb; ++b) F::prepare(x + t * K + b * F::kElems, xp + (t * nb + b) * F::kPrep);
}

// xp[p] = tokens 2p and 2p + 1 of x in Pairs<F>'s layout (formats512::PairX), p < ceil(T / 2); an odd T's last
// block has zeros where a second token would be.
template <class F>
NKV_AVX2 void prepare_x_pairs(const float* x, int64_t T, int64_t K, float* xp) {
    const int64_t nb = K / F::kElems;
    float one[F::kPrep];
    for (int64_t t = 0; t < T; ++t)
        for (int64_t b = 0; b < nb; ++b) {
            F::prepare(x + t * K + b * F::kElems, one);
            float* dst = xp + (t / 2 * nb + b) * 2 * F::kPrep + 8 * (t % 2);
            for (int64_t e = 0; e < F::kPrep; e += 8) {
                std::memcpy(dst + 2 * e, one + e, 8 * sizeof(float));
                if (t % 2 == 0 && t + 1 == T) std::memset(dst + 2 * e + 8, 0, 8 * sizeof(float));
            }
        }
}

// Prefetches step b of a walk of kStep bytes a step from pf: the weight rows a sweep further on, read linearly.
template <int64_t kStep>
inline void prefetch_step(const uint8_t* pf, int64_t b) {
    for (int l = 0; l < (kStep + 63) / 64; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(pf) + b * kStep + 64 * l, _MM_HINT_T0);
}

// Formats with a row-pair dot (formats512: F::dot_row_pair, up to 7 tokens over two rows in the halves of 512-bit
// registers).
template <class F, class = void>
struct HasRowPair : std::false_type {};
template <class F>
struct HasRowPair<F, std::void_t<decltype(F::template dot_row_pair<1>(nullptr, 0, nullptr, 0, nullptr))>>
    : std::true_type {};
static_assert(HasRowPair<formats512::Q4_K>::value && HasRowPair<formats512::Q6_K>::value &&
                  !HasRowPair<formats512::Q8_0>::value,
              "the row-pair dots are found where the formats define them");

namespace avx2 {
#define NKV_SIMD NKV_AVX2
#include "quant_drivers.h"
#undef NKV_SIMD
}  // namespace avx2

namespace avx512 {
#define NKV_SIMD NKV_AVX512
#include "quant_drivers.h"
#undef NKV_SIMD

// Output rows [r, re) for TT tokens (TT < kPairsMinTokens) two rows at a time through F::dot_row_pair, whole rows
// (x stays in L2), with dot_rows' prefetch of the rows a sweep further on; an odd last row through dot_rows. Each
// row's lanes do the AVX2 dot's arithmetic.
template <class F, int TT>
__attribute__((noinline)) NKV_AVX512 void dot_row_pairs(const float* xp, int64_t ldx, const uint8_t* w, int64_t N,
                                                        int64_t nb, const float* bias, float* y, int64_t ldy,
                                                        int64_t r, int64_t re) {
    const int64_t row_bytes = nb * F::kBytes;
    for (; r + 2 <= re; r += 2) {
        __m512 acc[TT];
#pragma GCC unroll 8
        for (int t = 0; t < TT; ++t) acc[t] = _mm512_setzero_ps();
        const uint8_t* wr = w + r * row_bytes;
        const uint8_t* pf = r + kSweepRows + 2 <= N ? wr + kSweepRows * row_bytes : nullptr;
        for (int64_t b = 0; b < nb; ++b) {
            if (pf) prefetch_step<2 * F::kBytes>(pf, b);
            F::template dot_row_pair<TT>(wr + b * F::kBytes, row_bytes, xp + b * F::kPrep, ldx, acc);
        }
#pragma GCC unroll 8
        for (int t = 0; t < TT; ++t)
            for (int h = 0; h < 2; ++h) y[t * ldy + r + h] = token_sum(&acc[t], h) + (bias ? bias[r + h] : 0.0f);
    }
    if (r < re) dot_rows<F, 1, TT>(xp, ldx, w, N, nb, bias, y, ldy, r, re, 0, nb, nullptr);
}

// dot_row_pairs for tn tokens, a run-time count up to TT
template <class F, int TT = kPairsMinTokens - 1>
NKV_AVX512 void row_pair_range(int64_t tn, const float* xp, int64_t K, const uint8_t* w, int64_t N, const float* bias,
                          float* y, int64_t ldy, int64_t r, int64_t re) {
    if constexpr (TT > 1)
        if (tn < TT) return row_pair_range<F, TT - 1>(tn, xp, K, w, N, bias, y, ldy, r, re);
    const int64_t nb = K / F::kElems;
    dot_row_pairs<F, TT>(xp, nb * F::kPrep, w, N, nb, bias, y, ldy, r, re);
}
}  // namespace avx512

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
            int n_threads, Precision precision) {
    const bool int8 = precision == Precision::kInt8;
    int64_t N = 0, bytes = 0;
    for (int s = 0; s < n_segs; ++s) {
        bytes += segs[s].rows * row_bytes(segs[s].qt, K);
        N += segs[s].rows;
    }
    if (T <= 0 || N <= 0) return;
    const Isa isa = isa_now();
    const bool avx2 = isa != Isa::kScalar;
    if (avx2 && T > kCallTokens) {
        // in blocks of tokens, which bounds the prepared x each thread keeps (a long prompt's would be megabytes)
        const int64_t blocks = (T + kCallTokens - 1) / kCallTokens;
        for (int64_t i = 0, t0 = 0; i < blocks; ++i) {
            const int64_t tn = (T - t0) / (blocks - i);
            matmul(x + t0 * K, tn, K, segs, n_segs, bias, y + t0 * N, n_threads, precision);
            t0 += tn;
        }
        return;
    }
    const int nt = resolve_threads(n_threads, bytes * T, N);
    std::vector<int64_t> row0(static_cast<size_t>(n_segs), 0);  // the first row of each segment in y and bias
    for (int s = 1; s < n_segs; ++s) row0[s] = row0[s - 1] + segs[s - 1].rows;
    const auto bias_of = [&](int s) { return bias ? bias + row0[s] : nullptr; };
    if (avx2) {
        // several tokens' exact FMAs two tokens at a time where the FMA units are 512 bits wide (Pairs)
        const bool pairs = !int8 && T >= kPairsMinTokens && isa == Isa::kAvx512;
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
            visit(segs[s].qt, int8, [&](auto f) {
                using F = decltype(f);
                // 64-byte aligned: the kernels' 32-byte loads of it never straddle two cache lines (that took
                // up to 40% longer for several tokens, where every FMA loads x)
                std::vector<float>& buf = prepared[static_cast<size_t>(s)];
                const int64_t rows = pairs ? (T + 1) / 2 * 2 : T;  // an odd count's last pair block is whole
                buf.resize(static_cast<size_t>(rows * (K / F::kElems * F::kPrep) + 16));
                float* aligned = buf.data() + (-reinterpret_cast<uintptr_t>(buf.data()) / sizeof(float) & 15);
                if (pairs)
                    prepare_x_pairs<F>(x, T, K, aligned);
                else
                    prepare_x<F>(x, T, K, aligned);
                xp[s] = aligned;
            });
        }
        // fewer tokens' exact dots two rows at a time, for the formats that have a row-pair dot (row pairs)
        const bool row_pairs = !int8 && T < kPairsMinTokens && isa == Isa::kAvx512;
        parallel_segments(segs, n_segs, nt, [&](int s, int64_t r0, int64_t r1, int) {
            const Segment& g = segs[s];
            float* out = y + row0[s];
            if (row_pairs && formats512::visit(g.qt, [&](auto f) {
                    using F = decltype(f);
                    if constexpr (HasRowPair<F>::value)
                        avx512::row_pair_range<F>(T, xp[s], K, g.w, g.rows, bias_of(s), out, N, r0, r1);
                    return HasRowPair<F>::value;
                }))
                return;
            if (pairs) {
                formats512::visit(g.qt, [&](auto f) {
                    avx512::matmul_range<Pairs<decltype(f)>>(xp[s], T, K, g.w, g.rows, bias_of(s), out, N, r0, r1);
                });
                return;
            }
            visit(g.qt, [&](auto f) {
                using F = decltype(f);
                if (!int8)
                    avx2::matmul_range<F>(xp[s], T, K, g.w, g.rows, bias_of(s), out, N, r0, r1);
                else if (isa == Isa::kAvx512)
                    avx512::matmul_range<Int8Vnni<F>>(xp[s], T, K, g.w, g.rows, bias_of(s), out, N, r0, r1);
                else
                    avx2::matmul_range<Int8<F>>(xp[s], T, K, g.w, g.rows, bias_of(s), out, N, r0, r1);
            });
        });
        return;
    }
    if (int8) {
        // Scalar int8: x quantised per segment (segments of one type quantise alike; this path is the reference)
        std::vector<std::vector<uint8_t>> xq(static_cast<size_t>(n_segs));
        for (int s = 0; s < n_segs; ++s)
            visit(segs[s].qt, [&](auto f) {
                using XQ = typename decltype(f)::XQ;
                const int64_t nb = T * (K / XQ::kElems);
                xq[s].resize(static_cast<size_t>(nb) * sizeof(XQ));
                XQ* out = reinterpret_cast<XQ*>(xq[s].data());
                for (int64_t b = 0; b < nb; ++b) formats::quantize(x + b * XQ::kElems, out + b);
            });
        parallel_segments(segs, n_segs, nt, [&](int s, int64_t r0, int64_t r1, int) {
            const Segment& g = segs[s];
            visit(g.qt, [&](auto f) {
                using F = decltype(f);
                matmul_rows_scalar_int8<F>(reinterpret_cast<const typename F::XQ*>(xq[s].data()), T, K, g.w,
                                           bias_of(s), y + row0[s], N, r0, r1);
            });
        });
        return;
    }
    // Scalar: per-thread fp32 scratch for a decoded row.
    std::vector<float> scratch(static_cast<size_t>(nt * K));
    parallel_segments(segs, n_segs, nt, [&](int s, int64_t r0, int64_t r1, int tid) {
        const Segment& g = segs[s];
        visit(g.qt, [&](auto f) {
            matmul_rows_scalar<decltype(f)>(x, T, K, g.w, bias_of(s), y + row0[s], N, r0, r1,
                                            scratch.data() + tid * K);
        });
    });
}

void dequantize(const uint8_t* w, int64_t N, int64_t K, QType qt, float* out, int n_threads) {
    const Segment seg{w, qt, N};
    const int64_t bytes = N * row_bytes(qt, K);
    if (N <= 0) return;
    const bool avx2 = isa_now() != Isa::kScalar;
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

namespace {

// fp32 -> bf16 bits, rounded to nearest even, NaN kept a (quiet) NaN: torch's float -> bfloat16 conversion.
inline uint16_t round_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

void round_row_scalar(const float* in, uint16_t* out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) out[i] = round_to_bf16(in[i]);
}

NKV_AVX2 void round_row_avx2(const float* in, uint16_t* out, int64_t n) {  // the same loop, vectorised by the compiler
    for (int64_t i = 0; i < n; ++i) out[i] = round_to_bf16(in[i]);
}

}  // namespace

void dequantize_bf16(const uint8_t* w, int64_t N, int64_t K, QType qt, uint16_t* out, int n_threads) {
    const Segment seg{w, qt, N};
    if (N <= 0) return;
    const bool avx2 = isa_now() != Isa::kScalar;
    const int nt = resolve_threads(n_threads, N * row_bytes(qt, K), N);
    std::vector<float> rows(static_cast<size_t>(nt * K));  // each thread's decoded fp32 row, cache-resident
    parallel_segments(&seg, 1, nt, [&](int, int64_t r0, int64_t r1, int tid) {
        float* row = rows.data() + tid * K;
        visit(qt, [&](auto f) {
            using F = decltype(f);
            for (int64_t r = r0; r < r1; ++r) {
                if (avx2) {
                    decode_rows_avx2<F>(w, K, r, r + 1, row);
                    round_row_avx2(row, out + r * K, K);
                } else {
                    decode_rows_scalar<F>(w, K, r, r + 1, row);
                    round_row_scalar(row, out + r * K, K);
                }
            }
        });
    });
}

}  // namespace nodekv::quant
