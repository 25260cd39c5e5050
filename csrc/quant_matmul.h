// Matrix products on GGUF/ggml block-quantised weights with fp32 activations.
//
// A weight W [N, K] of one type is stored row-major as raw ggml blocks: row n is K / block_elems(qt)
// consecutive blocks of block_bytes(qt) bytes. The formats (quant_formats.h has the layouts):
//   Q4_0, Q4_1, Q5_0, Q8_0   blocks of 32 elements, one fp16 scale (and min) per block
//   Q4_K, Q6_K               super-blocks of 256 elements with 8 / 16 sub-block scales
// A weight whose rows come in runs of different types (a fused q|k|v of Q5_0 and Q8_0 parts) is a list
// of segments, each a run of rows of one type, stacked in order; a weight of one type is one segment.
//
// Activations stay fp32 unless the int8 fast path is asked for (Precision): results equal x @ dequant(W)^T up to
// fp32 rounding, and dequantize equals gguf.quants.dequantize bit for bit. The AVX2/FMA/F16C path is
// chosen at run time (with AVX-512 VNNI for the int8 path's integer dots where the CPU has it); otherwise a scalar
// one runs.
#pragma once

#include <cstdint>

namespace nodekv::quant {

// Values are the ggml type ids (gguf.GGMLQuantizationType).
enum class QType : int { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };

// Throws std::invalid_argument for an id that is not one of QType.
QType qtype_from_id(int id);

// Elements and bytes per block of `qt`.
int64_t block_elems(QType qt);
int64_t block_bytes(QType qt);

// Bytes per row of K elements (std::invalid_argument unless K is a positive multiple of block_elems).
int64_t row_bytes(QType qt, int64_t K);

// `rows` consecutive rows of one type, starting at w.
struct Segment {
    const uint8_t* w;
    QType qt;
    int64_t rows;
};

// What matmul does with the activations. kExact keeps them fp32. kInt8 (the opt-in fast path) quantises each
// token's x per block to int8 with one fp32 scale (32 elements, or 256 for the K-quants, as ggml's q8 types) and
// multiplies integers: each x element moves by at most half its block's scale (quant_formats.h, "int8
// activations"); the weights stay exact.
enum class Precision : int { kExact = 0, kInt8 = 1 };

// y[T, N] = x[T, K] @ dequant(W)[N, K]^T (+ bias[N] when bias != nullptr), W the segments' rows in
// order (N = the sum of their rows), x as `precision` takes it. x, y row-major and contiguous; K must be a
// multiple of every segment's block_elems (std::invalid_argument if not). n_threads <= 0 means
// omp_get_max_threads(). y must not alias x. Row t of y depends on x[t] alone, bit for bit: the same whatever T,
// the other rows of x and n_threads (a batch of decode steps gives exactly the numbers of sequential ones).
void matmul(const float* x, int64_t T, int64_t K, const Segment* segs, int n_segs, const float* bias, float* y,
            int n_threads, Precision precision = Precision::kExact);

// out[N, K] = dequant(w), fp32 row-major.
void dequantize(const uint8_t* w, int64_t N, int64_t K, QType qt, float* out, int n_threads);

// out[N, K] = dequant(w) rounded to bf16 (nearest even; the bits of torch's float -> bfloat16 conversion of
// dequantize's output), row-major, each row decoded into a per-thread fp32 row first.
void dequantize_bf16(const uint8_t* w, int64_t N, int64_t K, QType qt, uint16_t* out, int n_threads);

}  // namespace nodekv::quant
