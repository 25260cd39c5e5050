// Small fp32 kernels for few-token steps; see cpu_ops.h for the math and the layouts.
#include "cpu_ops.h"

#include <algorithm>
#include <cmath>

#include "cpu_common.h"

namespace nodekv::ops {
namespace {

bool use_avx2() { return isa_now() >= Isa::kAvx2; }

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

// ---------------------------------------------------------------- AVX2 path

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

}  // namespace nodekv::ops
