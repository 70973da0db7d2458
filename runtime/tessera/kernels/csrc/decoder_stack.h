// A model's decoder layers run in one native call per forward pass (tensor-parallel size 1).
//
// Why: a decode step of a small model is dozens of kernels per layer, each a few microseconds to
// a millisecond, and the Python between them (module calls, views, dispatch) ran on the calling
// thread while the other OpenMP threads waited. On a 2-vCPU Xeon with AMX, SmolLM2 in bf16 spent
// about a tenth of its offline run there (perf: the caller's Python, the peer's libgomp wait).
//
// The layer is the one of models/llama.py, kernel for kernel and in the same order, so results
// are bit for bit those of the Python loop: add + RMSNorm, the QKV GEMM, RoPE on Q and K in
// place, paged attention, the O GEMM, add + RMSNorm, SwiGLU (gated GEMM, or GEMM + silu_and_mul),
// the down GEMM. A GEMM whose backend is not one of these kernels (oneDNN, ATen, fp32 compute of
// bf16 weights) calls back into Python, holding the GIL only for that call.

#pragma once

#include <torch/extension.h>

#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "ops.h"

// Hidden, as pybind11's own types are: a Linear holds a py::object.
namespace tessera {
namespace stack __attribute__((visibility("hidden"))) {

// How one linear layer multiplies: one of this library's GEMMs, or a Python callable.
enum class Gemm : int64_t { kPython = 0, kMkl = 1, kPanels = 2, kAmx = 3, kPanelsGated = 4, kAmxGated = 5 };

struct Linear {
  Gemm gemm;
  torch::Tensor packed;  // the packed weight (native GEMMs)
  int64_t n;             // output columns (gated: the SwiGLU width)
  torch::Tensor bias;    // empty: none
  py::object python;     // kPython: x -> y
  bool silu_after;       // silu_and_mul on the output (gate_up multiplied by a plain GEMM)

  torch::Tensor operator()(const torch::Tensor& x) const {
    torch::Tensor y;
    switch (gemm) {
      case Gemm::kMkl: y = mkl_linear(x, packed, n, bias); break;
      case Gemm::kPanels: y = panel_linear(x, packed, n, bias, false); break;
      case Gemm::kAmx: y = amx_linear(x, packed, n, bias); break;
      case Gemm::kPanelsGated: y = panel_linear_silu_mul(x, packed, n); break;
      case Gemm::kAmxGated: y = amx_linear_silu_mul(x, packed, n); break;
      case Gemm::kPython: {
        py::gil_scoped_acquire gil;
        y = python(x).cast<torch::Tensor>();
        break;
      }
    }
    return silu_after ? silu_and_mul(y.contiguous()) : y;
  }
};

struct Layer {
  torch::Tensor input_norm, post_norm;  // RMSNorm weights
  double input_eps, post_eps;
  Linear qkv, o, gate_up, down;
  int64_t heads, kv_heads, head_dim, sliding_window;  // sliding_window <= 0: none
  double scale;
};

// (norm(x + residual), x + residual) as models/layers/norm.py's RMSNorm: in place when there is a
// residual; without one, x is the residual and the norm a new tensor.
inline torch::Tensor add_and_norm(torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight,
                                  double eps) {
  if (!residual.defined()) {
    residual = x;
    return rms_norm(x, torch::empty({0}, x.options()), weight, eps);
  }
  return rms_norm(x, residual, weight, eps);
}

class DecoderStack {
 public:
  explicit DecoderStack(std::vector<Layer> layers) : layers_(std::move(layers)) {}

  // hidden [N, H] (and residual, None on the first stage's first layer) through every layer;
  // rope [N, head_dim] (cos | sin); the attention metadata as paged_attention takes it.
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor hidden, std::optional<torch::Tensor> first_residual,
                                                   torch::Tensor rope,
                                                   const std::vector<torch::Tensor>& kv_caches,
                                                   torch::Tensor slot_mapping, torch::Tensor block_tables,
                                                   torch::Tensor seq_lens, torch::Tensor query_start_loc) const {
    TORCH_CHECK(kv_caches.size() == layers_.size(), "one KV cache per layer");
    const int64_t n = hidden.size(0);
    torch::Tensor residual = first_residual.value_or(torch::Tensor());
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      torch::Tensor normed = add_and_norm(hidden, residual, layer.input_norm, layer.input_eps);
      const torch::Tensor qkv = layer.qkv(normed);
      const int64_t q_size = layer.heads * layer.head_dim, kv_size = layer.kv_heads * layer.head_dim;
      rotary_embedding(qkv.view({n, -1, layer.head_dim}).narrow(1, 0, layer.heads + layer.kv_heads), rope);
      const torch::Tensor q = qkv.narrow(1, 0, q_size);
      torch::Tensor attended = torch::empty(q.sizes(), q.options());
      paged_attention(attended, q, qkv.narrow(1, q_size, kv_size), qkv.narrow(1, q_size + kv_size, kv_size),
                      kv_caches[i], slot_mapping, block_tables, seq_lens, query_start_loc, layer.scale,
                      layer.sliding_window, /*softcap=*/0.0);  // the Llama layer caps no scores
      hidden = layer.o(attended);
      normed = add_and_norm(hidden, residual, layer.post_norm, layer.post_eps);
      hidden = layer.down(layer.gate_up(normed));
    }
    return {hidden, residual};
  }

 private:
  std::vector<Layer> layers_;
};

}  // namespace stack
}  // namespace tessera
