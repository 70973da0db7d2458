// The elementwise ops of the decoder: fused add + RMSNorm, SiLU * mul, rotate-half RoPE, and the
// greedy sampler's argmax.
//
// Why: the ATen formulation made a full pass (and a new tensor) per op where one pass suffices;
// each chain here is one pass, in the reference's rounding order.
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "silu.h"
#include "simd.h"
#include "torch_bf16.h"

namespace tessera {

namespace {

template <typename T>
void rms_norm_impl(T* xs, T* rs, T* os, const T* w, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(hidden);
    float* s = row.data();
    for (int64_t i = begin; i < end; ++i) {
      T* xi = xs + i * hidden;
      if (rs != nullptr) {
        T* ri = rs + i * hidden;
#pragma omp simd
        for (int64_t d = 0; d < hidden; ++d) {
          // The residual stream is kept in the model dtype, rounded as the reference rounds it.
          const float sum = to_float(xi[d]) + to_float(ri[d]);
          ri[d] = from_float<T>(sum);
          s[d] = round_to<T>(sum);
        }
      } else {
        widen(xi, s, hidden);
      }
      float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
      for (int64_t d = 0; d < hidden; ++d) squares += s[d] * s[d];
      const float inv_rms = 1.0f / std::sqrt(squares / static_cast<float>(hidden) + eps);
      T* oi = os + i * hidden;
      // Normalise, round to the model dtype, then scale: the reference's order.
#pragma omp simd
      for (int64_t d = 0; d < hidden; ++d)
        oi[d] = from_float<T>(to_float(w[d]) * round_to<T>(s[d] * inv_rms));
    }
  });
}

template <typename T>
void silu_and_mul_impl(const T* xs, T* os, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* gate = xs + i * 2 * width;
      const T* up = gate + width;
      T* o = os + i * width;
      int64_t d = 0;
      if constexpr (std::is_same_v<T, float> || IsBf16<T>::value) {
        // Explicit vectors: whether GCC vectorised the loop below varied with -march's tuning.
        for (; d + kLanes <= width; d += kLanes)
          storev_as(o + d, silu_mul<T>(loadv_as_float(gate + d), loadv_as_float(up + d)));
      }
      for (; d < width; ++d) {
        o[d] = from_float<T>(round_to<T>(silu(to_float(gate[d]))) * to_float(up[d]));
      }
    }
  });
}

template <typename T>
void rotary_impl(T* xs, const T* cs, int64_t rows, int64_t heads, int64_t dim, int64_t row_stride) {
  const int64_t half = dim / 2;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* cos = cs + i * dim;
      const T* sin = cos + half;
      for (int64_t h = 0; h < heads; ++h) {
        T* x1 = xs + i * row_stride + h * dim;
        T* x2 = x1 + half;
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) {
          const float a = to_float(x1[d]), b = to_float(x2[d]);
          const float c = to_float(cos[d]), s = to_float(sin[d]);
          x1[d] = from_float<T>(a * c - b * s);
          x2[d] = from_float<T>(b * c + a * s);
        }
      }
    }
  });
}

}  // namespace

// With a residual: residual += x, then x = rmsnorm(residual) * weight (both in place, one pass
// per row), returning x. Without one (an empty tensor): returns rmsnorm(x) * weight, x untouched.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [N, hidden] tensor");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be [hidden] in x's dtype");
  const bool fused = residual.numel() > 0;
  if (fused)
    TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() && residual.scalar_type() == x.scalar_type(),
                "residual must match x");
  torch::Tensor out = fused ? x : torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_impl<scalar_t>(x.data_ptr<scalar_t>(), fused ? residual.data_ptr<scalar_t>() : nullptr,
                            out.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), x.size(0), x.size(1),
                            static_cast<float>(eps));
  });
  return out;
}

// [N, 2I] (gate | up) -> [N, I]: silu(gate) * up.
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0, "x must be a contiguous [N, 2*I] tensor");
  torch::Tensor out = torch::empty({x.size(0), x.size(1) / 2}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_impl<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0), x.size(1) / 2);
  });
  return out;
}

// Each row's index of its first maximum, as torch.max(dim=-1).indices gives it (a row holding
// NaN gives its first NaN). Greedy sampling's hot path: ATen's max reduces about 2.3 G values/s
// here on 2 threads, and its bf16 logits needed an fp32 copy first; this reads the logits
// twice (the row's max, then where it first is) at memory speed, in their own dtype.
template <typename T>
int64_t row_argmax(const T* x, int64_t n) {
  float m = kNegInf;
  bool nan = false;
  int64_t d = 0;
  if constexpr (std::is_same_v<T, float> || IsBf16<T>::value) {
    fvec best = broadcastv(kNegInf);
    ivec any_nan{};
    for (; d + kLanes <= n; d += kLanes) {
      const fvec v = loadv_as_float(x + d);
      any_nan |= v != v;
      best = v > best ? v : best;  // NaN lanes compare false: they are tracked apart
    }
    m = hmax(best);
    for (int i = 0; i < kLanes; ++i) nan |= any_nan[i] != 0;
  }
  for (; d < n; ++d) {
    const float v = to_float(x[d]);
    nan |= v != v;
    m = v > m ? v : m;
  }
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_float(x[i]);
    if (nan ? v != v : v == m) return i;
  }
  return 0;  // not reached: n > 0, and the max (or a NaN) is somewhere in the row
}

torch::Tensor greedy_argmax(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0,
              "logits must be a non-empty [B, V] tensor with contiguous rows");
  torch::Tensor out = torch::empty({logits.size(0)}, logits.options().dtype(torch::kInt64));
  int64_t* indices = out.data_ptr<int64_t>();
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "greedy_argmax", [&] {
    const scalar_t* x = logits.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) indices[r] = row_argmax(x + r * logits.stride(0), vocab);
    });
  });
  return out;
}

// In place on x [N, heads, D] (rows may be strided): rotate-half RoPE with cos_sin [N, D]
// holding cos in the first half and sin in the second.
void rotary_embedding(torch::Tensor x, torch::Tensor cos_sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "x must be [N, heads, D] with contiguous heads");
  TORCH_CHECK(cos_sin.dim() == 2 && cos_sin.is_contiguous() && cos_sin.size(1) == x.size(2) &&
                  cos_sin.size(0) == x.size(0), "cos_sin must be [N, D]");
  TORCH_CHECK(cos_sin.scalar_type() == x.scalar_type(), "cos_sin must have x's dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary_embedding", [&] {
    rotary_impl<scalar_t>(x.data_ptr<scalar_t>(), cos_sin.data_ptr<scalar_t>(), x.size(0), x.size(1), x.size(2),
                          x.stride(0));
  });
}

}  // namespace tessera
