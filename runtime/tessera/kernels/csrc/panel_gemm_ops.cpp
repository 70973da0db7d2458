// The panel GEMM's ops (panel_gemm.h): packing a weight (plain or gated for SwiGLU), and x times
// a packed weight over the OpenMP threads, with the plain or the SwiGLU epilogue.
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "packed_weights.h"
#include "panel_gemm.h"
#include "silu.h"
#include "simd.h"
#include "torch_bf16.h"

namespace tessera {

// The dtypes Tessera's panel GEMM (panel_gemm.h) multiplies on this CPU: it needs AVX-512 (bf16
// through AVX512-BF16, or widened to fp32 with AVX512-BW) or AVX2 with FMA (bf16 widened).
std::vector<std::string> panel_gemm_dtypes() {
  std::vector<std::string> dtypes;
  if (panels::kFp32) dtypes.emplace_back("float32");
  if (panels::kBf16) dtypes.emplace_back("bfloat16");
  return dtypes;
}

namespace {

void check_panel_dtype(const torch::Tensor& t, const char* name) {
  const auto dtype = t.scalar_type();
  TORCH_CHECK((dtype == torch::kFloat32 && panels::kFp32) || (dtype == torch::kBFloat16 && panels::kBf16), name,
              ": the panel GEMM does not multiply ", dtype, " on this CPU");
}

// Calls fn with the tensor's elements as float or as bf16 bits.
template <typename Fn>
void with_panel_type(const torch::Tensor& t, Fn&& fn) {
  if (t.scalar_type() == torch::kFloat32)
    fn(static_cast<float*>(nullptr));
  else
    fn(static_cast<uint16_t*>(nullptr));
}

// The panels of weight [rows, K] (fp32, or bf16 with K even): [count, K * C] of its dtype
// (C = panels::kCols: 48 on AVX-512, 16 on AVX2), column c of panel p multiplying row row_of(p, c).
template <typename RowOf>
torch::Tensor pack_panels(const torch::Tensor& weight, int64_t count, const RowOf& row_of) {
  check_panel_dtype(weight, "weight");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight must be a contiguous [N, K] tensor");
  const int64_t k = weight.size(1);
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 || k % 2 == 0, "a bf16 weight needs an even K, got ", k);
  torch::Tensor packed;
  with_panel_type(weight, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    packed = pack_weight<panels::Layout<T>, T>(weight, count, row_of);
  });
  return packed;
}

#if defined(TESSERA_PANELS_AVX512) || defined(TESSERA_PANELS_AVX2)

// The element type the vector helpers (roundv_to, storev_as) take for the panels' T.
template <typename T>
using VectorElement = std::conditional_t<std::is_same_v<T, float>, float, c10::BFloat16>;

// The SwiGLU epilogue of gated panels (panels::GatedRows): a tile row's sums hold the gate and
// the up projection of the same kCols / 2 output columns; it writes silu(gate) * up there, the
// factors rounded to T first, as the unfused pass reads them from the projection's output.
struct SiluMulSums {
  static constexpr int64_t kOutCols = panels::kCols / 2;
  template <typename T>
  void operator()(T* y, const panels::Sums& sum, const panels::ColumnMasks& masks) const {
    using E = VectorElement<T>;
#if defined(TESSERA_PANELS_AVX512)
    // Gate columns 0-23 are sum[0] and the low half of sum[1]; up columns 0-23 are the high
    // half of sum[1] and sum[2].
    const __m512i middle = _mm512_castps_si512(sum[1]), last = _mm512_castps_si512(sum[2]);
    const fvec up_low = reinterpret_cast<fvec>(_mm512_alignr_epi32(last, middle, 8));
    const fvec up_high = reinterpret_cast<fvec>(_mm512_alignr_epi32(last, last, 8));
    const fvec low = silu_mul<E>(roundv_to<E>(reinterpret_cast<fvec>(sum[0])), roundv_to<E>(up_low));
    const fvec high = silu_mul<E>(roundv_to<E>(reinterpret_cast<fvec>(sum[1])), roundv_to<E>(up_high));
    panels::store(y, reinterpret_cast<__m512>(low), masks.lane[0]);
    panels::store(y + 16, reinterpret_cast<__m512>(high), static_cast<__mmask16>(masks.lane[1] & 0xFF));
#else
    const fvec out = silu_mul<E>(roundv_to<E>(reinterpret_cast<fvec>(sum[0])), roundv_to<E>(reinterpret_cast<fvec>(sum[1])));
    const int64_t live = std::min(masks.live, kOutCols);
    E buffer[kOutCols];
    storev_as(live == kOutCols ? reinterpret_cast<E*>(y) : buffer, out);
    if (live < kOutCols) std::memcpy(y, buffer, live * sizeof(T));
#endif
  }
};

#endif

// Rows of an output whose width is a multiple of this many bytes are stored further apart.
constexpr int64_t kAliasBytes = 4096;

// y [M, n] = the epilogue's outputs of x [M, K] times count packed panels, plus bias (plain
// panels) when non-empty. With pad_aliased_rows, when n's rows would be a multiple of 4 KB
// apart, y is a view whose rows are a cache line further apart: a register tile's rows then
// fall in different cache sets. Stored 4 KB-aligned, an EPYC Turin ran these GEMMs about 10%
// slower (SmolLM2's 49152-wide LM head at 64 rows: 449 -> 494 GFLOP/s padded; 8 rows 20%).
template <typename Epilogue>
torch::Tensor multiply_panels(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, int64_t count,
                              const torch::Tensor& bias, bool pad_aliased_rows, const Epilogue& epilogue) {
  check_panel_dtype(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] tensor");
  TORCH_CHECK(packed.scalar_type() == x.scalar_type(), "x and the packed weight must share a dtype");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(packed.dim() == 2 && packed.size(0) == count && packed.size(1) == k * panels::kCols,
              "the packed weight does not hold ", count, " panels of ", k, " inputs");
  const torch::Tensor widened_bias = fp32_bias(bias, n);
  const float* bias_values = bias_data(widened_bias);
  const int64_t row_bytes = n * x.element_size();
  const int64_t ldy = pad_aliased_rows && m > 1 && row_bytes % kAliasBytes == 0 ? n + 64 / x.element_size() : n;
  torch::Tensor out = torch::empty({m, ldy}, x.options()).narrow(1, 0, n);
  if (m == 0) return out;
#if defined(TESSERA_PANELS_AVX512) || defined(TESSERA_PANELS_AVX2)
  const bool widen = x.scalar_type() == torch::kBFloat16 && panels::kWidenBf16Inputs;
  const torch::Tensor input = widen ? x.to(torch::kFloat32) : x;  // M x K: small beside the GEMM
  with_panel_type(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if constexpr (std::is_same_v<T, float> || panels::kBf16) {  // else rejected by check_panel_dtype
      using In = std::conditional_t<panels::kWidenBf16Inputs, float, T>;
      const In* in = static_cast<const In*>(input.data_ptr());
      const T* weights = static_cast<const T*>(packed.data_ptr());
      T* y = static_cast<T*>(out.data_ptr());
      const panels::PanelWork work(m, k, count, sizeof(In), at::get_num_threads());
      const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), work.items));
      // Items are taken dynamically (see PanelWork), each thread claiming its next item as it
      // starts one, so that the item's last panel can prefetch the next one's first: with a
      // shared loop counter, the next panel in memory is usually the other thread's.
      std::atomic<int64_t> claimed{0};
#pragma omp parallel num_threads(threads)
      {
        int64_t item = claimed.fetch_add(1, std::memory_order_relaxed);
        while (item < work.items) {
          const int64_t next = claimed.fetch_add(1, std::memory_order_relaxed);
          panels::multiply_item(work, item, next < work.items ? next : -1, in, k, weights, n, ldy, count,
                                bias_values, y, epilogue);
          item = next;
        }
      }
    }
  });
#endif
  return out;
}

}  // namespace

// weight [N, K] (fp32, or bf16 with K even) -> its panels, [ceil(N / C), K * C] of the same dtype
// (C = panels::kCols: 48 on AVX-512, 16 on AVX2).
torch::Tensor panel_pack_weight(torch::Tensor weight) {
  return pack_panels(weight, panels::panel_count(weight.size(0)), panels::PlainRows{weight.size(0)});
}

// x [M, K] times a weight packed by panel_pack_weight ([N, K] before), plus bias [N] when
// non-empty; with pad_aliased_rows the result may be a view with padded rows (multiply_panels).
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor packed, int64_t n, torch::Tensor bias,
                           bool pad_aliased_rows) {
  return multiply_panels(x, packed, n, panels::panel_count(n), bias, pad_aliased_rows, panels::StoreSums{});
}

// A SwiGLU gate_up weight [2W, K] (gate rows over up rows) -> gated panels (panels::GatedRows),
// [ceil(W / (C / 2)), K * C].
torch::Tensor panel_pack_gated_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) % 2 == 0, "a gate_up weight has an even number of rows");
  const int64_t width = weight.size(0) / 2;
  return pack_panels(weight, panels::gated_panel_count(width), panels::GatedRows{width});
}

// silu(x @ gate.T) * (x @ up.T) [M, W] with a weight packed by panel_pack_gated_weight: SwiGLU
// without writing the [M, 2W] projection out and reading it back.
torch::Tensor panel_linear_silu_mul(torch::Tensor x, torch::Tensor packed, int64_t width) {
#if defined(TESSERA_PANELS_AVX512) || defined(TESSERA_PANELS_AVX2)
  return multiply_panels(x, packed, width, panels::gated_panel_count(width), torch::empty({0}), false, SiluMulSums{});
#else
  TORCH_CHECK(false, "the panel GEMM does not run on this CPU");
#endif
}

}  // namespace tessera
