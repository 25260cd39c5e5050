// The ggml block formats, one traits struct each; the matmul drivers (quant_matmul.cpp) are templates
// over them, and nothing else knows a layout. A format F provides:
//
//   kType, kElems, kBytes   its type id, elements per block (32, or 256 for a K-quant super-block), bytes
//   decode(blk, out)        the block's weights exactly as gguf.quants.dequantize computes them (scalar)
//   decode_avx2(blk, out)   the same values with AVX2
//   kPrep, prepare(x, xp)   the kernel's copy of one block's worth of one token's x: kPrep floats, in the
//                           order dot unpacks the quants, with block sums where dot needs them
//   dot<TT>(blk, xp, ldx, acc)  acc[t] plus the block's dot product with token t's prepared x (at xp + t ldx),
//                           spread over acc[t]'s lanes, for t < TT
//
// dot unpacks the block once and then runs the same arithmetic for every token, so token t's sums are the
// same bits whatever TT is: a batch of tokens gets exactly the numbers each token gets alone.
//
// Every weight is an exact fp32 product of its scales and quants (at most 24 significant bits), so the
// decoders round only where gguf does (a K-quant's min subtraction) and agree with it bit for bit.
//
// One-token decode is bound by the vector instructions spent per weight (about 3 per 8 weights at best, on
// top of the byte shuffling), so dot reads each byte once and takes the cheapest route to centred floats
// q - c: for nibbles, "magic" floats without shifts or conversions (a dword with q in its low bits and 0x4B
// in its top byte is the float 2^23 + q, and one exact subtraction of 2^23 + c centres it; a nibble masked
// in place, bits 4..7, gives 16 (q - c), and prepare scales the matching x by 1/16 or dot folds it into a
// scale, both exact); for bytes, sign extension and conversion. Centring matters for accuracy: with q in
// 0..15, d * sum(x q) and the offset times sum(x) are two large terms that cancel when sum(x) is large.
//
// quant_matmul.cpp includes this file twice: as it is (namespace formats, the SIMD code built for AVX2), and with
// NKV_FORMATS_512 defined (namespace formats512, the same source built for AVX-512, where the exact dots also take
// x as token pairs: PairX below). Hence the two include guards.
#if defined(NKV_FORMATS_512) ? !defined(NKV_QUANT_FORMATS_512_H) : !defined(NKV_QUANT_FORMATS_H)
#ifdef NKV_FORMATS_512
#define NKV_QUANT_FORMATS_512_H
#pragma push_macro("NKV_AVX2")
#undef NKV_AVX2
#define NKV_AVX2 NKV_AVX512
#else
#define NKV_QUANT_FORMATS_H
#endif

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "cpu_common.h"
#include "quant_matmul.h"

#ifdef NKV_FORMATS_512
namespace nodekv::quant::formats512 {
#else
namespace nodekv::quant::formats {
#endif

inline uint16_t load_u16(const uint8_t* p) {
    uint16_t v;
    std::memcpy(&v, p, 2);
    return v;
}

inline uint32_t load_u32(const uint8_t* p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

inline float load_half(const uint8_t* p) { return nodekv::half_to_float(load_u16(p)); }

// The 6-bit scales and mins of a Q4_K/Q5_K super-block (12 bytes): sub-block j's in byte j of each result.
//   bytes 0..3: scale j (bits 0..5), scale j + 4 (bits 6..7 -> 4..5)   bytes 8..11: scale j + 4 (bits 0..3)
//   bytes 4..7: min j   (bits 0..5), min j + 4   (bits 6..7 -> 4..5)                min j + 4   (bits 4..7)
inline void k_scales_mins(const uint8_t* p, uint64_t* sc, uint64_t* mn) {
    const uint32_t a = load_u32(p), b = load_u32(p + 4), c = load_u32(p + 8);
    *sc = (a & 0x3f3f3f3fu) | uint64_t{(c & 0x0f0f0f0fu) | ((a >> 2) & 0x30303030u)} << 32;
    *mn = (b & 0x3f3f3f3fu) | uint64_t{((c >> 4) & 0x0f0f0f0fu) | ((b >> 2) & 0x30303030u)} << 32;
}

// ---------------------------------------------------------------- AVX2 building blocks

NKV_AVX2 inline __m256 bcast_half(const uint8_t* p) {
    return _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(load_u16(p))));
}

NKV_AVX2 inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

NKV_AVX2 inline __m256 lane(__m256 v, int i) { return _mm256_permutevar8x32_ps(v, _mm256_set1_epi32(i)); }

// sum over i of v[i] * x[8 i .. 8 i + 7]
NKV_AVX2 inline __m256 dot4(const __m256 v[4], const float* x) {
    __m256 a = _mm256_mul_ps(v[0], _mm256_loadu_ps(x));
    a = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(x + 8), a);
    a = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(x + 16), a);
    return _mm256_fmadd_ps(v[3], _mm256_loadu_ps(x + 24), a);
}

// acc[t] += d (sum over i of v[i] * x_t[8 i .. 8 i + 7]) for the TT tokens x_t = x + t ldx: a block's 32 unpacked
// quants v, of scale d, against each token
template <int TT>
NKV_AVX2 inline void scaled_dot(const __m256 v[4], __m256 d, const float* x, int64_t ldx, __m256* acc) {
    for (int t = 0; t < TT; ++t) acc[t] = _mm256_fmadd_ps(d, dot4(v, x + t * ldx), acc[t]);
}

// acc[t] += c x_t[0..7] for the TT tokens x_t = x + t ldx: a block's term against x's block sums
template <int TT>
NKV_AVX2 inline void scaled_x(__m256 c, const float* x, int64_t ldx, __m256* acc) {
    for (int t = 0; t < TT; ++t) acc[t] = _mm256_fmadd_ps(c, _mm256_loadu_ps(x + t * ldx), acc[t]);
}

#ifdef NKV_FORMATS_512
// Prepared x for 512-bit FMAs over two tokens at once: tokens 2p and 2p + 1 share a block of twice a token's
// floats at x + p ldx, holding every 8 elements of the first token, then the same 8 of the second (element e of
// token 2p + h at 16 (e / 8) + 8 h + e % 8), and one __m512 accumulator acc[p] (token 2p in its low half). The dots
// index x in a token's elements, always multiples of 8, so `x + off` moves 2 off floats. Lane for lane the FMAs are
// the one-token ones, so every token gets the bits it gets through `const float*` x and __m256 accumulators; the
// last of an odd count runs on its halves of the block and accumulator in 256 bits.
struct PairX {
    const float* p;
    PairX operator+(int64_t off) const { return {p + 2 * off}; }
};

NKV_AVX512 inline __m512 both_halves(__m256 v) { return _mm512_insertf32x8(_mm512_castps256_ps512(v), v, 1); }

template <int TT>
NKV_AVX512 inline void scaled_dot(const __m256 v[4], __m256 d, PairX x, int64_t ldx, __m512* acc) {
    const __m512 v0 = both_halves(v[0]), v1 = both_halves(v[1]), v2 = both_halves(v[2]), v3 = both_halves(v[3]);
    const __m512 dd = both_halves(d);
    for (int p = 0; p < TT / 2; ++p) {
        const float* xp = x.p + p * ldx;
        __m512 a = _mm512_mul_ps(v0, _mm512_loadu_ps(xp));
        a = _mm512_fmadd_ps(v1, _mm512_loadu_ps(xp + 16), a);
        a = _mm512_fmadd_ps(v2, _mm512_loadu_ps(xp + 32), a);
        a = _mm512_fmadd_ps(v3, _mm512_loadu_ps(xp + 48), a);
        acc[p] = _mm512_fmadd_ps(dd, a, acc[p]);
    }
    if constexpr (TT % 2 != 0) {
        const float* xp = x.p + TT / 2 * ldx;
        __m256 a = _mm256_mul_ps(v[0], _mm256_loadu_ps(xp));
        a = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xp + 16), a);
        a = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xp + 32), a);
        a = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xp + 48), a);
        acc[TT / 2] = _mm512_zextps256_ps512(_mm256_fmadd_ps(d, a, _mm512_castps512_ps256(acc[TT / 2])));
    }
}

template <int TT>
NKV_AVX512 inline void scaled_x(__m256 c, PairX x, int64_t ldx, __m512* acc) {
    const __m512 cc = both_halves(c);
    for (int p = 0; p < TT / 2; ++p) acc[p] = _mm512_fmadd_ps(cc, _mm512_loadu_ps(x.p + p * ldx), acc[p]);
    if constexpr (TT % 2 != 0)
        acc[TT / 2] = _mm512_zextps256_ps512(
            _mm256_fmadd_ps(c, _mm256_loadu_ps(x.p + TT / 2 * ldx), _mm512_castps512_ps256(acc[TT / 2])));
}
#endif

// 16 nibble bytes (byte j: element j low, j + 16 high) in element order: v[0], v[1] = q - c of elements
// 0..7, 8..15; v[2], v[3] = 16 (q - c) of elements 16..23, 24..31. Both 128-bit lanes hold the 16 bytes;
// lane 0 reads bytes 0..3 and 8..11, lane 1 bytes 4..7 and 12..15, so 0x4B goes into a dword each lane
// leaves unread (lane 0's dword 1, lane 1's dword 0).
// nibbles' last step at either width (V __m256i or __m512i, P __m256 or __m512): the shuffled bytes a (elements
// 0..7) and b (8..15) masked to q and 16 q under 0x4B and centred, as vector-extension arithmetic
template <class V, class P>
NKV_AVX2 inline void magic_nibbles(V a, V b, float c, P v[4]) {
    using U32 = std::conditional_t<sizeof(V) == 32, uint32_t __attribute__((vector_size(32))),
                                   uint32_t __attribute__((vector_size(64)))>;
    const U32 ua = reinterpret_cast<U32>(a), ub = reinterpret_cast<U32>(b);
    const uint32_t lo = 0xff00000fu, hi = 0xff0000f0u;
    const float lo_bias = 8388608.0f + c, hi_bias = 8388608.0f + 16.0f * c;
    v[0] = reinterpret_cast<P>(ua & lo) - lo_bias;
    v[1] = reinterpret_cast<P>(ub & lo) - lo_bias;
    v[2] = reinterpret_cast<P>(ua & hi) - hi_bias;
    v[3] = reinterpret_cast<P>(ub & hi) - hi_bias;
}
alignas(32) inline constexpr uint32_t kNibbleShuffles[2][8] = {  // bytes 0..7, bytes 8..15
    {0x04808000, 0x04808001, 0x04808002, 0x04808003, 0x00808004, 0x00808005, 0x00808006, 0x00808007},
    {0x04808008, 0x04808009, 0x0480800a, 0x0480800b, 0x0080800c, 0x0080800d, 0x0080800e, 0x0080800f}};
NKV_AVX2 inline void nibbles(const uint8_t* qs, float c, __m256 v[4]) {
    const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    const __m256i src = _mm256_blend_epi32(raw, _mm256_set1_epi32(0x4b4b4b4b), 0x12);
    magic_nibbles(_mm256_shuffle_epi8(src, load256(kNibbleShuffles[0])),
                  _mm256_shuffle_epi8(src, load256(kNibbleShuffles[1])), c, v);
}

// 32 quant bytes (lane 0: elements 0..15, lane 1: 16..31) as floats q - c in "split" order: v[g] holds
// elements 4g..4g+3 in lane 0 and 16+4g..16+4g+3 in lane 1.
alignas(32) inline constexpr uint32_t kSplitShuffle[8] = {  // group 0's bytes into dwords; group g's at + 4 g
    0x80808000, 0x80808001, 0x80808002, 0x80808003, 0x80808000, 0x80808001, 0x80808002, 0x80808003};
NKV_AVX2 inline void split_bytes(__m256i q, float c, __m256 v[4]) {
    const __m256i magic = _mm256_set1_epi32(0x4b000000);
    const __m256 bias = _mm256_set1_ps(8388608.0f + c);
    const __m256i first = load256(kSplitShuffle);
    for (int g = 0; g < 4; ++g) {
        const __m256i bytes = _mm256_shuffle_epi8(q, _mm256_add_epi32(first, _mm256_set1_epi32(4 * g)));
        v[g] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_or_si256(bytes, magic)), bias);
    }
}

// Stores a split-order vector g (see split_bytes) into its 32-element group.
NKV_AVX2 inline void store_split(float* out, int g, __m256 v) {
    _mm_storeu_ps(out + 4 * g, _mm256_castps256_ps128(v));
    _mm_storeu_ps(out + 16 + 4 * g, _mm256_extractf128_ps(v, 1));
}

// x for split-order dots: per 32 elements, [x 4g..4g+3, x 16+4g..16+4g+3] for g = 0..3.
NKV_AVX2 inline void prepare_split(const float* x, int64_t n, float* xp) {
    for (int64_t i = 0; i < n; i += 32) {
        const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
        const __m256 x2 = _mm256_loadu_ps(x + i + 16), x3 = _mm256_loadu_ps(x + i + 24);
        _mm256_storeu_ps(xp + i, _mm256_permute2f128_ps(x0, x2, 0x20));
        _mm256_storeu_ps(xp + i + 8, _mm256_permute2f128_ps(x0, x2, 0x31));
        _mm256_storeu_ps(xp + i + 16, _mm256_permute2f128_ps(x1, x3, 0x20));
        _mm256_storeu_ps(xp + i + 24, _mm256_permute2f128_ps(x1, x3, 0x31));
    }
}

// x for nibble dots: elements 16..31 of each block of 32 scaled by 1/16 (exact).
NKV_AVX2 inline void prepare_nibbles(const float* x, float* xp) {
    const __m256 sixteenth = _mm256_set1_ps(0.0625f);
    _mm256_storeu_ps(xp, _mm256_loadu_ps(x));
    _mm256_storeu_ps(xp + 8, _mm256_loadu_ps(x + 8));
    _mm256_storeu_ps(xp + 16, _mm256_mul_ps(_mm256_loadu_ps(x + 16), sixteenth));
    _mm256_storeu_ps(xp + 24, _mm256_mul_ps(_mm256_loadu_ps(x + 24), sixteenth));
}

// The 8 bytes of v as floats, byte j in lane j.
NKV_AVX2 inline __m256 bytes_to_ps(uint64_t v) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(v))));
}

NKV_AVX2 inline float sum32(const float* x) {
    return hsum(_mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8)),
                              _mm256_add_ps(_mm256_loadu_ps(x + 16), _mm256_loadu_ps(x + 24))));
}

#ifdef NKV_FORMATS_512
// ---------------------------------------------------------------- row pairs (AVX-512, fewer than 8 tokens)
//
// The exact dot of up to 7 tokens over two weight rows at once (a format's dot_row_pair): row r's block unpacked into
// the low half of each 512-bit register and row r + 1's into the high half by the same instructions, against each
// token's x in both halves, every lane's arithmetic the one-row dot's (the same bits, tested). So few tokens are bound
// by the instructions that turn quants into floats, not by FMAs, and here each serves two rows. The K-quants have one
// (Q4_K, Q6_K); the 32-element formats keep the AVX2 kernels.

NKV_AVX512 inline __m512 halves(__m256 lo, __m256 hi) { return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1); }

// the 32 bytes at p in the low half, those at p + stride in the high half
NKV_AVX512 inline __m512i rows256(const uint8_t* p, int64_t stride) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(load256(p)), load256(p + stride), 1);
}

// x[0..7] in both halves
NKV_AVX512 inline __m512 both_x(const float* x) { return _mm512_broadcast_f32x8(_mm256_loadu_ps(x)); }

// lane(v, i) in each half: lane i of v in the low half, lane 8 + i in the high half
NKV_AVX512 inline __m512 lane_rows(__m512 v, int i) {
    return _mm512_permutexvar_ps(_mm512_inserti64x4(_mm512_set1_epi32(i), _mm256_set1_epi32(8 + i), 1), v);
}

// nibbles of the 16 bytes at qs (low half) and at qs + stride (high half)
NKV_AVX512 inline void nibbles_rows(const uint8_t* qs, int64_t stride, float c, __m512 v[4]) {
    const __m512i raw = _mm512_mask_broadcast_i32x4(
        _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs))), 0xff00,
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + stride)));
    const __m512i src = _mm512_mask_blend_epi32(0x1212, raw, _mm512_set1_epi32(0x4b4b4b4b));
    magic_nibbles(_mm512_shuffle_epi8(src, _mm512_broadcast_i64x4(load256(kNibbleShuffles[0]))),
                  _mm512_shuffle_epi8(src, _mm512_broadcast_i64x4(load256(kNibbleShuffles[1]))), c, v);
}

// split_bytes of each half's 32 bytes
NKV_AVX512 inline void split_bytes_rows(__m512i q, float c, __m512 v[4]) {
    const __m512i magic = _mm512_set1_epi32(0x4b000000);
    const __m512 bias = _mm512_set1_ps(8388608.0f + c);
    const __m512i first = _mm512_broadcast_i64x4(load256(kSplitShuffle));
    for (int g = 0; g < 4; ++g) {
        const __m512i bytes = _mm512_shuffle_epi8(q, _mm512_add_epi32(first, _mm512_set1_epi32(4 * g)));
        v[g] = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_or_si512(bytes, magic)), bias);
    }
}

// acc[t] += d (sum over i of v[i] * x_t[8 i .. 8 i + 7]) for the TT tokens x_t = x + t ldx: scaled_dot's arithmetic
// for both rows
template <int TT>
NKV_AVX512 inline void scaled_dot_rows(const __m512 v[4], __m512 d, const float* x, int64_t ldx, __m512* acc) {
    for (int t = 0; t < TT; ++t) {
        const float* xt = x + t * ldx;
        __m512 a = _mm512_mul_ps(v[0], both_x(xt));
        a = _mm512_fmadd_ps(v[1], both_x(xt + 8), a);
        a = _mm512_fmadd_ps(v[2], both_x(xt + 16), a);
        a = _mm512_fmadd_ps(v[3], both_x(xt + 24), a);
        acc[t] = _mm512_fmadd_ps(d, a, acc[t]);
    }
}
#endif

// ---------------------------------------------------------------- int8 activations (precision "int8")
//
// The fast path quantises each token's x once per call, as ggml's q8 types do, and multiplies integers:
// _mm256_maddubs_epi16 takes 32 byte products per instruction where the exact path spends 4 FMAs on 32 weights.
// A block of x of n elements is stored as d = max|x| / 127 and q = round(x / d) (round half to even; x / d taken
// as x * (1 / d), in fp32 on both paths, so the scalar and AVX2 quantisers give the same bits). Its error is at
// most d / 2 per element, which bounds a row's error by (d / 2) sum |w| (tested). The weights stay exact.
//   XQ32    per 32 elements (for the 32-element formats): d, s = d sum(q) (Q4_1's min term), q
//   XQ256   per 256 (for the K-quants, whose sub-block scales are integers): one d, the sums of q per 16
//           (the K-quants' min and centring terms), q
// Every integer sum fits: a byte pair of maddubs is at most 2 * 128 * 127 < 2^15, and a super-block's total with its
// 6-bit or int8 scales below 2^26, so the fp32 conversion of each lane is exact.
// q sits at a multiple of 32 bytes within a block whose size is a multiple of 64, so in the drivers' 64-byte aligned
// buffer no 32-byte load of q straddles two cache lines (unpadded, 40 and 292 bytes, most did: qwen2.5-1.5b's
// matmuls at 64 tokens took 8% longer, a 512-token int8 prefill 19% longer, on an AMD EPYC Zen 4).
struct XQ32 {
    static constexpr int64_t kElems = 32;
    float d, s;
    float pad[6];
    int8_t q[32];
};
struct XQ256 {
    static constexpr int64_t kElems = 256;
    float d;
    int16_t sum16[16];
    float pad[7];
    int8_t q[256];
};
static_assert(sizeof(XQ32) == 64 && offsetof(XQ32, q) == 32 && sizeof(XQ256) == 320 && offsetof(XQ256, q) == 64,
              "quantised x blocks: q 32-byte aligned, whole cache lines");

// XQ256 for Q4_K, q's 8 runs of 32 (Q4_K's sub-blocks) interleaved 4 bytes at a time: q[32c + 4j + e] holds element
// 32j + 4c + e (chunk c, run j < 8, e < 4). A 32-byte load is then 4 elements of every sub-block, so the integer dot
// (Q4_K::dot_i8) adds its 8 loads' maddubs pair sums in int16 lanes that each hold one sub-block (at most
// 8 * 2 * 15 * 127 < 2^15) and scales them with one madd a super-block, where runs in order need one a sub-block.
struct XQ256T : XQ256 {};
inline int interleaved(int e) { return 32 * (e % 32 / 4) + 4 * (e / 32) + e % 4; }  // where element e sits in q

inline float round_scale(float amax, float* inv) {
    const float d = amax / 127.0f;
    *inv = d != 0.0f ? 1.0f / d : 0.0f;
    return d;
}

// The reference quantiser: n elements (32 or 256) into q, returning d; sums of 16 into sum16 when given.
inline float quantize_block(const float* x, int64_t n, int8_t* q, int16_t* sum16) {
    float amax = 0.0f;
    for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
    float inv;
    const float d = round_scale(amax, &inv);
    for (int64_t i = 0; i < n; ++i) q[i] = static_cast<int8_t>(std::nearbyint(x[i] * inv));
    if (sum16)
        for (int64_t g = 0; g < n / 16; ++g) {
            int s = 0;
            for (int i = 0; i < 16; ++i) s += q[16 * g + i];
            sum16[g] = static_cast<int16_t>(s);
        }
    return d;
}

inline void quantize(const float* x, XQ32* out) {
    out->d = quantize_block(x, 32, out->q, nullptr);
    int s = 0;
    for (int i = 0; i < 32; ++i) s += out->q[i];
    out->s = out->d * static_cast<float>(s);
}

inline void quantize(const float* x, XQ256* out) { out->d = quantize_block(x, 256, out->q, out->sum16); }

inline void quantize(const float* x, XQ256T* out) {
    int8_t q[256];
    out->d = quantize_block(x, 256, q, out->sum16);
    for (int e = 0; e < 256; ++e) out->q[interleaved(e)] = q[e];
}

NKV_AVX2 inline int hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
    return _mm_cvtsi128_si32(s);
}

// The AVX2 quantiser, the same bits as quantize_block: 32 elements at x times inv into q; the element sums of
// each half (16) into half[0], half[1].
NKV_AVX2 inline void quantize32_avx2(const float* x, __m256 inv, int8_t* q, int* half) {
    __m256i i[4];
    for (int k = 0; k < 4; ++k)
        i[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * k), inv),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    half[0] = hsum_epi32(_mm256_add_epi32(i[0], i[1]));
    half[1] = hsum_epi32(_mm256_add_epi32(i[2], i[3]));
    // packs interleave the 128-bit lanes: dwords come out as elements 0-3, 8-11, 16-19, 24-27, 4-7, ...
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                        _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

NKV_AVX2 inline float amax_avx2(const float* x, int64_t n) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

NKV_AVX2 inline void quantize_avx2(const float* x, XQ32* out) {
    float inv;
    out->d = round_scale(amax_avx2(x, 32), &inv);
    int half[2];
    quantize32_avx2(x, _mm256_set1_ps(inv), out->q, half);
    out->s = out->d * static_cast<float>(half[0] + half[1]);
}

NKV_AVX2 inline void quantize_avx2(const float* x, XQ256* out) {
    float inv;
    out->d = round_scale(amax_avx2(x, 256), &inv);
    for (int g = 0; g < 8; ++g) {
        int half[2];
        quantize32_avx2(x + 32 * g, _mm256_set1_ps(inv), out->q + 32 * g, half);
        out->sum16[2 * g] = static_cast<int16_t>(half[0]);
        out->sum16[2 * g + 1] = static_cast<int16_t>(half[1]);
    }
}

// v[j]'s dword c -> v[c]'s dword j: an 8 x 8 transpose of 4-byte groups (unpack 32, unpack 64, swap 128-bit lanes).
NKV_AVX2 inline void transpose_dwords(__m256i v[8]) {
    __m256i t[8], u[8];
    for (int k = 0; k < 4; ++k) {  // t[2k] lane 0: v[2k] d0, v[2k + 1] d0, v[2k] d1, v[2k + 1] d1; t[2k + 1]: d2, d3
        t[2 * k] = _mm256_unpacklo_epi32(v[2 * k], v[2 * k + 1]);
        t[2 * k + 1] = _mm256_unpackhi_epi32(v[2 * k], v[2 * k + 1]);
    }
    for (int k = 0; k < 2; ++k) {  // u[4k + c]: dword c (lane 0) and c + 4 (lane 1) of v[4k .. 4k + 3]
        u[4 * k] = _mm256_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
        u[4 * k + 1] = _mm256_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
        u[4 * k + 2] = _mm256_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
        u[4 * k + 3] = _mm256_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
    }
    for (int c = 0; c < 4; ++c) {
        v[c] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x20);
        v[c + 4] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x31);
    }
}

NKV_AVX2 inline void quantize_avx2(const float* x, XQ256T* out) {
    quantize_avx2(x, static_cast<XQ256*>(out));
    __m256i v[8];
    for (int j = 0; j < 8; ++j) v[j] = load256(out->q + 32 * j);
    transpose_dwords(v);
    for (int c = 0; c < 8; ++c) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out->q + 32 * c), v[c]);
}

// The 8 pair-of-pairs sums of u[i] s[i] (u unsigned bytes <= 128, s signed bytes in -127..127) as int32.
NKV_AVX2 inline __m256i mul_sum_us8(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// acc += d_w d_x sum(w q) for an XQ32 block x, given the sum as int32 lanes p
NKV_AVX2 inline void add_scaled(__m256i p, __m256 dw, const XQ32& x, __m256& acc) {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(dw, _mm256_broadcast_ss(&x.d)), acc);
}

// acc[t] += d_w d_x(t) sum(w q_t) for the TT tokens' XQ32 blocks x + t ldx, w 32 signed bytes (maddubs wants one
// side unsigned: |w| against q with w's sign).
template <int TT>
NKV_AVX2 inline void signed_dot(__m256i w, __m256 dw, const XQ32* x, int64_t ldx, __m256* acc) {
    const __m256i aw = _mm256_sign_epi8(w, w);
    for (int t = 0; t < TT; ++t)
        add_scaled(mul_sum_us8(aw, _mm256_sign_epi8(load256(x[t * ldx].q), w)), dw, x[t * ldx], acc[t]);
}

// The same dots with AVX-512 VNNI (vpdpbusd: a lane's 4 byte products summed into int32 by one instruction, where
// AVX2 takes maddubs and madd). No int16 pair sum saturates in the AVX2 dots, so both compute the same integers, and
// the float steps after them are the same: the two paths give the same bits (tested), whichever the CPU has.
template <int TT>
NKV_AVX512 inline void signed_dot_vnni(__m256i w, __m256 dw, const XQ32* x, int64_t ldx, __m256* acc) {
    const __m256i aw = _mm256_sign_epi8(w, w), zero = _mm256_setzero_si256();
    for (int t = 0; t < TT; ++t)
        add_scaled(_mm256_dpbusd_epi32(zero, aw, _mm256_sign_epi8(load256(x[t * ldx].q), w)), dw, x[t * ldx], acc[t]);
}

// 16 nibble bytes as 32 bytes in element order: lane 0 the low nibbles (elements 0..15), lane 1 the high (16..31).
NKV_AVX2 inline __m256i nibble_bytes(const uint8_t* qs) {
    const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    return _mm256_and_si256(_mm256_srlv_epi64(raw, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0f));
}

// The scalar references of the int8 dots: the block's integer sums, then their scales, per token.
inline int dot_bytes(const int8_t* w, const int8_t* q, int n) {
    int s = 0;
    for (int i = 0; i < n; ++i) s += w[i] * q[i];
    return s;
}

// ---------------------------------------------------------------- the formats

// The AVX2 side of a 32-element format w = d q (fp16 d first in the block) whose F::quants gives the block's q as
// floats in element order: Q8_0 and Q5_0 differ only in how they unpack q.
template <class F>
struct ScaledQuants {
    NKV_AVX2 static void decode_avx2(const uint8_t* blk, float* out) {
        __m256 v[4];
        F::quants(blk, v);
        const __m256 d = bcast_half(blk);
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(d, v[i]));
    }
    NKV_AVX2 static void prepare(const float* x, float* xp) { std::memcpy(xp, x, sizeof(float) * 32); }
    template <int TT, class X = const float*, class Acc = __m256>
    NKV_AVX2 static void dot(const uint8_t* blk, X xp, int64_t ldx, Acc* acc) {
        __m256 v[4];
        F::quants(blk, v);
        scaled_dot<TT>(v, bcast_half(blk), xp, ldx, acc);
    }
    using XQ = XQ32;
    template <int TT>
    NKV_AVX2 static void dot_i8(const uint8_t* blk, const XQ32* x, int64_t ldx, __m256* acc) {
        signed_dot<TT>(F::signed_bytes(blk), bcast_half(blk), x, ldx, acc);
    }
    template <int TT>
    NKV_AVX512 static void dot_i8_vnni(const uint8_t* blk, const XQ32* x, int64_t ldx, __m256* acc) {
        signed_dot_vnni<TT>(F::signed_bytes(blk), bcast_half(blk), x, ldx, acc);
    }
    static float dot_i8_scalar(const uint8_t* blk, const XQ32& x) {
        int8_t q[32];
        F::signed_quants(blk, q);
        return load_half(blk) * x.d * static_cast<float>(dot_bytes(q, x.q, 32));
    }
};

// 34 B: fp16 d, 32 x int8 q.  w = d q
struct Q8_0 : ScaledQuants<Q8_0> {
    static constexpr QType kType = QType::Q8_0;
    static constexpr int64_t kElems = 32, kBytes = 34, kPrep = 32;

    static void decode(const uint8_t* blk, float* out) {
        const float d = load_half(blk);
        const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
        for (int i = 0; i < 32; ++i) out[i] = d * static_cast<float>(q[i]);
    }
    NKV_AVX2 static void quants(const uint8_t* blk, __m256 v[4]) {
        for (int i = 0; i < 4; ++i)
            v[i] = _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * i))));
    }    static void signed_quants(const uint8_t* blk, int8_t* q) { std::memcpy(q, blk + 2, 32); }
    NKV_AVX2 static __m256i signed_bytes(const uint8_t* blk) { return load256(blk + 2); }
};

// 18 B: fp16 d, 16 B nibbles (byte j: element j low, j + 16 high).  w = d (q - 8)
struct Q4_0 {
    static constexpr QType kType = QType::Q4_0;
    static constexpr int64_t kElems = 32, kBytes = 18, kPrep = 32;

    static void signed_quants(const uint8_t* blk, int8_t* q) {
        for (int j = 0; j < 16; ++j) {
            q[j] = static_cast<int8_t>((blk[2 + j] & 0x0f) - 8);
            q[j + 16] = static_cast<int8_t>((blk[2 + j] >> 4) - 8);
        }
    }
    static void decode(const uint8_t* blk, float* out) {
        int8_t q[32];
        signed_quants(blk, q);
        const float d = load_half(blk);
        for (int i = 0; i < 32; ++i) out[i] = d * static_cast<float>(q[i]);
    }
    NKV_AVX2 static void decode_avx2(const uint8_t* blk, float* out) {
        __m256 v[4];
        nibbles(blk + 2, 8.0f, v);
        const __m256 d = bcast_half(blk), d16 = _mm256_mul_ps(d, _mm256_set1_ps(0.0625f));
        _mm256_storeu_ps(out, _mm256_mul_ps(d, v[0]));
        _mm256_storeu_ps(out + 8, _mm256_mul_ps(d, v[1]));
        _mm256_storeu_ps(out + 16, _mm256_mul_ps(d16, v[2]));
        _mm256_storeu_ps(out + 24, _mm256_mul_ps(d16, v[3]));
    }
    NKV_AVX2 static void prepare(const float* x, float* xp) { prepare_nibbles(x, xp); }
    template <int TT, class X = const float*, class Acc = __m256>
    NKV_AVX2 static void dot(const uint8_t* blk, X xp, int64_t ldx, Acc* acc) {
        __m256 v[4];
        nibbles(blk + 2, 8.0f, v);
        scaled_dot<TT>(v, bcast_half(blk), xp, ldx, acc);
    }
    using XQ = XQ32;
    template <int TT>
    NKV_AVX2 static void dot_i8(const uint8_t* blk, const XQ32* x, int64_t ldx, __m256* acc) {
        signed_dot<TT>(signed_bytes(blk), bcast_half(blk), x, ldx, acc);
    }
    template <int TT>
    NKV_AVX512 static void dot_i8_vnni(const uint8_t* blk, const XQ32* x, int64_t ldx, __m256* acc) {
        signed_dot_vnni<TT>(signed_bytes(blk), bcast_half(blk), x, ldx, acc);
    }
    NKV_AVX2 static __m256i signed_bytes(const uint8_t* blk) {
        return _mm256_sub_epi8(nibble_bytes(blk + 2), _mm256_set1_epi8(8));
    }
    static float dot_i8_scalar(const uint8_t* blk, const XQ32& x) {
        int8_t q[32];
        signed_quants(blk, q);
        return load_half(blk) * x.d * static_cast<float>(dot_bytes(q, x.q, 32));
    }
};

// 20 B: fp16 d, fp16 m, 16 B nibbles as Q4_0's.  w = d q + m
struct Q4_1 {
    static constexpr QType kType = QType::Q4_1;
    // prepare appends {0, sum of the block's x, 0, ..., 0}: dot adds (m + 8 d) sum(x) through lane 1
    static constexpr int64_t kElems = 32, kBytes = 20, kPrep = 40;

    static void decode(const uint8_t* blk, float* out) {
        const float d = load_half(blk), m = load_half(blk + 2);
        for (int j = 0; j < 16; ++j) {
            out[j] = d * static_cast<float>(blk[4 + j] & 0x0f) + m;
            out[j + 16] = d * static_cast<float>(blk[4 + j] >> 4) + m;
        }
    }
    NKV_AVX2 static void decode_avx2(const uint8_t* blk, float* out) {
        __m256 v[4];
        nibbles(blk + 4, 0.0f, v);  // uncentred: d q + m rounds as gguf's
        const __m256 d = bcast_half(blk), d16 = _mm256_mul_ps(d, _mm256_set1_ps(0.0625f));
        const __m256 m = bcast_half(blk + 2);
        _mm256_storeu_ps(out, _mm256_fmadd_ps(d, v[0], m));
        _mm256_storeu_ps(out + 8, _mm256_fmadd_ps(d, v[1], m));
        _mm256_storeu_ps(out + 16, _mm256_fmadd_ps(d16, v[2], m));
        _mm256_storeu_ps(out + 24, _mm256_fmadd_ps(d16, v[3], m));
    }
    NKV_AVX2 static void prepare(const float* x, float* xp) {
        prepare_nibbles(x, xp);
        _mm256_storeu_ps(xp + 32, _mm256_setr_ps(0.0f, sum32(x), 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f));
    }
    template <int TT, class X = const float*, class Acc = __m256>
    NKV_AVX2 static void dot(const uint8_t* blk, X xp, int64_t ldx, Acc* acc) {
        __m256 v[4];
        nibbles(blk + 4, 8.0f, v);
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(load_u32(blk))));  // [d, m, 0, 0]
        const __m256 d = _mm256_broadcastss_ps(dm);
        // [d, m + 8 d, 0, ...]: m' = m + 8 d formed before it meets the accumulator, where m and 8 d would
        // otherwise cancel (exact for all but extreme d/m ratios); lane 0 meets x's 0
        const __m256 eight = _mm256_setr_ps(0.0f, 8.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f);
        const __m256 mp = _mm256_fmadd_ps(d, eight, _mm256_zextps128_ps256(dm));
        scaled_dot<TT>(v, d, xp, ldx, acc);
        scaled_x<TT>(mp, xp + 32, ldx, acc);
    }
    using XQ = XQ32;
    // d sum(q q_x) d_x + m s_x: the min meets x's sum, which the quantiser keeps (s)
    template <int TT>
    NKV_AVX2 static void dot_i8(const uint8_t* blk, const XQ32* x, int64_t ldx, __m256* acc) {
        const __m256i q = nibble_bytes(blk + 4);
        const __m256 d = bcast_half(blk), m = bcast_half(blk + 2);
        for (int t = 0; t < TT; ++t) {
            const XQ32& xt = x[t * ldx];
            const __m256 p = _mm256_cvtepi32_ps(mul_sum_us8(q, load256(xt.q)));
            acc[t] = _mm256_fmadd_ps(p, _mm256_mul_ps(d, _mm256_broadcast_ss(&xt.d)), acc[t]);
            acc[t] = _mm256_fmadd_ps(m, _mm256_zextps128_ps256(_mm_load_ss(&xt.s)), acc[t]);
        }
    }
    static float dot_i8_scalar(const uint8_t* blk, const XQ32& x) {
        int s = 0;
        for (int j = 0; j < 16; ++j) s += (blk[4 + j] & 0x0f) * x.q[j] + (blk[4 + j] >> 4) * x.q[j + 16];
        return load_half(blk) * x.d * static_cast<float>(s) + load_half(blk + 2) * x.s;
    }
};

// 22 B: fp16 d, u32 qh (bit j: the fifth bit of element j), 16 B nibbles as Q4_0's.  w = d (q - 16)
struct Q5_0 : ScaledQuants<Q5_0> {
    static constexpr QType kType = QType::Q5_0;
    static constexpr int64_t kElems = 32, kBytes = 22, kPrep = 32;

    static void decode(const uint8_t* blk, float* out) {
        int8_t q[32];
        signed_quants(blk, q);
        const float d = load_half(blk);
        for (int i = 0; i < 32; ++i) out[i] = d * static_cast<float>(q[i]);
    }
    // The 32 quants q - 16 as signed bytes in element order: the nibble, with 0xF0 above it where the fifth bit is
    // clear.
    NKV_AVX2 static __m256i signed_bytes(const uint8_t* blk) {
        const __m256i nib = nibble_bytes(blk + 6);
        // byte e gets qh's byte e / 8, of which bit e % 8 is element e's fifth bit
        const __m256i spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32(static_cast<int>(load_u32(blk + 2))),
            _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
        const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201u));
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
        return _mm256_or_si256(nib, _mm256_andnot_si256(set, _mm256_set1_epi8(static_cast<char>(0xf0))));
    }
    static void signed_quants(const uint8_t* blk, int8_t* q) {
        const uint32_t qh = load_u32(blk + 2);
        for (int j = 0; j < 16; ++j) {
            q[j] = static_cast<int8_t>(((blk[6 + j] & 0x0f) | static_cast<int>((qh >> j) & 1u) << 4) - 16);
            q[j + 16] = static_cast<int8_t>(((blk[6 + j] >> 4) | static_cast<int>((qh >> (j + 16)) & 1u) << 4) - 16);
        }
    }
    // The 32 quants as floats q - 16 in element order: the signed bytes sign-extended (fewer instructions and
    // constants than the magic floats).
    NKV_AVX2 static void quants(const uint8_t* blk, __m256 v[4]) {
        const __m256i q = signed_bytes(blk);
        const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
        v[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
        v[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(lo, lo)));
        v[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
        v[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(hi, hi)));
    }
};

// 144 B super-block of 8 sub-blocks of 32: fp16 d, fp16 dmin, 12 B of 6-bit scales and mins
// (k_scales_mins), 128 B nibbles: bytes 32i..32i+31 hold sub-block 2i (low nibbles) and 2i+1 (high).
// w = d sc_j q - dmin m_j
struct Q4_K {
    static constexpr QType kType = QType::Q4_K;
    // prepare appends the 8 sub-block sums of x: dot adds (8 d sc_j - dmin m_j) sum_j(x) for the centring
    static constexpr int64_t kElems = 256, kBytes = 144, kPrep = 264;

    static void decode(const uint8_t* blk, float* out) {
        const float d = load_half(blk), dmin = load_half(blk + 2);
        uint64_t sc, mn;
        k_scales_mins(blk + 4, &sc, &mn);
        for (int j = 0; j < 8; ++j) {
            const float dl = d * static_cast<float>((sc >> 8 * j) & 0xff);
            const float ml = dmin * static_cast<float>((mn >> 8 * j) & 0xff);
            const uint8_t* q = blk + 16 + 32 * (j / 2);
            for (int i = 0; i < 32; ++i)
                out[32 * j + i] = dl * static_cast<float>(j % 2 ? q[i] >> 4 : q[i] & 0x0f) - ml;
        }
    }
    // d sc_j and dmin m_j, lane j for sub-block j
    NKV_AVX2 static void scales(const uint8_t* blk, __m256* dsc, __m256* dmn) {
        uint64_t sc, mn;
        k_scales_mins(blk + 4, &sc, &mn);
        *dsc = _mm256_mul_ps(bcast_half(blk), bytes_to_ps(sc));
        *dmn = _mm256_mul_ps(bcast_half(blk + 2), bytes_to_ps(mn));
    }
    // Odd sub-blocks come as 16 q (high nibbles in place): their scales take the 1/16.
    NKV_AVX2 static __m256 nibble_scales(__m256 dsc) {
        return _mm256_mul_ps(dsc, _mm256_setr_ps(1.0f, 0.0625f, 1.0f, 0.0625f, 1.0f, 0.0625f, 1.0f, 0.0625f));
    }
    NKV_AVX2 static void decode_avx2(const uint8_t* blk, float* out) {
        __m256 dsc, dmn;
        scales(blk, &dsc, &dmn);
        const __m256 s = nibble_scales(dsc);
        for (int i = 0; i < 4; ++i) {
            __m256 a[4], b[4];  // uncentred, so that s q - dmin m rounds once, as gguf's
            nibbles(blk + 16 + 32 * i, 0.0f, a);
            nibbles(blk + 32 + 32 * i, 0.0f, b);
            const __m256 s0 = lane(s, 2 * i), m0 = lane(dmn, 2 * i);
            const __m256 s1 = lane(s, 2 * i + 1), m1 = lane(dmn, 2 * i + 1);
            float* o = out + 64 * i;
            _mm256_storeu_ps(o, _mm256_fmsub_ps(s0, a[0], m0));
            _mm256_storeu_ps(o + 8, _mm256_fmsub_ps(s0, a[1], m0));
            _mm256_storeu_ps(o + 16, _mm256_fmsub_ps(s0, b[0], m0));
            _mm256_storeu_ps(o + 24, _mm256_fmsub_ps(s0, b[1], m0));
            _mm256_storeu_ps(o + 32, _mm256_fmsub_ps(s1, a[2], m1));
            _mm256_storeu_ps(o + 40, _mm256_fmsub_ps(s1, a[3], m1));
            _mm256_storeu_ps(o + 48, _mm256_fmsub_ps(s1, b[2], m1));
            _mm256_storeu_ps(o + 56, _mm256_fmsub_ps(s1, b[3], m1));
        }
    }
    NKV_AVX2 static void prepare(const float* x, float* xp) {
        std::memcpy(xp, x, sizeof(float) * 256);
        for (int j = 0; j < 8; ++j) xp[256 + j] = sum32(x + 32 * j);
    }
    template <int TT, class X = const float*, class Acc = __m256>
    NKV_AVX2 static void dot(const uint8_t* blk, X xp, int64_t ldx, Acc* acc) {
        __m256 dsc, dmn;
        scales(blk, &dsc, &dmn);
        const __m256 s = nibble_scales(dsc);
        for (int i = 0; i < 4; ++i) {
            __m256 a[4], b[4];  // q - 8
            nibbles(blk + 16 + 32 * i, 8.0f, a);
            nibbles(blk + 32 + 32 * i, 8.0f, b);
            const __m256 even[4] = {a[0], a[1], b[0], b[1]}, odd[4] = {a[2], a[3], b[2], b[3]};
            scaled_dot<TT>(even, lane(s, 2 * i), xp + 64 * i, ldx, acc);
            scaled_dot<TT>(odd, lane(s, 2 * i + 1), xp + 64 * i + 32, ldx, acc);
        }
        const __m256 offset = _mm256_fmsub_ps(_mm256_set1_ps(8.0f), dsc, dmn);  // w = d sc (q - 8) + offset
        scaled_x<TT>(offset, xp + 256, ldx, acc);
    }
#ifdef NKV_FORMATS_512
    // dot for TT tokens over rows r (block at blk) and r + 1 (at blk + row_bytes) in the halves of acc[t] (row pairs)
    template <int TT>
    NKV_AVX512 static void dot_row_pair(const uint8_t* blk, int64_t row_bytes, const float* xp, int64_t ldx,
                                        __m512* acc) {
        __m256 dsc[2], dmn[2];
        scales(blk, &dsc[0], &dmn[0]);
        scales(blk + row_bytes, &dsc[1], &dmn[1]);
        const __m512 s = halves(nibble_scales(dsc[0]), nibble_scales(dsc[1]));
        for (int i = 0; i < 4; ++i) {
            __m512 a[4], b[4];
            nibbles_rows(blk + 16 + 32 * i, row_bytes, 8.0f, a);
            nibbles_rows(blk + 32 + 32 * i, row_bytes, 8.0f, b);
            const __m512 even[4] = {a[0], a[1], b[0], b[1]}, odd[4] = {a[2], a[3], b[2], b[3]};
            scaled_dot_rows<TT>(even, lane_rows(s, 2 * i), xp + 64 * i, ldx, acc);
            scaled_dot_rows<TT>(odd, lane_rows(s, 2 * i + 1), xp + 64 * i + 32, ldx, acc);
        }
        const __m512 offset = _mm512_fmsub_ps(_mm512_set1_ps(8.0f), halves(dsc[0], dsc[1]), halves(dmn[0], dmn[1]));
        for (int t = 0; t < TT; ++t) acc[t] = _mm512_fmadd_ps(offset, both_x(xp + 256 + t * ldx), acc[t]);
    }
#endif
    using XQ = XQ256T;
    // d d_x sum_j sc_j sum(q_j q_xj) - dmin d_x sum_j m_j sum(q_xj), the weights transposed into x's interleaved order
    // (XQ256T) once per block, then per token 8 maddubs summed in int16 lanes of one sub-block each, one madd with the
    // scales, one with the mins against x's sums of 16, one conversion each. Against sub-blocks in order (a madd
    // each), several tokens run 1.13x faster (Q4_K gate/up at 64 tokens, AMD EPYC Zen 4), one token 1.09x slower,
    // the transpose being paid per token; one kernel for both keeps a batch's rows bit for bit its tokens' alone.
    template <int TT>
    NKV_AVX2 static void dot_i8(const uint8_t* blk, const XQ256T* x, int64_t ldx, __m256* acc) {
        Int8Block b;
        int8_block(blk, &b);
        const __m256i scales = int16_pairs(b.sc);
        for (int t = 0; t < TT; ++t) {
            const XQ256T& xt = x[t * ldx];
            __m256i m[8];
            for (int c = 0; c < 8; ++c) m[c] = _mm256_maddubs_epi16(b.w[c], load256(xt.q + 32 * c));
            // summed as a tree: a chain of adds measured slower
            const __m256i p = _mm256_add_epi16(
                _mm256_add_epi16(_mm256_add_epi16(m[0], m[1]), _mm256_add_epi16(m[2], m[3])),
                _mm256_add_epi16(_mm256_add_epi16(m[4], m[5]), _mm256_add_epi16(m[6], m[7])));
            add_sums(_mm256_madd_epi16(p, scales), b, xt, acc[t]);
        }
    }
    // dot_i8 with VNNI: the 8 loads' products summed into sub-block j's int32 lane j directly, then times sc_j (an
    // exact int32 product, the integer the madd with the scales gives above). Two chains of 4 vpdpbusd, not one of 8:
    // on a Cascade Lake Xeon (latency 5) one chain took 1.17-1.26x the time of AVX2's maddubs tree for one token and
    // 1.03-1.09x for 64; two take 1.01-1.07x and 0.91-0.95x (qwen2.5-1.5b's Q4_K gate|up and down, 2 threads).
    template <int TT>
    NKV_AVX512 static void dot_i8_vnni(const uint8_t* blk, const XQ256T* x, int64_t ldx, __m256* acc) {
        Int8Block b;
        int8_block(blk, &b);
        const __m256i scales = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(b.sc)));
        for (int t = 0; t < TT; ++t) {
            const XQ256T& xt = x[t * ldx];
            __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
            for (int c = 0; c < 8; c += 2) {
                s0 = _mm256_dpbusd_epi32(s0, b.w[c], load256(xt.q + 32 * c));
                s1 = _mm256_dpbusd_epi32(s1, b.w[c + 1], load256(xt.q + 32 * c + 32));
            }
            add_sums(_mm256_mullo_epi32(_mm256_add_epi32(s0, s1), scales), b, xt, acc[t]);
        }
    }
    // What both integer dots take from a block: its q as bytes in XQ256T's interleaved order (w[c] holds 4 q of every
    // sub-block, sub-block j's in dword j), the scales as bytes, the mins as int16_pairs, d and -dmin.
    struct Int8Block {
        __m256i w[8], mins;
        uint64_t sc;
        __m256 d, neg_dmin;
    };
    NKV_AVX2 static void int8_block(const uint8_t* blk, Int8Block* b) {
        const __m256i m4 = _mm256_set1_epi8(0x0f);
        for (int i = 0; i < 4; ++i) {  // sub-block j's q in w[j], then transposed
            const __m256i raw = load256(blk + 16 + 32 * i);
            b->w[2 * i] = _mm256_and_si256(raw, m4);
            b->w[2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
        }
        transpose_dwords(b->w);
        uint64_t mn;
        k_scales_mins(blk + 4, &b->sc, &mn);
        b->mins = int16_pairs(mn);
        b->d = bcast_half(blk);
        b->neg_dmin = _mm256_xor_ps(bcast_half(blk + 2), _mm256_set1_ps(-0.0f));
    }
    // acc += d d_x isum - dmin d_x sum_j m_j sum(q_xj), isum the scaled sub-block sums in int32 lanes
    NKV_AVX2 static void add_sums(__m256i isum, const Int8Block& b, const XQ256T& xt, __m256& acc) {
        const __m256i msum = _mm256_madd_epi16(b.mins, load256(xt.sum16));
        const __m256 dx = _mm256_broadcast_ss(&xt.d);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(b.d, dx), acc);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(b.neg_dmin, dx), acc);
    }
    // The 8 bytes of v (sub-block j's scale or min in byte j) as int16, byte j in lanes 2j and 2j + 1.
    NKV_AVX2 static __m256i int16_pairs(uint64_t v) {
        const __m128i b = _mm_cvtsi64_si128(static_cast<int64_t>(v));
        return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(b, b));
    }
    static float dot_i8_scalar(const uint8_t* blk, const XQ256T& x) {
        uint64_t sc, mn;
        k_scales_mins(blk + 4, &sc, &mn);
        int isum = 0, msum = 0;
        for (int j = 0; j < 8; ++j) {
            const uint8_t* q = blk + 16 + 32 * (j / 2);
            int s = 0;
            for (int i = 0; i < 32; ++i) s += (j % 2 ? q[i] >> 4 : q[i] & 0x0f) * x.q[interleaved(32 * j + i)];
            isum += static_cast<int>(sc >> 8 * j & 0xff) * s;
            msum += static_cast<int>(mn >> 8 * j & 0xff) * (x.sum16[2 * j] + x.sum16[2 * j + 1]);
        }
        return load_half(blk) * x.d * static_cast<float>(isum) + -load_half(blk + 2) * x.d * static_cast<float>(msum);
    }
};

// 210 B super-block of 16 sub-blocks of 16: ql[128] low nibbles, qh[64] high 2 bits, int8 scales[16],
// fp16 d. Element 128h + 32g + i (h < 2, g < 4, i < 32): low 4 bits from ql[64h + 32(g % 2) + i]
// (the low nibble for g < 2, else the high), high 2 bits from bits 2g, 2g+1 of qh[32h + i].
// w = d sc_(e / 16) (q - 32)
struct Q6_K {
    static constexpr QType kType = QType::Q6_K;
    static constexpr int64_t kElems = 256, kBytes = 210, kPrep = 256;

    // element e's q - 32
    static int centred(const uint8_t* blk, int e) {
        const int h = e / 128, g = e / 32 % 4, i = e % 32;
        const int lo = blk[64 * h + 32 * (g % 2) + i] >> (g < 2 ? 0 : 4) & 0x0f;
        const int hi = blk[128 + 32 * h + i] >> (2 * g) & 0x03;
        return (lo | hi << 4) - 32;
    }
    static void decode(const uint8_t* blk, float* out) {
        const float d = load_half(blk + 208);
        const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
        for (int e = 0; e < 256; ++e) out[e] = d * static_cast<float>(sc[e / 16]) * static_cast<float>(centred(blk, e));
    }
    // d sc_j: lane j of s[0] for sub-blocks 0..7, of s[1] for 8..15
    NKV_AVX2 static void scales(const uint8_t* blk, __m256 s[2]) {
        const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
        const __m256 d = bcast_half(blk + 208);
        s[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
        s[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(sc, sc))));
    }
    // Half h's quants as bytes, q[g] for elements 128h + 32g + 0..31 (split_bytes' input: lane 0 holds
    // sub-block 8h + 2g, lane 1 sub-block 8h + 2g + 1).
    NKV_AVX2 static void quants(const uint8_t* blk, int h, __m256i q[4]) {
        six_bits(load256(blk + 64 * h), load256(blk + 64 * h + 32), load256(blk + 128 + 32 * h), q);
    }
    // q from the low nibbles of l0, l1 and their high nibbles, each with 2 bits of qh (in 16-bit lanes, whose shifts
    // the masks make bytewise); V is __m256i, or __m512i for row pairs
    template <class V>
    NKV_AVX2 static void six_bits(V l0, V l1, V qh, V q[4]) {
        using U16 = std::conditional_t<sizeof(V) == 32, uint16_t __attribute__((vector_size(32))),
                                       uint16_t __attribute__((vector_size(64)))>;
        const U16 a = reinterpret_cast<U16>(l0), b = reinterpret_cast<U16>(l1), h = reinterpret_cast<U16>(qh);
        const uint16_t m4 = 0x0f0f, m2 = 0x3030;
        q[0] = reinterpret_cast<V>((a & m4) | ((h << 4) & m2));
        q[1] = reinterpret_cast<V>((b & m4) | ((h << 2) & m2));
        q[2] = reinterpret_cast<V>(((a >> 4) & m4) | (h & m2));
        q[3] = reinterpret_cast<V>(((b >> 4) & m4) | ((h >> 2) & m2));
    }
    // The scales of a split-order vector of group g: sub-block 2g in lane 0, 2g + 1 in lane 1.
    NKV_AVX2 static __m256i pair_index(int g) {
        return _mm256_setr_epi32(2 * g, 2 * g, 2 * g, 2 * g, 2 * g + 1, 2 * g + 1, 2 * g + 1, 2 * g + 1);
    }
    NKV_AVX2 static __m256 pair(__m256 s, int g) { return _mm256_permutevar8x32_ps(s, pair_index(g)); }
#ifdef NKV_FORMATS_512
    // pair in each half: s holds a row pair's scales
    NKV_AVX512 static __m512 pair_rows(__m512 s, int g) {
        const __m256i i = pair_index(g);
        return _mm512_permutexvar_ps(
            _mm512_inserti64x4(_mm512_castsi256_si512(i), _mm256_add_epi32(i, _mm256_set1_epi32(8)), 1), s);
    }
#endif
    NKV_AVX2 static void decode_avx2(const uint8_t* blk, float* out) {
        __m256 s[2];
        scales(blk, s);
        for (int h = 0; h < 2; ++h) {
            __m256i q[4];
            quants(blk, h, q);
            for (int g = 0; g < 4; ++g) {
                __m256 v[4];
                split_bytes(q[g], 32.0f, v);
                const __m256 sg = pair(s[h], g);
                for (int k = 0; k < 4; ++k) store_split(out + 128 * h + 32 * g, k, _mm256_mul_ps(sg, v[k]));
            }
        }
    }
    NKV_AVX2 static void prepare(const float* x, float* xp) { prepare_split(x, 256, xp); }
    template <int TT, class X = const float*, class Acc = __m256>
    NKV_AVX2 static void dot(const uint8_t* blk, X xp, int64_t ldx, Acc* acc) {
        __m256 s[2];
        scales(blk, s);
        for (int h = 0; h < 2; ++h) {
            __m256i q[4];
            quants(blk, h, q);
            for (int g = 0; g < 4; ++g) {
                __m256 v[4];
                split_bytes(q[g], 32.0f, v);
                scaled_dot<TT>(v, pair(s[h], g), xp + 128 * h + 32 * g, ldx, acc);
            }
        }
    }
#ifdef NKV_FORMATS_512
    // dot for TT tokens over rows r (block at blk) and r + 1 (at blk + row_bytes) in the halves of acc[t] (row pairs)
    template <int TT>
    NKV_AVX512 static void dot_row_pair(const uint8_t* blk, int64_t row_bytes, const float* xp, int64_t ldx,
                                        __m512* acc) {
        __m256 s0[2], s1[2];
        scales(blk, s0);
        scales(blk + row_bytes, s1);
        for (int h = 0; h < 2; ++h) {
            __m512i q[4];
            six_bits(rows256(blk + 64 * h, row_bytes), rows256(blk + 64 * h + 32, row_bytes),
                     rows256(blk + 128 + 32 * h, row_bytes), q);
            const __m512 s = halves(s0[h], s1[h]);
            for (int g = 0; g < 4; ++g) {
                __m512 v[4];
                split_bytes_rows(q[g], 32.0f, v);
                scaled_dot_rows<TT>(v, pair_rows(s, g), xp + 128 * h + 32 * g, ldx, acc);
            }
        }
    }
#endif
    using XQ = XQ256;
    // d d_x (sum_k sc_k sum(q_k q_xk) - 32 sum_k sc_k sum(q_xk)), k over the 16 sub-blocks: q unsigned for maddubs,
    // centred through x's sums of 16
    template <int TT>
    NKV_AVX2 static void dot_i8(const uint8_t* blk, const XQ256* x, int64_t ldx, __m256* acc) {
        const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
        __m256i isum[TT];
        for (int t = 0; t < TT; ++t) isum[t] = _mm256_setzero_si256();
        for (int h = 0; h < 2; ++h) {
            __m256i q[4];
            quants(blk, h, q);
            // scales 8h..8h+7 as int16 in both lanes, shuffled into sub-block 8h + 2g's (lane 0) and 8h + 2g + 1's
            const __m256i half = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(h ? _mm_unpackhi_epi64(sc, sc) : sc));
            for (int g = 0; g < 4; ++g) {
                const int lo = 0x0100 * (4 * g + 1) + 4 * g, hi = lo + 0x0202;  // bytes of int16 2g / 2g + 1
                const __m256i s = _mm256_shuffle_epi8(
                    half, _mm256_setr_epi16(lo, lo, lo, lo, lo, lo, lo, lo, hi, hi, hi, hi, hi, hi, hi, hi));
                for (int t = 0; t < TT; ++t) {
                    const __m256i p = _mm256_maddubs_epi16(q[g], load256(x[t * ldx].q + 128 * h + 32 * g));
                    isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(p, s));
                }
            }
        }
        const __m256i scales = _mm256_cvtepi8_epi16(sc);
        const __m256 d = bcast_half(blk + 208);
        for (int t = 0; t < TT; ++t) {
            const XQ256& xt = x[t * ldx];
            const __m256i centre = _mm256_slli_epi32(_mm256_madd_epi16(scales, load256(xt.sum16)), 5);
            const __m256 total = _mm256_cvtepi32_ps(_mm256_sub_epi32(isum[t], centre));
            acc[t] = _mm256_fmadd_ps(total, _mm256_mul_ps(d, _mm256_broadcast_ss(&xt.d)), acc[t]);
        }
    }
    static float dot_i8_scalar(const uint8_t* blk, const XQ256& x) {
        const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
        int isum = 0;
        for (int e = 0; e < 256; ++e) isum += sc[e / 16] * centred(blk, e) * x.q[e];
        return load_half(blk + 208) * x.d * static_cast<float>(isum);
    }
};

// Calls fn(F{}) for the format of `qt` (the one list of formats; throws std::invalid_argument for an id
// that is not a QType).
template <class Fn>
decltype(auto) visit(QType qt, Fn&& fn) {
    switch (qt) {
        case QType::Q4_0: return fn(Q4_0{});
        case QType::Q4_1: return fn(Q4_1{});
        case QType::Q5_0: return fn(Q5_0{});
        case QType::Q8_0: return fn(Q8_0{});
        case QType::Q4_K: return fn(Q4_K{});
        case QType::Q6_K: return fn(Q6_K{});
    }
    throw std::invalid_argument("quant: bad QType " + std::to_string(static_cast<int>(qt)));
}

}  // namespace nodekv::quant::formats, formats512

#ifdef NKV_FORMATS_512
#pragma pop_macro("NKV_AVX2")
#endif
#endif  // the include guards
