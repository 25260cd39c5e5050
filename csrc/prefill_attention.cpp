// Flash-style causal GQA prefill attention; see prefill_attention.h for the scheme.
#include "prefill_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_common.h"
#include "cpu_ops.h"

namespace nodekv::ops {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLog2e = 1.44269504088896341f;
constexpr int64_t kBK = 64;     // keys per block (the packed K^T tile is [hd, kBK])
constexpr int64_t kRows = 96;   // target query rows (tokens x G) per task
constexpr int kMR = 6;          // rows per register tile of both micro-kernels

// Per-thread scratch of one task.
struct Scratch {
    std::vector<float> buf;
    float *qp, *s, *o, *m, *l, *alpha;
    void size(int64_t R, int64_t hd) {
        const int64_t need = R * hd + R * kBK + R * hd + 3 * R;
        if (static_cast<int64_t>(buf.size()) < need) buf.resize(static_cast<size_t>(need));
        qp = buf.data();
        s = qp + R * hd;
        o = s + R * kBK;
        m = o + R * hd;
        l = m + R;
        alpha = l + R;
    }
};

// ---------------------------------------------------------------- AVX2 kernels

// 2^x for x <= 0 (x = -inf gives 0); relative error ~1e-7. Below -126 the result is 0.
NKV_AVX2 inline __m256 exp2_nonpos(__m256 x) {
    const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-126.0f), _CMP_GE_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-126.0f));
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_mul_ps(_mm256_sub_ps(x, n), _mm256_set1_ps(0.693147180559945309f));  // |r| <= ln2/2
    const __m256 p = exp_reduced(r);
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
}

// s[MR, 16] (row stride kBK) = q[MR, hd] (row stride hd) . kt[hd, 16] (row stride ldk).
template <int MR>
NKV_AVX2 inline void qk_tile(const float* q, const float* kt, int64_t ldk, int64_t hd, float* s) {
    __m256 a0[MR], a1[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
        a0[r] = _mm256_setzero_ps();
        a1[r] = _mm256_setzero_ps();
    }
    for (int64_t d = 0; d < hd; ++d) {
        const __m256 k0 = _mm256_loadu_ps(kt + d * ldk), k1 = _mm256_loadu_ps(kt + d * ldk + 8);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
            const __m256 b = _mm256_broadcast_ss(q + r * hd + d);
            a0[r] = _mm256_fmadd_ps(b, k0, a0[r]);
            a1[r] = _mm256_fmadd_ps(b, k1, a1[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
        _mm256_storeu_ps(s + r * kBK, a0[r]);
        _mm256_storeu_ps(s + r * kBK + 8, a1[r]);
    }
}

// o[MR, 16] (row stride hd) = o * alpha[r] + p[MR, :n] (row stride kBK) . v[:n, 16] (row stride hd).
template <int MR>
NKV_AVX2 inline void pv_tile(const float* p, const float* v, int64_t n, int64_t hd, const float* alpha, float* o) {
    __m256 a0[MR], a1[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
        const __m256 al = _mm256_broadcast_ss(alpha + r);
        a0[r] = _mm256_mul_ps(_mm256_loadu_ps(o + r * hd), al);
        a1[r] = _mm256_mul_ps(_mm256_loadu_ps(o + r * hd + 8), al);
    }
    for (int64_t k = 0; k < n; ++k) {
        const __m256 v0 = _mm256_loadu_ps(v + k * hd), v1 = _mm256_loadu_ps(v + k * hd + 8);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
            const __m256 b = _mm256_broadcast_ss(p + r * kBK + k);
            a0[r] = _mm256_fmadd_ps(b, v0, a0[r]);
            a1[r] = _mm256_fmadd_ps(b, v1, a1[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
        _mm256_storeu_ps(o + r * hd, a0[r]);
        _mm256_storeu_ps(o + r * hd + 8, a1[r]);
    }
}

template <int MR>
NKV_AVX2 void qk_rows(const float* q, const float* kt, int64_t ldk, int64_t hd, int64_t ncols, float* s) {
    for (int64_t c = 0; c < ncols; c += 16) qk_tile<MR>(q, kt + c, ldk, hd, s + c);
}

template <int MR>
NKV_AVX2 void pv_rows(const float* p, const float* v, int64_t n, int64_t hd, const float* alpha, float* o) {
    for (int64_t c = 0; c < hd; c += 16) pv_tile<MR>(p, v + c, n, hd, alpha, o + c);
}

struct Avx2Ops {  // hd % 16 == 0
    // S[R, ncols] = Qp[R, hd] K^T (kt: K^T with row stride ldk); ncols % 16 == 0.
    NKV_AVX2 static void qk(const float* qp, int64_t R, const float* kt, int64_t ldk, int64_t hd, int64_t ncols,
                            float* s) {
        int64_t r = 0;
        for (; r + kMR <= R; r += kMR) qk_rows<kMR>(qp + r * hd, kt, ldk, hd, ncols, s + r * kBK);
        switch (R - r) {
            case 5: qk_rows<5>(qp + r * hd, kt, ldk, hd, ncols, s + r * kBK); break;
            case 4: qk_rows<4>(qp + r * hd, kt, ldk, hd, ncols, s + r * kBK); break;
            case 3: qk_rows<3>(qp + r * hd, kt, ldk, hd, ncols, s + r * kBK); break;
            case 2: qk_rows<2>(qp + r * hd, kt, ldk, hd, ncols, s + r * kBK); break;
            case 1: qk_rows<1>(qp + r * hd, kt, ldk, hd, ncols, s + r * kBK); break;
            default: break;
        }
    }
    // One row's softmax step over ncols (% 16 == 0) scores of which the first nv are visible:
    // s <- 2^(s - m_new) (0 where masked); returns the row's sum; m updated, alpha = 2^(m_old - m_new).
    NKV_AVX2 static float softmax_row(float* s, int64_t nv, int64_t ncols, float* m, float* alpha) {
        for (int64_t k = nv; k < ncols; ++k) s[k] = kNegInf;
        __m256 mx = _mm256_set1_ps(kNegInf);
        for (int64_t k = 0; k < ncols; k += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + k));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        const float bmax = std::max(_mm_cvtss_f32(h), _mm_cvtss_f32(_mm_movehdup_ps(h)));
        const float mn = std::max(*m, bmax);
        *alpha = *m == kNegInf ? 0.0f : std::exp2(*m - mn);
        *m = mn;
        const __m256 vm = _mm256_set1_ps(mn);
        __m256 sum0 = _mm256_setzero_ps(), sum1 = _mm256_setzero_ps();
        for (int64_t k = 0; k < ncols; k += 16) {
            const __m256 e0 = exp2_nonpos(_mm256_sub_ps(_mm256_loadu_ps(s + k), vm));
            const __m256 e1 = exp2_nonpos(_mm256_sub_ps(_mm256_loadu_ps(s + k + 8), vm));
            _mm256_storeu_ps(s + k, e0);
            _mm256_storeu_ps(s + k + 8, e1);
            sum0 = _mm256_add_ps(sum0, e0);
            sum1 = _mm256_add_ps(sum1, e1);
        }
        return hsum(_mm256_add_ps(sum0, sum1));
    }
    // O[R, hd] = O * alpha + P[R, :n] V[:n, hd].
    NKV_AVX2 static void pv(const float* p, int64_t R, const float* v, int64_t n, int64_t hd, const float* alpha,
                            float* o) {
        int64_t r = 0;
        for (; r + kMR <= R; r += kMR) pv_rows<kMR>(p + r * kBK, v, n, hd, alpha + r, o + r * hd);
        switch (R - r) {
            case 5: pv_rows<5>(p + r * kBK, v, n, hd, alpha + r, o + r * hd); break;
            case 4: pv_rows<4>(p + r * kBK, v, n, hd, alpha + r, o + r * hd); break;
            case 3: pv_rows<3>(p + r * kBK, v, n, hd, alpha + r, o + r * hd); break;
            case 2: pv_rows<2>(p + r * kBK, v, n, hd, alpha + r, o + r * hd); break;
            case 1: pv_rows<1>(p + r * kBK, v, n, hd, alpha + r, o + r * hd); break;
            default: break;
        }
    }
};

// ---------------------------------------------------------------- scalar kernels

struct ScalarOps {
    static void qk(const float* qp, int64_t R, const float* kt, int64_t ldk, int64_t hd, int64_t ncols, float* s) {
        for (int64_t r = 0; r < R; ++r) {
            float* sr = s + r * kBK;
            std::fill(sr, sr + ncols, 0.0f);
            for (int64_t d = 0; d < hd; ++d) {
                const float qv = qp[r * hd + d];
                const float* kr = kt + d * ldk;
                for (int64_t k = 0; k < ncols; ++k) sr[k] += qv * kr[k];
            }
        }
    }
    static float softmax_row(float* s, int64_t nv, int64_t ncols, float* m, float* alpha) {
        float bmax = kNegInf;
        for (int64_t k = 0; k < nv; ++k) bmax = std::max(bmax, s[k]);
        const float mn = std::max(*m, bmax);
        *alpha = *m == kNegInf ? 0.0f : std::exp2(*m - mn);
        *m = mn;
        float sum = 0.0f;
        for (int64_t k = 0; k < nv; ++k) {
            s[k] = std::exp2(s[k] - mn);
            sum += s[k];
        }
        std::fill(s + nv, s + ncols, 0.0f);
        return sum;
    }
    static void pv(const float* p, int64_t R, const float* v, int64_t n, int64_t hd, const float* alpha, float* o) {
        for (int64_t r = 0; r < R; ++r) {
            float* orow = o + r * hd;
            for (int64_t i = 0; i < hd; ++i) orow[i] *= alpha[r];
            for (int64_t k = 0; k < n; ++k) {
                const float pk = p[r * kBK + k];
                if (pk == 0.0f) continue;
                const float* vr = v + k * hd;
                for (int64_t i = 0; i < hd; ++i) orow[i] += pk * vr[i];
            }
        }
    }
};

// ---------------------------------------------------------------- driver

// K^T of KV head g's key block [b0, b0 + kBK) into kt [hd, kBK], zero past end.
void pack_kt(const PrefillArgs& a, int64_t g, int64_t b0, int64_t end, float* kt) {
    const int64_t hd = a.hd, n = std::clamp<int64_t>(end - b0, 0, kBK);
    const float* kb = a.k_cache + (g * a.capacity + b0) * hd;
    for (int64_t d = 0; d < hd; ++d) {
        float* dst = kt + d * kBK;
        for (int64_t k = 0; k < n; ++k) dst[k] = kb[k * hd + d];
        for (int64_t k = n; k < kBK; ++k) dst[k] = 0.0f;
    }
}

// One task: KV head g, query tokens [t0, t1); kt: that head's K^T blocks [n_kb, hd, kBK].
template <class Ops>
void run_task(const PrefillArgs& a, int64_t G, int64_t g, int64_t t0, int64_t t1, const float* kt, Scratch& sc) {
    const int64_t hd = a.hd, nt = t1 - t0, R = nt * G;
    sc.size(R, hd);
    const float qscale = kLog2e / std::sqrt(static_cast<float>(hd));
    // Pack Q: row r = t * G + j holds query head g * G + j of token t0 + t, scaled.
    for (int64_t t = 0; t < nt; ++t)
        for (int64_t j = 0; j < G; ++j) {
            const float* src = a.q + (t0 + t) * a.q_stride_t + (g * G + j) * a.q_stride_h;
            float* dst = sc.qp + (t * G + j) * hd;
            for (int64_t i = 0; i < hd; ++i) dst[i] = src[i] * qscale;
        }
    std::fill(sc.o, sc.o + R * hd, 0.0f);
    std::fill(sc.m, sc.m + R, kNegInf);
    std::fill(sc.l, sc.l + R, 0.0f);
    const float* vh = a.v_cache + g * a.capacity * hd;
    const int64_t end = a.start + t1;  // positions [0, end) are seen by some row
    for (int64_t b0 = 0; b0 < end; b0 += kBK) {
        const int64_t n = std::min(kBK, end - b0), ncols = (n + 15) / 16 * 16;
        // Rows whose token sees none of this block (only in the last blocks) are left out of
        // S, softmax and PV: the rows are ordered by token, so they form a tail.
        const int64_t first_blind = std::clamp<int64_t>(b0 - a.start - t0, 0, nt);  // tokens t < this see no key >= b0
        const int64_t r0 = first_blind * G;
        const int64_t Rb = R - r0;
        if (Rb <= 0) continue;
        Ops::qk(sc.qp + r0 * hd, Rb, kt + b0 * hd, kBK, hd, ncols, sc.s + r0 * kBK);
        for (int64_t r = r0; r < R; ++r) {
            const int64_t t = r / G;
            const int64_t nv = std::clamp<int64_t>(a.start + t0 + t + 1 - b0, 0, n);
            float alpha;
            const float sum = Ops::softmax_row(sc.s + r * kBK, nv, ncols, sc.m + r, &alpha);
            sc.l[r] = sc.l[r] * alpha + sum;
            sc.alpha[r] = alpha;
        }
        // P = sc.s[r0:R, :n] is complete here (another per-key matrix could be accumulated from it).
        Ops::pv(sc.s + r0 * kBK, Rb, vh + b0 * hd, n, hd, sc.alpha + r0, sc.o + r0 * hd);
    }
    for (int64_t t = 0; t < nt; ++t)
        for (int64_t j = 0; j < G; ++j) {
            const int64_t r = t * G + j;
            const float inv = 1.0f / sc.l[r];
            const float* src = sc.o + r * hd;
            float* dst = a.out + (t0 + t) * a.H * hd + (g * G + j) * hd;
            for (int64_t i = 0; i < hd; ++i) dst[i] = src[i] * inv;
        }
}

template <class Ops>
void prefill_typed(const PrefillArgs& a) {
    const int64_t G = a.H / a.kv_heads;
    const int64_t bq = std::max<int64_t>(1, kRows / G);  // tokens per task
    const int64_t n_qb = (a.n + bq - 1) / bq, n_tasks = a.kv_heads * n_qb;
    // Task c: query blocks from the last (most work) down, KV heads interleaved, so the dynamic
    // schedule starts the long tasks first.
    // K^T of every KV head, packed once in blocks: [kv_heads, n_kb, hd, kBK] (a block is contiguous, so its rows
    // do not alias in the cache), shared by the tasks.
    const int64_t end = a.start + a.n, n_kb = (end + kBK - 1) / kBK, ldk = n_kb * kBK;
    thread_local std::vector<float> kt_buf;
    kt_buf.resize(static_cast<size_t>(a.kv_heads * a.hd * ldk));
    float* const kt = kt_buf.data();
    auto pack = [&](int64_t u) {
        const int64_t g = u / n_kb;
        pack_kt(a, g, u % n_kb * kBK, end, kt + (g * ldk + u % n_kb * kBK) * a.hd);
    };
    auto task = [&](int64_t c, Scratch& sc) {
        const int64_t qb = n_qb - 1 - c / a.kv_heads, g = c % a.kv_heads;
        run_task<Ops>(a, G, g, qb * bq, std::min(a.n, (qb + 1) * bq), kt + g * a.hd * ldk, sc);
    };
    int nt = a.n_threads > 0 ? a.n_threads : omp_get_max_threads();
    nt = par::threads_after_guard(static_cast<int>(std::min<int64_t>(nt, n_tasks)));
    if (nt <= 1) {
        thread_local Scratch sc;
        for (int64_t u = 0; u < a.kv_heads * n_kb; ++u) pack(u);
        for (int64_t c = 0; c < n_tasks; ++c) task(c, sc);
    } else {
        par::run_team(a.kv_heads * n_kb, nt, [&](int64_t u, int) { pack(u); });
        par::run_team(n_tasks, nt, [&](int64_t c, int) {
            thread_local Scratch sc;
            task(c, sc);
        });
    }
}

}  // namespace

void prefill_attention(const PrefillArgs& a) {
    if (a.n <= 0) return;
    if (avx2_active() && a.hd % 16 == 0)
        prefill_typed<Avx2Ops>(a);
    else
        prefill_typed<ScalarOps>(a);
}

}  // namespace nodekv::ops
