// Paged attention's per-tile core, free of torch so it can be compiled and timed on its own.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace tessera {

// ---- the fp32 fast path: chunks of kLanes keys, head_dim a multiple of kLanes ---------------
//
// One row's update for one chunk of keys works on whole vectors of kLanes floats (simd.h): a
// vector of partial products per key, one transposing tree reduction for all of the chunk's
// scores (instead of a horizontal sum per key), then a vector max, exp and sum. The plain
// per-key loops spent most of their time on latency chains and scalar tails.

// Bytes [begin, end) of a cache block's keys and, a plane further, its values, requested into
// L2 (prefetcht1) line by line.
inline void prefetch_kv(const char* block, int64_t plane_bytes, int64_t begin, int64_t end) {
  for (int64_t off = begin; off < end; off += kCacheLine) {
    __builtin_prefetch(block + off, 0, 2);
    __builtin_prefetch(block + plane_bytes + off, 0, 2);
  }
}

// Requests the next cache block's keys and values into L2 a few lines per key computed, so the
// whole block is asked for by the time this one is done. Asked for in bursts instead (a row's
// share at a time), the prefetches fill the core's miss buffers and stall it until most have
// arrived, and fetch and compute barely overlap. On a KVM EPYC Genoa, decode attention over 30
// layers' caches ran 25% faster in fp32 and 17% in bf16 interleaved (the cursor kept in registers
// while a row group computes: stored back at every key, it cost bf16 most of that).
struct KvPrefetcher {
  const char* block = nullptr;
  int64_t plane = 0, offset = 0, end = 0, lines_per_step = 0;
  void start(const char* next_block, int64_t plane_bytes, int64_t bytes, int64_t steps) {
    block = next_block;
    plane = plane_bytes;
    offset = 0;
    end = next_block == nullptr ? 0 : bytes;
    lines_per_step = (bytes / kCacheLine + steps - 1) / steps;
  }
  inline void step() {
    const int64_t upto = std::min(end, offset + lines_per_step * kCacheLine);
    prefetch_kv(block, plane, offset, upto);
    offset = upto;
  }
  void finish() {  // the rest, when the block had fewer keys to compute than lines to request
    prefetch_kv(block, plane, offset, end);
    offset = end;
  }
};

// Gemma 2's soft-capping of attention scores, cap * tanh(score / cap), applied to the scaled
// scores before the softmax (cap > 0; callers skip it at 0, no capping).
inline float softcap_score(float score, float cap) { return cap * std::tanh(score / cap); }

inline fvec softcap_scores(fvec scores, float cap) {
  for (int64_t i = 0; i < kLanes; ++i) scores[i] = softcap_score(scores[i], cap);
  return scores;
}

// Vectors of the head dim (a power of two dividing kV) whose accumulators for R rows fit in
// three quarters of the vector registers.
constexpr int64_t pv_slice_vectors(int R, int64_t kV) {
  int64_t slice = kV;
  while (slice > 1 && R * slice > kVectorRegisters * 3 / 4) slice /= 2;
  return slice;
}

// Online-softmax update of R query rows that share a KV head (so they share the keys and
// values: each key and value vector is loaded once for all R) with keys [j0[r], j1[r]) of a
// chunk of kLanes keys (a row's range may be empty). Several rows at once also keeps several
// independent dependency chains in flight: one row alone spends most of its time waiting on
// the reductions' latency. idx[r] is the row's index into query / acc (kD floats each),
// row_max and row_sum.
template <typename T, int64_t kD, int R>
inline void attend_rows_chunk(const float* query, const T* keys, const T* values, int64_t stride,
                              const int64_t* idx, const int64_t* j0, const int64_t* j1, float* row_max,
                              float* row_sum, float* acc, float softcap, KvPrefetcher& shared_prefetcher) {
  static_assert(kD % kLanes == 0, "head_dim must be a multiple of kLanes");
  constexpr int64_t kV = kD / kLanes;
  KvPrefetcher prefetcher = shared_prefetcher;  // in registers here, not stored back every step
  int64_t lo = kLanes, hi = 0;
  for (int r = 0; r < R; ++r) {
    if (j0[r] >= j1[r]) continue;
    lo = std::min(lo, j0[r]);
    hi = std::max(hi, j1[r]);
  }
  fvec q[R][kV];
  for (int r = 0; r < R; ++r)
    for (int64_t i = 0; i < kV; ++i) q[r][i] = loadv(query + idx[r] * kD + kLanes * i);

  fvec partial[R][kLanes];
  for (int64_t j = 0; j < kLanes; ++j) {
    if (j < lo || j >= hi) {
      for (int r = 0; r < R; ++r) partial[r][j] = fvec{};
      continue;
    }
    prefetcher.step();
    fvec k[kV];
    for (int64_t i = 0; i < kV; ++i) k[i] = loadv_as_float(keys + j * stride + kLanes * i);
    for (int r = 0; r < R; ++r) {
      fvec even = q[r][0] * k[0], odd = fvec{};
      for (int64_t i = 1; i < kV; ++i) {
        if (i % 2)
          odd += q[r][i] * k[i];
        else
          even += q[r][i] * k[i];
      }
      partial[r][j] = even + odd;
    }
  }

  const ivec lane = lane_indices();
  fvec p[R];
  float correction[R];
  for (int r = 0; r < R; ++r) {
    const ivec valid = (lane >= static_cast<int32_t>(j0[r])) & (lane < static_cast<int32_t>(j1[r]));
    fvec raw = transpose_sum(partial[r]);
    if (softcap > 0.0f) raw = softcap_scores(raw, softcap);
    const fvec scores = valid ? raw : broadcastv(kNegInf);
    float& m = row_max[idx[r]];
    const float new_max = std::max(m, hmax(scores));
    p[r] = valid ? expv(scores - new_max) : fvec{};
    correction[r] = m == kNegInf ? 0.0f : exp_approx(m - new_max);
    m = new_max;
    row_sum[idx[r]] = row_sum[idx[r]] * correction[r] + hsum(p[r]);
  }

  // The rows' accumulators for a slice of the head dim at a time, as many vectors as fit in
  // registers beside a value vector and the probabilities (AVX2: 3 rows x 64 dims would spill
  // every accumulator at every key); each slice passes over the chunk's keys.
  constexpr int64_t kSlice = pv_slice_vectors(R, kV);
  for (int64_t s0 = 0; s0 < kV; s0 += kSlice) {
    fvec out[R][kSlice];
    for (int r = 0; r < R; ++r)
      for (int64_t i = 0; i < kSlice; ++i) out[r][i] = loadv(acc + idx[r] * kD + kLanes * (s0 + i)) * correction[r];
    for (int64_t j = lo; j < hi; ++j) {
      if (s0 == 0) prefetcher.step();
      for (int64_t i = 0; i < kSlice; ++i) {
        const fvec v = loadv_as_float(values + j * stride + kLanes * (s0 + i));
        for (int r = 0; r < R; ++r) out[r][i] += p[r][j] * v;  // p is 0 outside the row's own range
      }
    }
    for (int r = 0; r < R; ++r)
      for (int64_t i = 0; i < kSlice; ++i) storev(acc + idx[r] * kD + kLanes * (s0 + i), out[r][i]);
  }
  shared_prefetcher.offset = prefetcher.offset;
}

// The rows (up to four) of one KV head with keys [j0[r], j1[r]) of a cache block, a chunk of
// kLanes keys at a time.
template <typename T, int64_t kD>
inline void attend_rows_block(int count, const float* query, const T* keys, const T* values, int64_t stride,
                              int64_t block_keys, const int64_t* idx, const int64_t* j0, const int64_t* j1,
                              float* row_max, float* row_sum, float* acc, float softcap, KvPrefetcher& prefetcher) {
  for (int64_t c0 = 0; c0 < block_keys; c0 += kLanes) {
    int64_t chunk_j0[4], chunk_j1[4];
    bool any = false;
    for (int r = 0; r < count; ++r) {
      chunk_j0[r] = std::max<int64_t>(j0[r] - c0, 0);
      chunk_j1[r] = std::min<int64_t>(j1[r] - c0, kLanes);
      any |= chunk_j0[r] < chunk_j1[r];
    }
    if (!any) continue;
    const T* k = keys + c0 * stride;
    const T* v = values + c0 * stride;
#define TESSERA_ROWS(R)                                                                                  \
  case R:                                                                                                \
    attend_rows_chunk<T, kD, R>(query, k, v, stride, idx, chunk_j0, chunk_j1, row_max, row_sum, acc, softcap, prefetcher); \
    break;
    switch (count) {  // 1 to 4
      TESSERA_ROWS(1)
      TESSERA_ROWS(2)
      TESSERA_ROWS(3)
      TESSERA_ROWS(4)
    }
#undef TESSERA_ROWS
  }
}

// fp32 and bf16 (widened to fp32 lanes as they are loaded) take the vector paths.
template <typename T, int64_t kD>
constexpr bool kFastPath = (std::is_same_v<T, float> || IsBf16<T>::value) && kD > 0 && kD % kLanes == 0;

// ---- the generic path ------------------------------------------------------------------------

template <typename T>
inline void block_scores(const float* q, const T* keys, int64_t stride, int64_t j0, int64_t j1,
                         int64_t head_dim, float* scores) {
  for (int64_t j = j0; j < j1; ++j) {
    const T* k = keys + j * stride;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t d = 0; d < head_dim; ++d) sum += q[d] * to_float(k[d]);
    scores[j] = sum;
  }
}

// ---- paged attention ---------------------------------------------------------------------------

// One work item: all heads of query tokens [q_begin, q_end) of one sequence. All heads, so
// each visited block is read whole and in order (its KV heads are interleaved per token).
struct WorkItem {
  int64_t seq, q_begin, q_end, cost;
};

// Query rows (tokens x heads) per item: enough that a block read from memory serves many
// rows, few enough that the scratch stays in L2 and the items balance over threads.
constexpr int64_t kRowsPerItem = 128;

// Tokens per item: about kRowsPerItem rows, rounded up so that a KV head's rows (tokens x
// group) fill whole vectors on the many-rows path. SmolLM2 (9 heads, groups of 3) had 14
// tokens, 42 rows a KV head in 3 vectors of 16 lanes, an eighth of them empty; at 16 tokens
// its prefill attention ran about 10% faster (2-core EPYC Turin, 2198 prompt tokens, 30 layers,
// medians of 6 alternating runs: fp32 70.0 -> 63.1 ms, bf16 54.2 -> 49.5 ms). 32 heads without
// GQA had 4 tokens, 4 rows a KV head, too few for that path: at 16, fp32 ran 1.6x faster.
inline int64_t query_tile(int64_t num_heads, int64_t group) {
  const int64_t tokens = std::max<int64_t>(1, kRowsPerItem / num_heads);
  const int64_t whole = kLanes / std::gcd(group, kLanes);  // tokens whose rows fill whole vectors
  return (tokens + whole - 1) / whole * whole;
}

// Items of up to `tile` query tokens for every sequence, most expensive first (for dynamic
// scheduling over threads).
inline std::vector<WorkItem> make_work_items(const int64_t* starts, const int64_t* lens, int64_t num_seqs,
                                             int64_t tile, int64_t sliding_window) {
  std::vector<WorkItem> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t query_len = starts[s + 1] - starts[s];
    const int64_t first_pos = lens[s] - query_len;
    for (int64_t q0 = 0; q0 < query_len; q0 += tile) {
      const int64_t q1 = std::min(q0 + tile, query_len);
      const int64_t keys = first_pos + q1;
      const int64_t span = sliding_window > 0 ? std::min(keys, sliding_window + q1 - q0) : keys;
      items.push_back({s, q0, q1, span * (q1 - q0)});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& x, const WorkItem& y) { return x.cost > y.cost; });
  return items;
}

// Everything one work item needs to know about the batch and the cache.
template <typename T>
struct AttentionBatch {
  T* cache;
  int64_t kv_plane, token_stride, block_size, num_kv_heads, num_heads, group, head_dim;
  const T* q;
  int64_t q_stride;
  T* out;
  const int64_t *tables, *lens, *starts;
  int64_t table_stride, sliding_window;
  float scale;
  float softcap;  // attention scores soft-capped at this (softcap_score); <= 0: none
};

// Per-thread buffers of an item: scaled queries, output accumulators, softmax state; the
// lane-major ones (lane_*) serve the many-rows path below.
struct TileScratch {
  std::vector<float> query, acc, row_max, row_sum, scores;
  std::vector<float> lane_query, lane_acc, lane_sum, lane_probs, lane_correction, lane_keys;
  std::vector<int32_t> lane_pos;
  TileScratch(int64_t rows, int64_t head_dim, int64_t block_size)
      : query(rows * head_dim), acc(rows * head_dim), row_max(rows), row_sum(rows), scores(block_size) {}
};

// ---- the fp32 fast path for many query rows per KV head (prefills, long chunks) -------------
//
// The rows sharing a KV head go kLanes to a vector, a lane each (the queries are transposed
// once per item), so a chunk's scores come out as one vector per key with a lane per row: each
// key element is broadcast from memory into an FMA, and the softmax's max, exp and sums are
// lane-wise. The one-row path instead reduces every key's products across lanes with shuffles,
// which x86 runs on a single port: prefill attention was bound there.

// Fewer rows than this per KV head (a decode has just the group) would leave the lanes mostly empty.
constexpr int64_t kMinLaneRows = 8;

template <typename T, int64_t kD>
void attend_tile_lanes(const AttentionBatch<T>& a, const WorkItem& item, TileScratch& s) {
  static_assert(kD % kLanes == 0, "head_dim must be a multiple of kLanes");
  constexpr int64_t kV = kD / kLanes;
  // The rows one value load serves: their accumulators fill half the vector registers.
  constexpr int64_t kPvRows = std::max<int64_t>(1, kVectorRegisters / 2 / kV);
  const int64_t group = a.group;
  const int64_t query_len = a.starts[item.seq + 1] - a.starts[item.seq];
  const int64_t first_pos = a.lens[item.seq] - query_len;
  const int64_t rows_per_kv_head = (item.q_end - item.q_begin) * group;
  const int64_t vecs_per_kv_head = (rows_per_kv_head + kLanes - 1) / kLanes;
  const int64_t lanes = a.num_kv_heads * vecs_per_kv_head * kLanes;
  if (static_cast<int64_t>(s.lane_pos.size()) < lanes) {
    s.lane_query.resize(lanes * kD);
    s.lane_acc.resize(lanes * kD);
    s.lane_sum.resize(lanes);
    s.lane_pos.resize(lanes);
    s.lane_probs.resize(kLanes * kLanes);
    s.lane_correction.resize(kLanes);
    s.lane_keys.resize(kLanes * kD);
  }
  // Lane L = (kv_head * vecs_per_kv_head) * kLanes + i for the KV head's row i = token * group + head.
  float* query = s.lane_query.data();  // [vector][d][lane]
  float* acc = s.lane_acc.data();      // [lane][d]
  float* lane_sum = s.lane_sum.data();
  int32_t* lane_pos = s.lane_pos.data();  // the row's position; -1 for an empty lane (no key is valid)
  float* probs = s.lane_probs.data();     // [key][lane] of the current block
  float* correction = s.lane_correction.data();
  float* key_block = s.lane_keys.data();  // [key][d] of the current block and KV head
  const int64_t token_base = a.starts[item.seq] + item.q_begin;
  auto lane_source = [&](int64_t kv_head, int64_t i, int64_t& token, int64_t& head) {
    token = i / group;
    head = kv_head * group + i % group;
  };
  std::fill_n(acc, lanes * kD, 0.0f);
  for (int64_t vec = 0; vec < lanes / kLanes; ++vec) {
    const int64_t h = vec / vecs_per_kv_head;
    const T* src[kLanes];  // each lane's query row; nullptr for an empty lane
    for (int64_t lane = 0; lane < kLanes; ++lane) {
      const int64_t i = vec % vecs_per_kv_head * kLanes + lane;
      src[lane] = nullptr;
      lane_pos[vec * kLanes + lane] = -1;
      if (i >= rows_per_kv_head) continue;
      int64_t token, head;
      lane_source(h, i, token, head);
      lane_pos[vec * kLanes + lane] = static_cast<int32_t>(first_pos + item.q_begin + token);
      src[lane] = a.q + (token_base + token) * a.q_stride + head * kD;
    }
    for (int64_t d0 = 0; d0 < kD; d0 += kLanes) {
      fvec block[kLanes];
      for (int64_t lane = 0; lane < kLanes; ++lane)
        block[lane] = src[lane] != nullptr ? loadv_as_float(src[lane] + d0) * a.scale : fvec{};
      transpose_lanes(block);
      for (int64_t k = 0; k < kLanes; ++k) storev(query + (vec * kD + d0 + k) * kLanes, block[k]);
    }
  }

  const int64_t* table = a.tables + item.seq * a.table_stride;
  const int64_t last_pos = first_pos + item.q_end - 1;
  int64_t first_key = 0;
  if (a.sliding_window > 0) first_key = std::max<int64_t>(0, first_pos + item.q_begin - a.sliding_window + 1);
  const int64_t first_chunk = first_key / kLanes, last_chunk = last_pos / kLanes;
  // One vector of rows at a time over all its key chunks (kLanes keys of one cache block): its
  // queries, accumulators and the chunk's keys stay in L1 (chunks outermost would cycle every
  // row's state through it per chunk).
  for (int64_t vec = 0; vec < a.num_kv_heads * vecs_per_kv_head; ++vec) {
    const int64_t h = vec / vecs_per_kv_head;
    const float* q = query + vec * kD * kLanes;
    float* vec_acc = acc + vec * kLanes * kD;
    ivec pos;
    std::memcpy(&pos, lane_pos + vec * kLanes, sizeof(pos));
    fvec row_max = broadcastv(kNegInf), row_sum{};
    for (int64_t chunk = first_chunk; chunk <= last_chunk; ++chunk) {
      const int64_t key0 = chunk * kLanes;
      const int64_t block_keys = std::min(kLanes, last_pos + 1 - key0);
      // Each lane's keys in this chunk: [j0, j1) (causal, and the window's start).
      ivec j1 = pos - static_cast<int32_t>(key0) + 1;
      const ivec keys_here = ivec{} + static_cast<int32_t>(block_keys);
      j1 = j1 < keys_here ? j1 : keys_here;
      ivec j0{};
      if (a.sliding_window > 0) {
        j0 = pos - static_cast<int32_t>(a.sliding_window + key0) + 1;
        j0 = j0 > ivec{} ? j0 : ivec{};
      }
      int32_t lo = kLanes, hi = 0;
      for (int64_t lane = 0; lane < kLanes; ++lane) {
        if (j0[lane] < j1[lane]) {
          lo = std::min(lo, j0[lane]);
          hi = std::max(hi, j1[lane]);
        }
      }
      if (lo >= hi) continue;  // no row of this vector sees a key of this chunk
      const int64_t slot = table[key0 / a.block_size] * a.block_size + key0 % a.block_size;
      const T* keys = a.cache + slot * a.token_stride + h * kD;
      // The chunk's keys packed (kD apart, not a cache slot apart): fixed offsets in the loop below.
      for (int64_t j = lo; j < hi; ++j)
        for (int64_t i = 0; i < kV; ++i)
          storev(key_block + j * kD + kLanes * i, loadv_as_float(keys + j * a.token_stride + kLanes * i));
      const T* values = keys + a.kv_plane;

      // Scores: one vector (a lane per row) per key; keys outside [lo, hi) are masked below.
      fvec scores[kLanes];
      for (int64_t j = 0; j < kLanes; ++j) scores[j] = fvec{};
      for (int64_t d = 0; d < kD; ++d) {
        const fvec qd = loadv(q + d * kLanes);
        for (int64_t j = 0; j < kLanes; ++j) scores[j] += qd * key_block[j * kD + d];
      }
      if (a.softcap > 0.0f)
        for (int64_t j = lo; j < hi; ++j) scores[j] = softcap_scores(scores[j], a.softcap);
      const fvec neg_inf = broadcastv(kNegInf);
      fvec block_max = neg_inf;
      for (int64_t j = 0; j < kLanes; ++j) {
        const ivec key = ivec{} + static_cast<int32_t>(j);
        const ivec valid = (key >= j0) & (key < j1);
        scores[j] = valid ? scores[j] : neg_inf;
        block_max = block_max > scores[j] ? block_max : scores[j];
      }
      const fvec new_max = row_max > block_max ? row_max : block_max;
      // A lane with no key yet keeps max -inf: exp's argument must stay finite there.
      const fvec shift = new_max == neg_inf ? fvec{} : new_max;
      const fvec scale = row_max == neg_inf ? fvec{} : expv(row_max - shift);
      fvec sum{};
      for (int64_t j = lo; j < hi; ++j) {
        const fvec p = scores[j] == neg_inf ? fvec{} : expv(scores[j] - shift);
        storev(probs + j * kLanes, p);
        sum += p;
      }
      row_max = new_max;
      row_sum = row_sum * scale + sum;
      storev(correction, scale);

      // Outputs: rows kPvRows at a time, so each value vector loaded serves them all.
      for (int64_t r0 = 0; r0 < kLanes; r0 += kPvRows) {
        bool any = false;
        for (int64_t r = r0; r < r0 + kPvRows; ++r) any |= j0[r] < j1[r];
        if (!any) continue;  // no key here: the max is unchanged, so the correction is 1 (or 0 on zeros)
        float* rows_acc = vec_acc + r0 * kD;
        fvec out[kPvRows][kV];
        for (int64_t r = 0; r < kPvRows; ++r)
          for (int64_t i = 0; i < kV; ++i) out[r][i] = loadv(rows_acc + r * kD + kLanes * i) * correction[r0 + r];
        for (int64_t j = lo; j < hi; ++j) {
          fvec v[kV];
          for (int64_t i = 0; i < kV; ++i) v[i] = loadv_as_float(values + j * a.token_stride + kLanes * i);
          for (int64_t r = 0; r < kPvRows; ++r) {
            const float pj = probs[j * kLanes + r0 + r];  // 0 outside the row's own keys
            for (int64_t i = 0; i < kV; ++i) out[r][i] += pj * v[i];
          }
        }
        for (int64_t r = 0; r < kPvRows; ++r)
          for (int64_t i = 0; i < kV; ++i) storev(rows_acc + r * kD + kLanes * i, out[r][i]);
      }
    }
    storev(lane_sum + vec * kLanes, row_sum);
  }
  for (int64_t h = 0; h < a.num_kv_heads; ++h) {
    for (int64_t i = 0; i < rows_per_kv_head; ++i) {
      const int64_t lane = h * vecs_per_kv_head * kLanes + i;
      int64_t token, head;
      lane_source(h, i, token, head);
      T* dst = a.out + (token_base + token) * a.num_heads * kD + head * kD;
      const float inv = lane_sum[lane] > 0.0f ? 1.0f / lane_sum[lane] : 0.0f;
      const float* src = acc + lane * kD;
#pragma omp simd
      for (int64_t d = 0; d < kD; ++d) dst[d] = from_float<T>(src[d] * inv);
    }
  }
}

// kD > 0 fixes head_dim at compile time so the per-key loops unroll into straight vector code;
// kD == 0 is the generic path for any head_dim.
// How many blocks ahead to prefetch (2 and 3 measured no better than 1 on a 2-core VM).
constexpr int64_t kPrefetchDistance = 1;

template <typename T, int64_t kD>
void attend_tile(const AttentionBatch<T>& a, const WorkItem& item, TileScratch& scratch) {
  if constexpr (kFastPath<T, kD>) {
    if (a.block_size % kLanes == 0 && (item.q_end - item.q_begin) * a.group >= kMinLaneRows)
      return attend_tile_lanes<T, kD>(a, item, scratch);
  }
  const int64_t D = kD > 0 ? kD : a.head_dim;
  const int64_t group = a.group;
  const int64_t query_len = a.starts[item.seq + 1] - a.starts[item.seq];
  const int64_t first_pos = a.lens[item.seq] - query_len;  // position of the sequence's first query
  const int64_t tokens = item.q_end - item.q_begin;
  const int64_t rows = tokens * a.num_heads;
  const int64_t rows_per_kv_head = tokens * group;
  const int64_t block_bytes = a.block_size * a.token_stride * static_cast<int64_t>(sizeof(T));
  const int64_t* table = a.tables + item.seq * a.table_stride;
  float* query = scratch.query.data();
  float* acc = scratch.acc.data();
  float* row_max = scratch.row_max.data();
  float* row_sum = scratch.row_sum.data();
  float* scores = scratch.scores.data();
  const int64_t last_pos = first_pos + item.q_end - 1;
  int64_t first_key = 0;
  if (a.sliding_window > 0) first_key = std::max<int64_t>(0, first_pos + item.q_begin - a.sliding_window + 1);
  const int64_t plane_bytes = a.kv_plane * static_cast<int64_t>(sizeof(T));
  // The first block has no earlier one to hide its fetch behind: request all of it while the
  // queries are prepared.
  prefetch_kv(reinterpret_cast<const char*>(a.cache + table[first_key / a.block_size] * a.block_size * a.token_stride),
              plane_bytes, 0, block_bytes);

  // Rows are ordered (KV head, token, head within the group): rows sharing a KV head, hence
  // keys and values, are consecutive.
  auto kv_head_of = [&](int64_t r) { return r / rows_per_kv_head; };
  auto token_of = [&](int64_t r) { return item.q_begin + r % rows_per_kv_head / group; };
  auto head_of = [&](int64_t r) { return kv_head_of(r) * group + r % group; };
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = a.q + (a.starts[item.seq] + token_of(r)) * a.q_stride + head_of(r) * D;
    float* dst = query + r * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) dst[d] = to_float(src[d]) * a.scale;
    row_max[r] = kNegInf;
    row_sum[r] = 0.0f;
    std::fill_n(acc + r * D, D, 0.0f);
  }

  for (int64_t b = first_key / a.block_size; b <= last_pos / a.block_size; ++b) {
    const int64_t key0 = b * a.block_size;
    const int64_t block_keys = std::min(a.block_size, last_pos + 1 - key0);
    const T* block_keys_all = a.cache + table[b] * a.block_size * a.token_stride;
    // Blocks are scattered, so the hardware prefetcher restarts at each one: a later block's keys
    // and values are prefetched while this block is computed (on the fast path interleaved with
    // its keys, see KvPrefetcher; otherwise the rows below share it out), every cache line
    // (every other line, leaving the pair to the adjacent-line prefetcher, measured 10-35%
    // slower decode attention on a KVM Ice Lake), into L2 (prefetcht1: on a KVM EPYC Genoa
    // decode attention over 30 layers' caches ran 13-30% faster than into L1, whose few miss
    // buffers the loads of the block being computed need).
    const int64_t ahead = b + kPrefetchDistance;
    const char* next = ahead <= last_pos / a.block_size
                           ? reinterpret_cast<const char*>(a.cache + table[ahead] * a.block_size * a.token_stride)
                           : nullptr;
    const int64_t prefetch_per_row = (block_bytes / kCacheLine + rows - 1) / rows * kCacheLine;
    // The fast path makes a K and a V pass over the block's keys per group of up to four rows
    // of a KV head: the prefetches are spread over those passes.
    const bool interleaved = kFastPath<T, kD> && a.block_size % kLanes == 0;
    KvPrefetcher prefetcher;
    if (interleaved)
      prefetcher.start(next, plane_bytes, block_bytes, 2 * a.block_size * a.num_kv_heads * ((group + 3) / 4));
    // The fast path takes rows of one KV head up to four at a time.
    int64_t pending = 0, pending_idx[4], pending_j0[4], pending_j1[4];
    auto flush = [&] {
      if constexpr (kFastPath<T, kD>) {
        if (pending == 0) return;
        const T* keys = block_keys_all + kv_head_of(pending_idx[0]) * D;
        attend_rows_block<T, kD>(static_cast<int>(pending), query, keys, keys + a.kv_plane, a.token_stride,
                                 block_keys, pending_idx, pending_j0, pending_j1, row_max, row_sum, acc, a.softcap,
                                 prefetcher);
        pending = 0;
      }
    };
    for (int64_t r = 0; r < rows; ++r) {
      const T* keys = block_keys_all + kv_head_of(r) * D;
      const T* values = keys + a.kv_plane;
      if (next != nullptr && !interleaved)
        prefetch_kv(next, plane_bytes, r * prefetch_per_row, std::min(block_bytes, (r + 1) * prefetch_per_row));
      const int64_t pos = first_pos + token_of(r);
      const int64_t lo = a.sliding_window > 0 ? pos - a.sliding_window + 1 : 0;
      const int64_t j0 = std::max<int64_t>(0, lo - key0);
      const int64_t j1 = std::min(block_keys, pos - key0 + 1);
      if (j0 >= j1) continue;
      if constexpr (kFastPath<T, kD>) {
        if (a.block_size % kLanes == 0) {
          if (pending == 4 || (pending > 0 && kv_head_of(pending_idx[0]) != kv_head_of(r))) flush();
          pending_idx[pending] = r;
          pending_j0[pending] = j0;
          pending_j1[pending] = j1;
          ++pending;
          continue;
        }
      }
      const float* qr = query + r * D;
      block_scores<T>(qr, keys, a.token_stride, j0, j1, D, scores);
      if (a.softcap > 0.0f)
        for (int64_t j = j0; j < j1; ++j) scores[j] = softcap_score(scores[j], a.softcap);
      float block_max = kNegInf;
      for (int64_t j = j0; j < j1; ++j) block_max = std::max(block_max, scores[j]);
      const float new_max = std::max(row_max[r], block_max);
      const float correction = row_max[r] == kNegInf ? 0.0f : exp_approx(row_max[r] - new_max);
      row_max[r] = new_max;
      float* row_acc = acc + r * D;
      row_sum[r] *= correction;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) row_acc[d] *= correction;
      for (int64_t j = j0; j < j1; ++j) {
        const float pj = exp_approx(scores[j] - new_max);
        row_sum[r] += pj;
        const T* vj = values + j * a.token_stride;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) row_acc[d] += pj * to_float(vj[d]);
      }
    }
    flush();
    prefetcher.finish();
  }

  for (int64_t r = 0; r < rows; ++r) {
    T* dst = a.out + (a.starts[item.seq] + token_of(r)) * a.num_heads * D + head_of(r) * D;
    const float inv = row_sum[r] > 0.0f ? 1.0f / row_sum[r] : 0.0f;
    const float* ar = acc + r * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) dst[d] = from_float<T>(ar[d] * inv);
  }
}

}  // namespace tessera
