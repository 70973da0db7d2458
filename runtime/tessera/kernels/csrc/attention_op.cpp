// The paged_attention op: the new tokens' K/V written to their cache slots, then attention over
// each sequence's paged context, one work item per (sequence, query tile) over the OpenMP
// threads, on AMX tiles (amx_attention.h) or vector registers (paged_attention.h).
//
// Why: on CPU the ATen formulation of paged attention gathers every sequence's blocks into a
// padded copy and masks it, which moved more memory than the matmuls did. These kernels read the
// paged cache in place with an online softmax.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ops.h"
#include "amx_attention.h"
#include "amx_tiles.h"
#include "paged_attention.h"
#include "torch_bf16.h"

namespace tessera {

namespace {

template <typename T>
void paged_attention_impl(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k,
                          const torch::Tensor& v, torch::Tensor& kv_cache,
                          const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                          const torch::Tensor& seq_lens, const torch::Tensor& query_start_loc,
                          double scale, int64_t sliding_window, double softcap) {
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
                          static_cast<float>(scale),
                          static_cast<float>(softcap)};

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
  // (amx_attention.h's softmax takes the raw scores' max for the scaled ones': scale > 0. It
  // does not soft-cap: capped scores take the vector path.)
  if constexpr (IsBf16<T>::value)
    amx = (head_dim == 64 || head_dim == 128) && batch.scale > 0.0f && batch.softcap <= 0.0f &&
          amx::request_tile_state();
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
// softcap > 0 soft-caps the scaled scores, softcap * tanh(score / softcap) (Gemma 2); <= 0: none.
void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k, torch::Tensor v,
                     torch::Tensor kv_cache, torch::Tensor slot_mapping, torch::Tensor block_tables,
                     torch::Tensor seq_lens, torch::Tensor query_start_loc, double scale,
                     int64_t sliding_window, double softcap) {
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
                                   query_start_loc, scale, sliding_window, softcap);
  });
}

}  // namespace tessera
