// Paged attention for many queries (prefill), fp32, flash-style tiling; see paged_attention.h.
//
// K^T is packed once per call in blocks of kBK keys ([kv_heads, n_kb, hd, kBK], gathered from the
// pages), and V too unless every key block lies within one page (page_size % kBK == 0) of floats
// (half pages are converted as they are packed). Work is
// split into tasks of one block of query tokens each, holding all their query heads: per KV head,
// the rows of the G = H / kv_heads query heads that share it (row r = t * G + j) walk the key
// blocks from position 0 up to the block's last token (blocks fully above the diagonal are
// skipped), compute the score tile S = Q K^T with a register-blocked FMA kernel, update a running
// max and sum per row (online softmax, in base 2 with scale * log2(e) folded into the packed Q),
// and accumulate O += P V. The FMA kernels are written once for both widths: AVX2 takes tiles of 6
// rows x 16 columns, AVX-512 12 x 32 (for hd % 32 == 0), summing in the same order, so with the same
// bits. As a task owns its query rows, it adds their node mass straight into the caller's matrix,
// head after head: no races and an order that does not depend on threads.
//
// Node mass: nodes are runs of keys and all rows of a task walk the keys in the same order, so
// they share one open node (TaskMass). Its sums, one per row, are topped up from the probability
// tile P of each key block (a block inside one node adds the row sums the softmax computed anyway)
// and scaled with the output when a row's max rises; when the walk leaves the node they are stored
// with the max they were taken at, and at the end each becomes sum * 2^(ref - m) / l. Extra work:
// a sum per row and node boundary in a block, a copy of two floats per (row, node) and one exp2
// per (row, node) at the end. Scratch: 2 floats per (row, node) per thread.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_common.h"
#include "cpu_ops.h"
#include "paged_attention.h"

namespace nodekv::ops {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLog2e = 1.44269504088896341f;
constexpr int64_t kBK = 64;     // keys per block (the packed K^T tile is [hd, kBK])
constexpr int64_t kRows = 96;   // target query rows (tokens x G) per KV head of a task

// Per-thread scratch of one task: rows R = tokens x G; with node mass (n_nodes > 0) the node sums
// of TaskMass.
struct Scratch {
    std::vector<float> buf;
    float *qp, *s, *o, *m, *l, *alpha, *bsum, *w, *segs, *acc, *ref;
    void size(int64_t R, int64_t hd, int64_t n_nodes) {
        const int64_t need = R * hd + R * kBK + R * hd + 5 * R + (n_nodes ? kBK * R + 2 * R * n_nodes : 0);
        if (static_cast<int64_t>(buf.size()) < need) buf.resize(static_cast<size_t>(need));
        qp = buf.data();
        s = qp + R * hd;
        o = s + R * kBK;
        m = o + R * hd;
        l = m + R;
        alpha = l + R;
        bsum = alpha + R;
        w = bsum + R;
        segs = w + R;
        acc = segs + (n_nodes ? kBK * R : 0);
        ref = acc + R * n_nodes;
    }
};

// ---------------------------------------------------------------- register tiles of either width
//
// Both products of the attention, S = Qp K^T and O = O * alpha + P V, are one GEMM: C = C * diag(alpha) + A B, with
// C = 0 first where alpha is null. A register tile holds MR rows of C by two vectors of columns: 2L columns, L =
// W::kLanes (8 for F32x8, 16 for F32x16).

// c[MR, 2L] (row stride ldc) = c * alpha[r] (or 0) + a[MR, :K] (row stride lda) . b[:K, 2L] (row stride ldb).
template <class W, int MR>
NKV_EITHER_WIDTH void gemm_tile(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t K, const float* alpha,
                                float* c, int64_t ldc) {
    using V = typename W::V;
    constexpr int L = W::kLanes;
    V c0[MR], c1[MR];
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
        if (alpha) {
            const V al = W::set1(alpha[r]);
            c0[r] = W::mul(W::load(c + r * ldc), al);
            c1[r] = W::mul(W::load(c + r * ldc + L), al);
        } else {
            c0[r] = c1[r] = W::zero();
        }
    }
    for (int64_t k = 0; k < K; ++k) {
        const V b0 = W::load(b + k * ldb), b1 = W::load(b + k * ldb + L);
#pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) {
            const V ar = W::set1(a[r * lda + k]);
            c0[r] = W::fmadd(ar, b0, c0[r]);
            c1[r] = W::fmadd(ar, b1, c1[r]);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
        W::store(c + r * ldc, c0[r]);
        W::store(c + r * ldc + L, c1[r]);
    }
}

// The tiles of `rows` (1 <= rows <= MR) rows of C over its N columns (N % 2L == 0): MR rows high, or fewer.
template <class W, int MR>
NKV_EITHER_WIDTH void gemm_rows(int64_t rows, const float* a, int64_t lda, const float* b, int64_t ldb, int64_t K,
                                int64_t N, const float* alpha, float* c, int64_t ldc) {
    if constexpr (MR > 1)
        if (rows < MR) return gemm_rows<W, MR - 1>(rows, a, lda, b, ldb, K, N, alpha, c, ldc);
    for (int64_t j = 0; j < N; j += 2 * W::kLanes) gemm_tile<W, MR>(a, lda, b + j, ldb, K, alpha, c + j, ldc);
}

// C[R, N] = C * diag(alpha) (or 0) + A[R, K] B[K, N] in tiles of up to MR rows.
template <class W, int MR>
NKV_EITHER_WIDTH void gemm(const float* a, int64_t lda, int64_t R, const float* b, int64_t ldb, int64_t K, int64_t N,
                           const float* alpha, float* c, int64_t ldc) {
    for (int64_t r = 0; r < R; r += MR)
        gemm_rows<W, MR>(std::min<int64_t>(MR, R - r), a + r * lda, lda, b, ldb, K, N, alpha ? alpha + r : nullptr,
                         c + r * ldc, ldc);
}

// Sums of 16 columns' lanes, AVX2's two vectors of 8 or one of 16 (the same lanes side by side), added in one order.
NKV_AVX2 inline float lane_total(const __m256 (&s)[2]) { return hsum(_mm256_add_ps(s[0], s[1])); }
NKV_AVX512 inline float lane_total(const __m512 (&s)[1]) {
    return hsum(_mm256_add_ps(_mm512_castps512_ps256(s[0]), _mm512_extractf32x8_ps(s[0], 1)));
}

// One row's softmax step over ncols (a multiple of 2L, so of 16) scores of which the first nv are visible:
// s <- 2^(s - m_new) (0 where masked); returns the row's sum; m updated, alpha = 2^(m_old - m_new).
template <class W>
NKV_EITHER_WIDTH float softmax_step(float* s, int64_t nv, int64_t ncols, float* m, float* alpha) {
    using V = typename W::V;
    constexpr int L = W::kLanes, A = 16 / L;  // the row sum's accumulators: each sums its lanes of every 16 columns
    for (int64_t k = nv; k < ncols; ++k) s[k] = kNegInf;
    V mx = W::set1(kNegInf);
    for (int64_t k = 0; k < ncols; k += L) mx = W::max(mx, W::load(s + k));
    const float mn = std::max(*m, W::reduce_max(mx));
    *alpha = *m == kNegInf ? 0.0f : std::exp2(*m - mn);
    *m = mn;
    const V vm = W::set1(mn);
    V sum[A];
    for (int a = 0; a < A; ++a) sum[a] = W::zero();
    for (int64_t k = 0; k < ncols; k += 16)
        for (int a = 0; a < A; ++a) {
            const V e = exp2_nonpos<W>(W::sub(W::load(s + k + a * L), vm));
            W::store(s + k + a * L, e);
            sum[a] = W::add(sum[a], e);
        }
    return lane_total(sum);
}

// ---------------------------------------------------------------- AVX2 kernels

constexpr int kMR = 6;  // rows per tile: 12 accumulators + 2 loads + a broadcast of the 16 registers

struct Avx2Ops {  // hd % 16 == 0
    static constexpr int64_t kCols = 16;  // S is computed in column tiles of kCols
    // S[R, ncols] = Qp[R, hd] K^T (kt: K^T with row stride ldk); ncols % kCols == 0.
    NKV_AVX2 static void qk(const float* qp, int64_t R, const float* kt, int64_t ldk, int64_t hd, int64_t ncols,
                            float* s) {
        gemm<F32x8, kMR>(qp, hd, R, kt, ldk, hd, ncols, nullptr, s, kBK);
    }
    NKV_AVX2 static float softmax_row(float* s, int64_t nv, int64_t ncols, float* m, float* alpha) {
        return softmax_step<F32x8>(s, nv, ncols, m, alpha);
    }
    // O[R, hd] = O * alpha + P[R, :n] V[:n, hd].
    NKV_AVX2 static void pv(const float* p, int64_t R, const float* v, int64_t n, int64_t hd, const float* alpha,
                            float* o) {
        gemm<F32x8, kMR>(p, kBK, R, v, hd, n, hd, alpha, o, hd);
    }
    // out[k * ldo + i] = sum(p[i * kBK + off[k], i * kBK + off[k + 1])) for rows i < R and segments k <
    // nseg (0 = off[0] < ... < off[nseg] = n <= kBK; p's columns past n up to a multiple of 8 are 0).
    // Many short segments go 8 rows at a time: an 8x8 transpose turns columns into vectors of rows.
    NKV_AVX2 static void seg_sums(const float* p, int64_t R, const int64_t* off, int64_t nseg, float* out,
                                  int64_t ldo) {
        int64_t i = 0;
        if (nseg > 2) {
            const int64_t n = off[nseg];
            bool last[kBK + 8] = {};  // column c ends a segment
            for (int64_t k = 1; k <= nseg; ++k) last[off[k] - 1] = true;
            for (; i + 8 <= R; i += 8) {
                const float* pi = p + i * kBK;
                __m256 acc = _mm256_setzero_ps();
                float* dst = out + i;
                for (int64_t c = 0; c < n; c += 8) {
                    __m256 col[8];
                    transpose8(pi + c, kBK, col);
                    for (int q = 0; q < 8; ++q) {
                        acc = _mm256_add_ps(acc, col[q]);
                        if (last[c + q]) {
                            _mm256_storeu_ps(dst, acc);
                            acc = _mm256_setzero_ps();
                            dst += ldo;
                        }
                    }
                }
            }
        }
        for (; i < R; ++i)
            for (int64_t k = 0; k < nseg; ++k) out[k * ldo + i] = sum_avx2(p + i * kBK + off[k], off[k + 1] - off[k]);
    }
    // col[q][j] = p[j * ld + q]: the 8 x 8 block at p transposed.
    NKV_AVX2 static void transpose8(const float* p, int64_t ld, __m256 col[8]) {
        __m256 r[8], t[8];
        for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(p + j * ld);
        for (int j = 0; j < 4; ++j) {
            t[2 * j] = _mm256_unpacklo_ps(r[2 * j], r[2 * j + 1]);
            t[2 * j + 1] = _mm256_unpackhi_ps(r[2 * j], r[2 * j + 1]);
        }
        // t[0] = r0r1 lanes 0,1 | 4,5 interleaved ...: combine pairs of pairs, then the 128-bit halves
        const __m256 u0 = _mm256_shuffle_ps(t[0], t[2], _MM_SHUFFLE(1, 0, 1, 0));
        const __m256 u1 = _mm256_shuffle_ps(t[0], t[2], _MM_SHUFFLE(3, 2, 3, 2));
        const __m256 u2 = _mm256_shuffle_ps(t[1], t[3], _MM_SHUFFLE(1, 0, 1, 0));
        const __m256 u3 = _mm256_shuffle_ps(t[1], t[3], _MM_SHUFFLE(3, 2, 3, 2));
        const __m256 u4 = _mm256_shuffle_ps(t[4], t[6], _MM_SHUFFLE(1, 0, 1, 0));
        const __m256 u5 = _mm256_shuffle_ps(t[4], t[6], _MM_SHUFFLE(3, 2, 3, 2));
        const __m256 u6 = _mm256_shuffle_ps(t[5], t[7], _MM_SHUFFLE(1, 0, 1, 0));
        const __m256 u7 = _mm256_shuffle_ps(t[5], t[7], _MM_SHUFFLE(3, 2, 3, 2));
        col[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
        col[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
        col[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
        col[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
        col[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
        col[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
        col[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
        col[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
    }
    // w[r] = acc[r] * 2^(ref[r] - m[r]) * inv_l[r] for r < R (ref <= m).
    NKV_AVX2 static void node_probs(const float* acc, const float* ref, const float* m, const float* inv_l, int64_t R,
                                    float* w) {
        int64_t r = 0;
        for (; r + 8 <= R; r += 8) {
            const __m256 e = exp2_nonpos<F32x8>(_mm256_sub_ps(_mm256_loadu_ps(ref + r), _mm256_loadu_ps(m + r)));
            const __m256 p = _mm256_mul_ps(_mm256_loadu_ps(acc + r), e);
            _mm256_storeu_ps(w + r, _mm256_mul_ps(p, _mm256_loadu_ps(inv_l + r)));
        }
        for (; r < R; ++r) w[r] = acc[r] * std::exp2(ref[r] - m[r]) * inv_l[r];
    }
};

// ---------------------------------------------------------------- AVX-512 kernels
//
// The GEMM and the softmax step above on 16 lanes, summing in the AVX2 order (a row's 16 lanes are AVX2's two
// accumulators side by side): the AVX2 bits.

constexpr int kMR512 = 12;  // rows per tile: 24 accumulators + 2 loads + a broadcast of the 32 registers

struct Avx512Ops : Avx2Ops {  // hd % 32 == 0
    static constexpr int64_t kCols = 32;
    NKV_AVX512 static void qk(const float* qp, int64_t R, const float* kt, int64_t ldk, int64_t hd, int64_t ncols,
                              float* s) {
        gemm<F32x16, kMR512>(qp, hd, R, kt, ldk, hd, ncols, nullptr, s, kBK);
    }
    NKV_AVX512 static float softmax_row(float* s, int64_t nv, int64_t ncols, float* m, float* alpha) {
        return softmax_step<F32x16>(s, nv, ncols, m, alpha);
    }
    NKV_AVX512 static void pv(const float* p, int64_t R, const float* v, int64_t n, int64_t hd, const float* alpha,
                              float* o) {
        gemm<F32x16, kMR512>(p, kBK, R, v, hd, n, hd, alpha, o, hd);
    }
};

// ---------------------------------------------------------------- scalar kernels

struct ScalarOps {
    static constexpr int64_t kCols = 16;
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
    static void seg_sums(const float* p, int64_t R, const int64_t* off, int64_t nseg, float* out, int64_t ldo) {
        for (int64_t i = 0; i < R; ++i)
            for (int64_t k = 0; k < nseg; ++k) {
                float sum = 0.0f;
                for (int64_t c = off[k]; c < off[k + 1]; ++c) sum += p[i * kBK + c];
                out[k * ldo + i] = sum;
            }
    }
    static void node_probs(const float* acc, const float* ref, const float* m, const float* inv_l, int64_t R,
                           float* w) {
        for (int64_t r = 0; r < R; ++r) w[r] = acc[r] * std::exp2(ref[r] - m[r]) * inv_l[r];
    }
};

// ---------------------------------------------------------------- driver

// Packed K^T (and V) shared by the tasks of one call.
struct Packed {
    const float* kt;  // [kv_heads, n_kb, hd, kBK]: K^T of key block kb of KV head g, zero past end
    const float* v;   // [kv_heads, n_kb, kBK, hd], or nullptr: V rows are read from the pages
    int64_t n_kb;
};

// Block kb of KV head g into the packed buffers (vp: nullptr unless V is packed, as it always is
// from half pages).
void pack_block(const PagedArgs& a, int64_t g, int64_t kb, int64_t n_kb, float* kt, float* vp) {
    const int64_t hd = a.hd, b0 = kb * kBK, n = std::min(kBK, a.end - b0);
    const float* krow[kBK];
    const float* vrow[kBK];
    float* vdst = vp ? vp + (g * n_kb + kb) * kBK * hd : nullptr;
    if (a.kv_half) {  // V straight into its packed block, K via a per-thread fp32 copy
        thread_local std::vector<float> kf;
        kf.resize(static_cast<size_t>(kBK * hd));
        a.rows_to_floats(b0, n, g, kf.data(), vdst);
        for (int64_t k = 0; k < n; ++k) krow[k] = kf.data() + k * hd;
    } else {
        a.rows(b0, n, g, krow, vrow);
        if (vdst)
            for (int64_t k = 0; k < n; ++k) std::memcpy(vdst + k * hd, vrow[k], sizeof(float) * hd);
    }
    float* dst = kt + (g * n_kb + kb) * hd * kBK;
    for (int64_t k = 0; k < n; ++k)
        for (int64_t d = 0; d < hd; ++d) dst[d * kBK + k] = krow[k][d];
    for (int64_t d = 0; d < hd; ++d) std::fill(dst + d * kBK + n, dst + (d + 1) * kBK, 0.0f);
}

// Node mass of one task and KV head. All rows walk the same key blocks in the same order (a row
// only drops out of the last ones), so they share the node whose sums are still open: `open`,
// the node of the last keys seen. Its sums acc[open, r] ([node, row]) are kept at each row's
// running max, scaled by alpha with the output. When the walk enters the next node they are
// closed: ref[open, r] records the max they were taken at, for the rows' final max and sum to turn
// them into probabilities at the end.
struct TaskMass {
    int64_t R, open;
    float *acc, *ref;

    float* open_sums() const { return acc + open * R; }
    void close(const float* m) const {
        if (open >= 0) std::copy(m, m + R, ref + open * R);
    }
    // Enter node k (> open).
    void enter(int64_t k, const float* m) {
        close(m);
        open = k;
        std::fill(open_sums(), open_sums() + R, 0.0f);
    }
};

// col[t * ld] += sum_i w[t * G + i] for t < nt: the G query heads of a KV head, summed in order.
template <int kG>
void add_heads_g(const float* w, int64_t nt, float* col, int64_t ld) {
    for (int64_t t = 0; t < nt; ++t) {
        float add = w[t * kG];
        for (int i = 1; i < kG; ++i) add += w[t * kG + i];
        col[t * ld] += add;
    }
}
void add_heads(const float* w, int64_t nt, int64_t G, float* col, int64_t ld) {
    switch (G) {
        case 1: add_heads_g<1>(w, nt, col, ld); return;
        case 2: add_heads_g<2>(w, nt, col, ld); return;
        case 3: add_heads_g<3>(w, nt, col, ld); return;
        case 4: add_heads_g<4>(w, nt, col, ld); return;
        default:
            for (int64_t t = 0; t < nt; ++t) {
                float add = w[t * G];
                for (int64_t i = 1; i < G; ++i) add += w[t * G + i];
                col[t * ld] += add;
            }
    }
}

// One task: query tokens [t0, t1), every KV head in turn.
template <class Ops>
void run_task(const PagedArgs& a, int64_t G, int64_t t0, int64_t t1, const Packed& pk, Scratch& sc) {
    const int64_t hd = a.hd, nt = t1 - t0, R = nt * G, start = a.end - a.n, N = a.mass ? a.n_nodes : 0;
    sc.size(R, hd, N);
    const float qscale = kLog2e / std::sqrt(static_cast<float>(hd));
    const int64_t end = start + t1;  // keys [0, end) are seen by some row
    const int32_t* bounds = a.node_bounds;
    for (int64_t g = 0; g < a.kv_heads; ++g) {
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
        const float* kt = pk.kt + g * pk.n_kb * hd * kBK;
        TaskMass tm{R, -1, sc.acc, sc.ref};
        int64_t jb = 0;  // with mass: the node holding b0
        for (int64_t b0 = 0; b0 < end; b0 += kBK) {
            const int64_t n = std::min(kBK, end - b0), ncols = (n + Ops::kCols - 1) / Ops::kCols * Ops::kCols;
            // Rows whose token sees none of this block (only in the last blocks) are left out of
            // S, softmax and PV: the rows are ordered by token, so they come first (tokens t <
            // first_blind see no key >= b0).
            const int64_t first_blind = std::clamp<int64_t>(b0 - start - t0, 0, nt);
            const int64_t r0 = first_blind * G;
            const int64_t Rb = R - r0;
            if (Rb <= 0) continue;
            Ops::qk(sc.qp + r0 * hd, Rb, kt + b0 * hd, kBK, hd, ncols, sc.s + r0 * kBK);
            for (int64_t r = r0; r < R; ++r) {
                const int64_t t = r / G;
                const int64_t nv = std::clamp<int64_t>(start + t0 + t + 1 - b0, 0, n);
                float alpha;
                const float sum = Ops::softmax_row(sc.s + r * kBK, nv, ncols, sc.m + r, &alpha);
                sc.l[r] = sc.l[r] * alpha + sum;
                sc.alpha[r] = alpha;
                sc.bsum[r] = sum;
            }
            if (N) {  // P = sc.s[r0:R, :n] at the rows' new max; masked keys hold 0
                if (tm.open >= 0)
                    for (int64_t r = r0; r < R; ++r) tm.open_sums()[r] *= sc.alpha[r];
                while (bounds[jb + 1] <= b0) ++jb;
                int64_t off[kBK + 1], nseg = 0;  // the block's keys in nodes jb, jb + 1, ...: [off[k], off[k + 1])
                off[0] = 0;
                while (off[nseg] < n) {
                    off[nseg + 1] = std::min<int64_t>(bounds[jb + nseg + 1] - b0, n);
                    ++nseg;
                }
                const float* sums = sc.bsum;  // the block lies in one node: the softmax's row sums
                if (nseg > 1) {
                    Ops::seg_sums(sc.s + r0 * kBK, Rb, off, nseg, sc.segs + r0, R);
                    sums = sc.segs;
                }
                for (int64_t k = 0; k < nseg; ++k, sums += R) {
                    if (jb + k != tm.open) tm.enter(jb + k, sc.m);
                    float* open = tm.open_sums();
                    for (int64_t r = r0; r < R; ++r) open[r] += sums[r];
                }
            }
            const float* vb = pk.v ? pk.v + (g * pk.n_kb + b0 / kBK) * kBK * hd : a.v_row(b0, g);
            Ops::pv(sc.s + r0 * kBK, Rb, vb, n, hd, sc.alpha + r0, sc.o + r0 * hd);
        }
        for (int64_t r = 0; r < R; ++r) sc.bsum[r] = 1.0f / sc.l[r];  // now 1 / l
        for (int64_t t = 0; t < nt; ++t)
            for (int64_t j = 0; j < G; ++j) {
                const int64_t r = t * G + j;
                const float* src = sc.o + r * hd;
                float* dst = a.out + (t0 + t) * a.H * hd + (g * G + j) * hd;
                for (int64_t i = 0; i < hd; ++i) dst[i] = src[i] * sc.bsum[r];
            }
        if (N) {
            // mass[t0 + t, j] += sum_j' acc[j, r] 2^(ref[j, r] - m[r]) / l[r] over the rows r = t * G + j'
            tm.close(sc.m);
            for (int64_t j = 0; j <= tm.open; ++j) {
                Ops::node_probs(tm.acc + j * R, tm.ref + j * R, sc.m, sc.bsum, R, sc.w);
                add_heads(sc.w, nt, G, a.mass + t0 * N + j, N);
            }
        }
    }
}

template <class Ops>
void prefill_typed(const PagedArgs& a) {
    const int64_t G = a.H / a.kv_heads;
    // Tokens per task: up to kRows rows per KV head, fewer for short inputs so that there are
    // tasks to share (at least ~8, of >= 12 rows). A row's result does not depend on the split.
    const int64_t bq = std::clamp<int64_t>((a.n + 7) / 8, (12 + G - 1) / G, std::max<int64_t>(1, kRows / G));
    const int64_t n_tasks = (a.n + bq - 1) / bq;
    const int64_t n_kb = (a.end + kBK - 1) / kBK;
    const bool pack_v = a.kv_half || a.page_size % kBK != 0;  // else V is read in place: a key block lies in one page
    thread_local std::vector<float> kt_buf, v_buf;
    kt_buf.resize(static_cast<size_t>(a.kv_heads * n_kb * a.hd * kBK));
    if (pack_v) v_buf.resize(static_cast<size_t>(a.kv_heads * n_kb * kBK * a.hd));
    // the caller's buffers, also for the worker threads (a thread_local named in a lambda is the running thread's)
    float* const kt = kt_buf.data();
    float* const vt = pack_v ? v_buf.data() : nullptr;
    const Packed pk{kt, vt, n_kb};
    auto pack = [&](int64_t u) { pack_block(a, u / n_kb, u % n_kb, n_kb, kt, vt); };
    // Task c: query blocks from the last (most work) down, so the dynamic schedule starts the
    // long tasks first.
    auto task = [&](int64_t c, Scratch& sc) {
        const int64_t qb = n_tasks - 1 - c;
        run_task<Ops>(a, G, qb * bq, std::min(a.n, (qb + 1) * bq), pk, sc);
    };
    int nt = a.n_threads > 0 ? a.n_threads : omp_get_max_threads();
    // QK^T and PV over the visible keys (the causal triangle of the new rows)
    const double work = 4.0 * a.H * a.hd * a.n * (a.end - 0.5 * a.n);
    nt = par::threads_after_guard(static_cast<int>(std::min<int64_t>(nt, n_tasks)), work);
    if (nt <= 1) {
        thread_local Scratch sc;
        for (int64_t u = 0; u < a.kv_heads * n_kb; ++u) pack(u);
        for (int64_t c = 0; c < n_tasks; ++c) task(c, sc);
    } else {
        par::run_team(a.kv_heads * n_kb, nt, [&](int64_t u, int) { pack(u); }, work);
        par::run_team(n_tasks, nt, [&](int64_t c, int) {
            thread_local Scratch sc;
            task(c, sc);
        }, work);
    }
}

}  // namespace

void prefill_attention(const PagedArgs& a) {
    if (a.n <= 0) return;
    const Isa isa = isa_now();
    if (isa >= Isa::kAvx512 && a.hd % 32 == 0)
        prefill_typed<Avx512Ops>(a);
    else if (isa >= Isa::kAvx2 && a.hd % 16 == 0)
        prefill_typed<Avx2Ops>(a);
    else
        prefill_typed<ScalarOps>(a);
}

}  // namespace nodekv::ops
