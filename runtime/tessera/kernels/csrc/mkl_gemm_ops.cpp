// fp32 GEMM on MKL-packed weights: the ops mkl_pack_weight and mkl_linear.
#include <dlfcn.h>

#include <cstddef>
#include <cstdint>

#include "ops.h"
#include "torch_bf16.h"

namespace tessera {

// MKL's packed GEMM (cblas_sgemm_pack / cblas_sgemm_compute) reorders a weight once into the
// layout its kernels consume, for any number of rows: at decode sizes (8-64 rows) it runs
// 1.3-2.5x faster than an ordinary sgemm, and equally fast at prefill sizes. torch's wheel links
// MKL statically and exports these entry points; they are looked up at run time, so a torch
// without MKL just reports them unavailable.

namespace {

constexpr int kCblasRowMajor = 101, kCblasNoTrans = 111, kCblasTrans = 112, kCblasBMatrix = 162,
              kCblasPacked = 151;

// MKL's packed GEMM entry points in torch's library, or null where it has none.
struct MklPacked {
  using PackGetSize = size_t (*)(int, int, int, int);
  using Pack = void (*)(int, int, int, int, int, int, float, const float*, int, float*);
  using Compute = void (*)(int, int, int, int, int, int, const float*, int, const float*, int, float, float*, int);
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

}  // namespace tessera
