// Matrix products on GGUF/ggml block-quantised weights with fp32 activations.
//
// A weight W [N, K] is stored row-major as raw ggml blocks: row n is K/32 consecutive
// blocks of 32 elements, `block_bytes(qt)` bytes each, so a row is K/32*block_bytes bytes.
//   Q4_0 (18 B): fp16 d, 16 B nibbles;          w = d * (q - 8),  q in 0..15
//   Q4_1 (20 B): fp16 d, fp16 m, 16 B nibbles;  w = d * q + m,    q in 0..15
//   Q8_0 (34 B): fp16 d, 32 int8;               w = d * q
// In the nibble formats byte j of the block holds element j (low nibble) and j+16 (high).
//
// Activations stay fp32 (they are never quantised): results equal x @ dequant(W)^T up to
// fp32 rounding. The AVX2/FMA/F16C path is chosen at run time; otherwise a scalar one runs.
#pragma once

#include <cstdint>

namespace nodekv::quant {

// Values are the ggml type ids (gguf.GGMLQuantizationType).
enum class QType : int { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };

constexpr int64_t kBlockSize = 32;

// Throws std::invalid_argument for an id that is not one of QType.
QType qtype_from_id(int id);

// Bytes per 32-element block of `qt`.
int64_t block_bytes(QType qt);

// y[T, N] = x[T, K] @ dequant(w)[N, K]^T (+ bias[N] when bias != nullptr).
// x, y row-major and contiguous; K must be a multiple of 32 (std::invalid_argument if not).
// n_threads <= 0 means omp_get_max_threads(). y must not alias x.
void matmul(const float* x, int64_t T, int64_t K, const uint8_t* w, int64_t N, QType qt,
            const float* bias, float* y, int n_threads);

// out[N, K] = dequant(w), fp32 row-major.
void dequantize(const uint8_t* w, int64_t N, int64_t K, QType qt, float* out, int n_threads);

// "avx2" or "scalar": the path matmul/dequantize take now.
const char* active_isa();

// Testing hook: force the scalar path even where AVX2 is available.
void set_force_scalar(bool on);

}  // namespace nodekv::quant
