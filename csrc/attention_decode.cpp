// Paged attention for few queries (decode steps, short appends); see paged_attention.h.
//
// Keys are split in fixed chunks of 128 whose partial results are merged by log-sum-exp; within a
// chunk the softmax runs online over blocks of <= 64 keys that stay in L1 while every query row of
// a KV head reads them. A block within one page (every block when page_size is a multiple of 64)
// is read in place, one that spans pages through a table of row pointers. Half pages are read so
// too, each load of 8 or 16 halves converted to floats in registers (F16C, exact: the arithmetic is
// that of float pages holding the same values), so a step reads half the bytes; for more than 24
// query rows a block is converted once into a per-thread fp32 copy (2 x 16 KiB, in L1). The chunks of all KV
// heads are shared among up to n_threads threads when the work is large enough; the split does not
// depend on the thread count, so neither do the results. Scratch: hd + 2 floats per query row and
// chunk (150 KB for one SmolLM2 token at 8192 keys), plus with node mass one float per query row
// and (chunk, node overlapping it) pair. Scores are fp32 and max-subtracted, sums accumulate in
// fp32. Three SIMD levels: scalar, AVX2 (hd % 16 == 0) and AVX-512, which gives the AVX2 bits. The SIMD
// paths prefetch the next key block while computing the scores of the current one (BlockPrefetch).
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_common.h"
#include "cpu_ops.h"
#include "paged_attention.h"

namespace nodekv::ops {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The rows of a block of keys (or values) in pages of E (float, or uint16_t halves), row i at row(kp, i, hd): a
// block within one page is given by its first row (rows hd elements apart), one that spans pages by a table of row
// pointers.
template <class E>
inline const E* row(const E* first, int64_t i, int64_t hd) { return first + i * hd; }
template <class E>
inline const E* row(const E* const* table, int64_t i, int64_t) { return table[i]; }
// The rows from row i on.
template <class E>
inline const E* advance(const E* first, int64_t i, int64_t hd) { return first + i * hd; }
template <class E>
inline const E* const* advance(const E* const* table, int64_t i, int64_t) { return table + i; }

// An element of a page as a float (the SIMD paths load 8 or 16 with F32x8::load, F32x16::load).
inline float value(float x) { return x; }
inline float value(uint16_t h) { return half_to_float(h); }

// The next key block's keys and values (its run in its first page; after a chunk's last block, the first of the
// next chunk of the same KV head, which this thread or another is about to take), asked of the caches a few 64-byte
// lines at a time while the scores of the block before are computed, so that reading them from memory overlaps the
// arithmetic. Without it one token's attention waits for each block, then computes: 1.4x slower at 8K float32 keys,
// 1.3x at 8K halves (read in place; when a block was first converted into a buffer, that loop's streaming reads hid
// the wait as well as prefetching did).
// A burst of a whole block's prefetches would stall the core on its miss buffers instead.
struct BlockPrefetch {
    // fp32 keys: a block's K lines in its steps of 8 floats on the AVX-512 path (bs * hd / 16 lines, bs * hd / 64
    // steps); the AVX2 path takes more steps, and halves have half the lines: both are done sooner
    static constexpr int kLinesPerStep = 4;
    const char* k = nullptr;
    const char* v = nullptr;
    int64_t lines = 0;  // left of each
    BlockPrefetch(const PagedArgs& a, int64_t s, int64_t count, int64_t g) {
        if (count <= 0) return;
        const int64_t bytes = a.kv_half ? 2 : 4, off = a.row_offset(s, g) * bytes;
        k = static_cast<const char*>(a.k_pages) + off;
        v = static_cast<const char*>(a.v_pages) + off;
        lines = std::min(count, a.page_size - s % a.page_size) * a.hd * bytes / 64;
    }
    void step() {
        for (int i = 0; i < kLinesPerStep && lines > 0; ++i, --lines, k += 64, v += 64) {
            _mm_prefetch(k, _MM_HINT_T0);
            _mm_prefetch(v, _MM_HINT_T0);
        }
    }
};

// ---------------------------------------------------------------- scalar path

// Building blocks over one block of n keys, key i at row(kp, i, hd) and its value at row(vp, i, hd).
// Rows of scores are r = t * G + j for query t and query head g * G + j; `ld` is their stride.
struct ScalarOps {
    template <class Rows>
    static void scores(const float* qg, int64_t T, int64_t G, int64_t qst, int64_t qsh, Rows kp, int64_t n,
                       int64_t hd, float scale, float* sc, int64_t ld, BlockPrefetch&) {
        for (int64_t t = 0; t < T; ++t)
            for (int64_t j = 0; j < G; ++j) {
                const float* q = qg + t * qst + j * qsh;
                float* out = sc + (t * G + j) * ld;
                for (int64_t i = 0; i < n; ++i) {
                    float acc[8] = {};  // interleaved partial sums, as the SIMD path keeps them
                    for (int64_t c = 0; c < hd; ++c) acc[c % 8] += q[c] * value(row(kp, i, hd)[c]);
                    const float dot = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
                    out[i] = dot * scale;
                }
            }
    }
    static float max(const float* s, int64_t n) {
        float m = s[0];
        for (int64_t i = 1; i < n; ++i) m = std::max(m, s[i]);
        return m;
    }
    static float exp_sum(float* s, int64_t n, float mx) {
        float sum = 0.0f;
        for (int64_t i = 0; i < n; ++i) sum += (s[i] = std::exp(s[i] - mx));
        return sum;
    }
    static float sum(const float* s, int64_t n) {
        float sum = 0.0f;
        for (int64_t i = 0; i < n; ++i) sum += s[i];
        return sum;
    }
    template <class Rows>
    static void pv(const float* p, int64_t ld, int64_t R, Rows vp, int64_t n, int64_t hd, float* o) {
        for (int64_t r = 0; r < R; ++r)
            for (int64_t i = 0; i < n; ++i)
                for (int64_t c = 0; c < hd; ++c) o[r * hd + c] += p[r * ld + i] * value(row(vp, i, hd)[c]);
    }
};

// ---------------------------------------------------------------- AVX2 path

// [sum(a[0]), ..., sum(a[7])]: eight horizontal sums at once.
NKV_AVX2 inline __m256 hsum8(const __m256 a[8]) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// o[r, c..c+L CW) += sum_i p[r, i] * v_i[c..c+L CW) for RT rows, L = W::kLanes: each V load feeds RT FMAs, and
// RT x CW >= 8 independent accumulators keep both FMA pipes busy despite the 4-cycle latency. Each output element is
// summed over the keys in order, at both widths.
template <class W, int RT, int CW, class Rows>
NKV_EITHER_WIDTH void pv_tile(const float* p, int64_t ld, Rows vp, int64_t n, int64_t hd, float* o) {
    using V = typename W::V;
    constexpr int L = W::kLanes;
    for (int64_t c = 0; c < hd; c += L * CW) {
        V acc[RT][CW];
        for (int r = 0; r < RT; ++r)
            for (int w = 0; w < CW; ++w) acc[r][w] = W::load(o + r * hd + c + L * w);
        for (int64_t i = 0; i < n; ++i) {
            V pr[RT];
            for (int r = 0; r < RT; ++r) pr[r] = W::set1(p[r * ld + i]);
            const auto* vi = row(vp, i, hd) + c;
            for (int w = 0; w < CW; ++w) {
                const V v = W::load(vi + L * w);
                for (int r = 0; r < RT; ++r) acc[r][w] = W::fmadd(pr[r], v, acc[r][w]);
            }
        }
        for (int r = 0; r < RT; ++r)
            for (int w = 0; w < CW; ++w) W::store(o + r * hd + c + L * w, acc[r][w]);
    }
}

// The PV product of `rows` (1 <= rows <= RT) rows: a tile RT rows high, or fewer.
template <class W, int RT, int CW, class Rows>
NKV_EITHER_WIDTH void pv_block(int64_t rows, const float* p, int64_t ld, Rows vp, int64_t n, int64_t hd, float* o) {
    if constexpr (RT > 1)
        if (rows < RT) return pv_block<W, RT - 1, CW>(rows, p, ld, vp, n, hd, o);
    pv_tile<W, RT, CW>(p, ld, vp, n, hd, o);
}

// The PV product of R rows in tiles of up to RT rows.
template <class W, int RT, int CW, class Rows>
NKV_EITHER_WIDTH void pv_rows(const float* p, int64_t ld, int64_t R, Rows vp, int64_t n, int64_t hd, float* o) {
    for (int64_t r = 0; r < R; r += RT)
        pv_block<W, RT, CW>(std::min<int64_t>(RT, R - r), p + r * ld, ld, vp, n, hd, o + r * hd);
}

// Scores of one query row against keys [i0, n): 8 keys per step, so one q load feeds 8 FMAs.
template <class Rows>
NKV_AVX2 void scores_row(const float* q, Rows kp, int64_t i0, int64_t n, int64_t hd, float scale, float* out,
                         BlockPrefetch* pf = nullptr) {
    const __m256 vscale = _mm256_set1_ps(scale);
    int64_t i = i0;
    for (; i + 8 <= n; i += 8) {
        __m256 acc[8];
        for (int k = 0; k < 8; ++k) acc[k] = _mm256_setzero_ps();
        for (int64_t c = 0; c < hd; c += 8) {
            if (pf) pf->step();
            const __m256 qv = _mm256_loadu_ps(q + c);
            for (int k = 0; k < 8; ++k) acc[k] = _mm256_fmadd_ps(qv, F32x8::load(row(kp, i + k, hd) + c), acc[k]);
        }
        _mm256_storeu_ps(out + i, _mm256_mul_ps(hsum8(acc), vscale));
    }
    for (; i < n; ++i) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t c = 0; c < hd; c += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), F32x8::load(row(kp, i, hd) + c), acc);
        out[i] = hsum(acc) * scale;
    }
}

// Scores of two query rows: 2 rows x 4 keys per step, 6 loads per 8 FMAs instead of 9.
template <class Rows>
NKV_AVX2 void scores_row_pair(const float* q0, const float* q1, Rows kp, int64_t n, int64_t hd, float scale,
                              float* out0, float* out1, BlockPrefetch* pf = nullptr) {
    const __m256 vscale = _mm256_set1_ps(scale);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        __m256 acc[8];  // row 0 at keys i..i+3, then row 1
        for (int k = 0; k < 8; ++k) acc[k] = _mm256_setzero_ps();
        for (int64_t c = 0; c < hd; c += 8) {
            if (pf) pf->step();
            const __m256 qa = _mm256_loadu_ps(q0 + c), qb = _mm256_loadu_ps(q1 + c);
            for (int k = 0; k < 4; ++k) {
                const __m256 kv = F32x8::load(row(kp, i + k, hd) + c);
                acc[k] = _mm256_fmadd_ps(qa, kv, acc[k]);
                acc[4 + k] = _mm256_fmadd_ps(qb, kv, acc[4 + k]);
            }
        }
        const __m256 s = _mm256_mul_ps(hsum8(acc), vscale);
        _mm_storeu_ps(out0 + i, _mm256_castps256_ps128(s));
        _mm_storeu_ps(out1 + i, _mm256_extractf128_ps(s, 1));
    }
    scores_row(q0, kp, i, n, hd, scale, out0);
    scores_row(q1, kp, i, n, hd, scale, out1);
}

struct Avx2Ops {  // hd % 16 == 0
    template <class Rows>
    NKV_AVX2 static void scores(const float* qg, int64_t T, int64_t G, int64_t qst, int64_t qsh, Rows kp, int64_t n,
                                int64_t hd, float scale, float* sc, int64_t ld, BlockPrefetch& pf) {
        const int64_t R = T * G;
        auto qrow = [&](int64_t r) { return qg + r / G * qst + r % G * qsh; };
        int64_t r = 0;
        for (; r + 2 <= R; r += 2)
            scores_row_pair(qrow(r), qrow(r + 1), kp, n, hd, scale, sc + r * ld, sc + (r + 1) * ld, &pf);
        if (r < R) scores_row(qrow(r), kp, 0, n, hd, scale, sc + r * ld, &pf);
    }
    NKV_AVX2 static float max(const float* s, int64_t n) {
        __m256 m = _mm256_set1_ps(kNegInf);
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + i));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        float r = std::max(_mm_cvtss_f32(h), _mm_cvtss_f32(_mm_movehdup_ps(h)));
        for (; i < n; ++i) r = std::max(r, s[i]);
        return r;
    }
    NKV_AVX2 static float exp_sum(float* s, int64_t n, float mx) {
        const __m256 vm = _mm256_set1_ps(mx);
        __m256 sum = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            const __m256 e = exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(s + i), vm));
            _mm256_storeu_ps(s + i, e);
            sum = _mm256_add_ps(sum, e);
        }
        if (i < n) {
            const __m256i m = tail_mask(n - i);
            const __m256 e = _mm256_and_ps(exp_nonpos(_mm256_sub_ps(_mm256_maskload_ps(s + i, m), vm)),
                                           _mm256_castsi256_ps(m));
            _mm256_maskstore_ps(s + i, m, e);
            sum = _mm256_add_ps(sum, e);
        }
        return hsum(sum);
    }
    NKV_AVX2 static float sum(const float* s, int64_t n) { return sum_avx2(s, n); }
    // PV tiles of up to 12 accumulators. At hd % 32 != 0, 6 rows x 2 vectors and their 6 broadcasts are more than the 16
    // registers hold (3 accumulators a key go through the stack), yet 5- and 4-row tiles, which fit, ran no faster
    // (qwen2.5-0.5b's and SmolLM2's heads, decode at 2K-8K keys).
    template <class Rows>
    NKV_AVX2 static void pv(const float* p, int64_t ld, int64_t R, Rows vp, int64_t n, int64_t hd, float* o) {
        if (hd % 32 == 0)
            pv_rows<F32x8, 3, 4>(p, ld, R, vp, n, hd, o);
        else
            pv_rows<F32x8, 6, 2>(p, ld, R, vp, n, hd, o);
    }
};

// ---------------------------------------------------------------- AVX-512 path
//
// The AVX2 path's arithmetic on 16 lanes, so the same bits. Scores: one zmm holds two query rows' eight partial sums
// of one key (row r in lanes 0-7, row r + 1 in 8-15) against the key's 8 floats broadcast to both halves, and
// hsum8_halves reduces each half in hsum8's order; the keys past the last multiple of 8 go through the AVX2 code,
// which sums them in its own orders. PV: 16 output elements a vector, each summed over the keys in order.

// _mm256_hadd_ps on each 256-bit half: [a0+a1, a2+a3, b0+b1, b2+b3] per 128-bit lane.
NKV_AVX512 inline __m512 hadd_lanes(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Lanes 0-7: the sums of a[0..7]'s low halves, each in hsum8's order; lanes 8-15: of their high halves.
NKV_AVX512 inline __m512 hsum8_halves(const __m512 a[8]) {
    const __m512 u0 = hadd_lanes(hadd_lanes(a[0], a[1]), hadd_lanes(a[2], a[3]));
    const __m512 u1 = hadd_lanes(hadd_lanes(a[4], a[5]), hadd_lanes(a[6], a[7]));
    // per half, as hsum8's permute2f128s: [u0.lo, u1.lo] + [u0.hi, u1.hi] (128-bit lanes; u1 is source 16..31)
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
    const __m512i hi = _mm512_setr_epi32(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    return _mm512_add_ps(_mm512_permutex2var_ps(u0, lo, u1), _mm512_permutex2var_ps(u0, hi, u1));
}

// Scores of NP query-row pairs (rows q[2p], q[2p + 1]) against keys [0, n8), n8 % 8 == 0: 8 keys per step, each
// key's 8 floats loaded once for the NP pairs.
template <int NP, class Rows>
NKV_AVX512 void scores_pairs512(const float* const* q, Rows kp, int64_t n8, int64_t hd, float scale,
                                float* const* out, BlockPrefetch& pf) {
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < n8; i += 8) {
        __m512 acc[NP][8];
        for (int p = 0; p < NP; ++p)
            for (int k = 0; k < 8; ++k) acc[p][k] = _mm512_setzero_ps();
        for (int64_t c = 0; c < hd; c += 8) {
            pf.step();
            __m512 qv[NP];
            for (int p = 0; p < NP; ++p)
                qv[p] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(q[2 * p] + c)),
                                           _mm256_loadu_ps(q[2 * p + 1] + c), 1);
            for (int k = 0; k < 8; ++k) {
                const __m512 kv = _mm512_broadcast_f32x8(F32x8::load(row(kp, i + k, hd) + c));
                for (int p = 0; p < NP; ++p) acc[p][k] = _mm512_fmadd_ps(qv[p], kv, acc[p][k]);
            }
        }
        for (int p = 0; p < NP; ++p) {
            const __m512 s = _mm512_mul_ps(hsum8_halves(acc[p]), vscale);
            _mm256_storeu_ps(out[2 * p] + i, _mm512_castps512_ps256(s));
            _mm256_storeu_ps(out[2 * p + 1] + i, _mm512_extractf32x8_ps(s, 1));
        }
    }
}

struct Avx512Ops : Avx2Ops {  // hd % 16 == 0
    template <class Rows>
    NKV_AVX512 static void scores(const float* qg, int64_t T, int64_t G, int64_t qst, int64_t qsh, Rows kp,
                                  int64_t n, int64_t hd, float scale, float* sc, int64_t ld, BlockPrefetch& pf) {
        const int64_t R = T * G, pairs = R / 2, n8 = n / 8 * 8;
        auto qrow = [&](int64_t r) { return qg + r / G * qst + r % G * qsh; };
        constexpr int kPairs = 3;  // 24 accumulators, 3 query pairs and a key of the 32 registers
        for (int64_t p0 = 0; p0 < pairs; p0 += kPairs) {
            const float* q[2 * kPairs];
            float* out[2 * kPairs];
            const int np = static_cast<int>(std::min<int64_t>(kPairs, pairs - p0));
            for (int k = 0; k < 2 * np; ++k) q[k] = qrow(2 * p0 + k), out[k] = sc + (2 * p0 + k) * ld;
            if (np == 3) scores_pairs512<3>(q, kp, n8, hd, scale, out, pf);
            if (np == 2) scores_pairs512<2>(q, kp, n8, hd, scale, out, pf);
            if (np == 1) scores_pairs512<1>(q, kp, n8, hd, scale, out, pf);
            if (n8 < n)  // the tail as the AVX2 path sums it: in steps of 4 keys from n8 (a multiple of 4), then singly
                for (int k = 0; k < 2 * np; k += 2)
                    scores_row_pair(q[k], q[k + 1], advance(kp, n8, hd), n - n8, hd, scale, out[k] + n8,
                                    out[k + 1] + n8);
        }
        if (R % 2) scores_row(qrow(R - 1), kp, 0, n, hd, scale, sc + (R - 1) * ld, &pf);  // AVX2 steps of 8 keys too
    }
    // PV tiles of up to 24 accumulators (+ the V vector and 6 broadcasts of the 32 registers)
    template <class Rows>
    NKV_AVX512 static void pv(const float* p, int64_t ld, int64_t R, Rows vp, int64_t n, int64_t hd, float* o) {
        if (hd % 64 == 0)
            pv_rows<F32x16, 6, 4>(p, ld, R, vp, n, hd, o);
        else if (hd % 32 == 0)
            pv_rows<F32x16, 6, 2>(p, ld, R, vp, n, hd, o);
        else
            pv_rows<F32x16, 6, 1>(p, ld, R, vp, n, hd, o);
    }
};

// ---------------------------------------------------------------- driver

// Keys per softmax block: K and V blocks of <= 16 KiB each stay in L1 while every row of the
// group reads them.
int64_t block_positions(int64_t hd) { return std::clamp<int64_t>(4096 / hd / 8 * 8, 8, 64); }

// Keys per chunk, the unit of work shared among threads: fixed, so that the thread count does not
// change the results.
constexpr int64_t kChunk = 128;

// Below this many multiply-adds (QK^T and PV together) a fork/join costs more than it saves.
constexpr int64_t kParallelMacs = int64_t{1} << 17;

// Half pages: above this many query rows a block is converted into floats once instead of in registers by each pass
// of the score and PV tiles over it (tiles of up to 6 rows, 2 for AVX2's scores). On qwen2.5-1.5b's heads at 2K keys,
// reading in place is 1.3x faster for 6 rows and 1.05x for 24, converting once 1.04x for 48 and 1.1x for 96.
constexpr int64_t kConvertHalvesAbove = 24;

// Node mass of one unit (KV head, chunk): nodes [j0, j0 + cnt) overlap the chunk, and acc[r, j - j0]
// sums row r's unnormalised probabilities over node j's keys at the row's running max: a chunk
// touches few nodes, so they are all rescaled with the output whenever the max rises.
struct UnitMass {
    const int32_t* bounds;
    int64_t j0, cnt;
    float* acc;
};

// Online softmax over keys [s0, s1) of KV head g for its R = n * G query rows. Leaves the
// unnormalised output in o [R, hd], the running max in m [R] and the sum in l [R]; a row that
// sees none of these keys gets m = -inf, l = 0, o = 0. E: what the pages hold (float, or uint16_t halves).
template <class Ops, bool kMass, class E>
void attend_chunk(const PagedArgs& a, int64_t G, float scale, int64_t g, int64_t s0, int64_t s1, float* o,
                  float* m, float* l, float* sc, UnitMass* um) {
    const int64_t R = a.n * G, hd = a.hd, bs = block_positions(hd), start = a.end - a.n;
    thread_local std::vector<const E*> table;  // a block's key row pointers, then its value row pointers
    table.resize(static_cast<size_t>(2 * bs));
    const E** kp = table.data();
    const E** vp = kp + bs;
    thread_local std::vector<float> floats;  // a block's keys, then its values, converted from halves
    const bool convert = std::is_same_v<E, uint16_t> && R > kConvertHalvesAbove;
    if (convert) floats.resize(static_cast<size_t>(2 * bs * hd));
    std::fill(o, o + R * hd, 0.0f);
    std::fill(m, m + R, kNegInf);
    std::fill(l, l + R, 0.0f);
    if (kMass) std::fill(um->acc, um->acc + R * um->cnt, 0.0f);
    const float* qg = a.q + g * G * a.q_stride_h;
    int64_t jb = kMass ? um->j0 : 0;  // the node holding b0
    for (int64_t b0 = s0; b0 < s1; b0 += bs) {
        const int64_t n = std::min(bs, s1 - b0);
        // the block's rows: converted from halves, in place within one page, or through a pointer table
        const float *kf = nullptr, *vf = nullptr;
        const E *kb = nullptr, *vb = nullptr;
        if (convert) {
            kf = floats.data(), vf = kf + bs * hd;
            a.rows_to_floats(b0, n, g, floats.data(), floats.data() + bs * hd);
        } else if (b0 % a.page_size + n <= a.page_size) {
            kb = a.k_row<E>(b0, g), vb = a.v_row<E>(b0, g);
        } else {
            a.rows<E>(b0, n, g, kp, vp);
        }
        const E* const* kt = kp;
        const E* const* vt = vp;
        BlockPrefetch next(a, b0 + bs, std::min(bs, a.end - b0 - bs), g);  // beyond s1: the next chunk's
        if (kf)
            Ops::scores(qg, a.n, G, a.q_stride_t, a.q_stride_h, kf, n, hd, scale, sc, bs, next);
        else if (kb)
            Ops::scores(qg, a.n, G, a.q_stride_t, a.q_stride_h, kb, n, hd, scale, sc, bs, next);
        else
            Ops::scores(qg, a.n, G, a.q_stride_t, a.q_stride_h, kt, n, hd, scale, sc, bs, next);
        if (kMass)
            while (um->bounds[jb + 1] <= b0) ++jb;
        for (int64_t t = 0; t < a.n; ++t) {
            const int64_t nv = std::clamp<int64_t>(start + t + 1 - b0, 0, n);  // causal: visible keys
            for (int64_t j = 0; j < G; ++j) {
                const int64_t r = t * G + j;
                float* p = sc + r * bs;
                std::fill(p + nv, p + n, 0.0f);
                if (nv == 0) continue;
                const float mn = std::max(m[r], Ops::max(p, nv));
                const float alpha = m[r] == kNegInf ? 0.0f : std::exp(m[r] - mn);
                const float sum = Ops::exp_sum(p, nv, mn);
                l[r] = l[r] * alpha + sum;
                if (alpha != 1.0f)
                    for (int64_t c = 0; c < hd; ++c) o[r * hd + c] *= alpha;
                m[r] = mn;
                if (kMass) {
                    float* acc = um->acc + r * um->cnt;  // acc[k - j0]: node k
                    if (alpha != 1.0f)
                        for (int64_t k = 0; k <= jb - um->j0; ++k) acc[k] *= alpha;  // the nodes touched so far
                    for (int64_t k = jb, s = b0, e = b0 + nv; s < e; ++k) {  // the nodes of keys [b0, b0 + nv)
                        const int64_t se = std::min<int64_t>(um->bounds[k + 1], e);
                        acc[k - um->j0] += (s == b0 && se == e) ? sum : Ops::sum(p + (s - b0), se - s);
                        s = se;
                    }
                }
            }
        }
        if (vf)
            Ops::pv(sc, bs, R, vf, n, hd, o);
        else if (vb)
            Ops::pv(sc, bs, R, vb, n, hd, o);
        else
            Ops::pv(sc, bs, R, vt, n, hd, o);
    }
}

template <class Ops>
void decode_typed(const PagedArgs& a) {
    const int64_t G = a.H / a.kv_heads, R = a.n * G, hd = a.hd, end = a.end, N = a.n_nodes;
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    const int64_t n_split = (end + kChunk - 1) / kChunk, n_units = a.kv_heads * n_split;
    const int64_t unit_floats = R * (hd + 2);  // o [R, hd], m [R], l [R]
    // reused: called once per layer and token
    thread_local std::vector<float> results_buf, wts_buf, mass_buf;
    thread_local std::vector<int64_t> node_lo_buf, node_off_buf;
    results_buf.resize(static_cast<size_t>(n_units * unit_floats));
    wts_buf.resize(static_cast<size_t>(n_split));
    float* const results = results_buf.data();  // the caller's buffers, also for the worker threads
    float* const wts = wts_buf.data();
    // With mass: chunk c overlaps nodes [node_lo[c], node_lo[c] + cnt_c), whose sums for the R
    // rows of KV head g sit at mass_acc + (g * n_off + node_off[c]) * R, [R, cnt_c].
    int64_t* node_lo = nullptr;
    int64_t* node_off = nullptr;
    int64_t n_off = 0;
    float* mass_acc = nullptr;
    if (a.mass) {
        node_lo_buf.resize(static_cast<size_t>(n_split));
        node_off_buf.resize(static_cast<size_t>(n_split + 1));
        node_lo = node_lo_buf.data();
        node_off = node_off_buf.data();
        node_off[0] = 0;
        for (int64_t c = 0; c < n_split; ++c) {
            node_lo[c] = node_of(a.node_bounds, N, c * kChunk);
            const int64_t hi = node_of(a.node_bounds, N, std::min(end, (c + 1) * kChunk) - 1);
            node_off[c + 1] = node_off[c] + hi - node_lo[c] + 1;
        }
        n_off = node_off[n_split];
        mass_buf.resize(static_cast<size_t>(a.kv_heads * n_off * R));
        mass_acc = mass_buf.data();
    }

    auto run_unit = [&](int64_t u) {
        thread_local std::vector<float> sc;
        sc.resize(static_cast<size_t>(R * block_positions(hd)));
        // KV heads inner: a page holds the rows of all KV heads side by side, so consecutive units
        // read adjacent memory
        const int64_t c = u / a.kv_heads, g = u % a.kv_heads;
        float* res = results + (g * n_split + c) * unit_floats;
        UnitMass um{};
        if (a.mass)
            um = {a.node_bounds, node_lo[c], node_off[c + 1] - node_off[c], mass_acc + (g * n_off + node_off[c]) * R};
        const int64_t s0 = c * kChunk, s1 = std::min(end, s0 + kChunk);
        float *m = res + R * hd, *l = m + R;
        UnitMass* pm = a.mass ? &um : nullptr;
        if (a.mass && a.kv_half)
            attend_chunk<Ops, true, uint16_t>(a, G, scale, g, s0, s1, res, m, l, sc.data(), pm);
        else if (a.mass)
            attend_chunk<Ops, true, float>(a, G, scale, g, s0, s1, res, m, l, sc.data(), pm);
        else if (a.kv_half)
            attend_chunk<Ops, false, uint16_t>(a, G, scale, g, s0, s1, res, m, l, sc.data(), pm);
        else
            attend_chunk<Ops, false, float>(a, G, scale, g, s0, s1, res, m, l, sc.data(), pm);
    };
    int nt = a.n_threads > 0 ? a.n_threads : omp_get_max_threads();
    if (2 * a.H * a.n * end * hd < kParallelMacs) nt = 1;
    nt = par::threads_after_guard(static_cast<int>(std::min<int64_t>(nt, n_units)));
    if (nt <= 1)
        for (int64_t u = 0; u < n_units; ++u) run_unit(u);
    else
        par::run_team(n_units, nt, [&](int64_t u, int) { run_unit(u); });

    // Merge the chunks of each row: out = sum_c o_c e^(m_c - M) / sum_c l_c e^(m_c - M), M = max_c m_c
    // (finite: chunk 0 holds key 0, which every row sees); the node sums of chunk c scale alike.
    for (int64_t g = 0; g < a.kv_heads; ++g)
        for (int64_t r = 0; r < R; ++r) {
            const float* res0 = results + g * n_split * unit_floats;
            float M = kNegInf;
            for (int64_t c = 0; c < n_split; ++c) M = std::max(M, res0[c * unit_floats + R * hd + r]);
            float den = 0.0f;
            for (int64_t c = 0; c < n_split; ++c) {
                const float* res = res0 + c * unit_floats;
                const float mc = res[R * hd + r];
                wts[c] = mc == kNegInf ? 0.0f : std::exp(mc - M);
                den += res[R * hd + R + r] * wts[c];
            }
            const float inv = 1.0f / den;
            const int64_t t = r / G, h = g * G + r % G;
            float* out = a.out + t * a.H * hd + h * hd;
            std::fill(out, out + hd, 0.0f);
            for (int64_t c = 0; c < n_split; ++c) {
                const float* o = res0 + c * unit_floats + r * hd;
                const float w = wts[c] * inv;
                for (int64_t i = 0; i < hd; ++i) out[i] += o[i] * w;
            }
            if (a.mass) {
                float* mrow = a.mass + t * N;
                for (int64_t c = 0; c < n_split; ++c) {
                    const float w = wts[c] * inv;
                    const int64_t cnt = node_off[c + 1] - node_off[c];
                    const float* acc = mass_acc + (g * n_off + node_off[c]) * R + r * cnt;
                    if (w != 0.0f)
                        for (int64_t j = 0; j < cnt; ++j) mrow[node_lo[c] + j] += acc[j] * w;
                }
            }
        }
}

}  // namespace

void decode_attention(const PagedArgs& a) {
    if (a.n <= 0) return;
    const Isa isa = isa_now();
    if (isa >= Isa::kAvx512 && a.hd % 16 == 0)
        decode_typed<Avx512Ops>(a);
    else if (isa >= Isa::kAvx2 && a.hd % 16 == 0)
        decode_typed<Avx2Ops>(a);
    else
        decode_typed<ScalarOps>(a);
}

}  // namespace nodekv::ops
