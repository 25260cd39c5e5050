// Shared by the CPU kernels: the run-time SIMD level, small AVX2/AVX-512 helpers, and an OpenMP
// team with a guard against barrier stalls on a busy machine.
//
// No -mavx2 is given at build time: SIMD code carries NKV_AVX2 (or NKV_AVX512) and runs only where
// isa_now() says so, so the module loads on any x86-64.
#pragma once

// GCC 12's AVX-512 intrinsics pass an undefined vector through and warn of it wherever they inline (GCC bug 105593,
// fixed in 13): silenced for the files that include this one, on GCC 12 only.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ == 12
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
// The kernels written once for both vector widths (NKV_EITHER_WIDTH, below) have no target of their own, so GCC notes
// that they return vectors their (absent) target lacks, an ABI question that never arises: they are always inlined
// into callers that have the target. The note is silenced for the files that include this one.
#pragma GCC diagnostic ignored "-Wpsabi"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#define NKV_AVX2 __attribute__((target("avx2,fma,f16c")))
// AVX2 plus AVX-512 F/VL/BW/DQ/VNNI: the int8 path's byte products on 256-bit vectors (vpdpbusd on ymm,
// quant_formats.h), and on 512-bit ones the fp32 prefill attention and the exact quantised matmuls of 8 tokens or
// more (two tokens per FMA). AMD Zen 4 and later, Intel Ice Lake / Sapphire
// Rapids and later.
#define NKV_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni")))

namespace nodekv {

// AVX2 + FMA + F16C: the SIMD level every kernel has.
inline bool cpu_has_avx2() {
    static const bool has = [] {
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("f16c");
    }();
    return has;
}

inline bool cpu_has_avx512() {
    static const bool has = [] {
        __builtin_cpu_init();
        return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx512vnni");
    }();
    return has;
}

// The SIMD levels, each a superset of the one before. Every kernel takes the highest the CPU has, up to the limit
// limit_isa sets (a testing and benchmarking hook: the levels give the same bits, except where a kernel says not).
enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };
inline constexpr const char* kIsaNames[] = {"scalar", "avx2", "avx512"};
inline std::atomic<int> g_isa_limit{static_cast<int>(Isa::kAvx512)};

inline Isa isa_now() {
    const int limit = g_isa_limit.load(std::memory_order_relaxed);
    if (limit >= static_cast<int>(Isa::kAvx512) && cpu_has_avx512()) return Isa::kAvx512;
    if (limit >= static_cast<int>(Isa::kAvx2) && cpu_has_avx2()) return Isa::kAvx2;
    return Isa::kScalar;
}

inline const char* isa_name() { return kIsaNames[static_cast<int>(isa_now())]; }

// No SIMD level above `name` from now on ("scalar", "avx2" or "avx512", the default: the best there is).
inline void limit_isa(const std::string& name) {
    for (int i = 0; i < 3; ++i)
        if (name == kIsaNames[i]) return g_isa_limit.store(i, std::memory_order_relaxed);
    throw std::invalid_argument("unknown SIMD level '" + name + "' (scalar, avx2 or avx512)");
}

NKV_AVX2 inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// ---------------------------------------------------------------- kernels written once for both vector widths
//
// F32x8 (AVX2) and F32x16 (AVX-512) name the vector operations such a kernel uses. The kernel is a template over one
// of them marked NKV_EITHER_WIDTH: always inlined and without a target of its own, so its body is compiled inside its
// caller, an NKV_AVX2 or NKV_AVX512 function, with that caller's target, and the traits' functions inline there. A
// target on the template could not serve both widths: GCC inlines no AVX-512 function into an AVX2 one, and AVX2 code
// compiled with AVX-512 enabled may take EVEX encodings that an AVX2-only CPU cannot run. At both widths a kernel does
// the same operations in the same order, so gives the same bits lane for lane.
#define NKV_EITHER_WIDTH __attribute__((always_inline)) inline

struct F32x8 {
    using V = __m256;
    using Mask = __m256;  // lanes of all ones or all zeros
    static constexpr int kLanes = 8;
    NKV_AVX2 static V zero() { return _mm256_setzero_ps(); }
    NKV_AVX2 static V set1(float x) { return _mm256_set1_ps(x); }
    NKV_AVX2 static V load(const float* p) { return _mm256_loadu_ps(p); }
    NKV_AVX2 static V load(const uint16_t* p) {  // halves, converted exactly
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    }
    NKV_AVX2 static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
    NKV_AVX2 static V add(V a, V b) { return _mm256_add_ps(a, b); }
    NKV_AVX2 static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
    NKV_AVX2 static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
    NKV_AVX2 static V max(V a, V b) { return _mm256_max_ps(a, b); }
    NKV_AVX2 static float reduce_max(V v) {
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        return std::max(_mm_cvtss_f32(h), _mm_cvtss_f32(_mm_movehdup_ps(h)));
    }
    NKV_AVX2 static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }  // a * b + c, rounded once
    NKV_AVX2 static V round(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
    NKV_AVX2 static V pow2(V n) {  // 2^n for integral n in [-126, 127]
        const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
        return _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23));
    }
    NKV_AVX2 static Mask ge(V a, V b) { return _mm256_cmp_ps(a, b, _CMP_GE_OQ); }
    NKV_AVX2 static V mul_where(Mask k, V a, V b) { return _mm256_and_ps(_mm256_mul_ps(a, b), k); }  // 0 elsewhere
};

struct F32x16 {
    using V = __m512;
    using Mask = __mmask16;
    static constexpr int kLanes = 16;
    NKV_AVX512 static V zero() { return _mm512_setzero_ps(); }
    NKV_AVX512 static V set1(float x) { return _mm512_set1_ps(x); }
    NKV_AVX512 static V load(const float* p) { return _mm512_loadu_ps(p); }
    NKV_AVX512 static V load(const uint16_t* p) {
        return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    }
    NKV_AVX512 static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
    NKV_AVX512 static V add(V a, V b) { return _mm512_add_ps(a, b); }
    NKV_AVX512 static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
    NKV_AVX512 static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
    NKV_AVX512 static V max(V a, V b) { return _mm512_max_ps(a, b); }
    NKV_AVX512 static float reduce_max(V v) { return _mm512_reduce_max_ps(v); }
    NKV_AVX512 static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
    NKV_AVX512 static V round(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
    NKV_AVX512 static V pow2(V n) {
        const __m512i biased = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
        return _mm512_castsi512_ps(_mm512_slli_epi32(biased, 23));
    }
    NKV_AVX512 static Mask ge(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
    NKV_AVX512 static V mul_where(Mask k, V a, V b) { return _mm512_maskz_mul_ps(k, a, b); }
};

// e^r for |r| <= ln2/2 (after range reduction x = n ln2 + r): Cephes' expf polynomial, ~1 ulp. Callers scale by 2^n.
template <class W>
NKV_EITHER_WIDTH typename W::V exp_reduced(const typename W::V& r) {
    typename W::V p = W::set1(1.9875691500e-4f);
    p = W::fmadd(p, r, W::set1(1.3981999507e-3f));
    p = W::fmadd(p, r, W::set1(8.3334519073e-3f));
    p = W::fmadd(p, r, W::set1(4.1665795894e-2f));
    p = W::fmadd(p, r, W::set1(1.6666665459e-1f));
    p = W::fmadd(p, r, W::set1(5.0000001201e-1f));
    return W::fmadd(p, W::mul(r, r), W::add(r, W::set1(1.0f)));
}

// 2^x for x <= 0 (x = -inf gives 0); relative error ~1e-7. Below -126 the result is 0.
template <class W>
NKV_EITHER_WIDTH typename W::V exp2_nonpos(const typename W::V& x_in) {
    using V = typename W::V;
    const typename W::Mask keep = W::ge(x_in, W::set1(-126.0f));
    const V x = W::max(x_in, W::set1(-126.0f));
    const V n = W::round(x);
    const V r = W::mul(W::sub(x, n), W::set1(0.693147180559945309f));  // |r| <= ln2/2
    return W::mul_where(keep, exp_reduced<W>(r), W::pow2(n));
}

// exp(x) for x <= 0 (NaN propagates): exp_reduced on r = x - n ln2, times 2^n built as 2^n1 * 2^n2, so that
// results in the subnormal range come out right too. ~1 ulp.
NKV_AVX2 inline __m256 exp_nonpos(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-104.0f), x);  // exp(-104) < 2^-150 rounds to 0 anyway
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    const __m256 p = exp_reduced<F32x8>(r);
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i n1 = _mm256_srai_epi32(ni, 1);
    const __m256i n2 = _mm256_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}

// Lanes [0, n) of a vector, n in 0..8, for masked loads and stores of a row's tail.
NKV_AVX2 inline __m256i tail_mask(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Sum of p[0, n), 8 lanes at a time (masked tail).
NKV_AVX2 inline float sum_avx2(const float* p, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(p + i));
    if (i < n) acc = _mm256_add_ps(acc, _mm256_maskload_ps(p + i, tail_mask(n - i)));
    return hsum(acc);
}

// IEEE binary16 <-> float32 (GGUF block scales, KV pages kept in half precision). The scalar pair is the
// reference; the F16C loops below give the same bits 8 values at a time.

// Exact for every input (subnormals, inf, nan included).
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

// Rounded to nearest even, as F16C's vcvtps2ph and torch's .half(): overflow to infinity, subnormals kept, a NaN
// stays a (quiet) NaN.
inline uint16_t float_to_half(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
    if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds past 65504
    if (ax < 0x38800000u) {  // below 2^-14: a subnormal half. At 0.5 a float's ulp is 2^-24, the half's unit
        const float sum = std::fabs(f) + 0.5f;  // here, so this sum rounds |f| to whole units, to nearest even
        uint32_t s;
        std::memcpy(&s, &sum, 4);
        return static_cast<uint16_t>(sign | (s - 0x3f000000u));  // 2^-14 itself comes out as the smallest normal
    }
    // normal: rebias the exponent by 127 - 15 and round 23 mantissa bits to 10 (a carry moves into the exponent)
    const uint32_t odd = (ax >> 13) & 1u;
    return static_cast<uint16_t>(sign | ((ax - 0x38000000u + 0x0fffu + odd) >> 13));
}

NKV_AVX2 inline void halves_to_floats_f16c(const uint16_t* src, float* dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
    for (; i < n; ++i) dst[i] = half_to_float(src[i]);
}

NKV_AVX2 inline void floats_to_halves_f16c(const float* src, uint16_t* dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (; i < n; ++i) dst[i] = float_to_half(src[i]);
}

inline void halves_to_floats(const uint16_t* src, float* dst, int64_t n) {
    if (isa_now() >= Isa::kAvx2) return halves_to_floats_f16c(src, dst, n);
    for (int64_t i = 0; i < n; ++i) dst[i] = half_to_float(src[i]);
}

inline void floats_to_halves(const float* src, uint16_t* dst, int64_t n) {
    if (isa_now() >= Isa::kAvx2) return floats_to_halves_f16c(src, dst, n);
    for (int64_t i = 0; i < n; ++i) dst[i] = float_to_half(src[i]);
}

namespace par {

// Contention guard. A parallel region starts by waking the team and ends in a barrier that
// waits for all of it, so when another process holds a core, a team thread that is not
// scheduled costs the call a whole scheduler time slice (milliseconds): on a busy 2-core
// machine a decode step then took over a second instead of ~10 ms. The stall shows up on
// either side: the caller waits at the end for a worker that never ran, or the worker it woke
// takes its core and does all the work while the caller waits to be scheduled again. Both make
// the region's wall time far exceed the threads' busy time divided by the team size; when that
// excess is far longer than a chunk of work takes, the next calls run single-threaded, for a
// number of calls that doubles while the stalls persist. The state is shared by all kernels.
using Clock = std::chrono::steady_clock;
constexpr auto kStall = std::chrono::microseconds(1000);
constexpr int kSoloCallsMin = 128, kSoloCallsMax = 8192;
inline std::atomic<int> g_solo_left{0};
inline std::atomic<int> g_solo_span{kSoloCallsMin};

// Calls of more work than this (FLOPs; a few ms on this class of machine) neither consult nor feed the
// guard: a stall of one time slice is small next to them, while running them on one thread would halve
// their speed (a long prefill's attention took 1.3 s a layer instead of 0.7 after a stall elsewhere).
constexpr double kGuardedWorkMax = 2e7;

// The number of threads to use now for a call that wants nt and does `work` FLOPs (1 while the guard is
// on, unless the call is big).
inline int threads_after_guard(int nt, double work = 0) {
    if (nt <= 1 || work > kGuardedWorkMax || g_solo_left.load(std::memory_order_relaxed) <= 0) return nt;
    g_solo_left.fetch_sub(1, std::memory_order_relaxed);
    return 1;
}

// wall: the region's time as the caller saw it; busy: the threads' time inside the work loop,
// summed; n_chunks, nt: how the work was split.
inline void record_region(Clock::duration wall, Clock::duration busy, int64_t n_chunks, int nt) {
    const Clock::duration stall = wall - busy / nt, per_chunk = busy / std::max<int64_t>(n_chunks, 1);
    if (stall < kStall || stall < 4 * per_chunk) {
        g_solo_span.store(kSoloCallsMin, std::memory_order_relaxed);
        return;
    }
    const int span = g_solo_span.load(std::memory_order_relaxed);
    g_solo_left.store(span, std::memory_order_relaxed);
    g_solo_span.store(std::min(2 * span, kSoloCallsMax), std::memory_order_relaxed);
}

// fn(c, tid) for every chunk c in [0, n_chunks) on a team of nt >= 2 threads (tid 0 is the
// caller), claimed dynamically, then feeds the region's timing to the guard (unless `work` is big).
// Callers take nt from threads_after_guard and run serially themselves when it is 1.
template <class Fn>
void run_team(int64_t n_chunks, int nt, Fn&& fn, double work = 0) {
    const Clock::time_point start = Clock::now();
    std::atomic<Clock::rep> busy{0};
    int team = nt;
#pragma omp parallel num_threads(nt)
    {
        const int tid = omp_get_thread_num();
        if (tid == 0) team = omp_get_num_threads();
        const Clock::time_point t0 = Clock::now();
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t c = 0; c < n_chunks; ++c) fn(c, tid);
        busy.fetch_add((Clock::now() - t0).count(), std::memory_order_relaxed);
    }
    if (work <= kGuardedWorkMax) record_region(Clock::now() - start, Clock::duration(busy.load()), n_chunks, team);
}

}  // namespace par
}  // namespace nodekv
