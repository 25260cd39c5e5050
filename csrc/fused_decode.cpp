// The fused decode step (one new token for each of B sequences); see fused_decode.h.
#include "fused_decode.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

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

inline void linear(const QLinear& l, const float* x, int64_t T, float* y, int n_threads, quant::Precision p) {
    quant::matmul(x, T, l.K, l.segs.data(), static_cast<int>(l.segs.size()), l.bias, y, n_threads, p);
}

}  // namespace

Decoder::Decoder(const Dims& dims, const Embedding& embed, std::vector<LayerWeights> layers, const float* final_norm,
                 QLinear lm_head, quant::Precision precision)
    : d_(dims),
      embed_(embed),
      layers_(std::move(layers)),
      final_norm_(final_norm),
      lm_head_(std::move(lm_head)),
      precision_(precision) {
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

StepStatus Decoder::step(const StepArgs& a) {
    const int64_t dim = d_.dim, H = d_.n_heads, KV = d_.n_kv_heads, hd = d_.head_dim, I = d_.inter;
    const int64_t B = a.B, L = n_layers(), qkv_width = (H + 2 * KV) * hd;
    const int64_t layer_bytes = a.n_pages * KV * a.page_size * hd * (a.kv_half ? 2 : 4);  // per layer in the pools
    // Row r's attention in layer i, as PagedKVCache.attend runs it: store its k, v (from qkv, its row of the
    // projection) at position end - 1, then attend from its n (0 or 1) queries into out. Without qkv only
    // paged_attention's checks of the row's tables run.
    const auto attention = [&](const StepRow& r, int64_t i, const float* qkv, int64_t n, float* out) {
        const ops::PagedArgs pa{qkv, qkv_width, hd,
                                static_cast<char*>(a.k_pages) + i * layer_bytes,
                                static_cast<char*>(a.v_pages) + i * layer_bytes, a.kv_half,
                                a.n_pages, a.page_size, r.block_table, r.n_table, r.end,
                                qkv ? qkv + H * hd : nullptr, qkv ? qkv + (H + KV) * hd : nullptr,
                                qkv_width, hd, qkv_width, hd,
                                /*T=*/1, n, H, KV, hd,
                                r.node_bounds, r.mass ? r.n_nodes : 0, r.mass, out, a.n_threads};
        return ops::paged_attention(pa);
    };
    // Every check before anything is written, so that one bad row leaves every sequence as it was (the op-by-op
    // path would have stored the K/V of the rows before it): the tokens (the embedding lookup comes first there),
    // then each row's tables as its attention checks them in every layer.
    for (int64_t b = 0; b < B; ++b)
        if (a.rows[b].token < 0 || a.rows[b].token >= d_.vocab) return {kStepBadToken, b};
    for (int64_t b = 0; b < B; ++b)
        if (const int code = attention(a.rows[b], 0, nullptr, 0, nullptr)) return {code, b};

    const std::lock_guard<std::mutex> lock(mutex_);
    if (B > rows_) {
        const std::pair<std::vector<float>*, int64_t> scratch[] = {
            {&x_, dim}, {&h_, dim}, {&qkv_, qkv_width}, {&attn_, H * hd}, {&delta_, dim}, {&gu_, 2 * I}, {&act_, I}};
        for (const auto& [buf, width] : scratch) buf->resize(static_cast<size_t>(B * width));  // floats per row
        rows_ = B;
    }
    float *x = x_.data(), *h = h_.data(), *qkv = qkv_.data(), *attn = attn_.data(), *delta = delta_.data();

    Laps lap(times_);
    for (int64_t b = 0; b < B; ++b) {
        const int64_t token = a.rows[b].token;
        if (embed_.dense)
            std::memcpy(x + b * dim, embed_.dense + token * dim, sizeof(float) * dim);
        else
            quant::dequantize(embed_.w + token * quant::row_bytes(embed_.qt, dim), 1, dim, embed_.qt, x + b * dim, 1);
    }
    ops::rms_norm(x, B, dim, layers_[0].attn_norm, d_.eps, h);
    lap(kOther);
    for (int64_t i = 0; i < L; ++i) {
        const LayerWeights& w = layers_[static_cast<size_t>(i)];
        const bool last = i == L - 1;
        linear(w.wqkv, h, B, qkv, a.n_threads, precision_);
        lap(kQkv);
        ops::rope(qkv, B, H + KV, hd, qkv_width, hd, a.cos, a.sin_signed);
        lap(kRope);
        for (int64_t b = 0; b < B; ++b) {
            // Llama.forward: the last layer attends only when its output is used or mass is collected
            const int64_t n = (!last || a.want_out || a.rows[b].mass) ? 1 : 0;
            attention(a.rows[b], i, qkv + b * qkv_width, n, attn + b * H * hd);  // checked above: cannot fail
        }
        lap(kAttention);
        if (last && !a.want_out) break;
        linear(w.wo, attn, B, delta, a.n_threads, precision_);
        lap(kWo);
        ops::add_rms_norm(x, delta, B, dim, w.ffn_norm, d_.eps, h);
        lap(kOther);
        linear(w.w13, h, B, gu_.data(), a.n_threads, precision_);
        lap(kW13);
        ops::silu_mul(gu_.data(), B, I, act_.data());
        lap(kOther);
        linear(w.w2, act_.data(), B, delta, a.n_threads, precision_);
        lap(kW2);
        ops::add_rms_norm(x, delta, B, dim, last ? final_norm_ : layers_[static_cast<size_t>(i + 1)].attn_norm,
                          d_.eps, last ? a.h_out : h);
        lap(kOther);
    }
    if (a.want_out && a.logits && has_lm_head()) {
        linear(lm_head_, a.h_out, B, a.logits, a.n_threads, precision_);
        lap(kLmHead);
    }
    return {};
}

}  // namespace nodekv::decode
