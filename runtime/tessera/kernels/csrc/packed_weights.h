// What the panel GEMM's ops and the AMX GEMM's ops share around their kernels: a weight packed
// into panels of either Layout (panel_layout.h) as a tensor, and the fp32 bias the panels add.
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>

#include "panel_layout.h"
#include "torch_bf16.h"

namespace tessera {

// The panels of weight [rows, K] (elements T): [count, Layout::padded_k(K) * Layout::kCols] of
// its dtype, column c of panel p multiplying row row_of(p, c). The caller checks the weight.
template <typename Layout, typename T, typename RowOf>
torch::Tensor pack_weight(const torch::Tensor& weight, int64_t count, const RowOf& row_of) {
  const int64_t k = weight.size(1), panel_size = Layout::padded_k(k) * Layout::kCols;
  torch::Tensor packed = torch::empty({count, panel_size}, weight.options());
  const T* source = static_cast<const T*>(weight.data_ptr());
  T* out = static_cast<T*>(packed.data_ptr());
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel)
      pack_panel<Layout>(source, k, panel, row_of, out + panel * panel_size);
  });
  return packed;
}

// The sums are fp32: a bias [n] (empty: none) is widened once per call; undefined for none.
inline torch::Tensor fp32_bias(const torch::Tensor& bias, int64_t n) {
  if (bias.numel() == 0) return {};
  TORCH_CHECK(bias.numel() == n, "bias must have ", n, " elements");
  return bias.reshape({n}).to(torch::kFloat32).contiguous();
}

inline const float* bias_data(const torch::Tensor& fp32) { return fp32.defined() ? fp32.data_ptr<float>() : nullptr; }

}  // namespace tessera
