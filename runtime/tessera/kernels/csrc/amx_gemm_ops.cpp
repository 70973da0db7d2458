// The AMX GEMM's ops (amx_gemm.h): packing a bf16 weight (plain or gated for SwiGLU), and x
// times a packed weight over the OpenMP threads, with the plain or the SwiGLU epilogue.
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "ops.h"
#include "amx_gemm.h"
#include "amx_tiles.h"
#include "packed_weights.h"
#include "silu.h"
#include "simd.h"
#include "torch_bf16.h"

namespace tessera {

// Whether the AMX GEMM (amx_gemm.h) runs here: built for a CPU with AMX-BF16, and the tile state
// granted to this process.
bool amx_gemm_available() {
#if defined(TESSERA_AMX)
  return amx::request_tile_state();
#else
  return false;
#endif
}

namespace {

void check_amx(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(amx_gemm_available(), "the AMX GEMM does not run on this CPU");
  TORCH_CHECK(t.scalar_type() == torch::kBFloat16, name, ": the AMX GEMM multiplies bf16, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), name, " must be a contiguous 2-D tensor");
}

// The AMX panels of weight [rows, K]: [count, padded K * 32] bf16, column c of panel p
// multiplying row row_of(p, c).
template <typename RowOf>
torch::Tensor pack_amx_panels(const torch::Tensor& weight, int64_t count, const RowOf& row_of) {
  check_amx(weight, "weight");
  return pack_weight<amx::Layout, uint16_t>(weight, count, row_of);
}

#if defined(TESSERA_AMX)

// The SwiGLU epilogue of gated AMX panels: a row's sums hold the gate (columns 0-15) and the up
// projection (16-31) of its 16 outputs, rounded to bf16 first as the unfused pass reads them.
struct AmxSiluMulRow {
  static constexpr int64_t kOutCols = amx::kTileRows;
  void operator()(uint16_t* y, const float* sums, int64_t live, const float*) const {
    using E = c10::BFloat16;
    const fvec out = silu_mul<E>(roundv_to<E>(loadv(sums)), roundv_to<E>(loadv(sums + amx::kTileRows)));
    amx::store_bf16(y, reinterpret_cast<__m512>(out), live);
  }
};

#endif

// y [M, n] = the epilogue's outputs of x [M, K] times count AMX panels, plus bias when non-empty.
template <typename Epilogue>
torch::Tensor multiply_amx_panels(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, int64_t count,
                                  const torch::Tensor& bias, const Epilogue& epilogue) {
  check_amx(x, "x");
  const int64_t m = x.size(0), k = x.size(1), k_padded = amx::padded_k(k);
  TORCH_CHECK(packed.scalar_type() == torch::kBFloat16 && packed.dim() == 2 && packed.size(0) == count &&
                  packed.size(1) == k_padded * amx::kCols,
              "the packed weight does not hold ", count, " AMX panels of ", k, " inputs");
  const torch::Tensor widened_bias = fp32_bias(bias, n);
  [[maybe_unused]] const float* bias_values = bias_data(widened_bias);
  torch::Tensor out = torch::empty({m, n}, x.options());
  if (m == 0) return out;
  // Tiles read whole steps of 32 inputs and pairs of 16-row tiles: x is padded with zero inputs
  // when K is not whole steps; a short last group of 32 rows is read from a zero-padded copy.
  torch::Tensor input = x;
  if (k_padded != k) {
    input = torch::zeros({m, k_padded}, x.options());
    input.narrow(1, 0, k).copy_(x);
  }
  constexpr int64_t group = 2 * amx::kTileRows;
  const int64_t tail_row = m / group * group;
  torch::Tensor tail;
  if (tail_row < m) {
    tail = torch::zeros({group, k_padded}, x.options());
    tail.narrow(0, 0, m - tail_row).copy_(input.narrow(0, tail_row, m - tail_row));
  }
#if defined(TESSERA_AMX)
  const amx::Rows in{static_cast<const uint16_t*>(input.data_ptr()), k_padded,
                     tail_row < m ? static_cast<const uint16_t*>(tail.data_ptr()) : nullptr, tail_row < m ? tail_row : -1};
  const auto* weights = static_cast<const uint16_t*>(packed.data_ptr());
  auto* y = static_cast<uint16_t*>(out.data_ptr());
  const amx::Work work(m, k_padded, count, at::get_num_threads());
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), work.items));
  std::atomic<int64_t> claimed{0};
#pragma omp parallel num_threads(threads)
  {
    amx::configure_tiles();  // tile configuration is per thread
    for (int64_t item = claimed.fetch_add(1, std::memory_order_relaxed); item < work.items;
         item = claimed.fetch_add(1, std::memory_order_relaxed))
      amx::multiply_item(work, item, in, k_padded, weights, n, count, bias_values, y, epilogue);
    _tile_release();
  }
#endif
  return out;
}

}  // namespace

// bf16 weight [N, K] -> its AMX panels, [ceil(N / 32), padded K * 32].
torch::Tensor amx_pack_weight(torch::Tensor weight) {
  return pack_amx_panels(weight, amx::panel_count(weight.size(0)), amx::PlainRows{weight.size(0)});
}

// x [M, K] times a weight packed by amx_pack_weight ([N, K] before), plus bias [N] when non-empty.
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, int64_t n, torch::Tensor bias) {
#if defined(TESSERA_AMX)
  return multiply_amx_panels(x, packed, n, amx::panel_count(n), bias, amx::StoreRow{});
#else
  TORCH_CHECK(false, "the AMX GEMM does not run on this CPU");
#endif
}

// A SwiGLU gate_up weight [2W, K] (gate rows over up rows) -> gated AMX panels (amx::GatedRows).
torch::Tensor amx_pack_gated_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) % 2 == 0, "a gate_up weight has an even number of rows");
  const int64_t width = weight.size(0) / 2;
  return pack_amx_panels(weight, amx::gated_panel_count(width), amx::GatedRows{width});
}

// silu(x @ gate.T) * (x @ up.T) [M, W] with a weight packed by amx_pack_gated_weight.
torch::Tensor amx_linear_silu_mul(torch::Tensor x, torch::Tensor packed, int64_t width) {
#if defined(TESSERA_AMX)
  return multiply_amx_panels(x, packed, width, amx::gated_panel_count(width), torch::empty({0}), AmxSiluMulRow{});
#else
  TORCH_CHECK(false, "the AMX GEMM does not run on this CPU");
#endif
}

}  // namespace tessera
