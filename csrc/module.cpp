// nodekv._C: pybind11 bindings only; the code lives behind the csrc/*.h headers.
//
// Tensors cross as raw addresses (torch.Tensor.data_ptr()) plus sizes: the Python wrappers
// own validation and allocation, which keeps a call down to about a microsecond.
#include <pybind11/pybind11.h>

#include <cstdint>

#include "quant_matmul.h"

namespace py = pybind11;

namespace {

template <class T>
T* ptr(std::uintptr_t addr) {
    return reinterpret_cast<T*>(addr);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
    m.doc() = "nodekv C++ kernels";

    namespace q = nodekv::quant;
    m.def(
        "quant_matmul",
        [](std::uintptr_t x, int64_t T, int64_t K, std::uintptr_t w, int64_t N, int qtype,
           std::uintptr_t bias, std::uintptr_t y, int n_threads) {
            const q::QType qt = q::qtype_from_id(qtype);
            py::gil_scoped_release nogil;
            q::matmul(ptr<const float>(x), T, K, ptr<const uint8_t>(w), N, qt, ptr<const float>(bias),
                      ptr<float>(y), n_threads);
        },
        py::arg("x"), py::arg("T"), py::arg("K"), py::arg("w"), py::arg("N"), py::arg("qtype"),
        py::arg("bias"), py::arg("y"), py::arg("n_threads"),
        "y[T,N] = x[T,K] @ dequant(w)[N,K]^T (+ bias[N]); addresses of contiguous buffers, bias 0 = none.");
    m.def(
        "quant_dequantize",
        [](std::uintptr_t w, int64_t N, int64_t K, int qtype, std::uintptr_t out, int n_threads) {
            const q::QType qt = q::qtype_from_id(qtype);
            py::gil_scoped_release nogil;
            q::dequantize(ptr<const uint8_t>(w), N, K, qt, ptr<float>(out), n_threads);
        },
        py::arg("w"), py::arg("N"), py::arg("K"), py::arg("qtype"), py::arg("out"), py::arg("n_threads"),
        "out[N,K] (fp32) = dequant(w); addresses of contiguous buffers.");
    m.def(
        "quant_block_bytes", [](int qtype) { return q::block_bytes(q::qtype_from_id(qtype)); },
        py::arg("qtype"), "Bytes per 32-element block of a ggml type id.");
    m.def("quant_isa", &q::active_isa, "'avx2' or 'scalar': the path the quant kernels take now.");
    m.def("quant_force_scalar", &q::set_force_scalar, py::arg("on"),
          "Testing hook: force the scalar quant kernels even where AVX2 is available.");
}
