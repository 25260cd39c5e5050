// One decode step of a Llama-family model with GGUF block-quantised weights and fp32 activations: a
// new token for each of B sequences, run through every decoder layer in one call.
//
// At one token a layer is a dozen small steps (norm, 4 quantised GEMVs, RoPE, paged attention,
// SwiGLU, residual adds); run from Python each costs a few µs of wrapper, checks and allocation on
// top of its work, ~4 ms per SmolLM2-135M token. Here the same C++ functions run back to back on
// preallocated scratch, in the same order and with the same arguments, so the results are
// bit-identical to the op-by-op path (engine/model.py Llama.forward / forward_batch with the cpu
// backend). The B tokens are the rows of one batch, as forward_batch stacks them:
//
//   x = embed[tokens] (decoded from their blocks when quantised);  h = rms_norm(x, attn_norm[0])
//   per layer i:  qkv = h @ Wqkv^T (+ b);  RoPE on q, k (row b at its own position);  per row b: store
//                 its k, v at position end_b - 1 of its pages and attend over them (with node mass when
//                 collecting);  h = add_rms_norm(x += attn @ Wo^T, ffn_norm)
//                 x += silu_mul(h @ W13^T) @ W2^T;  h = rms_norm(x, attn_norm[i + 1] or the final norm)
//   logits = h @ W_lm^T  (when the lm_head is quantised too; else the caller runs it on h)
//
// The matmuls run with T = B: quant::matmul computes each row bit-identically whatever T, and the
// other ops are row by row, so B rows give exactly the numbers of B one-token steps.
//
// The matmuls and attention use the shared OpenMP team and contention guard (cpu_common.h) exactly as
// the separate calls do. Pointers are trusted: the Python side (engine/model.py) checks shapes once
// when it builds the decoder and the cache tensors on every step.
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <vector>

#include "quant_matmul.h"

namespace nodekv::decode {

// y[T, N] = x[T, K] @ dequant(W)[N, K]^T (+ bias), W the segments' rows stacked (quant_matmul.h): one
// segment for a weight of one type, several for a fused one whose parts differ in type.
struct QLinear {
    std::vector<quant::Segment> segs;  // empty: absent (only the lm_head may be)
    int64_t N = 0, K = 0;
    const float* bias = nullptr;
};

// The token embedding [vocab, dim]: dense fp32 rows, or (when dense is nullptr) quantised rows of one type
// decoded as they are looked up.
struct Embedding {
    const float* dense = nullptr;
    const uint8_t* w = nullptr;
    quant::QType qt = quant::QType::Q8_0;
};

struct LayerWeights {
    const float* attn_norm;  // [dim]
    QLinear wqkv;            // [(H + 2 KV) hd, dim]: q | k | v rows
    QLinear wo;              // [dim, H hd]
    const float* ffn_norm;   // [dim]
    QLinear w13;             // [2 I, dim]: gate | up rows
    QLinear w2;              // [dim, I]
};

struct Dims {
    int64_t dim, n_heads, n_kv_heads, head_dim, inter, vocab;
    float eps;
};

// One sequence of a step: its new token, its block table and its node-mass collector.
struct StepRow {
    int64_t token;
    const int32_t* block_table;  // n_table entries, n_table * page_size >= end
    int64_t n_table;
    int64_t end;                 // positions cached after this step (the new token is end - 1)
    const int32_t* node_bounds;  // with mass: n_nodes + 1 bounds, 0 = b[0] < ... < b[n_nodes] = end
    int64_t n_nodes;
    float* mass;                 // [n_nodes] accumulated (+=) over layers and heads, or nullptr
};

// Per-step inputs: B rows and what they share.
struct StepArgs {
    const StepRow* rows;
    int64_t B;
    const float* cos;         // [B, head_dim]: row b's at position rows[b].end - 1
    const float* sin_signed;  // [B, head_dim]
    void* k_pages;            // all layers: [layers, n_pages, kv_heads, page_size, hd], contiguous
    void* v_pages;
    bool kv_half;             // the pages hold IEEE halves, else floats (paged_attention.h)
    int64_t n_pages, page_size;
    bool want_out;            // false: the last layer only stores its K/V (and attends for rows collecting)
    float* h_out;             // [B, dim]: the final normed hidden states (written when want_out)
    float* logits;            // [B, vocab] or nullptr (when want_out and the lm_head is quantised)
    int n_threads;            // <= 0: omp_get_max_threads()
};

// What step found wrong before writing anything (the caller explains it); codes 1 and 2 are
// paged_attention's (paged_attention.h).
enum StepCode : int { kStepOk = 0, kStepBadBlockTable = 1, kStepBadNodeBounds = 2, kStepBadToken = 3 };
struct StepStatus {
    int code = kStepOk;
    int64_t row = 0;  // the first row found wrong
};

class Decoder {
   public:
    // final_norm [dim]; lm_head.segs empty if the lm_head is not quantised; precision: the matmuls' (quant_matmul.h).
    Decoder(const Dims& dims, const Embedding& embed, std::vector<LayerWeights> layers, const float* final_norm,
            QLinear lm_head, quant::Precision precision = quant::Precision::kExact);

    // One token per row through every layer (see the file comment). Steps of one Decoder run one at
    // a time (the scratch is the object's, grown to the largest B seen; a mutex serialises callers on
    // other threads).
    StepStatus step(const StepArgs& a);

    int64_t n_layers() const { return static_cast<int64_t>(layers_.size()); }
    bool has_lm_head() const { return !lm_head_.segs.empty(); }

    // Wall time spent in each part of the steps since the last reset, in seconds (a profile of the
    // step at ~40 clock reads per layer, all rows of a part together): kTimeParts names them.
    static constexpr int kTimeParts = 8;
    static constexpr const char* kTimeNames[kTimeParts] = {"wqkv", "rope", "attention", "wo",
                                                           "w13",  "w2",   "norms+silu", "lm_head"};
    std::array<double, kTimeParts> times() const { return times_; }
    void reset_times() { times_.fill(0.0); }

   private:
    Dims d_;
    Embedding embed_;
    std::vector<LayerWeights> layers_;
    const float* final_norm_;
    QLinear lm_head_;
    quant::Precision precision_;
    int64_t rows_ = 0;  // rows the scratch below holds
    std::vector<float> x_, h_, qkv_, attn_, delta_, gu_, act_;
    std::array<double, kTimeParts> times_{};
    std::mutex mutex_;
};

}  // namespace nodekv::decode
