// Paged attention for many query rows (prefills, long chunks) in bf16 on Intel AMX tiles.
//
// A work item (paged_attention.h's WorkItem: all heads of up to kQueryTokens tokens of one
// sequence) is taken one KV head at a time: the query rows sharing it (tokens x group), 16 to a
// tile, against its keys in blocks of kKeyBlock. Per block the keys are packed as AMX B tiles
// (K^T: pairs of dims by keys, a 16 x 16 transpose of 32-bit pairs) and the values as B tiles
// (pairs of keys by dims, an interleave), once for all the row tiles; then per row tile
// S = Q K^T into fp32 tiles, the online softmax over S's rows in vector registers, the
// probabilities rounded to bf16 (as torch's CPU flash attention rounds them for bf16 inputs), and
// O += P V into fp32 tiles, rescaled in memory between blocks.
//
// Why: the vector path (paged_attention.h's attend_tile_lanes) multiplies in fp32 FMAs, where a
// tile product does 16x16x32 in one instruction. On a 2-vCPU Xeon with AMX, 11 prompts of 32-256
// tokens (1812 in all) over 30 layers of SmolLM2's heads: 65.7 ms on the vector path, 30.0 ms
// here; what is left is mostly the softmax and the packing, not the products.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "paged_attention.h"
#include "simd.h"

namespace tessera::amx_attention {

#if defined(TESSERA_AMX)

constexpr int64_t kTile = 16;        // rows of a tile; keys of an S tile; dims of an O tile
constexpr int64_t kPairStep = 32;    // bf16 elements along a tile row (64 bytes)
constexpr int64_t kKeyBlock = 128;   // keys packed and scored at a time (multiple of 32)

// Query tokens per work item: a key block packed serves them all (with query_tile's 16 tokens
// a 150-token prompt packed its first keys ten times; at 64, three).
constexpr int64_t kQueryTokens = 64;

// Whether an item has the rows per KV head (tokens x group) that make AMX worth its packing: a
// tile's worth. Decodes (one token) stay on the vector path.
inline bool uses_amx(const WorkItem& item, int64_t group) { return (item.q_end - item.q_begin) * group >= kTile; }

// The item's scratch, per thread.
struct Scratch {
  std::vector<uint16_t> query, keys_t, values_t, probs;
  std::vector<float> scores, out, row_max, row_sum, correction;
  std::vector<int32_t> first_key, last_key;
  void reserve(int64_t row_tiles, int64_t head_dim) {
    const int64_t rows = row_tiles * kTile;
    if (static_cast<int64_t>(row_max.size()) >= rows && static_cast<int64_t>(query.size()) >= rows * head_dim &&
        static_cast<int64_t>(keys_t.size()) >= kKeyBlock * head_dim)
      return;
    query.assign(rows * head_dim, 0);
    out.assign(rows * head_dim, 0.0f);
    row_max.assign(rows, 0.0f);
    row_sum.assign(rows, 0.0f);
    first_key.assign(rows, 0);
    last_key.assign(rows, -1);
    keys_t.assign(kKeyBlock * head_dim, 0);
    values_t.assign(kKeyBlock * head_dim, 0);
    scores.assign(kTile * kKeyBlock, 0.0f);
    probs.assign(kTile * kKeyBlock, 0);
    correction.assign(kTile, 0.0f);
  }
};

// In place, the 16 x 16 matrix of 32-bit words in m becomes its transpose.
inline void transpose_words(__m512i* m) {
  fvec rows[kTile];
  for (int64_t i = 0; i < kTile; ++i) rows[i] = reinterpret_cast<fvec>(m[i]);
  transpose_lanes(rows);
  for (int64_t i = 0; i < kTile; ++i) m[i] = reinterpret_cast<__m512i>(rows[i]);
}

// Keys [0, count) of the block (bf16 rows at key_row(j)) as K^T tiles:
// for each chunk of 16 keys and each 32 dims, a tile whose row i holds dims 2i, 2i+1 of the 16
// keys. Keys past count are zeros.
template <int64_t kD, typename KeyRow>
inline void pack_keys(const KeyRow& key_row, int64_t count, uint16_t* keys_t) {
  constexpr int64_t kSteps = kD / kPairStep;
  const int64_t chunks = (count + kPairStep - 1) / kPairStep * 2;  // whole pairs of chunks, as scored
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    for (int64_t step = 0; step < kSteps; ++step) {
      __m512i m[kTile];
      for (int64_t n = 0; n < kTile; ++n) {
        const int64_t j = chunk * kTile + n;
        m[n] = j < count ? _mm512_loadu_si512(key_row(j) + step * kPairStep) : _mm512_setzero_si512();
      }
      transpose_words(m);
      uint16_t* tile = keys_t + (chunk * kSteps + step) * kTile * kPairStep;
      for (int64_t i = 0; i < kTile; ++i) _mm512_storeu_si512(tile + i * kPairStep, m[i]);
    }
  }
}

// Values [0, count) of the block as V tiles: row p of the block's packing holds, for every dim,
// the pair (key 2p, key 2p + 1); a tile is 16 such rows by 16 dims. Keys past count are zeros.
template <int64_t kD, typename ValueRow>
inline void pack_values(const ValueRow& value_row, int64_t count, uint16_t* values_t) {
  __m512i low_index, high_index;  // interleave two rows' 16-bit words: a0 b0 a1 b1 ...
  {
    alignas(64) uint16_t low[32], high[32];
    for (int i = 0; i < 16; ++i) {
      low[2 * i] = i, low[2 * i + 1] = 32 + i;
      high[2 * i] = 16 + i, high[2 * i + 1] = 48 + i;
    }
    low_index = _mm512_load_si512(low);
    high_index = _mm512_load_si512(high);
  }
  const int64_t pairs = (count + kPairStep - 1) / kPairStep * kTile;  // whole 32-key steps
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const int64_t j = 2 * pair;
    uint16_t* row = values_t + pair * 2 * kD;
    for (int64_t d0 = 0; d0 < kD; d0 += kPairStep) {
      const __m512i a = j < count ? _mm512_loadu_si512(value_row(j) + d0) : _mm512_setzero_si512();
      const __m512i b = j + 1 < count ? _mm512_loadu_si512(value_row(j + 1) + d0) : _mm512_setzero_si512();
      _mm512_storeu_si512(row + 2 * d0, _mm512_permutex2var_epi16(a, low_index, b));
      _mm512_storeu_si512(row + 2 * d0 + kPairStep, _mm512_permutex2var_epi16(a, high_index, b));
    }
  }
}

// Tile numbers (the intrinsics take them as literals): 0-1 score sums (S), 2-3 K^T tiles, 4-7
// the row tile's queries (kD / 32 of them); for P V, 0-3 output sums (16 dims each), 4
// probabilities, 5 values.
template <int64_t kSteps>
inline void load_queries(const uint16_t* query, int64_t stride) {
  _tile_loadd(4, query, stride);
  if constexpr (kSteps > 1) _tile_loadd(5, query + kPairStep, stride);
  if constexpr (kSteps > 2) _tile_loadd(6, query + 2 * kPairStep, stride);
  if constexpr (kSteps > 3) _tile_loadd(7, query + 3 * kPairStep, stride);
}

// Scores of chunks `chunk` and `chunk + 1` (16 keys each) into tiles 0 and 1.
template <int64_t kSteps>
inline void score_pair(const uint16_t* keys_t, int64_t chunk) {
  const uint16_t* first = keys_t + chunk * kSteps * kTile * kPairStep;
  const uint16_t* second = first + kSteps * kTile * kPairStep;
#define TESSERA_SCORE_STEP(STEP, QUERY)                       \
  _tile_loadd(2, first + (STEP) * kTile * kPairStep, 64);     \
  _tile_loadd(3, second + (STEP) * kTile * kPairStep, 64);    \
  _tile_dpbf16ps(0, QUERY, 2);                                \
  _tile_dpbf16ps(1, QUERY, 3);
  TESSERA_SCORE_STEP(0, 4)
  if constexpr (kSteps > 1) { TESSERA_SCORE_STEP(1, 5) }
  if constexpr (kSteps > 2) { TESSERA_SCORE_STEP(2, 6) }
  if constexpr (kSteps > 3) { TESSERA_SCORE_STEP(3, 7) }
#undef TESSERA_SCORE_STEP
}

// Scores of chunks [chunk, chunk + 4) into tiles 0-3, for head_dim 64 (queries in tiles 4-5, keys
// through 6-7): four sums in flight instead of two, since a product waits on the one before it
// in the same tile (the pairs ran at half the tile unit's rate).
inline void score_quad(const uint16_t* keys_t, int64_t chunk) {
  constexpr int64_t kChunkWords = 2 * kTile * kPairStep;  // a chunk's two steps of 32 dims
  const uint16_t* keys = keys_t + chunk * kChunkWords;
#define TESSERA_SCORE_STEP(STEP, QUERY)                                     \
  _tile_loadd(6, keys + (STEP) * kTile * kPairStep, 64);                    \
  _tile_dpbf16ps(0, QUERY, 6);                                              \
  _tile_loadd(7, keys + kChunkWords + (STEP) * kTile * kPairStep, 64);      \
  _tile_dpbf16ps(1, QUERY, 7);                                              \
  _tile_loadd(6, keys + 2 * kChunkWords + (STEP) * kTile * kPairStep, 64);  \
  _tile_dpbf16ps(2, QUERY, 6);                                              \
  _tile_loadd(7, keys + 3 * kChunkWords + (STEP) * kTile * kPairStep, 64);  \
  _tile_dpbf16ps(3, QUERY, 7);
  TESSERA_SCORE_STEP(0, 4)
  TESSERA_SCORE_STEP(1, 5)
#undef TESSERA_SCORE_STEP
}

// The four output tiles of 64 dims at out (rows `stride` bytes apart): zeroed, or loaded.
inline void start_outputs(bool fresh, float* out, int64_t stride) {
  if (fresh) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  } else {
    _tile_loadd(0, out, stride);
    _tile_loadd(1, out + kTile, stride);
    _tile_loadd(2, out + 2 * kTile, stride);
    _tile_loadd(3, out + 3 * kTile, stride);
  }
}

// Output tiles += probabilities (tile 4) times the values of 64 dims at values.
inline void accumulate_outputs(const uint16_t* values, int64_t stride) {
#define TESSERA_VALUE_GROUP(GROUP)                           \
  _tile_loadd(5, values + (GROUP) * kTile * 2, stride);     \
  _tile_dpbf16ps(GROUP, 4, 5);
  TESSERA_VALUE_GROUP(0)
  TESSERA_VALUE_GROUP(1)
  TESSERA_VALUE_GROUP(2)
  TESSERA_VALUE_GROUP(3)
#undef TESSERA_VALUE_GROUP
}

inline void store_outputs(float* out, int64_t stride) {
  _tile_stored(0, out, stride);
  _tile_stored(1, out + kTile, stride);
  _tile_stored(2, out + 2 * kTile, stride);
  _tile_stored(3, out + 3 * kTile, stride);
}

// 2^t for a vector of t (finite lanes; others are zeroed by the caller's mask): 2^round(t) by
// vscalefps times a degree-5 polynomial of the fraction (relative error ~2e-6, far below the
// bf16 rounding the probabilities get). About half the instructions of simd.h's expv,
// which softmax ran at: with AMX doing the products, softmax was most of a prefill's attention.
inline __m512 exp2_fraction(__mmask16 live, __m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);  // in [-1/2, 1/2]
  // e^(f ln 2) by Taylor: coefficients (ln 2)^k / k!.
  __m512 p = _mm512_set1_ps(1.3333558146428443e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(live, p, n);
}

// Lanes of the 16 keys from `key` a row with keys [first, last] sees.
inline __mmask16 live_keys(int64_t key, int32_t first, int32_t last) {
  if (key >= first && key + kTile - 1 <= last) return 0xFFFF;
  const __m512i keys = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(key)),
                                        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  return _mm512_cmpge_epi32_mask(keys, _mm512_set1_epi32(first)) & _mm512_cmple_epi32_mask(keys, _mm512_set1_epi32(last));
}

// The online-softmax step of a tile's 16 rows over the block's raw scores ([16][kKeyBlock], `keys`
// of them from key0): row i masked to [first[i], last[i]], the new maxima, the probabilities
// exp(scale * (s - max)) as bf16, the sums and the factors earlier outputs shrink by (row_max,
// row_sum and correction hold a lane per row). The rows' maxima and sums come out of their
// vectors together (a transpose, then lane-wise): reduced one row at a time, each row's chain of
// reductions and scalar exp stalled the core. scale > 0, so the raw max is the scaled one's.
template <typename T>
inline void softmax_tile(const float* scores, int64_t keys, int64_t key0, const int32_t* first, const int32_t* last,
                         float scale, float* row_max, float* row_sum, float* correction, uint16_t* probs) {
  fvec lanes[kTile];
  for (int64_t i = 0; i < kTile; ++i) {
    __m512 block_max = _mm512_set1_ps(kNegInf);
    for (int64_t j = 0; j < keys; j += kTile)
      block_max = _mm512_mask_max_ps(block_max, live_keys(key0 + j, first[i], last[i]), block_max,
                                     _mm512_loadu_ps(scores + i * kKeyBlock + j));
    lanes[i] = reinterpret_cast<fvec>(block_max);
  }
  transpose_lanes(lanes);
  fvec block_max = lanes[0];
  for (int64_t i = 1; i < kTile; ++i) block_max = block_max > lanes[i] ? block_max : lanes[i];
  const fvec neg_inf = broadcastv(kNegInf);
  const fvec old_max = loadv(row_max);
  const fvec scaled = block_max * scale;
  const fvec new_max = old_max > scaled ? old_max : scaled;
  // A row with no key yet keeps max -inf: nothing to correct, and its probabilities are zeros.
  const fvec shift = new_max == neg_inf ? fvec{} : new_max;
  storev(correction, old_max == neg_inf ? fvec{} : expv(old_max - shift));
  storev(row_max, new_max);

  const __m512 factor = _mm512_set1_ps(scale * 1.4426950408889634f);  // log2 e
  for (int64_t i = 0; i < kTile; ++i) {
    const __m512 offset = _mm512_set1_ps(-shift[i] * 1.4426950408889634f);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < keys; j += kTile) {
      const __mmask16 live = live_keys(key0 + j, first[i], last[i]);
      const __m512 p = exp2_fraction(live, _mm512_fmadd_ps(_mm512_loadu_ps(scores + i * kKeyBlock + j), factor, offset));
      sum = _mm512_add_ps(sum, p);
      amx::store_bf16(probs + i * kKeyBlock + j, p, kTile);  // nearest even, one instruction
    }
    lanes[i] = reinterpret_cast<fvec>(sum);
  }
  storev(row_sum, loadv(row_sum) * loadv(correction) + transpose_sum(lanes));
}

template <typename T, int64_t kD>
void attend_tile(const AttentionBatch<T>& a, const WorkItem& item, Scratch& s) {
  static_assert(kD % (4 * kTile) == 0 && kD / kPairStep <= 4, "head_dim 64 or 128");
  constexpr int64_t kSteps = kD / kPairStep;
  const auto* cache = reinterpret_cast<const uint16_t*>(a.cache);
  const auto* q = reinterpret_cast<const uint16_t*>(a.q);
  auto* out = reinterpret_cast<uint16_t*>(a.out);
  const int64_t group = a.group;
  const int64_t query_len = a.starts[item.seq + 1] - a.starts[item.seq];
  const int64_t first_pos = a.lens[item.seq] - query_len;
  const int64_t token_base = a.starts[item.seq] + item.q_begin;
  const int64_t rows = (item.q_end - item.q_begin) * group;
  const int64_t row_tiles = (rows + kTile - 1) / kTile;
  s.reserve(row_tiles, kD);
  const int64_t* table = a.tables + item.seq * a.table_stride;
  auto slot_of = [&](int64_t key) { return table[key / a.block_size] * a.block_size + key % a.block_size; };

  // Keys any row sees: [lo, hi]; each row's own range [first_key, last_key] (-1 past the rows).
  const int64_t hi = first_pos + item.q_end - 1;
  int64_t lo = 0;
  for (int64_t i = 0; i < row_tiles * kTile; ++i) {
    if (i >= rows) {
      s.first_key[i] = 0, s.last_key[i] = -1;
      continue;
    }
    const int64_t pos = first_pos + item.q_begin + i / group;
    s.last_key[i] = static_cast<int32_t>(pos);
    s.first_key[i] = static_cast<int32_t>(a.sliding_window > 0 ? std::max<int64_t>(0, pos - a.sliding_window + 1) : 0);
  }
  if (a.sliding_window > 0) lo = s.first_key[0];

  for (int64_t h = 0; h < a.num_kv_heads; ++h) {
    // The head's query rows, (token, head in group) in order, padding rows zero.
    for (int64_t i = 0; i < row_tiles * kTile; ++i) {
      uint16_t* dst = s.query.data() + i * kD;
      if (i < rows) {
        std::memcpy(dst, q + (token_base + i / group) * a.q_stride + (h * group + i % group) * kD, kD * 2);
      } else {
        std::memset(dst, 0, kD * 2);
      }
      s.row_max[i] = kNegInf;
      s.row_sum[i] = 0.0f;
    }
    const uint16_t* head_keys = cache + h * kD;
    for (int64_t key0 = lo / kPairStep * kPairStep; key0 <= hi; key0 += kKeyBlock) {
      const int64_t count = std::min(kKeyBlock, hi + 1 - key0);
      const int64_t keys = (count + kPairStep - 1) / kPairStep * kPairStep;  // scored: whole pairs of chunks
      pack_keys<kD>([&](int64_t j) { return head_keys + slot_of(key0 + j) * a.token_stride; }, count, s.keys_t.data());
      pack_values<kD>([&](int64_t j) { return head_keys + a.kv_plane + slot_of(key0 + j) * a.token_stride; }, count,
                      s.values_t.data());
      const bool fresh = key0 <= lo;
      for (int64_t r = 0; r < row_tiles; ++r) {
        const int64_t r0 = r * kTile;
        // Positions grow with the row: the tile's last row sees the most keys. Causal, the first
        // tiles of an item stop short of the block's end (scoring all of it cost 40% more).
        const int64_t tile_last = s.last_key[std::min(r0 + kTile, rows) - 1];
        if (tile_last < key0) continue;
        const int64_t tile_keys = std::min(keys, (tile_last - key0 + kPairStep) / kPairStep * kPairStep);
        // S = Q K^T, two chunks of 16 keys at a time.
        load_queries<kSteps>(s.query.data() + r0 * kD, kD * 2);
        int64_t chunk = 0;
        if constexpr (kSteps == 2) {
          for (; chunk + 4 <= tile_keys / kTile; chunk += 4) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            score_quad(s.keys_t.data(), chunk);
            _tile_stored(0, s.scores.data() + chunk * kTile, kKeyBlock * 4);
            _tile_stored(1, s.scores.data() + (chunk + 1) * kTile, kKeyBlock * 4);
            _tile_stored(2, s.scores.data() + (chunk + 2) * kTile, kKeyBlock * 4);
            _tile_stored(3, s.scores.data() + (chunk + 3) * kTile, kKeyBlock * 4);
          }
        }
        for (; chunk < tile_keys / kTile; chunk += 2) {
          _tile_zero(0);
          _tile_zero(1);
          score_pair<kSteps>(s.keys_t.data(), chunk);
          _tile_stored(0, s.scores.data() + chunk * kTile, kKeyBlock * 4);
          _tile_stored(1, s.scores.data() + (chunk + 1) * kTile, kKeyBlock * 4);
        }
        softmax_tile<T>(s.scores.data(), tile_keys, key0, s.first_key.data() + r0, s.last_key.data() + r0, a.scale,
                        s.row_max.data() + r0, s.row_sum.data() + r0, s.correction.data(), s.probs.data());
        // O = O * correction + P V, 64 dims (four tiles) at a time.
        float* row_out = s.out.data() + r0 * kD;
        if (!fresh) {
          for (int64_t i = 0; i < kTile; ++i)
            for (int64_t d = 0; d < kD; d += kTile)
              storev(row_out + i * kD + d, loadv(row_out + i * kD + d) * s.correction[i]);
        }
        for (int64_t d0 = 0; d0 < kD; d0 += 4 * kTile) {
          start_outputs(fresh, row_out + d0, kD * 4);
          for (int64_t step = 0; step < tile_keys / kPairStep; ++step) {
            _tile_loadd(4, s.probs.data() + step * kPairStep, kKeyBlock * 2);
            accumulate_outputs(s.values_t.data() + step * kTile * 2 * kD + d0 * 2, kD * 4);
          }
          store_outputs(row_out + d0, kD * 4);
        }
      }
    }
    for (int64_t i = 0; i < rows; ++i) {
      uint16_t* dst = out + (token_base + i / group) * a.num_heads * kD + (h * group + i % group) * kD;
      const float inv = s.row_sum[i] > 0.0f ? 1.0f / s.row_sum[i] : 0.0f;
      for (int64_t d = 0; d < kD; d += kTile)
        amx::store_bf16(dst + d, _mm512_mul_ps(_mm512_loadu_ps(s.out.data() + i * kD + d), _mm512_set1_ps(inv)), kTile);
    }
  }
}

#endif

}  // namespace tessera::amx_attention
