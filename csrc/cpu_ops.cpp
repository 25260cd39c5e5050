// Small fp32 kernels for few-token steps; see cpu_ops.h for the math and the layouts.
#include "cpu_ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_common.h"

namespace nodekv::ops {
namespace {

std::atomic<bool> g_force_scalar{false};

bool use_avx2() { return cpu_has_avx2() && !g_force_scalar.load(std::memory_order_relaxed); }

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// A product the compiler may not fuse with the sum that follows into an FMA (GCC contracts
// intrinsics too), so that rope rounds as torch's separate multiplies and add do.
inline float mul_unfused(float a, float b) {
    float p = a * b;
    asm("" : "+x"(p));
    return p;
}

NKV_AVX2 inline __m256 mul_unfused(__m256 a, __m256 b) {
    __m256 p = _mm256_mul_ps(a, b);
    asm("" : "+x"(p));
    return p;
}

// ---------------------------------------------------------------- scalar path

void rms_norm_scalar(float* x, const float* delta, int64_t T, int64_t d, const float* w, float eps,
                     float* y) {
    for (int64_t t = 0; t < T; ++t) {
        float* xr = x + t * d;
        float* yr = y + t * d;
        float acc[8] = {};  // interleaved partial sums, as the SIMD path keeps them
        for (int64_t i = 0; i < d; ++i) {
            if (delta) xr[i] += delta[t * d + i];
            acc[i % 8] += xr[i] * xr[i];
        }
        const float ss = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
        const float inv = 1.0f / std::sqrt(ss / static_cast<float>(d) + eps);
        for (int64_t i = 0; i < d; ++i) yr[i] = xr[i] * inv * w[i];
    }
}

void rope_scalar(float* x, int64_t T, int64_t n_heads, int64_t hd, int64_t stride_t, int64_t stride_h,
                 const float* cos, const float* sin) {
    const int64_t half = hd / 2;
    for (int64_t t = 0; t < T; ++t) {
        const float* c = cos + t * hd;
        const float* s = sin + t * hd;
        for (int64_t h = 0; h < n_heads; ++h) {
            float* r = x + t * stride_t + h * stride_h;
            for (int64_t i = 0; i < half; ++i) {
                const float a = r[i], b = r[i + half];
                r[i] = mul_unfused(a, c[i]) + mul_unfused(b, s[i]);
                r[i + half] = mul_unfused(b, c[i + half]) + mul_unfused(a, s[i + half]);
            }
        }
    }
}

void silu_mul_scalar(const float* gu, int64_t T, int64_t I, float* y) {
    for (int64_t t = 0; t < T; ++t)
        for (int64_t i = 0; i < I; ++i) {
            const float g = gu[t * 2 * I + i];
            y[t * I + i] = g / (1.0f + std::exp(-g)) * gu[t * 2 * I + I + i];
        }
}

// Attention building blocks over one block of n cached positions (see attend_chunk). Rows of
// scores are r = t * G + j for token t and query head g * G + j; `ld` is their stride.
struct ScalarOps {
    static void scores(const float* qg, int64_t T, int64_t G, int64_t qst, int64_t qsh, const float* kb,
                       int64_t n, int64_t hd, float scale, float* sc, int64_t ld) {
        for (int64_t t = 0; t < T; ++t)
            for (int64_t j = 0; j < G; ++j) {
                const float* q = qg + t * qst + j * qsh;
                float* out = sc + (t * G + j) * ld;
                for (int64_t i = 0; i < n; ++i) {
                    float acc[8] = {};  // interleaved partial sums, as the SIMD path keeps them
                    for (int64_t c = 0; c < hd; ++c) acc[c % 8] += q[c] * kb[i * hd + c];
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
    static void pv(const float* p, int64_t ld, int64_t R, const float* vb, int64_t n, int64_t hd, float* o) {
        for (int64_t r = 0; r < R; ++r)
            for (int64_t i = 0; i < n; ++i)
                for (int64_t c = 0; c < hd; ++c) o[r * hd + c] += p[r * ld + i] * vb[i * hd + c];
    }
};

// ---------------------------------------------------------------- AVX2 path

// exp(x) for x <= 0 (NaN propagates): Cephes' expf polynomial on r = x - n ln2, times 2^n
// built as 2^n1 * 2^n2, so that results in the subnormal range come out right too. ~1 ulp.
NKV_AVX2 inline __m256 exp_nonpos(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-104.0f), x);  // exp(-104) < 2^-150 rounds to 0 anyway
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    const __m256 p = exp_reduced(r);
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

NKV_AVX2 void rms_norm_avx2(float* x, const float* delta, int64_t T, int64_t d, const float* w, float eps,
                            float* y) {
    for (int64_t t = 0; t < T; ++t) {
        float* xr = x + t * d;
        float* yr = y + t * d;
        const float* dr = delta ? delta + t * d : nullptr;
        auto load = [&](int64_t i) NKV_AVX2 {  // x[i..i+8), after the residual add
            __m256 v = _mm256_loadu_ps(xr + i);
            if (dr) {
                v = _mm256_add_ps(v, _mm256_loadu_ps(dr + i));
                _mm256_storeu_ps(xr + i, v);
            }
            return v;
        };
        __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
        int64_t i = 0;
        for (; i + 32 <= d; i += 32) {
            const __m256 v0 = load(i), v1 = load(i + 8), v2 = load(i + 16), v3 = load(i + 24);
            acc0 = _mm256_fmadd_ps(v0, v0, acc0);
            acc1 = _mm256_fmadd_ps(v1, v1, acc1);
            acc2 = _mm256_fmadd_ps(v2, v2, acc2);
            acc3 = _mm256_fmadd_ps(v3, v3, acc3);
        }
        for (; i + 8 <= d; i += 8) {
            const __m256 v = load(i);
            acc0 = _mm256_fmadd_ps(v, v, acc0);
        }
        float ss = hsum(_mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3)));
        for (int64_t k = i; k < d; ++k) {
            if (dr) xr[k] += dr[k];
            ss += xr[k] * xr[k];
        }
        const float inv_f = 1.0f / std::sqrt(ss / static_cast<float>(d) + eps);
        const __m256 inv = _mm256_set1_ps(inv_f);
        for (i = 0; i + 8 <= d; i += 8)
            _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), inv),
                                                   _mm256_loadu_ps(w + i)));
        for (; i < d; ++i) yr[i] = xr[i] * inv_f * w[i];
    }
}

NKV_AVX2 void rope_avx2(float* x, int64_t T, int64_t n_heads, int64_t hd, int64_t stride_t, int64_t stride_h,
                        const float* cos, const float* sin) {
    const int64_t half = hd / 2;  // a multiple of 8 here
    for (int64_t t = 0; t < T; ++t) {
        const float* c = cos + t * hd;
        const float* s = sin + t * hd;
        for (int64_t h = 0; h < n_heads; ++h) {
            float* r = x + t * stride_t + h * stride_h;
            for (int64_t i = 0; i < half; i += 8) {
                const __m256 a = _mm256_loadu_ps(r + i), b = _mm256_loadu_ps(r + half + i);
                const __m256 lo = _mm256_add_ps(mul_unfused(a, _mm256_loadu_ps(c + i)),
                                                mul_unfused(b, _mm256_loadu_ps(s + i)));
                const __m256 hi = _mm256_add_ps(mul_unfused(b, _mm256_loadu_ps(c + half + i)),
                                                mul_unfused(a, _mm256_loadu_ps(s + half + i)));
                _mm256_storeu_ps(r + i, lo);
                _mm256_storeu_ps(r + half + i, hi);
            }
        }
    }
}

// silu(g) * u with e = exp(-|g|) <= 1, which cannot overflow: silu(g) = g * (g >= 0 ? 1 : e) / (1 + e).
NKV_AVX2 inline __m256 silu_mul8(__m256 g, __m256 u) {
    const __m256 e = exp_nonpos(_mm256_or_ps(g, _mm256_set1_ps(-0.0f)));
    const __m256 num = _mm256_blendv_ps(_mm256_mul_ps(g, e), g, _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_GE_OQ));
    return _mm256_mul_ps(_mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

NKV_AVX2 void silu_mul_avx2(const float* gu, int64_t T, int64_t I, float* y) {
    for (int64_t t = 0; t < T; ++t) {
        const float* g = gu + t * 2 * I;
        const float* u = g + I;
        float* yr = y + t * I;
        int64_t i = 0;
        for (; i + 8 <= I; i += 8)
            _mm256_storeu_ps(yr + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
        if (i < I) {
            const __m256i m = tail_mask(I - i);
            _mm256_maskstore_ps(yr + i, m, silu_mul8(_mm256_maskload_ps(g + i, m), _mm256_maskload_ps(u + i, m)));
        }
    }
}

// [sum(a[0]), ..., sum(a[7])]: eight horizontal sums at once.
NKV_AVX2 inline __m256 hsum8(const __m256 a[8]) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// o[r, c..c+8CW) += sum_i p[r, i] * v[i, c..c+8CW) for RT rows: each V load feeds RT FMAs, and
// RT x CW >= 8 independent accumulators keep both FMA pipes busy despite the 4-cycle latency.
template <int RT, int CW>
NKV_AVX2 void pv_tile(const float* p, int64_t ld, const float* vb, int64_t n, int64_t hd, float* o) {
    for (int64_t c = 0; c < hd; c += 8 * CW) {
        __m256 acc[RT][CW];
        for (int r = 0; r < RT; ++r)
            for (int w = 0; w < CW; ++w) acc[r][w] = _mm256_loadu_ps(o + r * hd + c + 8 * w);
        for (int64_t i = 0; i < n; ++i) {
            __m256 pr[RT];
            for (int r = 0; r < RT; ++r) pr[r] = _mm256_broadcast_ss(p + r * ld + i);
            for (int w = 0; w < CW; ++w) {
                const __m256 v = _mm256_loadu_ps(vb + i * hd + c + 8 * w);
                for (int r = 0; r < RT; ++r) acc[r][w] = _mm256_fmadd_ps(pr[r], v, acc[r][w]);
            }
        }
        for (int r = 0; r < RT; ++r)
            for (int w = 0; w < CW; ++w) _mm256_storeu_ps(o + r * hd + c + 8 * w, acc[r][w]);
    }
}

// Rows of the PV product per tile: up to 12 accumulators (+ the V vector and RT broadcasts).
template <int CW>
NKV_AVX2 void pv_rows(const float* p, int64_t ld, int64_t R, const float* vb, int64_t n, int64_t hd, float* o) {
    constexpr int kTile = 12 / CW;
    for (int64_t r = 0; r < R; r += kTile) {
        const float* pr = p + r * ld;
        float* orow = o + r * hd;
        switch (std::min<int64_t>(kTile, R - r)) {
            case 6: pv_tile<6, CW>(pr, ld, vb, n, hd, orow); break;
            case 5: pv_tile<5, CW>(pr, ld, vb, n, hd, orow); break;
            case 4: pv_tile<4, CW>(pr, ld, vb, n, hd, orow); break;
            case 3: pv_tile<3, CW>(pr, ld, vb, n, hd, orow); break;
            case 2: pv_tile<2, CW>(pr, ld, vb, n, hd, orow); break;
            default: pv_tile<1, CW>(pr, ld, vb, n, hd, orow); break;
        }
    }
}

// Scores of one query row against positions [i0, n): 8 positions per step, so one q load feeds 8 FMAs.
NKV_AVX2 void scores_row(const float* q, const float* kb, int64_t i0, int64_t n, int64_t hd, float scale,
                         float* out) {
    const __m256 vscale = _mm256_set1_ps(scale);
    int64_t i = i0;
    for (; i + 8 <= n; i += 8) {
        __m256 acc[8];
        for (int k = 0; k < 8; ++k) acc[k] = _mm256_setzero_ps();
        for (int64_t c = 0; c < hd; c += 8) {
            const __m256 qv = _mm256_loadu_ps(q + c);
            for (int k = 0; k < 8; ++k) acc[k] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kb + (i + k) * hd + c), acc[k]);
        }
        _mm256_storeu_ps(out + i, _mm256_mul_ps(hsum8(acc), vscale));
    }
    for (; i < n; ++i) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t c = 0; c < hd; c += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), _mm256_loadu_ps(kb + i * hd + c), acc);
        out[i] = hsum(acc) * scale;
    }
}

// Scores of two query rows: 2 rows x 4 positions per step, 6 loads per 8 FMAs instead of 9.
NKV_AVX2 void scores_row_pair(const float* q0, const float* q1, const float* kb, int64_t n, int64_t hd,
                              float scale, float* out0, float* out1) {
    const __m256 vscale = _mm256_set1_ps(scale);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        __m256 acc[8];  // row 0 at positions i..i+3, then row 1
        for (int k = 0; k < 8; ++k) acc[k] = _mm256_setzero_ps();
        for (int64_t c = 0; c < hd; c += 8) {
            const __m256 qa = _mm256_loadu_ps(q0 + c), qb = _mm256_loadu_ps(q1 + c);
            for (int k = 0; k < 4; ++k) {
                const __m256 kv = _mm256_loadu_ps(kb + (i + k) * hd + c);
                acc[k] = _mm256_fmadd_ps(qa, kv, acc[k]);
                acc[4 + k] = _mm256_fmadd_ps(qb, kv, acc[4 + k]);
            }
        }
        const __m256 s = _mm256_mul_ps(hsum8(acc), vscale);
        _mm_storeu_ps(out0 + i, _mm256_castps256_ps128(s));
        _mm_storeu_ps(out1 + i, _mm256_extractf128_ps(s, 1));
    }
    scores_row(q0, kb, i, n, hd, scale, out0);
    scores_row(q1, kb, i, n, hd, scale, out1);
}

struct Avx2Ops {  // hd % 16 == 0
    NKV_AVX2 static void scores(const float* qg, int64_t T, int64_t G, int64_t qst, int64_t qsh, const float* kb,
                                int64_t n, int64_t hd, float scale, float* sc, int64_t ld) {
        const int64_t R = T * G;
        auto qrow = [&](int64_t r) { return qg + r / G * qst + r % G * qsh; };
        int64_t r = 0;
        for (; r + 2 <= R; r += 2)
            scores_row_pair(qrow(r), qrow(r + 1), kb, n, hd, scale, sc + r * ld, sc + (r + 1) * ld);
        if (r < R) scores_row(qrow(r), kb, 0, n, hd, scale, sc + r * ld);
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
    static void pv(const float* p, int64_t ld, int64_t R, const float* vb, int64_t n, int64_t hd, float* o) {
        if (hd % 32 == 0)
            pv_rows<4>(p, ld, R, vb, n, hd, o);
        else
            pv_rows<2>(p, ld, R, vb, n, hd, o);
    }
};

// ---------------------------------------------------------------- attention driver

// Positions per softmax block: K and V blocks of <= 16 KiB each stay in L1 while every row of
// the group reads them.
int64_t block_positions(int64_t hd) { return std::clamp<int64_t>(4096 / hd / 8 * 8, 8, 64); }

// Positions per chunk, the unit of work shared among threads: fixed, so that the thread count
// does not change the results.
constexpr int64_t kChunk = 128;

// Below this many multiply-adds (QK^T and PV together) a fork/join costs more than it saves.
constexpr int64_t kParallelMacs = int64_t{1} << 17;

// Online softmax over positions [s0, s1) of KV head g for its R = T * G query rows. Leaves
// the unnormalised output in o [R, hd], the running max in m [R] and the sum in l [R]; a row
// that sees none of these positions gets m = -inf, l = 0, o = 0.
template <class Ops>
void attend_chunk(const AttentionArgs& a, int64_t G, float scale, int64_t g, int64_t s0, int64_t s1, float* o,
                  float* m, float* l, float* sc) {
    const int64_t R = a.T * G, hd = a.hd, bs = block_positions(hd);
    std::fill(o, o + R * hd, 0.0f);
    std::fill(m, m + R, kNegInf);
    std::fill(l, l + R, 0.0f);
    const float* qg = a.q + g * G * a.q_stride_h;
    const float* kh = a.k_cache + g * a.capacity * hd;
    const float* vh = a.v_cache + g * a.capacity * hd;
    for (int64_t b0 = s0; b0 < s1; b0 += bs) {
        const int64_t n = std::min(bs, s1 - b0);
        Ops::scores(qg, a.T, G, a.q_stride_t, a.q_stride_h, kh + b0 * hd, n, hd, scale, sc, bs);
        for (int64_t t = 0; t < a.T; ++t) {
            const int64_t nv = std::clamp<int64_t>(a.start + t + 1 - b0, 0, n);  // causal: visible positions
            for (int64_t j = 0; j < G; ++j) {
                const int64_t r = t * G + j;
                float* p = sc + r * bs;
                std::fill(p + nv, p + n, 0.0f);
                if (nv == 0) continue;
                const float mn = std::max(m[r], Ops::max(p, nv));
                const float alpha = m[r] == kNegInf ? 0.0f : std::exp(m[r] - mn);
                l[r] = l[r] * alpha + Ops::exp_sum(p, nv, mn);
                if (alpha != 1.0f)
                    for (int64_t c = 0; c < hd; ++c) o[r * hd + c] *= alpha;
                m[r] = mn;
            }
        }
        Ops::pv(sc, bs, R, vh + b0 * hd, n, hd, o);
    }
}

template <class Ops>
void attention_typed(const AttentionArgs& a) {
    const int64_t G = a.H / a.kv_heads, R = a.T * G, hd = a.hd, end = a.start + a.T;
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    const int64_t n_split = (end + kChunk - 1) / kChunk, n_units = a.kv_heads * n_split;
    const int64_t unit_floats = R * (hd + 2);  // o [R, hd], m [R], l [R]
    thread_local std::vector<float> results_buf, wts_buf;  // reused: called once per layer and token
    results_buf.resize(static_cast<size_t>(n_units * unit_floats));
    wts_buf.resize(static_cast<size_t>(n_split));
    float* const results = results_buf.data();  // the caller's buffer, also for the worker threads
    float* const wts = wts_buf.data();

    auto run_unit = [&](int64_t u) {
        thread_local std::vector<float> sc;
        sc.resize(static_cast<size_t>(R * block_positions(hd)));
        const int64_t g = u / n_split, c = u % n_split;
        float* res = results + u * unit_floats;
        attend_chunk<Ops>(a, G, scale, g, c * kChunk, std::min(end, (c + 1) * kChunk), res, res + R * hd,
                          res + R * hd + R, sc.data());
    };
    int nt = a.n_threads > 0 ? a.n_threads : omp_get_max_threads();
    if (2 * a.H * a.T * end * hd < kParallelMacs) nt = 1;
    nt = par::threads_after_guard(static_cast<int>(std::min<int64_t>(nt, n_units)));
    if (nt <= 1)
        for (int64_t u = 0; u < n_units; ++u) run_unit(u);
    else
        par::run_team(n_units, nt, [&](int64_t u, int) { run_unit(u); });

    // Merge the chunks of each row: out = sum_c o_c e^(m_c - M) / sum_c l_c e^(m_c - M), M = max_c m_c
    // (finite: chunk 0 holds position 0, which every row sees).
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
        }
}

}  // namespace

void rms_norm(const float* x, int64_t T, int64_t d, const float* w, float eps, float* y) {
    // Without delta x is only read; the kernels take it non-const for the fused residual add.
    float* xm = const_cast<float*>(x);
    if (use_avx2())
        rms_norm_avx2(xm, nullptr, T, d, w, eps, y);
    else
        rms_norm_scalar(xm, nullptr, T, d, w, eps, y);
}

void add_rms_norm(float* x, const float* delta, int64_t T, int64_t d, const float* w, float eps, float* y) {
    if (use_avx2())
        rms_norm_avx2(x, delta, T, d, w, eps, y);
    else
        rms_norm_scalar(x, delta, T, d, w, eps, y);
}

void rope(float* x, int64_t T, int64_t n_heads, int64_t hd, int64_t stride_t, int64_t stride_h, const float* cos,
          const float* sin_signed) {
    if (use_avx2() && hd % 16 == 0)
        rope_avx2(x, T, n_heads, hd, stride_t, stride_h, cos, sin_signed);
    else
        rope_scalar(x, T, n_heads, hd, stride_t, stride_h, cos, sin_signed);
}

void silu_mul(const float* gu, int64_t T, int64_t I, float* y) {
    if (use_avx2())
        silu_mul_avx2(gu, T, I, y);
    else
        silu_mul_scalar(gu, T, I, y);
}

void decode_attention(const AttentionArgs& a) {
    if (a.T <= 0) return;
    if (a.k_new)
        for (int64_t t = 0; t < a.T; ++t)
            for (int64_t g = 0; g < a.kv_heads; ++g) {
                const int64_t dst = g * a.capacity * a.hd + (a.start + t) * a.hd;
                std::memcpy(a.k_cache + dst, a.k_new + t * a.k_new_stride_t + g * a.k_new_stride_h,
                            sizeof(float) * a.hd);
                std::memcpy(a.v_cache + dst, a.v_new + t * a.v_new_stride_t + g * a.v_new_stride_h,
                            sizeof(float) * a.hd);
            }
    if (use_avx2() && a.hd % 16 == 0)
        attention_typed<Avx2Ops>(a);
    else
        attention_typed<ScalarOps>(a);
}

const char* active_isa() { return use_avx2() ? "avx2" : "scalar"; }

bool avx2_active() { return use_avx2(); }

void set_force_scalar(bool on) { g_force_scalar.store(on, std::memory_order_relaxed); }

}  // namespace nodekv::ops
