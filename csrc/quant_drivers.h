// The matmul drivers over a format's dot (quant_matmul.cpp), written once and compiled once per SIMD level:
// quant_matmul.cpp includes this file twice, in namespace avx2 with NKV_SIMD = NKV_AVX2 and in namespace avx512 with
// NKV_SIMD = NKV_AVX512, so that the VNNI dots and the token pairs' 512-bit ones inline into drivers built for them.
// Hence no include guard. It sees quant_matmul.cpp's constants (kRowTile, kTokens, kSweepRows, kXChunkFloats) and
// AccOf, token_sum, prefetch_step: a format's accumulators are __m256, one per token, or for Pairs __m512, one per two
// tokens.

// Output rows [r, re) for TT tokens (prepared x at xp + t ldx, output at y + t ldy) of a weight w of N rows of nb
// blocks, R rows at a time, over blocks [b0, b1): each (row, token) accumulator starts at zero at block 0, runs
// F::dot over the blocks in order and becomes y = hsum + bias after the last; between chunks of blocks it waits in
// acc (row r + i's at acc + i TT). Not inlined: inlined into its callers with all the other (R, TT) instances,
// its loop spilled accumulators (one token took 7% longer).
template <class F, int R, int TT>
__attribute__((noinline)) NKV_SIMD void dot_rows(const float* xp, int64_t ldx, const uint8_t* w, int64_t N,
                                                 int64_t nb, const float* bias, float* y, int64_t ldy, int64_t r,
                                                 int64_t re, int64_t b0, int64_t b1, typename AccOf<F>::type* acc) {
    using Acc = typename AccOf<F>::type;
    constexpr int kAcc = (TT + AccOf<F>::kTokens - 1) / AccOf<F>::kTokens;  // accumulators per row
    const int64_t row_bytes = nb * F::kBytes;
    for (int64_t i = r; i < re; i += R) {
        // (the loops over the accumulators unrolled, so that they stay in registers: left as loops, GCC made
        // them a stack array set and copied with rep stos and memcpy for every row group, 3-10% of one token's
        // time)
        Acc a[R][kAcc];
#pragma GCC unroll 64
        for (int j = 0; j < R; ++j)
#pragma GCC unroll 64
            for (int t = 0; t < kAcc; ++t) a[j][t] = b0 == 0 ? Acc{} : acc[(i - r + j) * kAcc + t];
        const uint8_t* wr = w + i * row_bytes;
        // Software prefetch of what the sweep reads later: the next chunk of the row (contiguous), or after the
        // last, the rows a sweep further on, walked linearly (the R rows are contiguous). The hardware
        // prefetcher alone leaves one-token decode at about half the DRAM bandwidth.
        const uint8_t* pf = nullptr;
        if (b1 < nb)
            pf = wr + b1 * F::kBytes;
        else if (i + kSweepRows + R <= N)
            pf = wr + kSweepRows * row_bytes;
        for (int64_t b = b0; b < b1; ++b) {
            if (pf) prefetch_step<R * F::kBytes>(pf, b - b0);
            const float* xb = xp + b * F::kPrep;
            for (int j = 0; j < R; ++j) F::template dot<TT>(wr + j * row_bytes + b * F::kBytes, xb, ldx, a[j]);
        }
#pragma GCC unroll 64
        for (int j = 0; j < R; ++j) {
            if (b1 == nb) {
#pragma GCC unroll 64
                for (int t = 0; t < TT; ++t) y[t * ldy + i + j] = token_sum(a[j], t) + (bias ? bias[i + j] : 0.0f);
            } else {
#pragma GCC unroll 64
                for (int t = 0; t < kAcc; ++t) acc[(i - r + j) * kAcc + t] = a[j][t];
            }
        }
    }
}

// dot_rows over rows [r, re) for tn tokens (a run-time count up to TT): one token R rows at a time, so that they
// share its x loads (never in chunks: acc unused); more, one row at a time.
template <class F, int TT = kTokens>
NKV_SIMD void dot_sweep(int64_t tn, const float* xp, int64_t ldx, const uint8_t* w, int64_t N, int64_t nb,
                        const float* bias, float* y, int64_t ldy, int64_t r, int64_t re, int64_t b0, int64_t b1,
                        typename AccOf<F>::type* acc) {
    if constexpr (TT > 1) {
        if (tn < TT) return dot_sweep<F, TT - 1>(tn, xp, ldx, w, N, nb, bias, y, ldy, r, re, b0, b1, acc);
        dot_rows<F, 1, TT>(xp, ldx, w, N, nb, bias, y, ldy, r, re, b0, b1, acc);
    } else {
        // Rows share a block's x loads while its x fits in registers (32-element blocks). A K-quant super-block's
        // does not: the compiler would hoist and spill it, and one row at a time measured 15-20% faster.
        constexpr int R = F::kPrep <= 64 ? kRowTile : 1;
        const int64_t r_main = r + (re - r) / R * R;
        dot_rows<F, R, 1>(xp, ldx, w, N, nb, bias, y, ldy, r, r_main, b0, b1, nullptr);
        dot_rows<F, 1, 1>(xp, ldx, w, N, nb, bias, y, ldy, r_main, re, b0, b1, nullptr);
    }
}

// y[:, r0:r1] (+ bias) for T tokens of prepared x (xp, prepare_x's layout). One token runs over the rows in one go.
// More tokens go in passes of up to kTokens (of equal size, so that each has as many independent accumulator chains as
// it can; for Pairs, every pass but the last of an even size), kSweepRows rows at a time over chunks of K: a pass's
// chunk of x then stays in L1 while the rows stream past (8 tokens of 896 floats would not fit), and the rows stay in
// cache for the next pass.
template <class F>
NKV_SIMD void matmul_range(const float* xp, int64_t T, int64_t K, const uint8_t* w, int64_t N, const float* bias,
                           float* y, int64_t ldy, int64_t r0, int64_t r1) {
    const int64_t nb = K / F::kElems, ldx = nb * F::kPrep;
    if (T == 1) {
        dot_sweep<F>(1, xp, ldx, w, N, nb, bias, y, ldy, r0, r1, 0, nb, nullptr);
        return;
    }
    const int64_t passes = (T + kTokens - 1) / kTokens;
    constexpr int kPer = AccOf<F>::kTokens;  // tokens per prepared x row: a pass must start on a row
    typename AccOf<F>::type acc[kSweepRows * kTokens];
    for (int64_t r = r0; r < r1; r += kSweepRows) {
        const int64_t re = std::min<int64_t>(r + kSweepRows, r1);
        for (int64_t p = 0, t0 = 0; p < passes; ++p) {
            int64_t tn = (T - t0) / (passes - p);
            if (p + 1 < passes) tn += (kPer - tn % kPer) % kPer;  // at most kTokens: kTokens is even
            const int64_t chunks = (nb * tn * F::kPrep / kPer + kXChunkFloats - 1) / kXChunkFloats;
            const int64_t kc = (nb + chunks - 1) / chunks;
            for (int64_t b0 = 0; b0 < nb; b0 += kc)
                dot_sweep<F>(tn, xp + t0 / kPer * ldx, ldx, w, N, nb, bias, y + t0 * ldy, ldy, r, re, b0,
                             std::min(b0 + kc, nb), acc);
            t0 += tn;
        }
    }
}
