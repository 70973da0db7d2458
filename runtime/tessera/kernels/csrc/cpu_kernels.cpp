// CPU kernels for the decoder's hot path: paged attention, fused add + RMSNorm, SiLU*mul, RoPE.
//
// Why: on CPU the ATen formulation of paged attention gathers every sequence's blocks into a
// padded copy and masks it, which moved more memory than the matmuls did; the elementwise ops
// each made a full pass (and a new tensor) where one pass suffices. These kernels read the
// paged cache in place with an online softmax and fuse each elementwise chain into one pass.
//
// Accumulation is in fp32 for every input dtype. Work is split with OpenMP on the same runtime
// (libgomp) and thread count as torch, so torch.set_num_threads governs these kernels too.

#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <omp.h>
#include <sched.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "paged_attention.h"
#include "amx_attention.h"
#include "amx_gemm.h"
#include "panel_gemm.h"

using namespace tessera;

// torch's bf16 converts with bit operations (paged_attention.h): loops over it then vectorise.
template <>
struct tessera::IsBf16<c10::BFloat16> : std::true_type {};

namespace {

template <typename T>
void paged_attention_impl(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k,
                          const torch::Tensor& v, torch::Tensor& kv_cache,
                          const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                          const torch::Tensor& seq_lens, const torch::Tensor& query_start_loc,
                          double scale, int64_t sliding_window) {
  const int64_t num_tokens = q.size(0);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2);
  const int64_t num_kv_heads = kv_cache.size(3), head_dim = kv_cache.size(4);
  const int64_t num_heads = q.size(1) / head_dim;
  const int64_t token_stride = num_kv_heads * head_dim;  // one cache slot
  AttentionBatch<T> batch{kv_cache.data_ptr<T>(),
                          num_blocks * block_size * token_stride,
                          token_stride,
                          block_size,
                          num_kv_heads,
                          num_heads,
                          num_heads / num_kv_heads,
                          head_dim,
                          q.data_ptr<T>(),
                          q.stride(0),
                          out.data_ptr<T>(),
                          block_tables.data_ptr<int64_t>(),
                          seq_lens.data_ptr<int64_t>(),
                          query_start_loc.data_ptr<int64_t>(),
                          block_tables.stride(0),
                          sliding_window,
                          static_cast<float>(scale)};

  // 1. The new tokens' K/V go to their slots first: a prefill attends to its own new keys.
  const T* k_data = k.data_ptr<T>();
  const T* v_data = v.data_ptr<T>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      T* slot = batch.cache + slots[i] * token_stride;
      std::memcpy(slot, k_data + i * k.stride(0), token_stride * sizeof(T));
      std::memcpy(slot + batch.kv_plane, v_data + i * v.stride(0), token_stride * sizeof(T));
    }
  });

  // 2. Attention, one work item per (sequence, query tile), longest first. In bf16 on AMX, items
  // with a tile's worth of rows per KV head or more run on the tiles (amx_attention.h), with
  // longer query tiles.
  bool amx = false;
  int64_t tile = query_tile(num_heads, batch.group);
#if defined(TESSERA_AMX)
  // (amx_attention.h's softmax takes the raw scores' max for the scaled ones': scale > 0.)
  if constexpr (IsBf16<T>::value)
    amx = (head_dim == 64 || head_dim == 128) && batch.scale > 0.0f && amx::request_tile_state();
  if (amx) tile = amx_attention::kQueryTokens;
#endif
  const std::vector<WorkItem> items =
      make_work_items(batch.starts, batch.lens, seq_lens.size(0), tile, sliding_window);
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int threads = std::max(1, std::min<int>(at::get_num_threads(), static_cast<int>(num_items)));
  bool amx_items = false;
#if defined(TESSERA_AMX)
  amx_items = amx && std::any_of(items.begin(), items.end(), [&](const WorkItem& item) {
                return amx_attention::uses_amx(item, batch.group);
              });
#endif
#pragma omp parallel num_threads(threads)
  {
    TileScratch scratch(query_tile(num_heads, batch.group) * num_heads, head_dim, block_size);
#if defined(TESSERA_AMX)
    amx_attention::Scratch amx_scratch;
    if (amx_items) amx::configure_tiles();  // per thread
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < num_items; ++w) {
#if defined(TESSERA_AMX)
      if constexpr (IsBf16<T>::value) {
        if (amx_items && amx_attention::uses_amx(items[w], batch.group)) {
          if (head_dim == 64)
            amx_attention::attend_tile<T, 64>(batch, items[w], amx_scratch);
          else
            amx_attention::attend_tile<T, 128>(batch, items[w], amx_scratch);
          continue;
        }
      }
#endif
      switch (head_dim) {
        case 64:
          attend_tile<T, 64>(batch, items[w], scratch);
          break;
        case 128:
          attend_tile<T, 128>(batch, items[w], scratch);
          break;
        default:
          attend_tile<T, 0>(batch, items[w], scratch);
      }
    }
#if defined(TESSERA_AMX)
    if (amx_items) _tile_release();
#endif
  }
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

void check_int64(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kInt64 && t.is_contiguous() && t.device().is_cpu(), name,
              " must be a contiguous int64 CPU tensor");
}

}  // namespace

// out[N, H*D] = softmax(q k^T * scale) v over each sequence's paged context, after writing the
// new tokens' k/v [N, KVH*D] into kv_cache [2, blocks, block_size, KVH, D] at slot_mapping.
// Sequence s owns query rows [query_start_loc[s], query_start_loc[s+1]) and its context is
// seq_lens[s] tokens long, the queries being the last ones (causal); sliding_window <= 0: none.
void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k, torch::Tensor v,
                     torch::Tensor kv_cache, torch::Tensor slot_mapping, torch::Tensor block_tables,
                     torch::Tensor seq_lens, torch::Tensor query_start_loc, double scale,
                     int64_t sliding_window) {
  check_rows(q, "q");
  check_rows(k, "k");
  check_rows(v, "v");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out must be contiguous and shaped like q");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous(), "kv_cache must be [2, blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() && k.scalar_type() == kv_cache.scalar_type() &&
                  v.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == kv_cache.scalar_type(),
              "q, k, v, out and kv_cache must share a dtype");
  TORCH_CHECK(k.size(1) == kv_cache.size(3) * kv_cache.size(4), "k width must be kv_heads * head_dim");
  TORCH_CHECK(q.size(1) % (kv_cache.size(3) * kv_cache.size(4)) == 0, "query heads must be a multiple of KV heads");
  check_int64(slot_mapping, "slot_mapping");
  check_int64(seq_lens, "seq_lens");
  check_int64(query_start_loc, "query_start_loc");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && block_tables.stride(1) == 1,
              "block_tables must be int64 with contiguous rows");
  TORCH_CHECK(query_start_loc.size(0) == seq_lens.size(0) + 1, "query_start_loc must have one entry per sequence + 1");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    paged_attention_impl<scalar_t>(out, q, k, v, kv_cache, slot_mapping, block_tables, seq_lens,
                                   query_start_loc, scale, sliding_window);
  });
}

// ---- elementwise -------------------------------------------------------------------------------

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

// silu(g) * u on lanes holding values of T's precision (the gate_up projection's outputs).
template <typename T>
inline fvec silu_mul(fvec g, fvec u) {
  const fvec e = expv(g < -g ? g : -g);  // exp of a non-positive argument only: stable for both signs
  const fvec sigmoid = (g >= 0.0f ? broadcastv(1.0f) : e) / (1.0f + e);
  return roundv_to<T>(g * sigmoid) * u;
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
        const float g = to_float(gate[d]);
        // exp of a non-positive argument only: sigmoid is stable for both signs.
        const float e = exp_approx(-std::fabs(g));
        const float sigmoid = g >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
        o[d] = from_float<T>(round_to<T>(g * sigmoid) * to_float(up[d]));
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

// Writes back and drops [address, address + bytes) from every cache level; whether it could
// here. The GEMM selection times each candidate on a weight evicted so: a decode step streams
// every layer's weights, far more than the caches hold, so each GEMM meets its weight in memory.
// On the Xeon with AMX, timed hot, MKL beat the panels on SmolLM2's QKV and O shapes by 1-2%;
// evicted, the panels won both (64 rows: 300 against 374 us, 180 against 248; MKL's packed
// buffers are 2-5x the weights' size).
bool evict_from_caches(int64_t address, int64_t bytes) {
#if defined(__x86_64__) || defined(__aarch64__)
  const char* begin = reinterpret_cast<const char*>(address);
  for (int64_t offset = 0; offset < bytes; offset += kCacheLine) {
#if defined(__CLFLUSHOPT__)
    __builtin_ia32_clflushopt(begin + offset);  // unordered among themselves: several in flight
#elif defined(__x86_64__)
    __builtin_ia32_clflush(begin + offset);
#else
    asm volatile("dc civac, %0" : : "r"(begin + offset) : "memory");
#endif
  }
#if defined(__x86_64__)
  __builtin_ia32_mfence();
#else
  asm volatile("dsb ish" : : : "memory");
#endif
  return true;
#else
  (void)address;
  (void)bytes;
  return false;
#endif
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

// ---- fp32 GEMM on MKL-packed weights --------------------------------------------------------
//
// MKL's packed GEMM (cblas_sgemm_pack / cblas_sgemm_compute) reorders a weight once into the
// layout its kernels consume, for any number of rows: at decode sizes (8-64 rows) it runs
// 1.3-2.5x faster than an ordinary sgemm, and equally fast at prefill sizes. torch's wheel links
// MKL statically and exports these entry points; they are looked up at run time, so a torch
// without MKL just reports them unavailable.

namespace {

constexpr int kCblasRowMajor = 101, kCblasNoTrans = 111, kCblasTrans = 112, kCblasBMatrix = 162,
              kCblasPacked = 151;
using PackGetSize = size_t (*)(int, int, int, int);
using Pack = void (*)(int, int, int, int, int, int, float, const float*, int, float*);
using Compute = void (*)(int, int, int, int, int, int, const float*, int, const float*, int, float, float*, int);

struct MklPacked {
  PackGetSize get_size = nullptr;
  Pack pack = nullptr;
  Compute compute = nullptr;
  MklPacked() {
    void* lib = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
    if (lib == nullptr) return;
    get_size = reinterpret_cast<PackGetSize>(dlsym(lib, "cblas_sgemm_pack_get_size"));
    pack = reinterpret_cast<Pack>(dlsym(lib, "cblas_sgemm_pack"));
    compute = reinterpret_cast<Compute>(dlsym(lib, "cblas_sgemm_compute"));
  }
  bool available() const { return get_size != nullptr && pack != nullptr && compute != nullptr; }
};

const MklPacked& mkl() {
  static const MklPacked instance;
  return instance;
}

// The row count MKL is told when packing; the packed layout serves any row count.
constexpr int kPackRowsHint = 64;

}  // namespace

bool mkl_packed_gemm_available() { return mkl().available(); }

// weight [N, K] fp32 -> an opaque byte buffer for mkl_linear.
torch::Tensor mkl_pack_weight(torch::Tensor weight) {
  TORCH_CHECK(mkl().available(), "MKL's packed GEMM is not available in this torch build");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == torch::kFloat32,
              "weight must be a contiguous fp32 [N, K] tensor");
  const int n = static_cast<int>(weight.size(0)), k = static_cast<int>(weight.size(1));
  torch::Tensor packed = torch::empty({static_cast<int64_t>(mkl().get_size(kCblasBMatrix, kPackRowsHint, n, k))},
                                      torch::dtype(torch::kUInt8));
  mkl().pack(kCblasRowMajor, kCblasBMatrix, kCblasTrans, kPackRowsHint, n, k, 1.0f, weight.data_ptr<float>(), k,
             reinterpret_cast<float*>(packed.data_ptr<uint8_t>()));
  return packed;
}

// x [M, K] fp32 times a packed weight [N, K] (transposed), plus bias [N] when non-empty.
torch::Tensor mkl_linear(torch::Tensor x, torch::Tensor packed, int64_t n, torch::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32,
              "x must be a contiguous fp32 [M, K] tensor");
  const int m = static_cast<int>(x.size(0)), k = static_cast<int>(x.size(1));
  torch::Tensor out = torch::empty({m, n}, x.options());
  float beta = 0.0f;
  if (bias.numel() > 0) {
    TORCH_CHECK(bias.numel() == n && bias.scalar_type() == torch::kFloat32, "bias must be fp32 [N]");
    out.copy_(bias.reshape({1, n}).expand({m, n}));  // a fresh buffer: GEMM accumulates into it
    beta = 1.0f;
  }
  if (m > 0)
    mkl().compute(kCblasRowMajor, kCblasNoTrans, kCblasPacked, m, static_cast<int>(n), k, x.data_ptr<float>(), k,
                  reinterpret_cast<const float*>(packed.data_ptr<uint8_t>()), 0, beta, out.data_ptr<float>(),
                  static_cast<int>(n));
  return out;
}

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

}  // namespace

namespace {

// The panels of weight [rows, K] (fp32, or bf16 with K even): [count, K * C] of its dtype
// (C = panels::kCols: 48 on AVX-512, 16 on AVX2), column c of panel p multiplying row row_of(p, c).
template <typename RowOf>
torch::Tensor pack_panels(const torch::Tensor& weight, int64_t count, const RowOf& row_of) {
  check_panel_dtype(weight, "weight");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight must be a contiguous [N, K] tensor");
  const int64_t k = weight.size(1);
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 || k % 2 == 0, "a bf16 weight needs an even K, got ", k);
  torch::Tensor packed = torch::empty({count, k * panels::kCols}, weight.options());
  with_panel_type(weight, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* source = static_cast<const T*>(weight.data_ptr());
    T* out = static_cast<T*>(packed.data_ptr());
    at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
      for (int64_t panel = begin; panel < end; ++panel)
        panels::pack_panel(source, k, panel, row_of, out + panel * k * panels::kCols);
    });
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
  torch::Tensor fp32_bias;  // the sums are fp32: a bf16 bias is widened once per call
  if (bias.numel() > 0) {
    TORCH_CHECK(bias.numel() == n, "bias must have ", n, " elements");
    fp32_bias = bias.reshape({n}).to(torch::kFloat32).contiguous();
  }
  const float* bias_data = bias.numel() > 0 ? fp32_bias.data_ptr<float>() : nullptr;
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
                                bias_data, y, epilogue);
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
  const int64_t k = weight.size(1), k_padded = amx::padded_k(k);
  torch::Tensor packed = torch::empty({count, k_padded * amx::kCols}, weight.options());
  const auto* source = static_cast<const uint16_t*>(weight.data_ptr());
  auto* out = static_cast<uint16_t*>(packed.data_ptr());
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel)
      amx::pack_panel(source, k, panel, row_of, out + panel * k_padded * amx::kCols);
  });
  return packed;
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
  torch::Tensor fp32_bias;  // the sums are fp32: the bias is widened once per call
  if (bias.numel() > 0) {
    TORCH_CHECK(bias.numel() == n, "bias must have ", n, " elements");
    fp32_bias = bias.reshape({n}).to(torch::kFloat32).contiguous();
  }
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
  const float* bias_data = bias.numel() > 0 ? fp32_bias.data_ptr<float>() : nullptr;
  const amx::Work work(m, k_padded, count, at::get_num_threads());
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), work.items));
  std::atomic<int64_t> claimed{0};
#pragma omp parallel num_threads(threads)
  {
    amx::configure_tiles();  // tile configuration is per thread
    for (int64_t item = claimed.fetch_add(1, std::memory_order_relaxed); item < work.items;
         item = claimed.fetch_add(1, std::memory_order_relaxed))
      amx::multiply_item(work, item, in, k_padded, weights, n, count, bias_data, y, epilogue);
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

#include "decoder_stack.h"

// Pins thread t of the OpenMP pool (the one torch, MKL and these kernels share; the caller is
// thread 0) to cpus[t]. libgomp keeps a team's threads for later regions of the same size, so
// the pinning lasts while torch's thread count stays len(cpus). Whether each pin took.
std::vector<bool> bind_threads(const std::vector<int64_t>& cpus) {
  const int n = static_cast<int>(cpus.size());
  std::vector<char> pinned(n, 0);
#pragma omp parallel num_threads(n)
  {
    const int t = omp_get_thread_num();
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cpus[t]), &set);
    pinned[t] = omp_get_num_threads() == n && sched_setaffinity(0, sizeof(set), &set) == 0;
  }
  return std::vector<bool>(pinned.begin(), pinned.end());
}

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
  stack::bind(m);
}
