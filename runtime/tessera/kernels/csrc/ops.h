// The ops the extension module exports (bindings.cpp registers them) and the decoder stack calls
// (decoder_stack.h): declared here, each defined in the .cpp of its idea, which documents it.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <string>
#include <vector>

namespace tessera {

// attention_op.cpp
void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor kv_cache,
                     torch::Tensor slot_mapping, torch::Tensor block_tables, torch::Tensor seq_lens,
                     torch::Tensor query_start_loc, double scale, int64_t sliding_window, double softcap);

// elementwise_ops.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor x);
torch::Tensor greedy_argmax(torch::Tensor logits);
void rotary_embedding(torch::Tensor x, torch::Tensor cos_sin);

// mkl_gemm_ops.cpp
bool mkl_packed_gemm_available();
torch::Tensor mkl_pack_weight(torch::Tensor weight);
torch::Tensor mkl_linear(torch::Tensor x, torch::Tensor packed, int64_t n, torch::Tensor bias);

// panel_gemm_ops.cpp
std::vector<std::string> panel_gemm_dtypes();
torch::Tensor panel_pack_weight(torch::Tensor weight);
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor packed, int64_t n, torch::Tensor bias, bool pad_aliased_rows);
torch::Tensor panel_pack_gated_weight(torch::Tensor weight);
torch::Tensor panel_linear_silu_mul(torch::Tensor x, torch::Tensor packed, int64_t width);

// amx_gemm_ops.cpp
bool amx_gemm_available();
torch::Tensor amx_pack_weight(torch::Tensor weight);
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, int64_t n, torch::Tensor bias);
torch::Tensor amx_pack_gated_weight(torch::Tensor weight);
torch::Tensor amx_linear_silu_mul(torch::Tensor x, torch::Tensor packed, int64_t width);

// cache_eviction.cpp
bool evict_from_caches(int64_t address, int64_t bytes);

// thread_binding.cpp
std::vector<bool> bind_threads(const std::vector<int64_t>& cpus);

}  // namespace tessera
