// nodekv._C: pybind11 bindings only; the code lives behind the csrc/*.h headers.
//
// Tensors cross as raw addresses (torch.Tensor.data_ptr()) plus sizes: the Python wrappers
// own validation and allocation, which keeps a call down to about a microsecond.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <vector>

#include "cpu_common.h"
#include "cpu_ops.h"
#include "fused_decode.h"
#include "paged_attention.h"
#include "quant_matmul.h"

namespace py = pybind11;

namespace {

template <class T>
T* ptr(std::uintptr_t addr) {
    return reinterpret_cast<T*>(addr);
}

namespace q = nodekv::quant;

// Segments from a table of n (address, ggml type id, rows) triples of integers.
template <class Int>
std::vector<q::Segment> segments(const Int* table, size_t n) {
    std::vector<q::Segment> segs;
    for (size_t i = 0; i < n; ++i)
        segs.push_back({ptr<const uint8_t>(static_cast<std::uintptr_t>(table[3 * i])),
                        q::qtype_from_id(static_cast<int>(table[3 * i + 1])), static_cast<int64_t>(table[3 * i + 2])});
    return segs;
}

// A quantised linear for Decoder from [K, bias, then (w, qtype, rows) per segment] (addresses; bias 0 = none).
nodekv::decode::QLinear qlinear(const std::vector<std::uintptr_t>& v) {
    if (v.size() < 5 || (v.size() - 2) % 3)
        throw std::invalid_argument("Decoder: a linear takes [K, bias] + [w, qtype, rows] per segment");
    nodekv::decode::QLinear l;
    l.K = static_cast<int64_t>(v[0]);
    l.bias = ptr<const float>(v[1]);
    l.segs = segments(v.data() + 2, (v.size() - 2) / 3);
    for (const q::Segment& s : l.segs) l.N += s.rows;
    return l;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
    m.doc() = "nodekv C++ kernels";

    m.def("isa", &nodekv::isa_name, "'avx512', 'avx2' or 'scalar': the SIMD level every CPU kernel takes now.");
    m.def("limit_isa", &nodekv::limit_isa, py::arg("name"),
          "Testing and benchmarking hook: no SIMD level above name ('scalar', 'avx2' or 'avx512', the default: the "
          "best the CPU has) in any CPU kernel from now on.");

    m.def(
        "quant_matmul",
        [](std::uintptr_t x, int64_t T, int64_t K, std::uintptr_t segs, int64_t n_segs, std::uintptr_t bias,
           std::uintptr_t y, int n_threads, bool int8) {
            const std::vector<q::Segment> s = segments(ptr<const int64_t>(segs), static_cast<size_t>(n_segs));
            py::gil_scoped_release nogil;
            q::matmul(ptr<const float>(x), T, K, s.data(), static_cast<int>(s.size()), ptr<const float>(bias),
                      ptr<float>(y), n_threads, int8 ? q::Precision::kInt8 : q::Precision::kExact);
        },
        py::arg("x"), py::arg("T"), py::arg("K"), py::arg("segs"), py::arg("n_segs"), py::arg("bias"), py::arg("y"),
        py::arg("n_threads"), py::arg("int8") = false,
        "y[T,N] = x[T,K] @ dequant(W)[N,K]^T (+ bias[N]), W the rows of n_segs segments stacked: segs is the address "
        "of an int64 [n_segs, 3] table of (weight address, ggml type id, rows); contiguous buffers, bias 0 = none; "
        "int8: x quantised to int8 per block (the fast path, quant_matmul.h).");
    m.def(
        "quant_dequantize",
        [](std::uintptr_t w, int64_t N, int64_t K, int qtype, std::uintptr_t out, int n_threads, bool bf16) {
            const q::QType qt = q::qtype_from_id(qtype);
            py::gil_scoped_release nogil;
            if (bf16)
                q::dequantize_bf16(ptr<const uint8_t>(w), N, K, qt, ptr<uint16_t>(out), n_threads);
            else
                q::dequantize(ptr<const uint8_t>(w), N, K, qt, ptr<float>(out), n_threads);
        },
        py::arg("w"), py::arg("N"), py::arg("K"), py::arg("qtype"), py::arg("out"), py::arg("n_threads"),
        py::arg("bf16") = false,
        "out[N,K] = dequant(w), fp32, or with bf16 its bits rounded to nearest even; addresses of contiguous buffers.");
    m.def(
        "quant_block_size",
        [](int qtype) {
            const q::QType qt = q::qtype_from_id(qtype);
            return py::make_tuple(q::block_elems(qt), q::block_bytes(qt));
        },
        py::arg("qtype"), "(elements, bytes) per block of a ggml type id with a native kernel.");

    namespace o = nodekv::ops;
    m.def(
        "rms_norm",
        [](std::uintptr_t x, int64_t T, int64_t d, std::uintptr_t w, float eps, std::uintptr_t y) {
            o::rms_norm(ptr<const float>(x), T, d, ptr<const float>(w), eps, ptr<float>(y));
        },
        py::arg("x"), py::arg("T"), py::arg("d"), py::arg("w"), py::arg("eps"), py::arg("y"),
        "y[T,d] = x / sqrt(mean(x^2) + eps) * w; contiguous fp32 buffers.");
    m.def(
        "add_rms_norm",
        [](std::uintptr_t x, std::uintptr_t delta, int64_t T, int64_t d, std::uintptr_t w, float eps,
           std::uintptr_t y) {
            o::add_rms_norm(ptr<float>(x), ptr<const float>(delta), T, d, ptr<const float>(w), eps, ptr<float>(y));
        },
        py::arg("x"), py::arg("delta"), py::arg("T"), py::arg("d"), py::arg("w"), py::arg("eps"), py::arg("y"),
        "x += delta in place, then y = rms_norm(x, w, eps); contiguous fp32 buffers.");
    m.def(
        "rope",
        [](std::uintptr_t x, int64_t T, int64_t n_heads, int64_t hd, int64_t stride_t, int64_t stride_h,
           std::uintptr_t cos, std::uintptr_t sin_signed) {
            o::rope(ptr<float>(x), T, n_heads, hd, stride_t, stride_h, ptr<const float>(cos),
                    ptr<const float>(sin_signed));
        },
        py::arg("x"), py::arg("T"), py::arg("n_heads"), py::arg("hd"), py::arg("stride_t"), py::arg("stride_h"),
        py::arg("cos"), py::arg("sin_signed"),
        "In place: x[t,h,:] = x * cos[t] + roll(x, hd/2) * sin_signed[t]; element strides for t and h.");
    m.def(
        "silu_mul",
        [](std::uintptr_t gu, int64_t T, int64_t I, std::uintptr_t y) {
            o::silu_mul(ptr<const float>(gu), T, I, ptr<float>(y));
        },
        py::arg("gu"), py::arg("T"), py::arg("I"), py::arg("y"),
        "y[T,I] = silu(gu[:, :I]) * gu[:, I:]; contiguous fp32 buffers.");
    m.def(
        "paged_attention",
        [](std::uintptr_t q, int64_t q_stride_t, int64_t q_stride_h, std::uintptr_t k_pages, std::uintptr_t v_pages,
           int64_t n_pages, int64_t page_size, std::uintptr_t block_table, int64_t n_table, int64_t end,
           std::uintptr_t k_new, int64_t k_new_stride_t, int64_t k_new_stride_h, std::uintptr_t v_new,
           int64_t v_new_stride_t, int64_t v_new_stride_h, int64_t T, int64_t n, int64_t H, int64_t kv_heads,
           int64_t hd, std::uintptr_t node_bounds, int64_t n_nodes, std::uintptr_t mass, std::uintptr_t out,
           int n_threads, bool kv_half) {
            const o::PagedArgs a{ptr<const float>(q), q_stride_t, q_stride_h, ptr<void>(k_pages), ptr<void>(v_pages),
                                 kv_half, n_pages, page_size, ptr<const int32_t>(block_table), n_table, end,
                                 ptr<const float>(k_new), ptr<const float>(v_new), k_new_stride_t, k_new_stride_h,
                                 v_new_stride_t, v_new_stride_h, T, n, H, kv_heads, hd,
                                 ptr<const int32_t>(node_bounds), n_nodes, ptr<float>(mass), ptr<float>(out),
                                 n_threads};
            py::gil_scoped_release nogil;
            return o::paged_attention(a);
        },
        py::arg("q"), py::arg("q_stride_t"), py::arg("q_stride_h"), py::arg("k_pages"), py::arg("v_pages"),
        py::arg("n_pages"), py::arg("page_size"), py::arg("block_table"), py::arg("n_table"), py::arg("end"),
        py::arg("k_new"), py::arg("k_new_stride_t"), py::arg("k_new_stride_h"), py::arg("v_new"),
        py::arg("v_new_stride_t"), py::arg("v_new_stride_h"), py::arg("T"), py::arg("n"), py::arg("H"),
        py::arg("kv_heads"), py::arg("hd"), py::arg("node_bounds"), py::arg("n_nodes"), py::arg("mass"),
        py::arg("out"), py::arg("n_threads"), py::arg("kv_half") = false,
        "Causal GQA attention of the last n of end positions over one layer's [n_pages, kv_heads, page_size, hd] "
        "K/V pages (fp32, or IEEE halves with kv_half) through block_table (int32), storing k_new/v_new [T, "
        "kv_heads, hd] at end-T.. first (0 = none); mass [n, n_nodes] += attention per key node (0 = none); out [n, "
        "H*hd]. Returns 0, or 1 for a block table entry out of range, 2 for bad node bounds (nothing written then).");

    namespace d = nodekv::decode;
    py::class_<d::Decoder>(m, "Decoder",
                           "A decode step (one token for each of B sequences) through every layer in one call "
                           "(csrc/fused_decode.h); built over weight addresses, which must outlive it.")
        .def(py::init([](int64_t dim, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, int64_t inter,
                         int64_t vocab, float eps, const std::vector<std::uintptr_t>& embed,
                         const std::vector<std::vector<std::vector<std::uintptr_t>>>& layers,
                         std::uintptr_t final_norm, const std::vector<std::uintptr_t>& lm_head, bool int8) {
                 if (embed.size() != 2) throw std::invalid_argument("Decoder: embed takes [address, qtype]");
                 d::Embedding emb;
                 if (embed[1] == 0) {
                     emb.dense = ptr<const float>(embed[0]);
                 } else {
                     emb.w = ptr<const uint8_t>(embed[0]);
                     emb.qt = q::qtype_from_id(static_cast<int>(embed[1]));
                 }
                 std::vector<d::LayerWeights> ls;
                 for (const auto& v : layers) {
                     if (v.size() != 5 || v[0].size() != 2)
                         throw std::invalid_argument("Decoder: a layer takes [[attn_norm, ffn_norm]] + 4 linears");
                     ls.push_back({ptr<const float>(v[0][0]), qlinear(v[1]), qlinear(v[2]), ptr<const float>(v[0][1]),
                                   qlinear(v[3]), qlinear(v[4])});
                 }
                 return new d::Decoder({dim, n_heads, n_kv_heads, head_dim, inter, vocab, eps}, emb, std::move(ls),
                                       ptr<const float>(final_norm),
                                       lm_head.empty() ? d::QLinear{} : qlinear(lm_head),
                                       int8 ? q::Precision::kInt8 : q::Precision::kExact);
             }),
             py::arg("dim"), py::arg("n_heads"), py::arg("n_kv_heads"), py::arg("head_dim"), py::arg("inter"),
             py::arg("vocab"), py::arg("eps"), py::arg("embed"), py::arg("layers"), py::arg("final_norm"),
             py::arg("lm_head"), py::arg("int8") = false,
             "embed: [address, ggml type id] (0 = dense fp32 rows); layers: per layer [[attn_norm, ffn_norm], wqkv, "
             "wo, w13, w2], each linear [K, bias] + [w, qtype, rows] per segment (addresses); lm_head: such a linear "
             "or [] (not quantised: the caller runs it); int8: the matmuls' fast path.")
        .def(
            "step",
            [](d::Decoder& self, const std::vector<int64_t>& rows, std::uintptr_t cos, std::uintptr_t sin_signed,
               std::uintptr_t k_pages, std::uintptr_t v_pages, bool kv_half, int64_t n_pages, int64_t page_size,
               bool want_out, std::uintptr_t h_out, std::uintptr_t logits, int n_threads) {
                constexpr size_t kFields = 7;
                if (rows.empty() || rows.size() % kFields)
                    throw std::invalid_argument("Decoder.step: rows takes 7 integers per row");
                std::vector<d::StepRow> rs;
                for (size_t i = 0; i < rows.size(); i += kFields) {
                    const int64_t* r = rows.data() + i;
                    rs.push_back({r[0], ptr<const int32_t>(static_cast<std::uintptr_t>(r[1])), r[2], r[3],
                                  ptr<const int32_t>(static_cast<std::uintptr_t>(r[4])), r[5],
                                  ptr<float>(static_cast<std::uintptr_t>(r[6]))});
                }
                const d::StepArgs a{rs.data(), static_cast<int64_t>(rs.size()), ptr<const float>(cos),
                                    ptr<const float>(sin_signed), ptr<void>(k_pages), ptr<void>(v_pages), kv_half,
                                    n_pages, page_size, want_out, ptr<float>(h_out), ptr<float>(logits), n_threads};
                d::StepStatus status;
                {
                    py::gil_scoped_release nogil;
                    status = self.step(a);
                }
                return py::make_tuple(status.code, status.row);
            },
            "One token for each of B sequences (row b at position end_b - 1) through every layer. rows: per row "
            "(token, block_table, n_table, end, node_bounds, n_nodes, mass), flattened (addresses; mass [n_nodes] += "
            "node attention mass, 0 = none); cos, sin_signed [B, head_dim]; the K/V pools of all layers, shared "
            "(fp32, or IEEE halves with kv_half); h_out [B, dim] the final normed states, logits [B, vocab] (0 = "
            "none). Returns (code, row): code 0, or for the first row found wrong 1 for a bad block table entry, 2 for "
            "bad node bounds, 3 for a token outside the vocabulary (nothing written then).")
        .def(
            "times",
            [](const d::Decoder& self) {
                py::dict out;
                const auto t = self.times();
                for (int i = 0; i < d::Decoder::kTimeParts; ++i) out[d::Decoder::kTimeNames[i]] = t[i];
                return out;
            },
            "Seconds spent in each part of the steps since the last reset_times(): a per-token profile.")
        .def("reset_times", &d::Decoder::reset_times)
        .def_property_readonly("n_layers", &d::Decoder::n_layers)
        .def_property_readonly("has_lm_head", &d::Decoder::has_lm_head);
}
