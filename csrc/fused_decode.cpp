// The fused one-token decode step; see fused_decode.h.
#include "fused_decode.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>

#include "cpu_ops.h"
#include "paged_attention.h"

namespace nodekv::decode {
namespace {

void check_linear(const QLinear& l, int64_t N, int64_t K, const char* what, int64_t layer) {
    int64_t rows = 0;
    for (const quant::Segment& s : l.segs) {
        if (!s.w) throw std::invalid_argument(std::string("Decoder: ") + what + " has a segment without data");
        quant::row_bytes(s.qt, K);  // throws unless K is a multiple of the type's block
        rows += s.rows;
    }
    if (l.segs.empty() || l.N != N || l.K != K || rows != N)
        throw std::invalid_argument(std::string("Decoder: ") + what + " of layer " + std::to_string(layer) +
                                    " must be a quantised [" + std::to_string(N) + ", " + std::to_string(K) +
                                    "] weight, got [" + std::to_string(l.N) + ", " + std::to_string(l.K) + "] of " +
                                    std::to_string(rows) + " rows in " + std::to_string(l.segs.size()) + " segments");
}

inline void gemv(const QLinear& l, const float* x, float* y, int n_threads) {
    quant::matmul(x, 1, l.K, l.segs.data(), static_cast<int>(l.segs.size()), l.bias, y, n_threads);
}

}  // namespace

Decoder::Decoder(const Dims& dims, const Embedding& embed, std::vector<LayerWeights> layers, const float* final_norm,
                 QLinear lm_head)
    : d_(dims), embed_(embed), layers_(std::move(layers)), final_norm_(final_norm), lm_head_(std::move(lm_head)) {
    const int64_t dim = d_.dim, H = d_.n_heads, KV = d_.n_kv_heads, hd = d_.head_dim, I = d_.inter;
    if (dim <= 0 || H <= 0 || KV <= 0 || H % KV || hd <= 0 || hd % 2 || I <= 0 || d_.vocab <= 0)
        throw std::invalid_argument("Decoder: bad model dimensions");
    if (layers_.empty()) throw std::invalid_argument("Decoder: no layers");
    if (!(embed_.dense || embed_.w) || !final_norm_)
        throw std::invalid_argument("Decoder: missing embedding or final norm");
    if (!embed_.dense) quant::row_bytes(embed_.qt, dim);  // throws unless dim is a multiple of the type's block
    for (size_t i = 0; i < layers_.size(); ++i) {
        const LayerWeights& l = layers_[i];
        const auto li = static_cast<int64_t>(i);
        if (!l.attn_norm || !l.ffn_norm) throw std::invalid_argument("Decoder: missing norm weights");
        check_linear(l.wqkv, (H + 2 * KV) * hd, dim, "wqkv", li);
        check_linear(l.wo, dim, H * hd, "wo", li);
        check_linear(l.w13, 2 * I, dim, "w13", li);
        check_linear(l.w2, dim, I, "w2", li);
    }
    if (has_lm_head()) check_linear(lm_head_, d_.vocab, dim, "lm_head", -1);
    x_.resize(static_cast<size_t>(dim));
    h_.resize(static_cast<size_t>(dim));
    qkv_.resize(static_cast<size_t>((H + 2 * KV) * hd));
    attn_.resize(static_cast<size_t>(H * hd));
    delta_.resize(static_cast<size_t>(dim));
    gu_.resize(static_cast<size_t>(2 * I));
    act_.resize(static_cast<size_t>(I));
}

namespace {

// Adds the time since the last lap to one of the step's parts.
class Laps {
   public:
    explicit Laps(std::array<double, Decoder::kTimeParts>& t) : t_(t), last_(Clock::now()) {}
    void operator()(int part) {
        const Clock::time_point now = Clock::now();
        t_[part] += std::chrono::duration<double>(now - last_).count();
        last_ = now;
    }

   private:
    using Clock = std::chrono::steady_clock;
    std::array<double, Decoder::kTimeParts>& t_;
    Clock::time_point last_;
};

enum Part { kQkv, kRope, kAttention, kWo, kW13, kW2, kOther, kLmHead };

}  // namespace

int Decoder::step(const StepArgs& a) {
    const int64_t dim = d_.dim, H = d_.n_heads, KV = d_.n_kv_heads, hd = d_.head_dim, I = d_.inter;
    const int64_t L = n_layers(), qkv_width = (H + 2 * KV) * hd;
    const int64_t layer_stride = a.n_pages * KV * a.page_size * hd;  // floats per layer in the pools
    if (a.token < 0 || a.token >= d_.vocab) return kStepBadToken;
    const std::lock_guard<std::mutex> lock(mutex_);
    float *x = x_.data(), *h = h_.data(), *qkv = qkv_.data(), *attn = attn_.data(), *delta = delta_.data();

    Laps lap(times_);
    if (embed_.dense)
        std::memcpy(x, embed_.dense + a.token * dim, sizeof(float) * dim);
    else
        quant::dequantize(embed_.w + a.token * quant::row_bytes(embed_.qt, dim), 1, dim, embed_.qt, x, 1);
    ops::rms_norm(x, 1, dim, layers_[0].attn_norm, d_.eps, h);
    lap(kOther);
    for (int64_t i = 0; i < L; ++i) {
        const LayerWeights& w = layers_[static_cast<size_t>(i)];
        const bool last = i == L - 1;
        gemv(w.wqkv, h, qkv, a.n_threads);
        lap(kQkv);
        ops::rope(qkv, 1, H + KV, hd, qkv_width, hd, a.cos, a.sin_signed);
        lap(kRope);
        // Llama.forward: the last layer attends only when its output is used or mass is collected
        const int64_t n = (!last || a.want_out || a.mass) ? 1 : 0;
        const ops::PagedArgs pa{qkv, qkv_width, hd,
                                a.k_pages + i * layer_stride, a.v_pages + i * layer_stride,
                                a.n_pages, a.page_size, a.block_table, a.n_table, a.end,
                                qkv + H * hd, qkv + (H + KV) * hd, qkv_width, hd, qkv_width, hd,
                                /*T=*/1, n, H, KV, hd,
                                a.node_bounds, a.mass ? a.n_nodes : 0, a.mass, attn, a.n_threads};
        const int status = ops::paged_attention(pa);
        lap(kAttention);
        if (status != ops::kPagedOk) return status;  // only layer 0 can fail: the tables are the same for all
        if (last && !a.want_out) break;
        gemv(w.wo, attn, delta, a.n_threads);
        lap(kWo);
        ops::add_rms_norm(x, delta, 1, dim, w.ffn_norm, d_.eps, h);
        lap(kOther);
        gemv(w.w13, h, gu_.data(), a.n_threads);
        lap(kW13);
        ops::silu_mul(gu_.data(), 1, I, act_.data());
        lap(kOther);
        gemv(w.w2, act_.data(), delta, a.n_threads);
        lap(kW2);
        ops::add_rms_norm(x, delta, 1, dim, last ? final_norm_ : layers_[static_cast<size_t>(i + 1)].attn_norm,
                          d_.eps, last ? a.h_out : h);
        lap(kOther);
    }
    if (a.want_out && a.logits && has_lm_head()) {
        gemv(lm_head_, a.h_out, a.logits, a.n_threads);
        lap(kLmHead);
    }
    return kStepOk;
}

}  // namespace nodekv::decode
