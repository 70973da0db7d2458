// The extension module: registers the ops, and nothing else (each op is in the .cpp of its idea).
//
// All kernels accumulate in fp32 for every input dtype. Work is split with OpenMP on the same
// runtime (libgomp) and thread count as torch, so torch.set_num_threads governs these kernels too.
//
// One translation unit (a unity build): this file includes each op's .cpp, so torch's headers are
// compiled once, not once per op (a minute a build, for every ISA variant). Each .cpp stands
// alone (it includes what it uses, its helpers in an unnamed namespace, its ops declared in
// ops.h), so compiled as a unit of its own it would give the same code.

#include <torch/extension.h>

#include "amx_gemm_ops.cpp"
#include "attention_op.cpp"
#include "cache_eviction.cpp"
#include "decoder_stack.h"
#include "elementwise_ops.cpp"
#include "mkl_gemm_ops.cpp"
#include "ops.h"
#include "panel_gemm_ops.cpp"
#include "thread_binding.cpp"

using namespace tessera;

namespace {

// The decoder stack (decoder_stack.h) as Python classes.
void bind_decoder_stack(py::module_& m) {
  using namespace tessera::stack;
  py::enum_<Gemm>(m, "StackGemm")
      .value("PYTHON", Gemm::kPython)
      .value("MKL", Gemm::kMkl)
      .value("PANELS", Gemm::kPanels)
      .value("AMX", Gemm::kAmx)
      .value("PANELS_GATED", Gemm::kPanelsGated)
      .value("AMX_GATED", Gemm::kAmxGated);
  py::class_<Linear>(m, "StackLinear")
      .def(py::init([](Gemm gemm, torch::Tensor packed, int64_t n, torch::Tensor bias, py::object python,
                       bool silu_after) { return Linear{gemm, packed, n, bias, python, silu_after}; }),
           py::arg("gemm"), py::arg("packed"), py::arg("n"), py::arg("bias"), py::arg("python"),
           py::arg("silu_after"));
  py::class_<Layer>(m, "StackLayer")
      .def(py::init([](torch::Tensor input_norm, double input_eps, torch::Tensor post_norm, double post_eps,
                       Linear qkv, Linear o, Linear gate_up, Linear down, int64_t heads, int64_t kv_heads,
                       int64_t head_dim, double scale, int64_t sliding_window) {
             return Layer{input_norm, post_norm, input_eps, post_eps, qkv, o, gate_up, down,
                          heads, kv_heads, head_dim, sliding_window, scale};
           }),
           py::arg("input_norm"), py::arg("input_eps"), py::arg("post_norm"), py::arg("post_eps"), py::arg("qkv"),
           py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("heads"), py::arg("kv_heads"),
           py::arg("head_dim"), py::arg("scale"), py::arg("sliding_window"));
  py::class_<DecoderStack>(m, "DecoderStack")
      .def(py::init<std::vector<Layer>>(), py::arg("layers"))
      // The GIL is released for the whole pass (other threads keep running), taken back only
      // around a Python GEMM.
      .def("forward", &DecoderStack::forward, py::call_guard<py::gil_scoped_release>());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels touch no Python object: let other threads (heartbeats, sockets) run meanwhile.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("mkl_packed_gemm_available", &mkl_packed_gemm_available, "whether MKL's packed GEMM can be used");
  m.def("mkl_pack_weight", &mkl_pack_weight, "pack an fp32 [N, K] weight for mkl_linear", nogil);
  m.def("mkl_linear", &mkl_linear, "x @ weight.T (+ bias) with a packed weight", nogil);
  m.def("paged_attention", &paged_attention, "attention over a paged KV cache (prefill, decode, mixed)", nogil);
  m.def("rms_norm", &rms_norm, "RMSNorm, with the residual add fused in when a residual is given", nogil);
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up", nogil);
  m.def("amx_gemm_available", &amx_gemm_available, "whether the AMX GEMM runs on this CPU");
  m.def("amx_pack_weight", &amx_pack_weight, "pack a bf16 [N, K] weight into AMX panels", nogil);
  m.def("amx_linear", &amx_linear, "x @ weight.T (+ bias) with an AMX-packed weight", nogil);
  m.def("amx_pack_gated_weight", &amx_pack_gated_weight, "pack a bf16 [2W, K] gate_up weight into gated AMX panels", nogil);
  m.def("amx_linear_silu_mul", &amx_linear_silu_mul, "silu(x @ gate.T) * (x @ up.T) with gated AMX panels", nogil);
  m.def("panel_gemm_dtypes", &panel_gemm_dtypes, "the dtypes panel_linear multiplies on this CPU");
  m.def("panel_pack_weight", &panel_pack_weight, "pack an [N, K] weight into column panels", nogil);
  m.def("panel_linear", &panel_linear, "x @ weight.T (+ bias) with a panel-packed weight", py::arg("x"),
        py::arg("packed"), py::arg("n"), py::arg("bias"), py::arg("pad_aliased_rows") = false, nogil);
  m.def("panel_pack_gated_weight", &panel_pack_gated_weight, "pack a [2W, K] gate_up weight into gated panels", nogil);
  m.def("panel_linear_silu_mul", &panel_linear_silu_mul, "silu(x @ gate.T) * (x @ up.T) with gated panels", nogil);
  m.def("bind_threads", &bind_threads, "pin OpenMP thread t to cpus[t]");
  m.def("rotary_embedding", &rotary_embedding, "rotate-half RoPE in place", nogil);
  m.def("evict_from_caches", &evict_from_caches, "write back and drop [address, address + bytes) from the caches", nogil);
  m.def("greedy_argmax", &greedy_argmax, "each row's index of its first maximum (first NaN if any)", nogil);
  bind_decoder_stack(m);
}
